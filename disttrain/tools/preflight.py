"""Dry-run a recipe on CPU before renting GPUs: `make preflight RECIPE=... STRATEGY=zero3`.

The recipe's model is shrunk to a tiny one of the same architecture (same class and config, tiny dims,
random init, nothing downloaded: the config comes from model_configs/ or a local model dir), then two CPU
processes train under the chosen accelerate config, stop half-way with a checkpoint, resume to the end
and export the result, which is loaded back.
Catches: recipe typos and type errors, impossible strategy combinations, architecture/strategy problems
(wrapping, tied weights, LoRA target names), and export/load problems. Does not catch: GPU memory fit
(see docs/strategies.md), hub access, or kernels that only exist on GPUs (QLoRA, flash-attention).
Stages: recipe, compatibility, shrink, save (stop half-way with a checkpoint), resume (same command
continues to the end), export (the exported model loads back).
Context parallelism (fsdp_cp) on a CPU runs torch's ring attention with the test-only mapping of its CPU
attention kernel (tests/cpu_ring; torch maps only its CUDA kernels), as the project's own tests do.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

from disttrain.recipe.schema import LOCAL_DATA_SUFFIXES, Recipe, load_recipe
from disttrain.errors import DisttrainError, exit_on_user_error
from disttrain.runtime.launcher import REPO, cpu_ring_env, launch_command, run_logged
from disttrain.metrics.log import read_metrics

MODEL_CONFIGS = REPO / "model_configs"
TINY_DATA = {"alpaca": "data/tiny_alpaca.jsonl", "chat": "data/tiny_chat.jsonl", "text": "data/tiny_text.jsonl",
             "sharegpt": "data/tiny_sharegpt.jsonl", "preference": "data/tiny_dpo.jsonl",
             "unpaired": "data/tiny_kto.jsonl", "prompt": "data/tiny_prompts.jsonl"}
TINY_VISION_DATA = {"chat": "data/tiny_vlm.jsonl", "sharegpt": "data/tiny_llava.jsonl"}  # a vision-language model's
TINY_DIMS = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
TINY_EXPERTS = 4


def find_config_dir(name_or_path: str) -> Path:
    """A local model dir, or the shipped copy of a hub model's config.json (model_configs/<org>__<name>)."""
    local = Path(name_or_path)
    if (local / "config.json").is_file():
        return local
    shipped = MODEL_CONFIGS / name_or_path.replace("/", "__")
    if (shipped / "config.json").is_file():
        return shipped
    raise DisttrainError(f"no config.json for {name_or_path!r}: not a local dir and not shipped in "
                         f"{MODEL_CONFIGS.relative_to(REPO)}/; add its config.json as "
                         f"model_configs/{name_or_path.replace('/', '__')}/config.json")


def shrink_config(config_dir: Path, tokenizer, min_kv_heads: int = 1):
    """Same architecture and options (GQA ratio, tied embeddings, rope scaling, experts and routing), tiny
    dimensions. `min_kv_heads`: tensor parallelism splits the key/value heads over its processes, so the GQA
    ratio is lowered until each process has one."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(config_dir)
    heads = TINY_DIMS["num_attention_heads"]
    ratio = max(1, config.num_attention_heads // getattr(config, "num_key_value_heads", config.num_attention_heads))
    for key, value in TINY_DIMS.items():
        setattr(config, key, value)
    config.num_key_value_heads = max(min_kv_heads, heads // min(ratio, heads))
    if getattr(config, "head_dim", None):
        config.head_dim = config.hidden_size // heads
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[: config.num_hidden_layers]
    if hasattr(config, "max_window_layers"):
        config.max_window_layers = config.num_hidden_layers
    for key in ("num_experts", "num_local_experts"):  # mixture of experts: 4 experts, 2 per token, small
        if getattr(config, key, None):
            setattr(config, key, min(getattr(config, key), TINY_EXPERTS))
            config.num_experts_per_tok = min(config.num_experts_per_tok, TINY_EXPERTS // 2)
    for key in ("moe_intermediate_size", "shared_expert_intermediate_size"):
        if getattr(config, key, None):
            setattr(config, key, TINY_DIMS["intermediate_size"] // 4)
    if getattr(config, "mlp_only_layers", None):
        config.mlp_only_layers = [i for i in config.mlp_only_layers if i < config.num_hidden_layers]
    config.vocab_size = len(tokenizer)
    config.bos_token_id, config.eos_token_id, config.pad_token_id = None, tokenizer.eos_token_id, tokenizer.pad_token_id
    return config


def build_shrunk_model(recipe: Recipe, out_dir: Path, min_kv_heads: int = 1) -> tuple[Path, str]:
    import torch
    from transformers import AutoModelForCausalLM

    from disttrain.tools.tiny import build_tokenizer

    config_dir = find_config_dir(recipe.model.name_or_path)
    vision = _vision_family(config_dir)
    if vision is not None:
        return _shrunk_vision_model(vision, out_dir)
    tokenizer = build_tokenizer()
    config = shrink_config(config_dir, tokenizer, min_kv_heads)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    return out_dir, f"{type(model).__name__} ({config.model_type}, tied={config.tie_word_embeddings})"


def _vision_family(config_dir: Path) -> str | None:
    """A vision-language config's model type (None: a text model)."""
    config = json.loads((config_dir / "config.json").read_text())
    return config.get("model_type", "?") if "vision_config" in config else None


