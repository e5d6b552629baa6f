"""The preference item: DPO in bf16 with the three reference modes (adapters off, precomputed, a live copy
beside a ZeRO-2 policy), and KTO (its partners' no-grad pass and z in bf16)."""

from __future__ import annotations

import math

from harness import LORA, PASS, Ctx, Fail, read_metrics, recipe, require_finite_losses, train

def dpo(ctx: Ctx) -> tuple[str, str]:
    """Preference tuning in bf16 on the GPU, the reference modes: LoRA (one no-grad forward with the adapters
    disabled per micro-batch), full fine-tuning (the precomputed pass), and a live frozen copy beside a ZeRO-2
    policy (the same precision: no reward before any update); finite losses, the reward metrics logged, the
    chunked preference gradient in bf16 autocast; and KTO with LoRA on unpaired examples (z logged, the margin
    evaluated)."""
    from disttrain.runtime.launcher import REPO

    data = {"path": str(REPO / "data/tiny_dpo.jsonl"), "format": "preference", "packing": False,
            "eval_path": str(REPO / "data/tiny_dpo_eval.jsonl"), "max_seq_len": min(ctx.s.seq, 128)}
    summary = []
    # live_zero2: a frozen reference copy next to a ZeRO-2 policy; DeepSpeed runs the policy in bf16 weights and
    # accelerate does not autocast there, so the copy must be cast too: at step 1 policy == reference, and the
    # rewards (beta x log-ratio) must be ~0 (they were not while the copy scored in fp32)
    unpaired = {**data, "path": str(REPO / "data/tiny_kto.jsonl"), "format": "unpaired",
                "eval_path": str(REPO / "data/tiny_kto_eval.jsonl")}
    for label, extra, config in (("lora", {"lora": LORA}, "single_gpu"), ("full", {}, "single_gpu"),
                                 ("live_zero2", {"preference": {"reference": "model"}}, "zero2"),
                                 ("kto", {"lora": LORA, "preference": {"loss": "kto"}, "data": unpaired},
                                  "single_gpu")):
        run = ctx.item_dir / label
        tree = recipe(ctx, run, **{"data": data, **extra},
                      training={"objective": "dpo", "lr": 1e-4, "eval_every": ctx.s.steps},
                      output={"save_final_model": False, "checkpoint_at_end": False})
        _, log = train(ctx, label, config, tree)
        found = require_finite_losses(run, ctx.s.steps, log)
        first = [r for r in read_metrics(run) if "rewards/chosen" in r][0]
        if label == "live_zero2" and abs(first["rewards/chosen"]) > 1e-3:
            raise Fail(f"live_zero2: rewards/chosen {first['rewards/chosen']:.2e} at step {first['step']}, policy and "
                       "reference differ before any update (not the same precision?)", log)
        score = "rewards/margin" if label == "kto" else "rewards/accuracy"  # KTO has no pairs to rank
        last = [r for r in read_metrics(run) if score in r][-1]
        evals = [r for r in read_metrics(run) if f"eval_{score}" in r]
        if not evals:
            raise Fail(f"{label}: no evaluation line with eval_{score}", log)
        if label == "kto" and not all(math.isfinite(r["kl"]) for r in read_metrics(run) if "kl" in r):
            raise Fail("kto: z (kl) not finite", log)
        ctx.figures[label] = {"loss": [found[1], found[ctx.s.steps]], score: last[score],
                              f"eval_{score}": evals[-1][f"eval_{score}"]}
        summary.append(f"{label}: loss {found[1]:.3f} -> {found[ctx.s.steps]:.3f}, "
                       f"eval {score.split('/')[1]} {evals[-1][f'eval_{score}']:.2f}")
    return PASS, "; ".join(summary)

