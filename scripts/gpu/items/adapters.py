"""Adapter items: LoRA and QLoRA (4-bit base, bitsandbytes) under DDP and FSDP2; the adapter is exported."""

from __future__ import annotations

from harness import (LORA, PASS, Ctx, Fail, Skip, check_adapter_export, recipe, require_finite_losses,
                     require_gpus, train)

def adapter(ctx: Ctx, config: str, quantized: bool, nproc: int = 1) -> tuple[str, str]:
    """LoRA (or QLoRA) trains with finite losses and exports its adapter, saving a checkpoint at every step by
    time (output.checkpoint_minutes); `nproc` processes (one GPU each; a machine with fewer SKIPs)."""
    require_gpus(nproc, config)
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
    # output.checkpoint_minutes due at every step: each rank's clock flag crosses the step's all-reduce and comes
    # back through pinned memory (the GPU path of loop._FlagsOnHost), and every rank saves the same steps
    output = {"checkpoint_minutes": 1e-6, "keep_last": ctx.s.steps + 1}
    _, log = train(ctx, "run", config, recipe(ctx, run, model=model, lora=LORA, training={"lr": 1e-3},
                                             output=output), env=env, nproc=nproc)
    found = require_finite_losses(run, ctx.s.steps, log)
    saved = sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.startswith("step-"))
    if saved != [f"step-{s:08d}" for s in range(1, ctx.s.steps + 1)]:
        raise Fail(f"checkpoints by time: expected one at every step, found {saved}", log)
    tensors = len(check_adapter_export(run / "final", log))
    ctx.figures.update(first_loss=found[1], final_loss=found[ctx.s.steps], adapter_tensors=tensors)
    return PASS, f"{ctx.s.steps} steps, losses finite ({found[1]:.3f} -> {found[ctx.s.steps]:.3f}); adapter exported"

