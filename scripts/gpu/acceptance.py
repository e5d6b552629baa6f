"""The GPU acceptance run: every claim of disttrain that only a GPU can check, in one command, one
PASS / FAIL / SKIP / INFO line per item. Prepared on CPU; not yet run on a GPU.

    make gpu-kit    # here: gpu_kit/, the wheels the GPU machine lacks (scripts/gpu/kit.py), ~9 MiB
    # on the GPU machine (one H200; torch, accelerate, transformers, peft preinstalled), from the repo root,
    # carrying gpu_kit:
    python3 scripts/gpu/acceptance.py --out $OUT --wheels gpu_kit
    # CPU dry run (tests/test_gpu_acceptance.py runs a subset): tiny model, 4 steps, fp32, the CPU items
    python3 scripts/gpu/acceptance.py --dry-run --out /tmp/acceptance

Items (--items a,b,c picks some; default all, started in the order below):

    doctor_nccl               `python -m disttrain.doctor --nproc 1 --json` exits 0; NCCL / GPU lines recorded
    full_bf16_{single,fsdp,zero2,zero3}
                              bf16 full fine-tune, world size 1: an uninterrupted run of N steps, and a new
                              launch resumed from its step-N/2 checkpoint (it must say so): per-step losses
                              equal (rel 1e-3 on GPU), final/ loads with AutoModelForCausalLM.from_pretrained
    lora_{ddp,fsdp}           LoRA trains, every logged loss finite, the adapter is exported
    qlora_{ddp,fsdp}          the same with model.quantization=4bit; qlora_fsdp sets DISTTRAIN_ALLOW_UNVERIFIED=1
                              (this run is what verifies it); SKIP when bitsandbytes does not import
    adamw_8bit                training.optimizer=adamw_8bit on one GPU; SKIP without bitsandbytes
    packing_{sdpa,flash_attention_2}
                              scripts/gpu/packing_isolation.py says packed examples are isolated, and train.py's
                              eval loss of the initial weights is the same packed and unpacked (rel 1e-2 in
                              bf16); flash_attention_2 SKIPs when flash_attn does not import
    fsdp_sync_memory          FSDP2, grad_accum 4: peak GPU memory with distributed.fsdp_sync_each_micro_batch
                              true vs false (INFO: at world size 1 the shard is the whole model)
    mfu                       scripts/bench/gpu_figures.py --configs single,fsdp (0.84B model): its table copied
    offload_activations       training.offload_activations: the same losses as without (rel 1e-3), peak memory
                              and step time of both recorded
    loss_memory               disttrain.bench_memory (single, fsdp; vocab 152k, seq 4096): the loss's share of
                              peak memory, full logits vs chunked; PASS when chunked cuts it >= 8x

A failed item is recorded with the tail of its log and the others still run. When an item's time is up
(--timeout) its subprocess is SIGKILLed with every process under it. --jobs items run side by side (default
3 on a GPU: launches of the small model are mostly start-up); doctor_nccl, fsdp_sync_memory and mfu measure
the machine and always run alone. An item that would start with less of the --budget left than it needs is
SKIPped. acceptance.json / acceptance.md are rewritten after every item, so a run cut short still leaves
what finished. --out gets exactly three files (acceptance.json, acceptance.md, launches.log: every
subprocess's output); models, data and run dirs go to --work. Exit status: 0 when no item FAILed, 1
otherwise, 2 without a CUDA GPU (and no --dry-run).

--wheels DIR: `pip install --no-index --no-deps` of DIR's wheels before anything else, into site-packages
when it is writable, else (or with --site DIR) into a target dir put first on PYTHONPATH for every launch.
--no-deps skips version ranges, so every range of the carried packages' requirements and disttrain's own
(pyproject.toml) is then checked against what the machine has: each one not met is one line, printed and
recorded in the JSON (meta.wheels.pins), before the first item. A missing package fails only the items that
import it. `make gpu-kit` builds DIR (scripts/gpu/kit.py: pydantic and its core, datasets, DeepSpeed built
without ops, bitsandbytes slimmed to the machine's CUDA library); the GPU image has none of them.

Time on the H200 — an ESTIMATE, not a measurement (this script has never run on a GPU). One `accelerate
launch` of the small model (hidden 512, 4 layers, seq 512, 8 steps) is ~8-15 s there, almost all start-up
(imports, CUDA init, model load); DeepSpeed ~15-20 s. Per item (Item.estimate_s below):
    wheels ~30 s, model + corpus ~10 s, doctor_nccl ~15 s                                      ~55 s
    full_bf16_single 28, _fsdp 30, _zero2 38, _zero3 40, streaming_resume 28 (2 launches each); lora_ddp 15,
    lora_fsdp 18, qlora_ddp 18, qlora_fsdp 20, adamw_8bit 15, dpo 50, packing_sdpa 35, packing_flash_attention_2
    35 (a SKIP without flash-attn: ~2 s)                        370 s in all; 3 side by side: ~120-145 s
    fsdp_sync_memory 30, mfu 90 (0.84B build ~20 s + 2 launches of 20 steps), loss_memory 60    ~180 s
    total ~6.5 min with --jobs 3 (default --budget 470 s: the whole run stays under 8 min); --jobs 1
    would need ~8 min, so the last items may be SKIPped for the budget.
CPU dry run here (2 cores): the test's subset, measured below (tests/test_gpu_acceptance.py).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import math
import os
import platform
import shutil
import tempfile
import subprocess
import sys
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

# Only modules whose imports the bare GPU image has (stdlib, tqdm): disttrain.config needs pydantic, which
# may arrive with --wheels. Everything else is imported inside the functions that use it.
from disttrain.launcher import kill_tree, launch_command  # noqa: E402
from disttrain.metrics import read_metrics  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kit  # noqa: E402  (stdlib + packaging: the kit's parts and the version pins its install skipped)

PASS, FAIL, SKIP, INFO = "PASS", "FAIL", "SKIP", "INFO"
PACKING_SCRIPT = REPO / "scripts/gpu/packing_isolation.py"
GPU_FIGURES = REPO / "scripts/bench/gpu_figures.py"
# The acceptance model: Llama shape, random init, large enough that bf16 kernels are the real ones,
# small enough that a launch is start-up time (~13M parameters with the tiny tokenizer's vocabulary).
ACCEPT_SHAPE = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=4, num_attention_heads=8,
                    num_key_value_heads=4, max_position_embeddings=2048)
LORA = {"r": 8, "alpha": 16, "dropout": 0.0, "target_modules": "all-linear"}
MAX_LOG_TAIL = 4000


# ----------------------------------------------------------------------------- settings and state
@dataclass
class Settings:
    """What differs between the GPU run and the CPU dry run."""

    device: str  # cuda / cpu (for packing_isolation.py)
    dtype: str  # bfloat16 / float32 (packing_isolation.py)
    precision: str  # the recipes' training.mixed_precision: bf16 / no
    shape: str  # gpu_figures.SHAPES key of the model built for the items
    seq: int
    steps: int  # N of the full fine-tune items; the stop is at N // 2
    micro_batch: int
    loss_rtol: float  # resumed vs uninterrupted per-step losses
    eval_rtol: float  # packed vs unpacked eval loss at init

    @classmethod
    def for_run(cls, dry_run: bool) -> Settings:
        if dry_run:
            return cls("cpu", "float32", "no", "tiny", seq=64, steps=4, micro_batch=2, loss_rtol=1e-5, eval_rtol=1e-4)
        return cls("cuda", "bfloat16", "bf16", "accept", seq=512, steps=8, micro_batch=4, loss_rtol=1e-3,
                   eval_rtol=1e-2)


class Fail(Exception):
    """The item's claim does not hold; `log` is the file whose tail explains it."""

    def __init__(self, detail: str, log: Path | None = None):
        super().__init__(detail)
        self.detail, self.log = detail, log


