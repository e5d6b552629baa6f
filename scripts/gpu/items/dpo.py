"""The preference item: DPO in bf16 with the three reference modes (adapters off, precomputed, a live copy
beside a ZeRO-2 policy)."""

from __future__ import annotations

from harness import LORA, PASS, Ctx, Fail, read_metrics, recipe, require_finite_losses, train

def dpo(ctx: Ctx) -> tuple[str, str]:
    """Preference tuning in bf16 on the GPU, the reference modes: LoRA (one no-grad forward with the adapters
    disabled per micro-batch), full fine-tuning (the precomputed pass), and a live frozen copy beside a ZeRO-2
    policy (the same precision: no reward before any update); finite losses, the reward metrics logged, the
    chunked preference gradient in bf16 autocast."""
    from disttrain.runtime.launcher import REPO

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

