"""Preference pairs -> token rows, and pairs -> batches.

Each response is rendered with its prompt as one conversation (the chat template applied once, as for SFT)
and only the response's assistant tokens are scored (its end-of-turn token included). Truncation to
max_seq_len keeps the prompt's opening (BOS, the system turn, the first user header), the end of the prompt
and the start of the responses: the responses get at least half of the row (or all they need), the prompt
the rest, cut in its middle (the oldest text after the opening); chosen and rejected lose the same prompt
tokens. A pair left without a scored token on either side is dropped and counted.

A batch of n pairs is 2n sequences: the n chosen responses, then the n rejected ones, so both sides of a pair
are always in the same micro-batch. `PAIR_INDEX` (the pair's row in the training set) lets precomputed
reference log-probs be looked up. Padded, each sequence is a row; padding-free (data.packing: true, as TRL's
`padding_free`), the sequences are packed into as few rows as hold them, each row no wider than the longest
sequence (first fit, longest first), with position ids restarting at 0 for each sequence (no attention across
sequences: data/collation.py) and `SEQUENCE_INDEX` saying which sequence each token belongs to, so the
objectives sum their per-token log-probs per sequence; for flash-attention, all in one row with the
boundaries its varlen kernel reads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from disttrain.data.collation import LENGTHS_KEY, SQUARES_KEY, pack_sequences
from disttrain.data.formats import Conversation, PreferencePair
from disttrain.data.templates import IGNORE_INDEX, message_text, render, tokenize_rendered

PAIR_COLUMNS = ("chosen_input_ids", "chosen_labels", "rejected_input_ids", "rejected_labels", "n_targets",
                "n_tokens", "truncated")
PAIR_INDEX = "pair_index"


def _last_runs(labels: list[int], keep: int) -> list[int]:
    """Only the last `keep` runs of targets (a template with generation markers labels every assistant turn)."""
    runs, inside = [], False
    for i, label in enumerate(labels):
        if label != IGNORE_INDEX and not inside:
            runs.append(i)
        inside = label != IGNORE_INDEX
    if len(runs) <= keep:
        return labels
    start = runs[-keep]
    return [IGNORE_INDEX] * start + labels[start:]


def render_response(prompt: list[dict], response: list[dict], tools: list[dict] | None, tokenizer):
    """One response rendered with its prompt as one conversation, only the response's assistant turns scored."""
    rendered = render(Conversation(prompt + response, tools), tokenizer)
    scored = sum(1 for m in response if m["role"] == "assistant")
    if rendered.text is not None:
        rendered.spans = rendered.spans[-scored:]  # the prompt's own assistant turns are context, not scored
        rendered.opening = _opening(rendered.text, prompt)
    else:
        rendered.labels = _last_runs(rendered.labels, scored)
    return rendered


def _opening(text: str, prompt: list[dict]) -> int:
    """Where the first user message's text starts in the rendering: what comes before it (BOS, the system
    turn, the user header) is kept when the prompt is cut."""
    first = next((message_text(m).strip() for m in prompt if m["role"] == "user"), "")
    at = text.find(first) if first else -1
    return max(at, 0)


def prompt_length(labels: list[int]) -> int:
    return next((i for i, label in enumerate(labels) if label != IGNORE_INDEX), len(labels))


def targets(labels: list[int]) -> int:
    return len(labels) - labels.count(IGNORE_INDEX) - (labels[0] != IGNORE_INDEX) if labels else 0


