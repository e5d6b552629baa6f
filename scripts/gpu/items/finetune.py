"""Full fine-tuning items: bf16 under one process, FSDP2, ZeRO-2, ZeRO-3 and a streamed feed, each an
uninterrupted run and a resumed one that must repeat it; and 8-bit Adam (bitsandbytes)."""

from __future__ import annotations

from harness import PASS, Ctx, Fail, Skip, check_full_export, max_rel_diff, read_metrics, recipe, \
    require_finite_losses, require_gpus, train

from disttrain.runtime.startup import CYCLES_HELD_GPU_MEMORY


# sharded configs whose samples gather the model whole once (not over a tp or ep mesh), and what the log says then
SAMPLES_GATHER_WHOLE = ("fsdp", "hsdp", "zero3", "zero3_ulysses", "fsdp_cp")
SAMPLES_WHOLE = "samples: the whole model gathered once"


def full_finetune(ctx: Ctx, config: str, streaming: bool = False, nproc: int = 1) -> tuple[str, str]:
    """Uninterrupted vs a new launch resumed from the uninterrupted run's step-N/2 checkpoint: the same
    per-step losses after it; the export loads. `streaming`: the training data as a stream (the loader moves
    batches to the GPU itself; each rank's position from the checkpoint). `nproc`: processes (one GPU each);
    a machine with fewer GPUs SKIPs the item (HSDP's 2 x 2 mesh needs 4)."""
    require_gpus(nproc, config)
    if config.startswith("zero"):
        ok, why = ctx.importable("deepspeed")
        if not ok:
            raise Fail(f"deepspeed does not import: {why}")
    n, stop = ctx.s.steps, ctx.s.steps // 2
    ckpt = {"checkpoint_every": stop, "keep_last": 2}
    data = {"streaming": True} if streaming else {}
    if config in ("zero3_ulysses", "fsdp_cp"):  # the sequence meshes attend without a mask: no packing
        data["packing"] = False
    logging, env = {}, None
    if config == "fsdp_pp":  # one stage per GPU; unpacked rows, no samples (what a pipeline carries today)
        data["packing"], logging, env = False, {"samples": 0}, {"PARALLELISM_CONFIG_PP_SIZE": str(nproc)}
    a, b = ctx.item_dir / "uninterrupted", ctx.item_dir / "resumed"
    first, log_a = train(ctx, "uninterrupted", config, recipe(ctx, a, output=ckpt, data=data, logging=logging),
                         env=env, nproc=nproc)
    ref = require_finite_losses(a, n, log_a)
    held = [line for line in first.stdout.splitlines() if CYCLES_HELD_GPU_MEMORY in line]
    if held:  # the collector is paused while a run is set up (disttrain/runtime/startup.py): it held GPU memory
        raise Fail(held[0], log_a)
    if config in SAMPLES_GATHER_WHOLE and SAMPLES_WHOLE not in first.stdout:  # the small model fits a GPU
        raise Fail(f"the end-of-run samples under {config} did not say '{SAMPLES_WHOLE}' "
                   "(disttrain/training/samples.py: sharded weights gathered once when they fit)", log_a)
    saved = a / "checkpoints" / f"step-{stop:08d}"
    second, log_b = train(ctx, "resumed", config, recipe(ctx, b, output=ckpt, data=data, logging=logging),
                          (f"output.resume={saved}",), env=env, nproc=nproc)
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
    if config.startswith("zero"):
        require_final_equals_checkpoint(ctx, b, n, log_b)
    return PASS, f"resumed at {stop}/{n}: max rel loss diff {diff:.2g} (<= {ctx.s.loss_rtol:g}); final/ loads"


def require_final_equals_checkpoint(ctx: Ctx, run, step: int, log) -> None:
    """ZeRO with the float32 model under bf16 trains a bf16 copy and keeps fp32 masters: final/ must hold what the
    checkpoint readers return for the last checkpoint (DeepSpeed's zero_to_fp32: the masters), bit for bit, in
    their dtype (it held the bf16-rounded module weights; disttrain/model/export.py)."""
    from safetensors.torch import load_file

    from disttrain.model import from_checkpoint

    with ctx.lock:  # from_pretrained patches torch's init functions while it builds: one at a time
        model, _, _ = from_checkpoint.load(run / "checkpoints" / f"step-{step:08d}")
    state, final = model.state_dict(), load_file(run / "final" / "model.safetensors")
    differ = [name for name, value in final.items()
              if name in state and (value.dtype != state[name].dtype or not value.equal(state[name]))]
    if differ:
        raise Fail(f"final/ differs from the step-{step} checkpoint's weights in {len(differ)} tensors "
                   f"(e.g. {differ[0]}: {final[differ[0]].dtype} vs {state[differ[0]].dtype})", log)


def adamw_8bit(ctx: Ctx) -> tuple[str, str]:
    """training.optimizer=adamw_8bit (bitsandbytes' 8-bit states on the GPU): finite losses and a full export."""
    ok, why = ctx.importable("bitsandbytes")
    if not ok:
        raise Skip(f"bitsandbytes does not import ({why}): carry its wheel with --wheels")
    run = ctx.item_dir / "run"
    _, log = train(ctx, "run", "single_gpu", recipe(ctx, run, training={"optimizer": "adamw_8bit"}))
    found = require_finite_losses(run, ctx.s.steps, log)
    check_full_export(ctx, run / "final", log)
    ctx.figures.update(first_loss=found[1], final_loss=found[ctx.s.steps])
    return PASS, f"{ctx.s.steps} steps, losses finite ({found[1]:.3f} -> {found[ctx.s.steps]:.3f}); final/ loads"