def _shrunk_vision_model(model_type: str, out_dir: Path) -> tuple[Path, str]:
    """A vision-language model shrinks to the tiny one of its family (same classes, tiny encoder and language
    model, its processor): the families tools/tiny.py builds; others are refused in one line."""
    from disttrain.tools.tiny import VLM_FAMILIES, build_vlm_dir

    if model_type not in VLM_FAMILIES:
        raise DisttrainError(f"preflight shrinks the vision-language families {', '.join(VLM_FAMILIES)} only, not "
                             f"{model_type} (docs/vlm.md)")
    build_vlm_dir(out_dir, model_type)
    return out_dir, f"{model_type} vision-language model with its processor (tools/tiny.py)"


def cpu_overrides(recipe: Recipe, model_dir: Path, run_dir: Path, steps: int) -> tuple[list[str], list[str]]:
    """Recipe overrides that make the run CPU-sized; returns (overrides, notes on what was substituted)."""
    notes = []
    data_overrides = []
    shipped = {**TINY_DATA, **(TINY_VISION_DATA if _vision_family(model_dir) else {})}
    for i, src in enumerate(recipe.data.all_sources()):
        path = src.path
        if not (path.endswith(LOCAL_DATA_SUFFIXES) and Path(path).is_file()):
            path = str(REPO / shipped[src.format])
            notes.append(f"data: hub dataset {src.path!r} replaced by the shipped {shipped[src.format]}")
        if recipe.data.sources is None:
            data_overrides.append(f"data.path={path}")
            if path != src.path:  # a hub dataset's columns do not apply to the shipped data
                data_overrides += ["data.columns={}", "data.subset=null"]
        else:  # no evaluation in the dry run; columns of a hub dataset do not apply to the shipped data
            data_overrides += [f"data.sources.{i}.path={path}", f"data.sources.{i}.eval_path=null",
                               f"data.sources.{i}.eval_split=null", f"data.sources.{i}.eval_fraction=0.0"]
            if path != src.path:
                data_overrides.append(f"data.sources.{i}.columns={{}}")
    if recipe.model.quantization:
        notes.append("model.quantization: 4-bit needs CUDA; the dry run uses plain LoRA on the same targets")
    if recipe.model.attn_implementation != "sdpa":
        notes.append(f"attention: {recipe.model.attn_implementation} -> sdpa on CPU")
    overrides = [
        f"model.name_or_path={model_dir}", "model.dtype=float32", "model.attn_implementation=sdpa",
        "model.quantization=null", "model.tokenizer_name_or_path=null",
        *data_overrides, "data.eval_path=null", "data.eval_split=null", "data.eval_fraction=0.0",
        # with tools the template lists their schemas before the prompt (some hundred tokens in the tiny tokenizer)
        f"data.max_seq_len={min(recipe.data.max_seq_len, 512 if recipe.rl.agentic() else 128)}",
        f"training.max_steps={steps}", f"training.micro_batch_size={min(recipe.training.micro_batch_size, 2)}",
        f"training.grad_accum={min(recipe.training.grad_accum, 2)}", "training.mixed_precision=no",
        "training.optimizer=adamw", "training.eval_every=null",
        "logging.report_to=[none]", "logging.every_steps=1", f"output.dir={run_dir}",
    ]
    if recipe.training.objective == "grpo":  # rollouts sized for CPU processes
        overrides += [f"rl.num_generations={min(recipe.rl.num_generations, 4)}",
                      f"rl.max_completion_length={min(recipe.rl.max_completion_length, 16)}"]
    return overrides, notes