def truncate_pair(chosen: tuple, rejected: tuple, max_len: int, bos_id: int | None = None):
    """(chosen, rejected, truncated): both sequences at most max_len, keeping the prompt's opening (BOS, the
    system turn, the first user header: the third item of each side, in tokens), the prompt's end and the
    responses' start: the tokens cut are the oldest ones after the opening. An opening longer than the room
    left keeps only its first token if that is BOS (Gemma degrades badly without it)."""
    if max(len(chosen[0]), len(rejected[0])) <= max_len:
        return chosen[:2], rejected[:2], False
    prompts = [prompt_length(side[1]) for side in (chosen, rejected)]
    longest_response = max(len(side[0]) - p for side, p in zip((chosen, rejected), prompts))
    response_budget = min(longest_response, max(max_len - max(prompts), max_len // 2))
    prompt_budget = max_len - response_budget
    cut = []
    for (ids, labels, *opening), p in zip((chosen, rejected), prompts):
        drop = max(p - prompt_budget, 0)
        keep = opening[0] if opening else 0
        if keep > p - drop:  # no room for the whole opening: BOS alone, where there is one
            keep = 1 if bos_id is not None and ids[0] == bos_id and p - drop >= 1 else 0
        end = p + response_budget
        cut.append((ids[:keep] + ids[keep + drop:end], labels[:keep] + labels[keep + drop:end]))
    return cut[0], cut[1], True


def render_pair(pair: PreferencePair, tokenizer) -> tuple:
    """Both sides of a pair, each rendered with the prompt as one conversation."""
    return tuple(render_response(pair.prompt, side, pair.tools, tokenizer) for side in (pair.chosen, pair.rejected))


def tokenize_pairs(rendered_pairs: list[tuple], tokenizer, max_len: int) -> dict:
    """Columns PAIR_COLUMNS for a batch of rendered pairs (render_pair); every text goes through one
    fast-tokenizer call."""
    encoded = tokenize_rendered([side for pair in rendered_pairs for side in pair], tokenizer, openings=True)
    columns = {key: [] for key in PAIR_COLUMNS}
    for i in range(len(rendered_pairs)):
        chosen, rejected, truncated = truncate_pair(encoded[2 * i], encoded[2 * i + 1], max_len,
                                                    tokenizer.bos_token_id)
        columns["chosen_input_ids"].append(chosen[0])
        columns["chosen_labels"].append(chosen[1])
        columns["rejected_input_ids"].append(rejected[0])
        columns["rejected_labels"].append(rejected[1])
        # a pair counts only when both sides keep a scored token (the minimum says so; the report sums both)
        both = (targets(chosen[1]), targets(rejected[1]))
        columns["n_targets"].append(sum(both) if min(both) > 0 else 0)
        columns["n_tokens"].append(len(chosen[0]) + len(rejected[0]))
        columns["truncated"].append(truncated)
    return columns


@dataclass
class PairCollator:
    """n pair rows -> their 2n sequences (chosen first, then rejected), right-padded with an attention_mask or
    padding-free (`padding_free`; `flatten`: in one row, for flash-attention), the loop's bookkeeping per
    row, and each pair's PAIR_INDEX. `sides`: the column prefixes of the two sequences of a row (KTO's: the
    example and its KL partner, data/unpaired.py); `carried`: per-row columns passed on as they are (one value
    per row); `sides_apart`: padding-free, each side's sequences in rows of their own (KTO runs its examples
    without their partners)."""

    pad_token_id: int
    pad_to_multiple_of: int | None = None
    sides: tuple[str, str] = ("chosen_", "rejected_")
    carried: tuple[str, ...] = ()
    padding_free: bool = False
    flatten: bool = False
    sides_apart: bool = False

    def __call__(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        sequences = [(list(r[f"{side}input_ids"]), list(r[f"{side}labels"])) for side in self.sides for r in rows]
        out = self._packed(sequences) if self.padding_free else self._padded(sequences)
        out[PAIR_INDEX] = torch.tensor([r.get(PAIR_INDEX, -1) for r in rows], dtype=torch.long)
        out.update({key: torch.tensor([r[key] for r in rows]) for key in self.carried})
        return out

    def _width(self, sequences: list[tuple]) -> int:
        longest = max(len(ids) for ids, _ in sequences)
        if self.pad_to_multiple_of:
            longest = -(-longest // self.pad_to_multiple_of) * self.pad_to_multiple_of
        return longest

    def _padded(self, sequences: list[tuple]) -> dict[str, torch.Tensor]:
        longest = self._width(sequences)
        batch = {"input_ids": [], "labels": [], "attention_mask": [], LENGTHS_KEY: [], SQUARES_KEY: []}
        for ids, labels in sequences:
            pad = longest - len(ids)
            batch["input_ids"].append(ids + [self.pad_token_id] * pad)
            batch["labels"].append(labels + [IGNORE_INDEX] * pad)
            batch["attention_mask"].append([1] * len(ids) + [0] * pad)
            batch[LENGTHS_KEY].append(len(ids))
            batch[SQUARES_KEY].append(len(ids) ** 2)
        return {k: torch.tensor(v, dtype=torch.long) for k, v in batch.items()}

    def _packed(self, sequences: list[tuple]) -> dict[str, torch.Tensor]:
        return pack_sequences(sequences, self.pad_token_id, self._width(sequences), self.flatten,
                              groups=2 if self.sides_apart else 1)[0]