class Skip(Exception):
    pass


@dataclass
class Ctx:
    """The run's shared state; each item gets its own copy (`for_item`) with its name, dir, deadline and
    figures. The lock and the import cache stay shared between copies (items may run in threads)."""

    s: Settings
    work: Path
    launches_log: Path
    model_dir: Path | None = None
    corpus: Path | None = None
    params: int = 0
    item: str = ""
    item_dir: Path = Path()
    timeout: float = math.inf
    deadline: float = math.inf
    figures: dict = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    _importable: dict = field(default_factory=dict)

    def for_item(self, name: str, timeout: float) -> Ctx:
        return replace(self, item=name, item_dir=self.work / name, timeout=timeout,
                       deadline=time.monotonic() + timeout, figures={})

    def remaining(self) -> float:
        left = self.deadline - time.monotonic()
        if left <= 1:
            raise Fail(f"timed out: the item's {self.timeout:g} s were spent")
        return left

    def importable(self, module: str) -> tuple[bool, str]:
        """Imports `module` in a fresh interpreter (a broken CUDA extension fails there, not here)."""
        if module not in self._importable:
            proc = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, text=True,
                                  timeout=180)
            last = (proc.stderr.strip().splitlines() or [""])[-1]
            self._importable[module] = (proc.returncode == 0, last)
        return self._importable[module]


# ----------------------------------------------------------------------------- subprocesses and runs
def run_cmd(ctx: Ctx, label: str, cmd: list[str], env: dict | None = None) -> tuple[subprocess.CompletedProcess, Path]:
    """One subprocess of the current item, from the repository root, stdout and stderr into
    <item_dir>/<label>.log (then appended to launches.log). When the item's time is up, the subprocess and
    every process under it are SIGKILLed (launcher.kill_tree). Each item gets its
    own `datasets` cache: items running side by side never write the same cache file."""
    ctx.item_dir.mkdir(parents=True, exist_ok=True)
    log = ctx.item_dir / f"{label}.log"
    env = {"HF_DATASETS_CACHE": str(ctx.item_dir / "hf_datasets"), **(env or {})}
    timeout = ctx.remaining()
    started = time.monotonic()
    with log.open("w") as sink:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", **env})
    timed_out = False
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        kill_tree(proc)
    except BaseException:
        kill_tree(proc)
        raise
    seconds = round(time.monotonic() - started, 1)
    ctx.figures.setdefault("launch_s", {})[label] = seconds  # start-up cost, to size later runs
    output = log.read_text(errors="replace") + (f"\n(killed after {timeout:.0f} s)\n" if timed_out else "")
    log.write_text(output)
    with ctx.lock, ctx.launches_log.open("a") as f:
        f.write(f"\n===== {ctx.item} / {label} (exit {proc.returncode}, {seconds:g} s): "
                f"{' '.join(f'{k}={v}' for k, v in env.items())} {' '.join(cmd)}\n{output}")
    if timed_out:
        raise Fail(f"{label}: timed out (killed with every process under it: the item's {ctx.timeout:g} s "
                   "were spent)", log)
    return subprocess.CompletedProcess(cmd, proc.returncode, output, ""), log


def error_line(proc: subprocess.CompletedProcess) -> str:
    """The line that says why a launch failed: disttrain's `error:` line, else the last exception line."""
    lines = [ln.strip() for ln in proc.stdout.splitlines() if ln.strip()]
    for pattern in ("error: ", "Error:", "Error", "error"):
        found = [ln for ln in lines if pattern in ln and not ln.startswith(("W", "[W"))]
        if found:
            return found[-1][:400]
    return lines[-1][:400] if lines else "(no output)"


def recipe(ctx: Ctx, run_dir: Path, **sections) -> dict:
    """The items' base recipe (packed text of max_seq_len, logging every step), sections merged in."""
    s = ctx.s
    tree = {
        "model": {"name_or_path": str(ctx.model_dir), "dtype": "float32", "attn_implementation": "sdpa"},
        "data": {"path": str(ctx.corpus), "format": "text", "max_seq_len": s.seq, "packing": True},
        "training": {"max_steps": s.steps, "micro_batch_size": s.micro_batch, "grad_accum": 2, "lr": 1e-4,
                     "lr_scheduler": "cosine", "warmup_steps": 1, "mixed_precision": s.precision, "seed": 7},
        "logging": {"report_to": ["none"], "every_steps": 1},
        "output": {"dir": str(run_dir)},
    }
    for name, values in sections.items():
        tree.setdefault(name, {}).update(values)
    return tree


