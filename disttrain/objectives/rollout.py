"""Rollouts for training.objective: grpo: completions sampled from the current policy with transformers'
generate(), and the training rows made of them.

All of a step's prompts x rl.num_generations completions are sampled in one generate() call per rank (at most
rl.rows_per_generate rows a call), the prompts left-padded. Each completion draws from its own seed (sampling.py:
the run's seed, the prompt batch, the prompt's row and the completion's index), so its tokens depend neither on
the rows beside it nor on which rank holds it nor on the process's random state: every strategy samples what one
process samples, and a resumed run samples what an uninterrupted one would.

generate() runs with synced_gpus only where the forward has collectives (FSDP2 and ZeRO-3 gathering each layer,
when the whole model is not gathered once for the rollout: runtime/rollout_weights.py): there a rank whose
completions have all ended keeps running forward passes until every rank's have. Completions end at an EOS token
(kept, and trained on) or at rl.max_completion_length (truncated).
"""

from __future__ import annotations

import torch

from disttrain.data import IGNORE_INDEX, LENGTHS_KEY, SQUARES_KEY
from disttrain.data.collation import SEQUENCE_COUNT, SEQUENCE_INDEX, pack_sequences
from disttrain.objectives import sampling

MASK_KEY = "rl_mask"              # [rows, seq]: 1 at the positions predicting a completion token trained on
ADVANTAGES_KEY = "rl_advantages"  # [rows]
OLD_KEY = "rl_old_logps"          # [rows, seq]: log-probs at generation (rl.num_iterations > 1)
REF_KEY = "rl_ref_logps"          # [rows, seq]: the reference's log-probs (rl.beta > 0)
SAMPLED_KEY = "rl_sampled_logps"  # [rows, seq]: the vLLM server's log-probs of the completion tokens
ENGINE_KEY = "rl_engine_weights"  # [rows, seq] or [rows, 1]: the importance-sampling correction of them
# [rows, seq]: padding-free rows (data.packing): where each padded position's token sits in the packed rows, as a
# flat index (packed row x width + column; -1: no token). The per-position tensors above stay in the padded layout
PACKED_AT = "rl_packed_at"
ROLLOUT_KEYS = (MASK_KEY, ADVANTAGES_KEY, OLD_KEY, REF_KEY, SAMPLED_KEY, ENGINE_KEY, PACKED_AT)


def eos_ids(tokenizer, module) -> list[int]:
    """Where completions end: the tokenizer's EOS and the model's generation config's."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    config_eos = getattr(getattr(module, "generation_config", None), "eos_token_id", None)
    ids |= set(config_eos if isinstance(config_eos, list) else [config_eos] if config_eos is not None else [])
    return sorted(ids)


def generate_calls(rl, rows: int) -> int:
    """The generate() calls `rows` completions take (rl.rows_per_generate rows a call at most)."""
    return -(-rows // (rl.rows_per_generate or rows))


@torch.no_grad()
def sample(module, rl, prompts: list[list[int]], seeds: list[int], eos: list[int], pad_id: int, device,
           synced: bool, calls: int = 1, max_new_tokens: int | None = None) -> list[tuple[list[int], bool]]:
    """One completion per (prompt, seed) -- (ids, truncated) -- sampled by `module` (the bare model, in eval
    mode) in generate_calls() calls. When `synced`, every rank must make as many: `calls` (agreed by the caller)
    pads this rank's with throwaway calls of one row. `max_new_tokens`: rl.max_completion_length unless given (a
    multi-turn rollout's turn: what is left of it)."""
    step = rl.rows_per_generate or len(prompts)
    completions = []
    for start in range(0, len(prompts), step):
        completions += _generate(module, rl, prompts[start:start + step], seeds[start:start + step], eos, pad_id,
                                 device, synced, max_new_tokens)
    for _ in range(calls - generate_calls(rl, len(prompts))):
        _generate(module, rl, prompts[:1], seeds[:1], eos, pad_id, device, synced, max_new_tokens)
    return completions


