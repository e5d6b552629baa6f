"""The online-RL items: GRPO on one GPU in bf16, rollouts sampled by transformers' generate from the policy being
trained (the KV cache on the GPU), scored by the tiny recipe's reward functions; a reward model trained in bf16."""

from __future__ import annotations

from harness import PASS, Ctx, Fail, read_metrics, recipe, require_finite_losses, train

STEPS_PER_SETTING_STEP = 4  # 32 prompt batches on the GPU (8 x 4), 16 in the CPU dry run


def grpo(ctx: Ctx) -> tuple[str, str]:
    """GRPO on the tiny tasks' prompts: finite losses at every step, the reward rising (its last fifth of steps
    above its first), the rollout throughput (completion tokens per second of sampling), the time split between
    sampling and training, and the peak memory recorded."""
    from disttrain.runtime.launcher import REPO

    steps = ctx.s.steps * STEPS_PER_SETTING_STEP
    rewards = [{"function": f"{REPO}/recipes/tiny/rewards.py:letters"},
               {"function": f"{REPO}/recipes/tiny/rewards.py:answer_words"}]
    run = ctx.item_dir / "run"
    tree = recipe(ctx, run, data={"path": str(REPO / "data/tiny_prompts.jsonl"), "format": "prompt", "packing": False,
                                  "max_seq_len": 64},
                  training={"objective": "grpo", "max_steps": steps, "micro_batch_size": 4, "grad_accum": 1,
                            "lr": 5e-3, "lr_scheduler": "constant", "warmup_steps": 0},
                  rl={"num_generations": 8, "max_completion_length": 32, "epsilon_high": 0.28, "rewards": rewards},
                  output={"save_final_model": False, "checkpoint_at_end": False})
    _, log = train(ctx, "run", "single_gpu", tree)
    require_finite_losses(run, steps, log)
    records = [r for r in read_metrics(run) if "reward" in r]
    fifth = max(len(records) // 5, 1)
    first = sum(r["reward"] for r in records[:fifth]) / fifth
    last = sum(r["reward"] for r in records[-fifth:]) / fifth
    if not last > first:
        raise Fail(f"the reward did not rise: {first:.3f} over the first fifth of {len(records)} steps, {last:.3f} "
                   "over the last", log)
    throughput = sorted(r["rollout_tokens_per_s"] for r in records)[len(records) // 2]
    rollout_share = sum(r["rollout_s"] for r in records) / max(sum(r["step_time_s"] for r in records), 1e-9)
    peak = max(r.get("peak_mem_gb", 0.0) for r in read_metrics(run))
    ctx.figures.update(reward_first_fifth=first, reward_last_fifth=last, rollout_tokens_per_s_median=throughput,
                       rollout_s_over_step_s=rollout_share, peak_mem_gb=peak)
    return PASS, (f"{steps} steps, reward {first:.3f} -> {last:.3f}; rollouts {throughput:.0f} tokens/s (median), "
                  f"peak {peak:.2f} GB")


def reward_model(ctx: Ctx) -> tuple[str, str]:
    """A reward model on the GPU in bf16: the one-label score head trained on the tiny DPO pairs (Bradley-Terry),
    finite losses, the eval pair accuracy recorded and above chance, the export loadable by transformers."""
    from disttrain.runtime.launcher import REPO

    run = ctx.item_dir / "run"
    steps = ctx.s.steps * STEPS_PER_SETTING_STEP
    tree = recipe(ctx, run, data={"path": str(REPO / "data/tiny_dpo.jsonl"), "format": "preference", "packing": False,
                                  "eval_path": str(REPO / "data/tiny_dpo_eval.jsonl"), "max_seq_len": 64},
                  training={"objective": "reward", "max_steps": steps, "micro_batch_size": 8, "grad_accum": 1,
                            "lr": 3e-3, "eval_every": steps},
                  reward_model={"center_rewards_coefficient": 0.01})
    _, log = train(ctx, "run", "single_gpu", tree)
    require_finite_losses(run, steps, log)
    evals = [r for r in read_metrics(run) if "eval_rewards/accuracy" in r]
    if not evals or not evals[-1]["eval_rewards/accuracy"] > 0.5:
        raise Fail(f"eval pair accuracy {evals[-1]['eval_rewards/accuracy'] if evals else 'missing'}: not above "
                   "chance", log)
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(run / "final")
    if model.config.num_labels != 1:
        raise Fail(f"the export has {model.config.num_labels} labels, not one score", log)
    accuracy = evals[-1]["eval_rewards/accuracy"]
    ctx.figures.update(eval_pair_accuracy=accuracy)
    return PASS, f"{steps} steps, eval pair accuracy {accuracy:.2f}; the export loads with one label"