def train(ctx: Ctx, label: str, config: str, tree: dict, overrides: tuple[str, ...] = (),
          env: dict | None = None) -> tuple[subprocess.CompletedProcess, Path]:
    """`accelerate launch --config_file accelerate_configs/<config>.yaml --num_processes 1 train.py` with
    the recipe `tree` (written next to the run); Fail with the error line when it does not exit 0."""
    import yaml

    ctx.item_dir.mkdir(parents=True, exist_ok=True)
    path = ctx.item_dir / f"{label}.yaml"
    path.write_text(yaml.safe_dump(tree, sort_keys=False))
    cmd = launch_command(config, 1, "train.py", "--recipe", str(path), *overrides)
    proc, log = run_cmd(ctx, label, cmd, env)
    if proc.returncode != 0:
        raise Fail(f"{label} ({config}) exit {proc.returncode}: {error_line(proc)}", log)
    return proc, log


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run_dir) if "loss" in r}


def require_finite_losses(run_dir: Path, steps: int, log: Path, first: int = 1) -> dict[int, float]:
    found = losses(run_dir)
    if sorted(found) != list(range(first, steps + 1)):
        raise Fail(f"{run_dir.name}: logged steps {sorted(found)}, expected {first}..{steps}", log)
    bad = {k: v for k, v in found.items() if not math.isfinite(v)}
    if bad:
        raise Fail(f"{run_dir.name}: non-finite loss at steps {sorted(bad)}", log)
    return found


def max_rel_diff(a: dict[int, float], b: dict[int, float]) -> float:
    """Over the steps b logged."""
    return max(abs(a[k] - b[k]) / max(abs(a[k]), 1e-12) for k in b)


def check_full_export(ctx: Ctx, final: Path, log: Path) -> None:
    """final/ is a standard HF dir: from_pretrained loads it, with every weight finite."""
    import torch
    from transformers import AutoModelForCausalLM

    if not (final / "config.json").is_file():
        raise Fail(f"no exported model at {final}", log)
    with ctx.lock:  # from_pretrained patches torch's init functions while it builds: one at a time
        model = AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32)
    params = sum(p.numel() for p in model.parameters())
    if params != ctx.params:
        raise Fail(f"{final} has {params:,} parameters, the model trained has {ctx.params:,}", log)
    if not all(torch.isfinite(p).all() for p in model.parameters()):
        raise Fail(f"{final} holds non-finite weights", log)


def check_adapter_export(final: Path, log: Path) -> int:
    """final/ holds a LoRA adapter (config + finite safetensors weights); returns its tensor count."""
    import torch
    from safetensors.torch import load_file

    weights = final / "adapter_model.safetensors"
    if not ((final / "adapter_config.json").is_file() and weights.is_file()):
        raise Fail(f"no adapter exported at {final}", log)
    tensors = load_file(weights)
    if not tensors or not all(torch.isfinite(t).all() for t in tensors.values()):
        raise Fail(f"{weights}: empty or non-finite adapter weights", log)
    return len(tensors)


# ----------------------------------------------------------------------------- items
def full_finetune(ctx: Ctx, config: str, streaming: bool = False) -> tuple[str, str]:
    """Uninterrupted vs a new launch resumed from the uninterrupted run's step-N/2 checkpoint: the same
    per-step losses after it; the export loads. `streaming`: the training data as a stream (the loader moves
    batches to the GPU itself; each rank's position from the checkpoint)."""
    if config.startswith("zero"):
        ok, why = ctx.importable("deepspeed")
        if not ok:
            raise Fail(f"deepspeed does not import: {why}")
    n, stop = ctx.s.steps, ctx.s.steps // 2
    ckpt = {"checkpoint_every": stop, "keep_last": 2}
    data = {"streaming": True} if streaming else {}
    a, b = ctx.item_dir / "uninterrupted", ctx.item_dir / "resumed"
    _, log_a = train(ctx, "uninterrupted", config, recipe(ctx, a, output=ckpt, data=data))
    ref = require_finite_losses(a, n, log_a)
    saved = a / "checkpoints" / f"step-{stop:08d}"
    second, log_b = train(ctx, "resumed", config, recipe(ctx, b, output=ckpt, data=data),
                          (f"output.resume={saved}",))
    if f"resumed from {saved} at step {stop}/{n}" not in second.stdout:
        raise Fail(f"the launch given output.resume={saved} did not say 'resumed from {saved} at step {stop}/{n}'",
                   log_b)
    resumed_from = [r.get("resumed_from_step") for r in read_metrics(b) if "resumed_from_step" in r]
    if resumed_from != [stop]:
        raise Fail(f"metrics.jsonl marks resumed_from_step {resumed_from}, expected [{stop}]", log_b)
    got = require_finite_losses(b, n, log_b, first=stop + 1)
    diff = max_rel_diff(ref, got)
    ctx.figures.update(steps=n, resumed_at=stop, final_loss=ref[n], max_rel_loss_diff=diff)
    if diff > ctx.s.loss_rtol:
        raise Fail(f"resumed losses differ from the uninterrupted run by rel {diff:.3g} > {ctx.s.loss_rtol:g}: "
                   f"{ {k: (ref[k], got[k]) for k in got} }", log_b)
    check_full_export(ctx, b / "final", log_b)
    return PASS, f"resumed at {stop}/{n}: max rel loss diff {diff:.2g} (<= {ctx.s.loss_rtol:g}); final/ loads"


