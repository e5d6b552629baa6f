"""The vision-language items: the tiny Gemma-3-shaped model (SigLIP-style encoder, pooled projector; PIL image
processor, no torchvision) trained on the shipped pictures in bf16 under FSDP2 (its encoder blocks wrapped by their
own class, from the model's _no_split_modules) and under ZeRO-3 (the encoder partitioned; the bucket sizes from the
text config's hidden size): the paths a GPU runs differently (bf16 pixels through the encoder, sdpa's CUDA kernels
with Gemma 3's bidirectional image blocks, FSDP2 / DeepSpeed on NCCL). The data alternates image and text-only
rows, one row per micro-batch: a text-only micro-batch's blank image row (data/vision.py) keeps the ranks' NCCL
collectives in step."""

from __future__ import annotations

from harness import PASS, Ctx, Fail, read_metrics, recipe, require_finite_losses, train

STEPS_PER_SETTING_STEP = 4


def vision_language(ctx: Ctx, config: str) -> tuple[str, str]:
    """Finite losses at every step, the eval loss below its first value, the export loadable by
    AutoModelForImageTextToText and AutoProcessor, one sample generated on an image, peak memory recorded."""
    from disttrain.runtime.launcher import REPO
    from disttrain.tools.tiny import build_vlm_dir

    model_dir = build_vlm_dir(ctx.item_dir / "tiny-gemma3-vl")
    run = ctx.item_dir / "run"
    steps = ctx.s.steps * STEPS_PER_SETTING_STEP
    tree = recipe(ctx, run, model={"name_or_path": str(model_dir), "dtype": "float32",
                                   "attn_implementation": "sdpa"},
                  data={"path": str(REPO / "data/tiny_vlm_mixed.jsonl"), "format": "chat", "packing": False,
                        "eval_path": str(REPO / "data/tiny_vlm_eval.jsonl"), "max_seq_len": 64},
                  training={"max_steps": steps, "micro_batch_size": 1, "grad_accum": 8, "lr": 3e-3,
                            "eval_every": steps // 2},
                  logging={"samples": 1})
    proc, log = train(ctx, "run", config, tree)
    require_finite_losses(run, steps, log)
    evals = [r["eval_loss"] for r in read_metrics(run) if "eval_loss" in r]
    if len(evals) < 2 or not evals[-1] < evals[0]:
        raise Fail(f"the eval loss did not fall: {evals}", log)
    if "sample: " not in proc.stdout:
        raise Fail("no end-of-run sample was printed", log)
    from transformers import AutoModelForImageTextToText, AutoProcessor

    AutoProcessor.from_pretrained(run / "final")
    model = AutoModelForImageTextToText.from_pretrained(run / "final")
    peak = max(r.get("peak_mem_gb", 0.0) for r in read_metrics(run))
    ctx.figures.update(eval_loss_first=evals[0], eval_loss_last=evals[-1], peak_mem_gb=peak)
    return PASS, (f"{steps} steps under {config}, eval loss {evals[0]:.3f} -> {evals[-1]:.3f}; final/ loads "
                  f"({type(model).__name__} + AutoProcessor), peak {peak:.2f} GB")
