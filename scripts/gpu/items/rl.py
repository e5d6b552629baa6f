"""The online-RL items: GRPO on one GPU in bf16, rollouts sampled by transformers' generate from the policy being
trained (the KV cache on the GPU), scored by the tiny recipe's reward functions; a reward model trained in bf16."""

from __future__ import annotations

from harness import PASS, Ctx, Fail, read_metrics, recipe, require_finite_losses, train

STEPS_PER_SETTING_STEP = 4  # 32 prompt batches on the GPU (8 x 4), 16 in the CPU dry run


def _fifths(records: list[dict], key: str) -> tuple[float, float]:
    """The mean of `key` over the first fifth of the logged steps and over the last fifth."""
    fifth = max(len(records) // 5, 1)
    return (sum(r[key] for r in records[:fifth]) / fifth, sum(r[key] for r in records[-fifth:]) / fifth)


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
    first, last = _fifths(records, "reward")
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


# a ~0.75B Llama shape (random weights, the tiny tokenizer's vocabulary): decoding a model of this size is what the
# rollout engines are compared on; the CPU dry run keeps the acceptance model
DECODE_SHAPE = dict(hidden_size=2048, intermediate_size=5504, num_hidden_layers=16, num_attention_heads=16,
                    num_key_value_heads=8, max_position_embeddings=2048)


def _decode_model(ctx: Ctx):
    """The model the engines decode: DECODE_SHAPE on a GPU (made once, bf16 safetensors), else the acceptance
    model."""
    import torch

    if not torch.cuda.is_available():
        return ctx.model_dir
    folder = ctx.work / "decode-model"
    if not (folder / "config.json").is_file():
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        config = AutoConfig.from_pretrained(ctx.model_dir)
        for key, value in DECODE_SHAPE.items():
            setattr(config, key, value)
        config.head_dim = DECODE_SHAPE["hidden_size"] // DECODE_SHAPE["num_attention_heads"]
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        model.save_pretrained(folder)
        AutoTokenizer.from_pretrained(ctx.model_dir).save_pretrained(folder)
    return folder


def _grpo_tree(ctx: Ctx, run, model_dir, steps: int, rl: dict) -> dict:
    from disttrain.runtime.launcher import REPO

    rewards = [{"function": f"{REPO}/recipes/tiny/rewards.py:letters"},
               {"function": f"{REPO}/recipes/tiny/rewards.py:answer_words"}]
    tree = recipe(ctx, run, data={"path": str(REPO / "data/tiny_prompts.jsonl"), "format": "prompt", "packing": False,
                                  "max_seq_len": 64},
                  training={"objective": "grpo", "max_steps": steps, "micro_batch_size": 4, "grad_accum": 2,
                            "lr": 1e-5, "lr_scheduler": "constant", "warmup_steps": 0},
                  rl={"num_generations": 8, "max_completion_length": 128, "rewards": rewards, **rl},
                  output={"save_final_model": False, "checkpoint_at_end": False})
    tree["model"]["name_or_path"] = str(model_dir)
    return tree


def _rollout_figures(run) -> tuple[float, float, dict]:
    """(rollout tokens/s over the run, sampling share of the step time, {step: reward}), the first step (compile,
    warm-up) left out."""
    records = [r for r in read_metrics(run) if "reward" in r and r["step"] > 1]
    rollout_s = sum(r["rollout_s"] for r in records)
    tokens = sum(r["rollout_tokens_per_s"] * r["rollout_s"] for r in records)
    share = rollout_s / max(sum(r["step_time_s"] for r in records), 1e-9)
    return tokens / max(rollout_s, 1e-9), share, {r["step"]: r["reward"] for r in records}


def grpo_engines(ctx: Ctx) -> tuple[str, str]:
    """The in-process rollout engines on one GPU, a ~0.75B model in bf16, 64 completions of up to 128 tokens per
    step: rl.engine generate (dynamic KV cache) against static (static KV cache, the decode step compiled by
    transformers). Rollout tokens/s of each (the first step, with the compile, left out), their ratio, the sampling
    share of the step, and on how many steps the two sampled alike (bf16 kernels differ between the compiled and
    eager decode: recorded, not failed)."""
    steps = max(ctx.s.steps, 4)
    model_dir = _decode_model(ctx)
    figures = {}
    for engine in ("generate", "static"):
        run = ctx.item_dir / engine
        _, log = train(ctx, engine, "single_gpu", _grpo_tree(ctx, run, model_dir, steps, {"engine": engine}))
        require_finite_losses(run, steps, log)
        figures[engine] = _rollout_figures(run)
    (fast, fast_share, rewards), (static, static_share, static_rewards) = figures["generate"], figures["static"]
    alike = sum(static_rewards.get(s) == r for s, r in rewards.items())
    ctx.figures.update(generate_tokens_per_s=fast, static_tokens_per_s=static, static_over_generate=static / fast,
                       generate_sampling_share=fast_share, static_sampling_share=static_share,
                       steps_sampled_alike=alike, steps_compared=len(rewards))
    return PASS, (f"rollouts: generate {fast:.0f} tokens/s ({fast_share:.0%} of the step), static {static:.0f} "
                  f"({static_share:.0%}): x{static / fast:.2f}; {alike}/{len(rewards)} steps sampled alike")


def grpo_gather(ctx: Ctx, config: str, nproc: int = 2) -> tuple[str, str]:
    """Gather-once under FSDP2 or ZeRO-3 on 2 GPUs: the same GRPO run with rl.generation_weights whole and
    per_layer, the ~0.75B model in bf16; rollout seconds of each, their ratio, and the rewards equal at every step
    (the same weights decode either way). SKIP below 2 GPUs."""
    from harness import require_gpus

    require_gpus(nproc, config)
    steps = max(ctx.s.steps, 4)
    model_dir = _decode_model(ctx)
    seconds, rewards = {}, {}
    for weights in ("whole", "per_layer"):
        run = ctx.item_dir / weights
        _, log = train(ctx, weights, config, _grpo_tree(ctx, run, model_dir, steps, {"generation_weights": weights}),
                       nproc=nproc)
        require_finite_losses(run, steps, log)
        records = [r for r in read_metrics(run) if "reward" in r and r["step"] > 1]
        seconds[weights], rewards[weights] = sum(r["rollout_s"] for r in records), {r["step"]: r["reward"]
                                                                                     for r in records}
    equal = sum(rewards["whole"].get(s) == r for s, r in rewards["per_layer"].items())
    ratio = seconds["per_layer"] / max(seconds["whole"], 1e-9)
    ctx.figures.update(whole_rollout_s=seconds["whole"], per_layer_rollout_s=seconds["per_layer"],
                       per_layer_over_whole=ratio, steps_rewards_equal=equal, steps_compared=len(rewards["whole"]))
    if equal != len(rewards["per_layer"]):
        raise Fail(f"{config}: the whole and per-layer rollouts' rewards differ on "
                   f"{len(rewards['per_layer']) - equal} of {len(rewards['per_layer'])} steps", log)
    return PASS, (f"{config}: rollouts {seconds['whole']:.1f} s whole vs {seconds['per_layer']:.1f} s per layer "
                  f"(x{ratio:.1f}); rewards equal at every step")


def distill(ctx: Ctx) -> tuple[str, str]:
    """Distillation on one GPU in bf16: a freshly initialised student of the acceptance model's shape taught by the
    acceptance model (the teacher, frozen beside it), every step on the student's own samples (generate on the
    GPU), the generalised JSD of both heads chunked on the GPU: finite losses, the divergence falling (its last
    fifth of steps below its first), the training tokens/s and the peak memory of the two models recorded."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from disttrain.runtime.launcher import REPO

    student = ctx.item_dir / "student"
    torch.manual_seed(1)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(ctx.model_dir)).save_pretrained(student)
    AutoTokenizer.from_pretrained(ctx.model_dir).save_pretrained(student)
    steps = ctx.s.steps * STEPS_PER_SETTING_STEP
    run = ctx.item_dir / "run"
    tree = recipe(ctx, run, data={"path": str(REPO / "data/tiny_prompts.jsonl"), "format": "prompt", "packing": False,
                                  "max_seq_len": 64},
                  training={"objective": "distill", "max_steps": steps, "micro_batch_size": 8, "grad_accum": 1,
                            "lr": 1e-3, "lr_scheduler": "constant", "warmup_steps": 0},
                  distill={"teacher": str(ctx.model_dir), "lmbda": 1.0, "beta": 0.5, "max_completion_length": 32},
                  output={"save_final_model": False, "checkpoint_at_end": False})
    tree["model"]["name_or_path"] = str(student)
    _, log = train(ctx, "run", "single_gpu", tree)
    require_finite_losses(run, steps, log)
    records = [r for r in read_metrics(run) if "loss" in r]
    first, last = _fifths(records, "loss")
    if not last < first:
        raise Fail(f"the divergence did not fall: {first:.4f} over the first fifth of {len(records)} steps, "
                   f"{last:.4f} over the last", log)
    speed = sorted(r["tokens_per_s"] for r in records)[len(records) // 2]
    peak = max(r.get("peak_mem_gb", 0.0) for r in read_metrics(run))
    ctx.figures.update(divergence_first_fifth=first, divergence_last_fifth=last, tokens_per_s_median=speed,
                       peak_mem_gb=peak)
    return PASS, (f"{steps} steps, divergence {first:.4f} -> {last:.4f}; {speed:.0f} tokens/s (median), "
                  f"peak {peak:.2f} GB")


def agent(ctx: Ctx) -> tuple[str, str]:
    """Multi-turn rollouts with a tool on one GPU in bf16: the acceptance model (the tiny tokenizer: its chat
    template lists tools, its response template parses calls) warm-started by SFT on the shipped tool-calling
    transcripts, then GRPO with recipes/tiny/tools.py:lookup -- each turn one generate() on the GPU, the tool run
    in a thread beside it, its reply appended and masked. Finite losses in both runs; on the GPU the tool called
    (tools/call_frequency above 0.3 over the run) and its replies inside the logged trajectories; the rollout
    throughput, the sampling share of the step, the tools' counts and the peak memory recorded."""
    from disttrain.runtime.launcher import REPO

    sft_steps, steps = ctx.s.steps * 50, ctx.s.steps * STEPS_PER_SETTING_STEP
    sft = ctx.item_dir / "sft"
    tree = recipe(ctx, sft, data={"path": str(REPO / "data/tiny_tool_sft.jsonl"), "format": "chat", "packing": False,
                                  "max_seq_len": 384},
                  training={"max_steps": sft_steps, "micro_batch_size": 16, "grad_accum": 1, "lr": 2e-3,
                            "lr_scheduler": "cosine", "warmup_steps": 10},
                  output={"checkpoint_at_end": False})
    _, log = train(ctx, "sft", "single_gpu", tree)
    require_finite_losses(sft, sft_steps, log)
    run = ctx.item_dir / "run"
    tree = recipe(ctx, run, data={"path": str(REPO / "data/tiny_tool_prompts.jsonl"), "format": "prompt",
                                  "packing": False, "max_seq_len": 320},
                  training={"objective": "grpo", "max_steps": steps, "micro_batch_size": 4, "grad_accum": 1,
                            "lr": 2e-4, "lr_scheduler": "constant", "warmup_steps": 0},
                  rl={"num_generations": 8, "max_completion_length": 96, "temperature": 0.5,
                      "max_tool_calling_iterations": 2, "tools": [f"{REPO}/recipes/tiny/tools.py:lookup"],
                      "rewards": [{"function": f"{REPO}/recipes/tiny/tools.py:code_answer"}]},
                  output={"save_final_model": False, "checkpoint_at_end": False})
    tree["model"]["name_or_path"] = str(sft / "final")
    _, log = train(ctx, "run", "single_gpu", tree)
    require_finite_losses(run, steps, log)
    records = [r for r in read_metrics(run) if "tools/call_frequency" in r]
    calls = sum(r["tools/call_frequency"] for r in records) / max(len(records), 1)
    replies = any("<|im_start|>tool" in c["completion"] for r in read_metrics(run) for c in r.get("completions", []))
    if ctx.s.device == "cuda" and not (calls > 0.3 and replies):
        raise Fail(f"the warm-started policy called the tool {calls:.2f} times a completion (expected above 0.3), "
                   f"its replies {'' if replies else 'not '}in the logged trajectories", log)
    throughput = sorted(r["rollout_tokens_per_s"] for r in records)[len(records) // 2]
    rollout_share = sum(r["rollout_s"] for r in records) / max(sum(r["step_time_s"] for r in records), 1e-9)
    peak = max(r.get("peak_mem_gb", 0.0) for r in read_metrics(run))
    ctx.figures.update(tool_calls_per_completion=calls, tool_replies_logged=replies,
                       tool_failures_per_call=sum(r["tools/failure_frequency"] for r in records) / max(len(records), 1),
                       rollout_tokens_per_s_median=throughput, rollout_s_over_step_s=rollout_share, peak_mem_gb=peak)
    return PASS, (f"{sft_steps} SFT + {steps} GRPO steps; {calls:.2f} tool calls a completion; rollouts "
                  f"{throughput:.0f} tokens/s (median), {rollout_share:.0%} of the step; peak {peak:.2f} GB")