def adapter(ctx: Ctx, config: str, quantized: bool) -> tuple[str, str]:
    """LoRA (or QLoRA) trains with finite losses and exports its adapter."""
    env = {}
    model = {}
    if quantized:
        ok, why = ctx.importable("bitsandbytes")
        if not ok:
            raise Skip(f"bitsandbytes does not import ({why}): carry its wheel with --wheels")
        model = {"quantization": "4bit", "dtype": "bfloat16"}
        if config == "fsdp":
            env = {"DISTTRAIN_ALLOW_UNVERIFIED": "1"}  # disttrain refuses QLoRA + FSDP2 until this run passes
            ctx.figures["env"] = env
    run = ctx.item_dir / "run"
    _, log = train(ctx, "run", config, recipe(ctx, run, model=model, lora=LORA, training={"lr": 1e-3}), env=env)
    found = require_finite_losses(run, ctx.s.steps, log)
    tensors = check_adapter_export(run / "final", log)
    ctx.figures.update(first_loss=found[1], final_loss=found[ctx.s.steps], adapter_tensors=tensors)
    return PASS, f"{ctx.s.steps} steps, losses finite ({found[1]:.3f} -> {found[ctx.s.steps]:.3f}); adapter exported"


def dpo(ctx: Ctx) -> tuple[str, str]:
    """Preference tuning in bf16 on the GPU, the reference modes: LoRA (one no-grad forward with the adapters
    disabled per micro-batch), full fine-tuning (the precomputed pass), and a live frozen copy beside a ZeRO-2
    policy (the same precision: no reward before any update); finite losses, the reward metrics logged, the
    chunked preference gradient in bf16 autocast."""
    from disttrain.launcher import REPO

    data = {"path": str(REPO / "data/tiny_dpo.jsonl"), "format": "preference", "packing": False,
            "eval_path": str(REPO / "data/tiny_dpo_eval.jsonl"), "max_seq_len": min(ctx.s.seq, 128)}
    summary = []
    # live_zero2: a frozen reference copy next to a ZeRO-2 policy; DeepSpeed runs the policy in bf16 weights and
    # accelerate does not autocast there, so the copy must be cast too: at step 1 policy == reference, and the
    # rewards (beta x log-ratio) must be ~0 (they were not while the copy scored in fp32)
    for label, extra, config in (("lora", {"lora": LORA}, "single_gpu"), ("full", {}, "single_gpu"),
                                 ("live_zero2", {"preference": {"reference": "model"}}, "zero2")):
        run = ctx.item_dir / label
        tree = recipe(ctx, run, data=data, training={"objective": "dpo", "lr": 1e-4, "eval_every": ctx.s.steps},
                      output={"save_final_model": False, "checkpoint_at_end": False}, **extra)
        _, log = train(ctx, label, config, tree)
        found = require_finite_losses(run, ctx.s.steps, log)
        first = [r for r in read_metrics(run) if "rewards/chosen" in r][0]
        if label == "live_zero2" and abs(first["rewards/chosen"]) > 1e-3:
            raise Fail(f"live_zero2: rewards/chosen {first['rewards/chosen']:.2e} at step {first['step']}, policy and "
                       "reference differ before any update (not the same precision?)", log)
        last = [r for r in read_metrics(run) if "rewards/accuracy" in r][-1]
        evals = [r for r in read_metrics(run) if "eval_rewards/accuracy" in r]
        if not evals:
            raise Fail(f"{label}: no evaluation line with eval_rewards/accuracy", log)
        ctx.figures[label] = {"loss": [found[1], found[ctx.s.steps]], "rewards/accuracy": last["rewards/accuracy"],
                              "eval_rewards/accuracy": evals[-1]["eval_rewards/accuracy"]}
        summary.append(f"{label}: loss {found[1]:.3f} -> {found[ctx.s.steps]:.3f}, "
                       f"eval accuracy {evals[-1]['eval_rewards/accuracy']:.2f}")
    return PASS, "; ".join(summary)


def adamw_8bit(ctx: Ctx) -> tuple[str, str]:
    ok, why = ctx.importable("bitsandbytes")
    if not ok:
        raise Skip(f"bitsandbytes does not import ({why}): carry its wheel with --wheels")
    run = ctx.item_dir / "run"
    _, log = train(ctx, "run", "single_gpu", recipe(ctx, run, training={"optimizer": "adamw_8bit"}))
    found = require_finite_losses(run, ctx.s.steps, log)
    check_full_export(ctx, run / "final", log)
    ctx.figures.update(first_loss=found[1], final_loss=found[ctx.s.steps])
    return PASS, f"{ctx.s.steps} steps, losses finite ({found[1]:.3f} -> {found[ctx.s.steps]:.3f}); final/ loads"


def packing(ctx: Ctx, attn: str) -> tuple[str, str]:
    """Model level (packing_isolation.py) and training level (eval loss of the initial weights, packed vs
    unpacked, through train.py)."""
    if attn.startswith("flash_attention"):
        ok, why = ctx.importable("flash_attn")
        if not ok:
            raise Skip(f"flash_attn does not import ({why}): carry a flash-attn wheel built for this torch/CUDA")
    if not PACKING_SCRIPT.is_file():
        raise Fail(f"{PACKING_SCRIPT.relative_to(REPO)} is missing")
    out = ctx.item_dir / "isolation.json"
    proc, log = run_cmd(ctx, "isolation", [sys.executable, str(PACKING_SCRIPT), "--model", str(ctx.model_dir),
                                           "--attn", attn, "--device", ctx.s.device, "--dtype", ctx.s.dtype,
                                           "--json", str(out)])
    if not out.is_file():  # it exits 1 when not isolated, with its report written: that is judged below
        raise Fail(f"packing_isolation.py exit {proc.returncode}, no report: {error_line(proc)}", log)
    isolation = json.loads(out.read_text())
    ctx.figures.update({k: v for k, v in isolation.items() if isinstance(v, (bool, int, float, str))})
    if not isolation["isolated"]:
        raise Fail(f"packing_isolation.py: packed examples are not isolated under {attn} "
                   f"(max abs diff {isolation['max_abs_diff']:.3g})", log)
    # train.py evaluates only after a step; with lr 1e-30 that step moves no fp32 master weight (an Adam
    # update is ~lr), so the eval at step 1 is the eval of the initial weights, packed or not.
    evals = {}
    for packed in (True, False):
        label = "packed" if packed else "unpacked"
        run = ctx.item_dir / label
        tree = recipe(ctx, run, model={"attn_implementation": attn},
                      data={"packing": packed, "eval_fraction": 0.2},
                      training={"max_steps": 1, "lr": 1e-30, "lr_scheduler": "constant", "warmup_steps": 0,
                                "eval_every": 1},
                      output={"save_final_model": False, "checkpoint_at_end": False})
        _, log = train(ctx, label, "single_gpu", tree)
        found = [r["eval_loss"] for r in read_metrics(run) if "eval_loss" in r]
        if len(found) != 1 or not math.isfinite(found[0]):
            raise Fail(f"{label}: expected one finite eval_loss in metrics.jsonl, got {found}", log)
        evals[label] = found[0]
    rel = abs(evals["packed"] - evals["unpacked"]) / abs(evals["unpacked"])
    ctx.figures.update(eval_loss_packed=evals["packed"], eval_loss_unpacked=evals["unpacked"], eval_rel_diff=rel)
    if rel > ctx.s.eval_rtol:
        raise Fail(f"eval loss at init: packed {evals['packed']:.6g} vs unpacked {evals['unpacked']:.6g} "
                   f"(rel {rel:.3g} > {ctx.s.eval_rtol:g})", log)
    return PASS, (f"isolated (max abs diff {isolation['max_abs_diff']:.2g}); eval loss at init packed "
                  f"{evals['packed']:.5g} = unpacked {evals['unpacked']:.5g} (rel {rel:.2g} <= {ctx.s.eval_rtol:g})")


