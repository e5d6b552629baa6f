"""The run's own files besides metrics and checkpoints: the output dir, a copy of the resolved recipe (and what
changed on resume), data_report.json, run.json with the one-screen run summary, and where final/ is."""

from __future__ import annotations

from pathlib import Path

import yaml

from disttrain.recipe.schema import Recipe, flat_fields, recipe_to_dict
from disttrain.runtime.backends import bare_model

FINAL_MODEL_DIR = "final"


def final_model_dir(recipe: Recipe) -> Path:
    return Path(recipe.output.dir) / FINAL_MODEL_DIR


# Fields that may change between a run and its resumption without changing what is trained.
_RESUME_NEUTRAL = ("output.", "logging.", "training.stop_at_step", "training.eval_every", "distributed.")


def recipe_changes(saved: dict, current: dict) -> list[str]:
    """'key: old -> new' for every training-relevant field that differs between two recipes."""
    old, new = flat_fields(saved), flat_fields(current)
    return [f"{key}: {old.get(key)!r} -> {new.get(key)!r}" for key in sorted(set(old) | set(new))
            if old.get(key) != new.get(key) and not key.startswith(_RESUME_NEUTRAL)]


def start(accelerator, recipe: Recipe, resuming: bool = False) -> None:
    """Create the output dir and keep the exact recipe (overrides applied) next to the results. A resumed run
    whose recipe differs from the saved one says so: the checkpoint's optimizer and scheduler restore the
    saved learning rate, and other data or hyper-parameters make the loss jump."""
    if accelerator.is_main_process:
        out = Path(recipe.output.dir)
        out.mkdir(parents=True, exist_ok=True)
        saved_path = out / "recipe.yaml"
        current = recipe_to_dict(recipe)
        if resuming and saved_path.is_file():
            changes = recipe_changes(yaml.safe_load(saved_path.read_text()) or {}, current)
            if changes:
                accelerator.print("warning: resuming with a changed recipe: " + "; ".join(changes) + " (the "
                                  "checkpoint restores the saved optimizer and LR schedule; a learning-rate change "
                                  "does not take effect). See docs/troubleshooting.md#recipe-changed-on-resume")
        saved_path.write_text(yaml.safe_dump(current, sort_keys=False))
    accelerator.wait_for_everyone()


def report_data(accelerator, reports: dict, out_dir: str | Path) -> None:
    """One line per split (and per source of a mixture), and the same numbers in <output.dir>/data_report.json."""
    import json
    from dataclasses import asdict

    for name, r in reports.items():
        accelerator.print(f"data[{name}]: {r.examples} examples -> {r.rows} rows, {r.target_tokens} target tokens, "
                          f"{r.tokens} tokens per epoch")
        for source, counts in r.sources.items():
            accelerator.print(f"data[{name}]: mixture: {source}: {counts['examples']} examples, "
                              f"{counts['target_tokens']} target tokens "
                              f"({counts['target_tokens'] / max(r.target_tokens, 1):.1%})")
        if r.images:
            accelerator.print(f"data[{name}]: {r.images}")
        if r.dropped_no_target:
            accelerator.print(f"data[{name}]: WARNING dropped {r.dropped_no_target} examples with no target tokens "
                              "(prompt fills max_seq_len, or empty answer)")
        if r.dropped_image_cut:
            accelerator.print(f"data[{name}]: WARNING dropped {r.dropped_image_cut} examples whose image tokens reach "
                              "past max_seq_len (an image is all its tokens or none): raise data.max_seq_len, or lower "
                              "data.max_pixels")
        if r.truncated:
            accelerator.print(f"data[{name}]: note: {r.truncated} examples truncated to max_seq_len")
        if r.dropped_remainder_tokens:
            accelerator.print(f"data[{name}]: note: the last {r.dropped_remainder_tokens} tokens (less than one row) "
                              "were dropped by concat_and_chunk")
    per_rank = _preparation_per_rank(accelerator, reports.get("train"))
    if accelerator.is_main_process:
        summary = {name: asdict(r) for name, r in reports.items()}
        for r in summary.values():  # rank-local numbers: reported for every rank below instead
            r.pop("prepare_s"), r.pop("tokenised_here")
        summary["preparation_per_rank"] = per_rank
        (Path(out_dir) / "data_report.json").write_text(json.dumps(summary, indent=1))


