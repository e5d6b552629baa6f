"""Adapter items: LoRA and QLoRA (4-bit base, bitsandbytes) under DDP and FSDP2; the adapter is exported."""

from __future__ import annotations

from harness import (LORA, PASS, Ctx, Skip, check_adapter_export, recipe, require_finite_losses, require_gpus,
                     train)

def adapter(ctx: Ctx, config: str, quantized: bool, nproc: int = 1) -> tuple[str, str]:
    """LoRA (or QLoRA) trains with finite losses and exports its adapter; `nproc` processes (one GPU each; a
    machine with fewer SKIPs)."""
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
    _, log = train(ctx, "run", config, recipe(ctx, run, model=model, lora=LORA, training={"lr": 1e-3}), env=env,
                   nproc=nproc)
    found = require_finite_losses(run, ctx.s.steps, log)
    tensors = len(check_adapter_export(run / "final", log))
    ctx.figures.update(first_loss=found[1], final_loss=found[ctx.s.steps], adapter_tensors=tensors)
    return PASS, f"{ctx.s.steps} steps, losses finite ({found[1]:.3f} -> {found[ctx.s.steps]:.3f}); adapter exported"