def doctor_nccl(ctx: Ctx) -> tuple[str, str]:
    """`make doctor` on one process: exit 0, its NCCL / GPU / bandwidth lines kept."""
    import yaml

    ctx.item_dir.mkdir(parents=True, exist_ok=True)
    path = ctx.item_dir / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe(ctx, ctx.item_dir / "run"), sort_keys=False))
    timeout = max(30, int(ctx.remaining()) - 20)
    cmd = [sys.executable, "-m", "disttrain.doctor", "--nproc", "1", "--recipe", str(path), "--json",
           "--timeout-s", str(timeout), "--max-bytes", str(64 << 20 if ctx.s.device == "cuda" else 1 << 20)]
    proc, log = run_cmd(ctx, "doctor", cmd)
    try:  # stdout and stderr share the log: the report is the JSON object that starts on a line "{"
        start = proc.stdout.rindex("\n{\n") + 1 if "\n{\n" in proc.stdout else proc.stdout.index("{")
        report, _ = json.JSONDecoder().raw_decode(proc.stdout[start:])
    except ValueError:
        raise Fail(f"doctor exit {proc.returncode}, no JSON report: {error_line(proc)}", log) from None
    keep = ("torch", "cuda runtime vs driver", "nccl", "gpu", "all_reduce bandwidth", "interconnect")
    lines = {c["name"]: f"{c['status']} {c['detail']}" for c in report["checks"]
             if c["name"] in keep or c["name"].startswith("gpu ")}
    ctx.figures.update(lines)
    failed = [f"{c['name']}: {c['detail']}" for c in report["checks"] if c["status"] == "FAIL"]
    if proc.returncode != 0:
        raise Fail(f"doctor exit {proc.returncode}: FAIL lines: {'; '.join(failed) or error_line(proc)}", log)
    nccl = lines.get("nccl", "no nccl line (no GPU)")
    return PASS, f"exit 0; nccl: {nccl}"


def fsdp_sync_memory(ctx: Ctx) -> tuple[str, str]:
    """FSDP2 with grad_accum 4, distributed.fsdp_sync_each_micro_batch true vs false: peak memory of each."""
    peaks = {}
    for sync in (True, False):
        label = f"sync_{str(sync).lower()}"
        run = ctx.item_dir / label
        tree = recipe(ctx, run, training={"max_steps": 3, "grad_accum": 4},
                      distributed={"fsdp_sync_each_micro_batch": sync},
                      output={"save_final_model": False, "checkpoint_at_end": False})
        _, log = train(ctx, label, "fsdp", tree)
        require_finite_losses(run, 3, log)
        peaks[label] = max(r["peak_mem_gb"] for r in read_metrics(run) if "peak_mem_gb" in r)
    ctx.figures.update(peak_mem_gb=peaks)
    return INFO, (f"peak GB sync each micro-batch {peaks['sync_true']:.3f}, sync on the last only "
                  f"{peaks['sync_false']:.3f} (world size 1: the shard is the whole model; information only)")