def _preparation_per_rank(accelerator, train_report) -> list[dict]:
    """Every rank's preparation time and whether it tokenised (collective). Only the main process should:
    the others read its `datasets` cache. A rank that tokenised too has another cache (several nodes
    without a shared HF_DATASETS_CACHE): said in one line, since it multiplies start-up time."""
    from accelerate.utils import gather_object

    if train_report is None:  # a stream: every rank tokenises its own shards as it trains
        return []
    mine = {"rank": accelerator.process_index, "prepare_s": round(train_report.prepare_s, 3),
            "tokenised_here": train_report.tokenised_here}
    per_rank = gather_object([mine]) if accelerator.num_processes > 1 else [mine]
    others = [r for r in per_rank if r["rank"] != 0]
    accelerator.print(f"data: prepared in {per_rank[0]['prepare_s']:.1f} s on rank 0"
                      + (f"; the other ranks read its cache in <= {max(r['prepare_s'] for r in others):.1f} s"
                         if others else ""))
    again = [r["rank"] for r in others if r["tokenised_here"]]
    if again:
        accelerator.print(f"data: WARNING ranks {again} tokenised the data again instead of reading rank 0's cache: "
                          "their datasets cache is elsewhere (several nodes?); point HF_DATASETS_CACHE at a "
                          "shared directory on every node")
    return per_rank


RUN_FILE = "run.json"


def describe_run(accelerator, recipe: Recipe, model, plan, per_epoch: int, total_steps: int) -> None:
    """The one-screen run summary, and the same facts in <output.dir>/run.json (for the report and card)."""
    import json
    import platform

    import torch

    from disttrain.model.params import count_parameters

    strategy, mesh = plan.strategy, plan.mesh  # parallel/plan.ParallelPlan

    total, trainable = count_parameters(bare_model(accelerator, model))
    t = recipe.training
    data_ranks = plan.data_ranks(accelerator)  # Ulysses: a group of sp processes reads one share of the rows
    global_batch = t.micro_batch_size * t.grad_accum * data_ranks
    if accelerator.is_main_process:
        device = accelerator.device
        device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else (platform.processor() or "cpu")
        facts = {"strategy": strategy, "distributed_type": accelerator.distributed_type.value,
                 "processes": accelerator.num_processes, "device": device.type, "device_name": device_name,
                 "mixed_precision": t.mixed_precision, "params": total, "trainable_params": trainable,
                 "global_batch": global_batch, "total_steps": total_steps, "objective": t.objective,
                 "torch": torch.__version__, **({"mesh": mesh} if mesh else {})}
        (Path(recipe.output.dir) / RUN_FILE).write_text(json.dumps(facts, indent=1))
    accelerator.print(
        f"run: strategy={strategy}{f' mesh={mesh}' if mesh else ''} distributed_type="
        f"{accelerator.distributed_type.value} processes={accelerator.num_processes} device={accelerator.device} "
        f"mixed_precision={t.mixed_precision} "
        f"compile={'regional (inductor, dynamic shapes)' if t.compile else 'no'}\n"
        f"run: params={total / 1e6:.2f}M trainable={trainable / 1e6:.2f}M "
        f"global_batch={global_batch} rows ({t.micro_batch_size} x {t.grad_accum} accum x "
        f"{data_ranks} {'procs' if data_ranks == accelerator.num_processes else f'groups of {plan.group} procs'}) "
        f"steps/epoch={'(a stream: passes per rank)' if recipe.data.streaming else per_epoch} "
        f"total_steps={total_steps}")
    from disttrain.runtime.backends import fsdp_layout

    if t.mixed_precision == "fp8":
        from disttrain.runtime import fp8

        accelerator.print(f"run: {fp8.describe(bare_model(accelerator, model))}")
    layout = fsdp_layout(model)
    if layout:  # FSDP2 or TP: which mesh the parameters live on (HSDP: replicated x sharded)
        accelerator.print(f"run: {'tensor-parallel' if plan.tensor_parallel else 'FSDP2'} parameters on the mesh "
                          f"{layout}")