def strategy_of(config_file: Path) -> str:
    text = config_file.read_text()
    if "distributed_type: DEEPSPEED" in text:
        return "deepspeed"
    if "distributed_type: FSDP" in text:
        return "fsdp"
    return "ddp"


def load_export(final: Path, lora: bool) -> str:
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    vision = _vision_family(final) is not None if (final / "config.json").is_file() else False
    if lora:
        from peft import AutoPeftModel, AutoPeftModelForCausalLM

        model = (AutoPeftModel if vision else AutoPeftModelForCausalLM).from_pretrained(final)
    else:
        model = (AutoModelForImageTextToText if vision else AutoModelForCausalLM).from_pretrained(final)
    n = sum(p.numel() for p in model.parameters())
    return f"{final} loads ({n / 1e6:.2f}M params)"


class Report:
    def __init__(self):
        self.rows: list[tuple[str, str, str]] = []

    def add(self, stage: str, ok: bool, detail: str) -> bool:
        self.rows.append((stage, "PASS" if ok else "FAIL", detail))
        print(f"[{'PASS' if ok else 'FAIL'}] {stage}: {detail}", flush=True)
        return ok

    def failed(self) -> bool:
        return any(status == "FAIL" for _, status, _ in self.rows)


def config_processes(config_file: Path) -> int:
    """The processes an accelerate config is written for: its mesh's size (hsdp.yaml: 2 x 2) or 2."""
    import yaml

    return max(2, int(yaml.safe_load(config_file.read_text()).get("num_processes") or 2))


def config_tp(config_file: Path, nproc: int) -> int:
    """The tensor-parallel processes a config launches: tp.yaml every process, fsdp_tp.yaml its tp_size."""
    import yaml

    mesh = yaml.safe_load(config_file.read_text()).get("parallelism_config") or {}
    tp = int(mesh.get("parallelism_config_tp_size", 1))
    return nproc if tp > 1 and "parallelism_config_dp_shard_size" not in mesh else tp


def ring_on_cpu(config_file: Path) -> dict:
    """The environment a context-parallel dry run needs on a CPU: tests/cpu_ring on PYTHONPATH (see above)."""
    import torch
    import yaml

    mesh = yaml.safe_load(config_file.read_text()).get("parallelism_config") or {}
    if int(mesh.get("parallelism_config_cp_size", 1)) == 1 or torch.cuda.is_available():
        return {}
    return cpu_ring_env()