def offload_activations(ctx: Ctx) -> tuple[str, str]:
    """training.offload_activations (save_on_cpu, pinned): the same losses as without, with its peak GPU
    memory and step time next to the plain run's (the speed cost is what docs still lack)."""
    runs = {}
    for offload in (False, True):
        label = f"offload_{str(offload).lower()}"
        run = ctx.item_dir / label
        tree = recipe(ctx, run, training={"max_steps": 6, "offload_activations": offload},
                      output={"save_final_model": False, "checkpoint_at_end": False})
        _, log = train(ctx, label, "single_gpu", tree)
        records = [r for r in read_metrics(run) if "loss" in r]
        runs[label] = (require_finite_losses(run, 6, log), max(r["peak_mem_gb"] for r in records),
                       sorted(r["step_time_s"] for r in records)[len(records) // 2])
    (plain, plain_peak, plain_s), (offload, offload_peak, offload_s) = runs["offload_false"], runs["offload_true"]
    diff = max_rel_diff(plain, offload)
    ctx.figures.update(max_rel_loss_diff=diff, peak_mem_gb=[plain_peak, offload_peak], step_s=[plain_s, offload_s])
    summary = (f"losses max rel diff {diff:.2e}; peak {plain_peak:.3f} -> {offload_peak:.3f} GB; step "
               f"{plain_s:.3f} -> {offload_s:.3f} s")
    return (PASS if diff <= 1e-3 else FAIL), summary


def mfu(ctx: Ctx) -> tuple[str, str]:
    """scripts/bench/gpu_figures.py (0.84B, seq 2048) on single and fsdp, its table kept."""
    out, work = ctx.item_dir / "figures", ctx.item_dir / "figures_work"
    per_launch = max(30, int((ctx.remaining() - 40) / 2))  # the 0.84B model is built first (~20 s)
    cmd = [sys.executable, str(GPU_FIGURES), "--configs", "single,fsdp", "--steps", "20", "--warmup", "10",
           "--out", str(out), "--work", str(work), "--timeout", str(per_launch)]
    proc, log = run_cmd(ctx, "gpu_figures", cmd)
    result = out / "gpu_figures.json"
    if result.is_file():
        figures = json.loads(result.read_text())
        ctx.figures.update(meta=figures["meta"], rows=figures["rows"], table=(out / "gpu_figures.md").read_text())
        inner = out / "launches.log"
        if inner.is_file():
            with ctx.lock, ctx.launches_log.open("a") as f:
                f.write(f"\n===== {ctx.item} / gpu_figures launches\n{inner.read_text()}")
    if proc.returncode != 0:
        failed = "; ".join(f"{r['config']}: {r['error']}" for r in ctx.figures.get("rows", []) if "error" in r)
        raise Fail(f"gpu_figures.py exit {proc.returncode}: {failed or error_line(proc)}", log)
    rows = ctx.figures["rows"]
    return PASS, "; ".join(f"{r['config']}: MFU {r['mfu']:.1%}, {r['tokens_per_s_per_device']:,.0f} tok/s, "
                           f"{r['peak_mem_gb']:.1f} GB" for r in rows)


def loss_memory(ctx: Ctx) -> tuple[str, str]:
    """disttrain.bench_memory on one GPU (single and FSDP2, vocab 152k, seq 4096): the loss's share of peak
    memory with full logits vs chunked; PASS when chunked cuts it at least 8x."""
    out = ctx.item_dir / "bench_memory"
    cmd = [sys.executable, "-m", "disttrain.bench_memory", "--strategies", "single_gpu,fsdp", "--nproc", "1",
           "--seq", "4096", "--steps", "4", "--warmup", "2", "--out", str(out),
           "--timeout", str(max(30, int(ctx.remaining() / 6)))]
    proc, log = run_cmd(ctx, "bench_memory", cmd)
    if proc.returncode != 0 or not (out / "results.json").is_file():
        raise Fail(f"bench_memory exit {proc.returncode}: {error_line(proc)}", log)
    rows = json.loads((out / "results.json").read_text())["rows"]
    ctx.figures.update(rows=rows, table=(out / "results.md").read_text())
    worst = min(r["reduction"] for r in rows)
    summary = "; ".join(f"{r['strategy']}: loss {r['plain_loss_gb']:.2f} -> {r['chunked_loss_gb']:.2f} GB "
                        f"({r['reduction']:.1f}x), step time x{r['step_time_ratio']:.2f}" for r in rows)
    return (PASS if worst >= 8 else FAIL), summary


@dataclass(frozen=True)
class Item:
    name: str
    run: Callable[[Ctx], tuple[str, str]]
    estimate_s: float  # on the H200: an ESTIMATE (never run there); not started with less budget left
    timeout_s: float  # killed after this (default; --timeout changes it)
    cpu: bool  # runs in --dry-run (tiny model; the timeouts fit it too)
    alone: bool = False  # measures the machine (bandwidth, memory, speed): never next to another item


ITEMS = [
    Item("doctor_nccl", doctor_nccl, 15, 90, True, alone=True),
    Item("full_bf16_single", partial(full_finetune, config="single_gpu"), 28, 120, True),
    Item("full_bf16_fsdp", partial(full_finetune, config="fsdp"), 30, 120, True),
    Item("full_bf16_zero2", partial(full_finetune, config="zero2"), 38, 150, True),
    Item("full_bf16_zero3", partial(full_finetune, config="zero3"), 40, 150, True),
    Item("streaming_resume", partial(full_finetune, config="single_gpu", streaming=True), 28, 120, True),
    Item("lora_ddp", partial(adapter, config="ddp", quantized=False), 15, 60, True),
    Item("lora_fsdp", partial(adapter, config="fsdp", quantized=False), 18, 60, True),
    Item("qlora_ddp", partial(adapter, config="ddp", quantized=True), 18, 60, False),
    Item("qlora_fsdp", partial(adapter, config="fsdp", quantized=True), 20, 60, False),
    Item("adamw_8bit", adamw_8bit, 15, 60, False),
    Item("dpo", dpo, 50, 150, True),
    Item("packing_sdpa", partial(packing, attn="sdpa"), 35, 90, True),
    Item("packing_flash_attention_2", partial(packing, attn="flash_attention_2"), 35, 90, False),
    Item("fsdp_sync_memory", fsdp_sync_memory, 30, 90, False, alone=True),
    Item("offload_activations", offload_activations, 25, 90, True, alone=True),
    Item("mfu", mfu, 90, 180, False, alone=True),
    Item("loss_memory", loss_memory, 60, 150, False, alone=True),
]
BY_NAME = {item.name: item for item in ITEMS}


# ----------------------------------------------------------------------------- the run
def installed_versions() -> dict[str, str]:
    return {(d.metadata["Name"] or "?").lower(): d.version for d in importlib.metadata.distributions()}


def install_wheels(folder: Path, target: Path | None = None) -> dict:
    """pip install --no-deps the kit's wheels (make gpu-kit): into site-packages when it is writable, else into
    `target` (default: a temp dir), which then goes first on sys.path and on PYTHONPATH for every launch."""
    import sysconfig

    wheels = sorted(folder.glob("*.whl"))
    record = {"dir": str(folder), "wheels": [w.name for w in wheels]}
    if not wheels:
        record.update(ok=False, error=f"no .whl files in {folder}")
        return record
    if target is None and not os.access(sysconfig.get_paths()["purelib"], os.W_OK):
        target = Path(tempfile.gettempdir()) / "disttrain_site"
    before = installed_versions()
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
           "--find-links", str(folder), *(["--upgrade", "--target", str(target)] if target else []),
           *map(str, wheels)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if target is not None:
        record["target"] = str(target)
        sys.path.insert(0, str(target))
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(target), os.environ.get("PYTHONPATH")) if p)
    importlib.invalidate_caches()
    after = installed_versions()
    record.update(ok=proc.returncode == 0, exit=proc.returncode,
                  installed={k: v for k, v in after.items() if before.get(k) != v})
    if proc.returncode != 0:
        record["error"] = (proc.stdout + proc.stderr)[-MAX_LOG_TAIL:]
        return record
    # --no-deps skipped every version range: check them here, before the first item (one line each)
    manifest = folder / "manifest.json"
    names = ([p["name"] for p in json.loads(manifest.read_text())["parts"]] if manifest.is_file()
             else [w.name.split("-")[0] for w in wheels])
    record["pins"] = kit.pin_mismatches(names, kit.project_requirements())
    return record


