"""Prompts for online RL (data.format: prompt) -> token rows, and rows -> prompt batches.

A chat prompt is rendered with the chat template and its generation prompt (the assistant header the policy
continues from); a plain-text prompt is used as it is, after BOS where the tokenizer adds one. Prompts are never
cut: one longer than data.max_seq_len stops the run in one line naming its record, before any model loads (a
cut prompt would ask another question). Every other column of the record travels with it, as JSON, to the
reward functions (TRL passes the dataset's columns to them by name).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch

from disttrain.data.formats import Prompt
from disttrain.data.templates import _bos, _check_fast, apply_template
from disttrain.errors import DataError

PROMPT_INDEX = "prompt_index"  # the prompt's row in the training set: its completions' random seed
PROMPT_COLUMNS = ("prompt_ids", "record", "n_targets", "n_tokens", "truncated")


def prompt_text(prompt: Prompt, tokenizer) -> tuple[str, list[int]]:
    """(text, token ids put before it) of one prompt as the model sees it before its completion."""
    if prompt.text is not None:
        return prompt.text, _bos(tokenizer)
    if not tokenizer.chat_template:
        raise DataError("a chat prompt needs a tokenizer with a chat template (this one has none): give the prompt "
                        "as a string, or set model.tokenizer_name_or_path to a tokenizer with one")
    return apply_template(tokenizer, prompt.conversation, tokenize=False, add_generation_prompt=True), []


def tokenize_prompts(prompts: list[Prompt], records: list[dict], tokenizer, max_len: int, field: str,
                     where) -> dict:
    """Rendered prompts -> PROMPT_COLUMNS, all texts through one fast-tokenizer call; `field`: the record's prompt
    column (the rest of the record is kept for the rewards); `where(i)` names record i in an error."""
    rendered = []
    for i, prompt in enumerate(prompts):
        try:
            rendered.append(prompt_text(prompt, tokenizer))
        except DataError as exc:  # the template's own refusal, named with its record
            raise DataError(f"{where(i)}: {exc}") from None
    _check_fast(tokenizer)
    encodings = tokenizer([text for text, _ in rendered], add_special_tokens=False)["input_ids"]
    ids = [prefix + list(tokens) for (_, prefix), tokens in zip(rendered, encodings)]
    for i, row in enumerate(ids):
        if len(row) > max_len:
            raise DataError(f"{where(i)}: the prompt has {len(row)} tokens, over data.max_seq_len={max_len} (the "
                            "longest prompt for format: prompt): raise data.max_seq_len or shorten the prompt")
    # the prompt as the policy saw it (chat messages, or the text), the other columns as they are
    kept = [json.dumps({"prompt": p.text if p.text is not None else p.conversation.messages,
                        **{k: v for k, v in r.items() if k != field}}, default=str) for p, r in zip(prompts, records)]
    return {"prompt_ids": ids, "record": kept, "n_targets": [1] * len(ids), "n_tokens": [len(r) for r in ids],
            "truncated": [False] * len(ids)}


@dataclass
class PromptCollator:
    """Prompt rows -> a prompt batch: the ids as lists (each prompt's completions are generated on their own,
    unpadded), the prompts' row numbers, and the records for the rewards."""

    def __call__(self, rows: list[dict]) -> dict:
        return {"prompt_ids": [list(r["prompt_ids"]) for r in rows],
                PROMPT_INDEX: torch.tensor([r[PROMPT_INDEX] for r in rows], dtype=torch.long),
                "record": [r["record"] for r in rows]}