def _generate(module, rl, prompts, seeds, eos, pad_id, device, synced,
              max_new_tokens: int | None = None) -> list[tuple[list[int], bool]]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):  # left-padded: every row's completion starts at `width`
        ids[row, width - len(prompt):] = torch.tensor(prompt)
        attention[row, width - len(prompt):] = 1
    ids, attention = ids.to(device), attention.to(device)
    with sampling.bare_generation_config(module, eos, pad_id, max_new_tokens or rl.max_completion_length,
                                         static_cache=rl.engine == "static") as config:
        out = module.generate(input_ids=ids, attention_mask=attention, generation_config=config,
                              logits_processor=sampling.processors(rl, seeds, width, device,
                                                                   [width - len(p) for p in prompts]),
                              synced_gpus=synced)
    completions = []
    for row in out[:, width:].tolist():
        end = next((i for i, token in enumerate(row) if token in eos), None)
        completions.append((row[:end + 1], False) if end is not None else (row, True))
    return completions


def training_rows(prompts: list[list[int]], completions: list[tuple[list[int], bool]], pad_id: int,
                  mask_truncated: bool, device, sampled_logps: list[list[float]] | None = None,
                  policy: list[list[int]] | None = None, padding_free: bool = False, one_row: bool = False) -> dict:
    """Rows of prompt + completion, right-padded: labels on the completion tokens trained on, MASK_KEY at the
    positions predicting them (the layout of the chunked head's per-position log-probs), and the bookkeeping the
    loop counts tokens and FLOPs by. `prompts`: each completion's prompt; `sampled_logps`: an engine's log-probs
    of each completion's tokens, laid out like MASK_KEY (SAMPLED_KEY); `policy`: per completion token, 1 where the
    policy sampled it and 0 where a tool's message put it (agent.py): the zeros get no label and no weight.
    `padding_free` (data.packing): the model's inputs packed (without_padding); `one_row`: all in one row (flash
    attention)."""
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
            if policy is not None:
                mine = torch.tensor(policy[row], dtype=torch.bool)
                labels[row, len(prompt):length][~mine] = IGNORE_INDEX
                mask[row, len(prompt) - 1:length - 1] *= mine.float()
    lengths = attention.sum(-1)
    batch = {"input_ids": input_ids, "attention_mask": attention, "labels": labels, MASK_KEY: mask,
             LENGTHS_KEY: lengths, SQUARES_KEY: lengths * lengths}
    if sampled_logps is not None:
        batch[SAMPLED_KEY] = torch.zeros(len(prompts), longest, dtype=torch.float32)
        for row, (prompt, values) in enumerate(zip(prompts, sampled_logps)):
            batch[SAMPLED_KEY][row, len(prompt) - 1:len(prompt) - 1 + len(values)] = torch.tensor(values)
    if padding_free:
        batch = without_padding(batch, pad_id, one_row)
    return {k: v.to(device) for k, v in batch.items()}


def without_padding(batch: dict, pad_id: int, one_row: bool) -> dict:
    """Training rows whose model inputs (input ids, labels, position ids) are packed padding-free
    (data/collation.pack_sequences: rows no wider than the longest, or one row), with PACKED_AT mapping the
    padded layout, which the loss's per-position tensors keep, onto them. One row needs no boundaries: at batch
    size 1 transformers reads restarting position ids as packed sequences, flash-attention included."""
    lengths = batch[LENGTHS_KEY].tolist()
    sequences = [(batch["input_ids"][r, :n].tolist(), batch["labels"][r, :n].tolist()) for r, n in enumerate(lengths)]
    packed, placed = pack_sequences(sequences, pad_id, sum(lengths) if one_row else max(lengths))
    width = packed["input_ids"].shape[1]
    at = torch.full_like(batch["input_ids"], -1)
    for r, ((row, start), n) in enumerate(zip(placed, lengths)):
        at[r, :n] = row * width + start + torch.arange(n)
    del packed[SEQUENCE_INDEX], packed[SEQUENCE_COUNT]
    kept = {k: v for k, v in batch.items() if k not in ("input_ids", "attention_mask", "labels", LENGTHS_KEY,
                                                        SQUARES_KEY)}
    return {**kept, **packed, PACKED_AT: at}


def to_padded(packed: torch.Tensor, at: torch.Tensor | None) -> torch.Tensor:
    """[rows, seq] per-position values of padding-free rows laid out as the padded rows (0 where no token)."""
    if at is None:
        return packed
    return torch.where(at >= 0, packed.reshape(-1)[at.clamp(min=0)], packed.new_zeros(()))


def to_packed(padded: torch.Tensor, at: torch.Tensor | None, shape: torch.Size) -> torch.Tensor:
    """The inverse of to_padded: padded-layout values put at their packed positions (0 elsewhere)."""
    if at is None:
        return padded
    valid = at >= 0
    out = padded.new_zeros(shape.numel())
    return out.index_put_((at[valid],), padded[valid]).view(shape)