def wheels_line(record: dict) -> str:
    if record["ok"]:
        where = f" into {record['target']}" if record.get("target") else ""
        pins = (f"; {len(record['pins'])} version pin(s) not met: " + "; ".join(record["pins"])
                if record.get("pins") else "; every version pin met")
        return ("installed " + (", ".join(f"{k} {v}" for k, v in record["installed"].items()) or "nothing new")
                + where + pins)
    return "FAILED: " + record["error"][-300:]


def environment(dry_run: bool) -> dict:
    import torch

    def version(dist: str) -> str | None:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return None

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"device": gpu or f"CPU ({platform.machine()}, {os.cpu_count()} cores; dry run)", "dry_run": dry_run,
            "python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "nccl": ".".join(map(str, torch.cuda.nccl.version())) if gpu else None,
            "packages": {d: version(d) for d in ("accelerate", "transformers", "peft", "pydantic", "datasets",
                                                 "deepspeed", "bitsandbytes", "flash-attn", "wandb")}}


def prepare(ctx: Ctx) -> None:
    """The model (random init, Llama shape) and a synthetic text corpus, made here like gpu_figures.py does."""
    sys.path.insert(0, str(GPU_FIGURES.parent))
    import gpu_figures

    gpu_figures.SHAPES.setdefault("accept", ACCEPT_SHAPE)
    rows = ctx.s.steps * ctx.s.micro_batch * 4  # grad_accum up to 4 (fsdp_sync_memory), + eval rows
    ctx.corpus = gpu_figures.write_corpus(ctx.work / "corpus.jsonl", 2 * rows * ctx.s.seq, ctx.s.seq)
    ctx.params = gpu_figures.build_model(ctx.s.shape, ctx.work / "model")
    ctx.model_dir = ctx.work / "model"  # set last: items FAIL at once when the model is missing


def run_item(ctx: Ctx, item: Item, timeout: float, dry_run: bool) -> dict:
    """One item: its status, detail, figures and (for a FAIL) the tail of the log that explains it."""
    ctx = ctx.for_item(item.name, timeout)
    started = time.monotonic()
    tail = None
    try:
        if dry_run and not item.cpu:
            raise Skip("needs a GPU (dry run on CPU)")
        if ctx.model_dir is None:
            raise Fail("the model and corpus could not be built (meta.prepare_error says why)")
        status, detail = item.run(ctx)
    except Skip as exc:
        status, detail = SKIP, str(exc)
    except Fail as exc:
        status, detail = FAIL, exc.detail
        if exc.log is not None and exc.log.is_file():
            tail = exc.log.read_text()[-MAX_LOG_TAIL:]
    except Exception as exc:  # a bug or a surprise in one item must not cost the others their minutes
        status, detail = FAIL, f"{type(exc).__name__}: {exc}"
        tail = traceback.format_exc()[-MAX_LOG_TAIL:]
    row = {"item": item.name, "status": status, "detail": detail, "seconds": round(time.monotonic() - started, 1),
           "timeout_s": timeout, "figures": ctx.figures}
    if tail:
        row["log_tail"] = tail
    return row


def markdown(meta: dict, rows: list[dict]) -> str:
    env = meta["environment"]
    lines = [f"# GPU acceptance: {env['device']}", "",
             f"torch {env['torch']} (CUDA {env['cuda']}, NCCL {env['nccl']}), python {env['python']}; "
             + ", ".join(f"{k} {v}" for k, v in env["packages"].items() if v)
             + "; not installed: " + (", ".join(k for k, v in env["packages"].items() if not v) or "-"), ""]
    if meta.get("wheels"):
        lines += [f"wheels from {meta['wheels']['dir']}: {wheels_line(meta['wheels'])}", ""]
    counts = {s: sum(r["status"] == s for r in rows) for s in (PASS, FAIL, SKIP, INFO)}
    lines += [f"{counts[PASS]} PASS, {counts[FAIL]} FAIL, {counts[SKIP]} SKIP, {counts[INFO]} INFO "
              f"in {meta['seconds']:.0f} s{' (dry run)' if env['dry_run'] else ''}", "",
              "| item | status | seconds | detail |", "|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['item']} | {r['status']} | {r['seconds']:g} | {r['detail'].replace('|', '/')} |")
    for r in rows:
        if r["figures"].get("table"):
            lines += ["", f"## {r['item']}", "", r["figures"]["table"].strip()]
    for r in rows:
        if r.get("log_tail"):
            lines += ["", f"## {r['item']}: {r['status']}", "", "```", r["log_tail"].strip()[-2500:], "```"]
    return "\n".join(lines) + "\n"


def write_results(out: Path, meta: dict, rows: list[dict]) -> None:
    (out / "acceptance.json").write_text(json.dumps({"meta": meta, "items": rows}, indent=1))
    (out / "acceptance.md").write_text(markdown(meta, rows))


def parse_timeouts(values: list[str], names: list[str]) -> dict[str, float]:
    """`--timeout 120` (every item) and/or `--timeout lora_ddp=5,mfu=200` (named items)."""
    timeouts = {name: BY_NAME[name].timeout_s for name in names}
    for value in values:
        for part in value.split(","):
            name, sep, seconds = part.rpartition("=")
            if not sep:
                timeouts = dict.fromkeys(timeouts, float(seconds))
            elif name not in BY_NAME:
                raise SystemExit(f"error: --timeout {part}: unknown item {name!r}")
            else:
                timeouts[name] = float(seconds)
    return timeouts