def run(recipe_path: str, strategy: str, nproc: int | None, steps: int, work_dir: Path, overrides=()) -> Report:
    """nproc None: what the config is written for (config_processes)."""
    report = Report()
    try:
        recipe = load_recipe(recipe_path, overrides)
        report.add("recipe", True, f"{recipe_path} parses and validates")
    except DisttrainError as exc:
        report.add("recipe", False, str(exc))
        return report
    config_file = REPO / "accelerate_configs" / f"{strategy}.yaml"
    if not config_file.is_file():
        report.add("strategy", False, f"no accelerate_configs/{strategy}.yaml; choose one of "
                   + ", ".join(sorted(p.stem for p in (REPO / "accelerate_configs").glob("*.yaml"))))
        return report

    nproc = nproc or config_processes(config_file)
    from disttrain.recipe import compat

    try:
        compat.check(recipe, strategy_of(config_file), gpu=True)
        compat.check_unproven(recipe, {"single_gpu": "single"}.get(strategy, strategy))
        report.add("compatibility", True, f"{strategy} + {'LoRA' if recipe.lora else 'full'}"
                   f"{' + 4-bit' if recipe.model.quantization else ''} + {recipe.training.optimizer} on GPUs")
    except DisttrainError as exc:
        report.add("compatibility", False, str(exc))
        return report

    shutil.rmtree(work_dir, ignore_errors=True)
    work_dir.mkdir(parents=True)
    try:
        model_dir, description = build_shrunk_model(recipe, work_dir / "model", config_tp(config_file, nproc))
        report.add("shrink", True, f"{recipe.model.name_or_path} -> tiny {description}")
    except Exception as exc:  # unknown architecture, broken config: say so, do not crash
        report.add("shrink", False, f"{type(exc).__name__}: {exc}")
        return report

    run_dir = work_dir / "run"
    cpu, notes = cpu_overrides(recipe, model_dir, run_dir, steps)
    if recipe.training.objective == "distill":  # the teacher shrunk the same way, with the same tiny tokenizer
        try:
            teacher = recipe.model_copy(update={"model": recipe.model.model_copy(
                update={"name_or_path": recipe.distill.teacher})})
            teacher_dir, teacher_description = build_shrunk_model(teacher, work_dir / "teacher")
        except Exception as exc:
            report.add("shrink", False, f"teacher: {type(exc).__name__}: {exc}")
            return report
        cpu += [f"distill.teacher={teacher_dir}", "distill.teacher_revision=null", "distill.teacher_dtype=null",
                f"distill.max_completion_length={min(recipe.distill.max_completion_length, 16)}"]
        notes.append(f"distill.teacher: {recipe.distill.teacher} -> tiny {teacher_description}")
    for note in notes:
        print(f"       note: {note}")
    base = launch_command(strategy, nproc, "train.py", "--recipe", str(recipe_path), *overrides, *cpu)
    env = ring_on_cpu(config_file)
    if env:
        print("       note: context parallelism on CPU: torch's ring with the test-only CPU kernel mapping "
              "(tests/cpu_ring)")
    half = max(1, steps // 2)

    # save: stop half-way, as a preempted job would, leaving a checkpoint
    first = run_logged(base + [f"training.stop_at_step={half}", f"output.checkpoint_every={half}"],
                       work_dir / "save.log", env=env)
    checkpoint = run_dir / "checkpoints" / f"step-{half:08d}"
    if not report.add("save", first.returncode == 0 and checkpoint.is_dir(),
                      f"{nproc} processes under {strategy}, stopped at step {half}: {checkpoint.name} written"
                      if first.returncode == 0 else _failure(first, work_dir / "save.log")):
        return report
    # resume: the same command continues from that checkpoint to the end, then exports
    second = run_logged(base + [f"output.checkpoint_every={half}"], work_dir / "resume.log", env=env)
    if second.returncode != 0:
        report.add("resume", False, _failure(second, work_dir / "resume.log"))
        return report
    losses = [m["loss"] for m in read_metrics(run_dir) if "loss" in m]
    resumed = f"resumed from {checkpoint} at step {half}" in second.stdout
    report.add("resume", resumed and len(losses) == steps,
               f"continued from step {half} to {steps}, loss {losses[0]:.3f} -> {losses[-1]:.3f}" if resumed
               else "the second run did not resume from the checkpoint")
    try:
        report.add("export", True, load_export(run_dir / "final", recipe.lora is not None))
    except Exception as exc:
        report.add("export", False, f"{type(exc).__name__}: {exc}")
    return report


def _failure(proc: subprocess.CompletedProcess, log_path: Path) -> str:
    errors = [line for line in proc.stderr.splitlines() if line.startswith(("error:", "[rank0]:"))]
    return f"exit {proc.returncode}; {errors[-1] if errors else 'see the log'} (full log: {log_path})"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", required=True)
    parser.add_argument("--strategy", default="ddp", help="an accelerate_configs/<name>.yaml, e.g. ddp, fsdp, zero3")
    parser.add_argument("--nproc", type=int, default=None,
                        help="CPU processes (default: what the config is written for: 2, or its mesh's size)")
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps in all (half before the resume)")
    parser.add_argument("--work-dir", default=None, help="default: outputs/preflight/<recipe>-<strategy>")
    parser.add_argument("overrides", nargs="*", metavar="key.path=value")
    args = parser.parse_args(argv)
    work = Path(args.work_dir or f"outputs/preflight/{Path(args.recipe).parent.name}-"
                                 f"{Path(args.recipe).stem}-{args.strategy}")
    report = run(args.recipe, args.strategy, args.nproc, args.steps, work.resolve(), args.overrides)
    print("preflight:", "FAILED" if report.failed() else "all stages passed")
    sys.exit(1 if report.failed() else 0)


if __name__ == "__main__":
    with exit_on_user_error():
        main()
