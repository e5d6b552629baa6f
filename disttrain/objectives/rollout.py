"""Rollouts for training.objective: grpo: completions sampled from the current policy with transformers'
generate(), and the training rows made of them.

Each prompt's num_generations completions are sampled in one generate() call of their own (the prompt repeated,
no padding), under a seed made of the run's seed, the step's prompt batch and the prompt's row: the draws do not
depend on which rank holds the prompt, on how prompts are batched or on the process's random state (forked, so
dropout's stream is untouched). So every strategy samples what one process samples, a tensor-parallel group's
ranks sample alike, and a resumed run samples what an uninterrupted one would.

Under several processes generate() runs with synced_gpus: a rank whose completions have all ended keeps running
forward passes (without sampling) until every rank's have, because FSDP2 and ZeRO-3 gather each layer's weights
collectively in every forward (and tensor parallelism reduces inside it): a rank that stopped early would leave the
others waiting forever. Completions end at an EOS token (kept, and trained on) or at rl.max_completion_length
(truncated).
"""

from __future__ import annotations

import torch

from disttrain.data import IGNORE_INDEX, LENGTHS_KEY, SQUARES_KEY

MASK_KEY = "rl_mask"              # [rows, seq]: 1 at the positions predicting a completion token trained on
ADVANTAGES_KEY = "rl_advantages"  # [rows]
OLD_KEY = "rl_old_logps"          # [rows, seq]: log-probs at generation (rl.num_iterations > 1)
REF_KEY = "rl_ref_logps"          # [rows, seq]: the reference's log-probs (rl.beta > 0)
ROLLOUT_KEYS = (MASK_KEY, ADVANTAGES_KEY, OLD_KEY, REF_KEY)


def completion_seed(seed: int, batch: int, prompt_row: int) -> int:
    """The sampling seed of one prompt's completions in one prompt batch (a step, or mu steps with
    rl.num_iterations): the same whichever rank samples them."""
    return (seed * 1_000_003 + batch * 7_919 + prompt_row) % (2**63 - 1)


def eos_ids(tokenizer, module) -> list[int]:
    """Where completions end: the tokenizer's EOS and the model's generation config's."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    config_eos = getattr(getattr(module, "generation_config", None), "eos_token_id", None)
    ids |= set(config_eos if isinstance(config_eos, list) else [config_eos] if config_eos is not None else [])
    return sorted(ids)


@torch.no_grad()
def sample(module, rl, prompt: list[int], seed: int, eos: list[int], pad_id: int, device,
           synced: bool) -> list[tuple[list[int], bool]]:
    """rl.num_generations (completion ids, truncated) of one prompt, sampled by `module` (the bare model, in
    eval mode; every rank calls this as often as the others when `synced`)."""
    from transformers import GenerationConfig

    ids = torch.tensor([prompt] * rl.num_generations, device=device)
    # a config of its own, as TRL builds one: the checkpoint's generation defaults (top_k 50, repetition
    # penalties) would sample from another distribution than the one the loss takes log-probs of
    config = GenerationConfig(do_sample=True, temperature=rl.temperature, top_p=rl.top_p, top_k=rl.top_k or 0,
                              max_new_tokens=rl.max_completion_length, eos_token_id=eos, pad_token_id=pad_id,
                              use_cache=True)
    forked = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=forked):
        torch.manual_seed(seed)
        out = module.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=config,
                              synced_gpus=synced)
    completions = []
    for row in out[:, len(prompt):].tolist():
        end = next((i for i, token in enumerate(row) if token in eos), None)
        completions.append((row[:end + 1], False) if end is not None else (row, True))
    return completions


def training_rows(prompts: list[list[int]], completions: list[tuple[list[int], bool]], pad_id: int,
                  mask_truncated: bool, device) -> dict:
    """Rows of prompt + completion, right-padded: labels on the completion tokens trained on, MASK_KEY at the
    positions predicting them (the layout of the chunked head's per-position log-probs), and the bookkeeping the
    loop counts tokens and FLOPs by. `prompts`: each completion's prompt."""
    longest = max(len(p) + len(c) for p, (c, _) in zip(prompts, completions))
    input_ids = torch.full((len(prompts), longest), pad_id, dtype=torch.long)
    attention = torch.zeros_like(input_ids)
    labels = torch.full_like(input_ids, IGNORE_INDEX)
    mask = torch.zeros(len(prompts), longest, dtype=torch.float32)
    for row, (prompt, (completion, truncated)) in enumerate(zip(prompts, completions)):
        length = len(prompt) + len(completion)
        input_ids[row, :length] = torch.tensor(prompt + completion)
        attention[row, :length] = 1
        if completion and not (mask_truncated and truncated):
            labels[row, len(prompt):length] = torch.tensor(completion)
            mask[row, len(prompt) - 1:length - 1] = 1.0
    lengths = attention.sum(-1)
    batch = {"input_ids": input_ids, "attention_mask": attention, "labels": labels, MASK_KEY: mask,
             LENGTHS_KEY: lengths, SQUARES_KEY: lengths * lengths}
    return {k: v.to(device) for k, v in batch.items()}