class Runner:
    """Runs the items in the order asked: `jobs` at a time, except that an `alone` item waits for the
    running ones and runs by itself. Each row is printed and the results are rewritten as soon as it ends."""

    def __init__(self, ctx: Ctx, out: Path, meta: dict, names: list[str], timeouts: dict[str, float],
                 budget: float, dry_run: bool, started: float):
        self.ctx, self.out, self.meta, self.names = ctx, out, meta, names
        self.timeouts, self.budget, self.dry_run, self.started = timeouts, budget, dry_run, started
        self.rows: dict[str, dict] = {}

    def one(self, name: str) -> None:
        item = BY_NAME[name]
        left = self.budget - (time.monotonic() - self.started)
        need = max(20, item.estimate_s)
        if left < need and (item.cpu or not self.dry_run):
            row = {"item": name, "status": SKIP, "seconds": 0, "timeout_s": 0, "figures": {},
                   "detail": f"not started: {max(left, 0):.0f} s of the --budget of {self.budget:g} s left, "
                             f"it needs ~{need:g} s"}
        else:
            row = run_item(self.ctx, item, min(self.timeouts[name], left), self.dry_run)
        with self.ctx.lock:
            self.rows[name] = row
            print(f"{row['status']:<4}  {name:<26} {row['seconds']:>6.1f}s  {row['detail']}", flush=True)
            self.write()

    def write(self) -> None:
        self.meta["seconds"] = round(time.monotonic() - self.started, 1)
        write_results(self.out, self.meta, [self.rows[n] for n in self.names if n in self.rows])

    def run(self, jobs: int) -> list[dict]:
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            running = []
            for name in self.names:
                if jobs > 1 and BY_NAME[name].alone:
                    for future in running:
                        future.result()
                    running = []
                    self.one(name)
                else:
                    running.append(pool.submit(self.one, name))
            for future in running:
                future.result()
        self.write()
        return [self.rows[n] for n in self.names]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="acceptance.json/.md and launches.log go here")
    parser.add_argument("--work", type=Path, default=None,
                        help="model, corpus and run dirs (default: a fresh temporary dir; kept out of --out)")
    parser.add_argument("--items", default=",".join(BY_NAME), help=f"comma-separated, of {', '.join(BY_NAME)}")
    parser.add_argument("--wheels", type=Path, default=None,
                        help="pip install the .whl files of this dir first (the folder `make gpu-kit` builds)")
    parser.add_argument("--site", type=Path, default=None,
                        help="install the wheels into this dir (put first on PYTHONPATH) instead of site-packages; "
                             "default: site-packages when writable, else a temp dir")
    parser.add_argument("--dry-run", action="store_true",
                        help="CPU: tiny model, 4 steps, fp32; GPU-only items SKIP")
    parser.add_argument("--timeout", action="append", default=[], metavar="S|ITEM=S[,ITEM=S]",
                        help="seconds per item (all items, or the named ones); default: each item's own")
    parser.add_argument("--budget", type=float, default=None,
                        help="seconds for the whole run: items that would start later are SKIPped "
                             "(default 470 on a GPU, none in a dry run)")
    parser.add_argument("--jobs", type=int, default=None,
                        help="items run side by side (default 3 on a GPU, 1 in a dry run); doctor_nccl, "
                             "fsdp_sync_memory and mfu always run alone")
    args = parser.parse_args(argv)
    names = [n for n in args.items.split(",") if n]
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        parser.error(f"unknown --items {unknown}; known: {', '.join(BY_NAME)}")
    timeouts = parse_timeouts(args.timeout, names)
    budget = args.budget if args.budget is not None else (math.inf if args.dry_run else 470)
    jobs = args.jobs or (1 if args.dry_run else 3)
    started = time.monotonic()  # the budget counts the wheels and the model build too

    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print("error: no CUDA GPU visible (torch.cuda.is_available() is False); on CPU use --dry-run", file=sys.stderr)
        return 2
    for key, value in (("HF_HUB_OFFLINE", "1"), ("HF_DATASETS_OFFLINE", "1"), ("TOKENIZERS_PARALLELISM", "false"),
                       ("WANDB_MODE", "offline")):
        os.environ.setdefault(key, value)
    args.out.mkdir(parents=True, exist_ok=True)
    for name in ("acceptance.json", "acceptance.md", "launches.log"):
        (args.out / name).unlink(missing_ok=True)
    work = args.work or Path(tempfile.mkdtemp(prefix="disttrain_acceptance_"))
    marker = work / ".disttrain_acceptance"
    if work.exists() and any(work.iterdir()) and not marker.exists():
        parser.error(f"--work {work} holds other files; give an empty or new directory (it is wiped)")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    marker.touch()
    meta = {"command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
            "work": str(work), "budget_s": None if math.isinf(budget) else budget, "jobs": jobs, "seconds": 0}
    if args.wheels:
        meta["wheels"] = install_wheels(args.wheels, args.site)
        print(f"wheels: {wheels_line(meta['wheels'])}", flush=True)
        for line in meta["wheels"].get("pins", []):
            print(f"pin not met: {line}", flush=True)
    meta["environment"] = environment(args.dry_run)
    ctx = Ctx(s=Settings.for_run(args.dry_run), work=work, launches_log=args.out / "launches.log")
    ctx.launches_log.touch()
    try:
        prepare(ctx)
        meta["model"] = {"shape": ctx.s.shape, "params": ctx.params, "seq": ctx.s.seq, "steps": ctx.s.steps,
                         "precision": ctx.s.precision}
    except Exception as exc:  # every item then FAILs with this line instead of the run dying silently
        meta["prepare_error"] = f"{type(exc).__name__}: {exc}"
        print(traceback.format_exc(), file=sys.stderr, flush=True)
    rows = Runner(ctx, args.out, meta, names, timeouts, budget, args.dry_run, started).run(jobs)
    print(f"wrote {args.out / 'acceptance.json'}, {args.out / 'acceptance.md'}, {args.out / 'launches.log'}")
    return 1 if any(r["status"] == FAIL for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
