"""Rows to batches: padding, the bookkeeping the loop needs, and the packed-row layout each attention
implementation needs to keep examples apart.

Packed rows carry position ids restarting at 0 for each example. sdpa and eager turn that into a
block-diagonal causal mask (no attention across examples) for any batch size when no attention_mask is passed
and the KV cache is off (use_cache=False, as the loop runs). flash-attention does not: transformers' flash path
reads position ids as packed only at batch size 1 (`_is_packed_sequence`), so a micro-batch of several packed
rows would attend across examples. For flash implementations the collator therefore flattens a packed
micro-batch into one row and passes the example boundaries (`cu_seq_lens_*`, `max_length_*`), which
transformers hands to flash_attn_varlen_func as they are. tests/test_data.py checks isolation on the real
model, flash included (through transformers' own flash code with CPU reference kernels).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from disttrain.data.templates import IGNORE_INDEX

LENGTHS_KEY = "num_tokens"  # per-row non-padding length; popped by the loop before the forward pass
SQUARES_KEY = "seq_len_sq"  # per-row sum of squared sequence lengths (attention FLOPs); popped likewise
TARGETS_KEY = "num_targets"  # context parallelism: the targets of this process's part, counted before the cut
IMAGES_COUNT_KEY = "num_images"  # vision-language rows: each row's images (the loss self-check's first row)
# padding-free pair batches (data/preference.py): the sequence each token belongs to, for per-sequence sums, and
# how many sequences it counts (an int); packed in two groups (KTO's examples, then their KL partners), the row
# where the second group starts (flattened into one row: the token; an int)
SEQUENCE_INDEX = "sequence_index"
SEQUENCE_COUNT = "num_sequences"
SECOND_GROUP_AT = "second_group_at"
BOOKKEEPING_KEYS = (LENGTHS_KEY, SQUARES_KEY, TARGETS_KEY, IMAGES_COUNT_KEY, SEQUENCE_INDEX, SEQUENCE_COUNT,
                    SECOND_GROUP_AT)
# position t's target, already shifted (transformers' name): set before a sequence is split across ranks
# (context parallelism), where shifting inside each shard would lose the target at every shard boundary
SHIFT_LABELS_KEY = "shift_labels"


def flattens_packed_rows(attn_implementation: str) -> bool:
    """Whether packed rows must travel as one flattened row with explicit example boundaries (see the module
    docstring): true for flash-attention, whose varlen kernel isolates examples only that way; false for sdpa
    and eager, where one row per sequence keeps the mask and the attention cost per row (a flattened row
    would cost (micro_batch x max_seq_len)^2 there)."""
    return attn_implementation.startswith("flash_attention")


@dataclass
class Collator:
    """Right-pads a list of rows. Unpacked rows get an attention_mask; packed rows get their padding as a
    separate position block instead, so the block-diagonal mask keeps it away from real tokens. With
    `flatten_packed`, packed rows are concatenated into one row (no padding at all) with the boundaries of
    every example for flash-attention's varlen kernel."""

    pad_token_id: int
    pad_to_multiple_of: int | None = None
    flatten_packed: bool = False

    def __call__(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        packed = "position_ids" in rows[0]
        if packed and self.flatten_packed:
            return self._flattened(rows)
        longest = max(len(r["input_ids"]) for r in rows)
        if self.pad_to_multiple_of:
            longest = -(-longest // self.pad_to_multiple_of) * self.pad_to_multiple_of
        batch = {"input_ids": [], "labels": [], ("position_ids" if packed else "attention_mask"): [],
                 LENGTHS_KEY: [], SQUARES_KEY: []}
        for r in rows:
            n = len(r["input_ids"])
            pad = longest - n
            batch[LENGTHS_KEY].append(n)
            batch[SQUARES_KEY].append(_sum_of_squared_segments(r["position_ids"]) if packed else n * n)
            batch["input_ids"].append(list(r["input_ids"]) + [self.pad_token_id] * pad)
            batch["labels"].append(list(r["labels"]) + [IGNORE_INDEX] * pad)
            if packed:
                batch["position_ids"].append(list(r["position_ids"]) + list(range(pad)))
            else:
                batch["attention_mask"].append([1] * n + [0] * pad)
        return {k: torch.tensor(v, dtype=torch.long) for k, v in batch.items()}

    @staticmethod
    def _flattened(rows: list[dict]) -> dict:
        """One row of all examples. The first token of every sequence (position 0) is no target: in a row of
        its own nothing predicts it, and flattened the previous row's last token would (a concat-and-chunk
        row starts mid-document with a label there), so the loss equals the unflattened batch's."""
        ids, labels, positions = [], [], []
        for r in rows:
            ids += r["input_ids"]
            labels += r["labels"]
            positions += r["position_ids"]
        starts = [i for i, p in enumerate(positions) if p == 0] + [len(positions)]
        for start in starts[:-1]:
            labels[start] = IGNORE_INDEX
        longest = max(b - a for a, b in zip(starts, starts[1:]))
        boundaries = torch.tensor(starts, dtype=torch.int32)
        return {"input_ids": torch.tensor([ids]), "labels": torch.tensor([labels]),
                "position_ids": torch.tensor([positions]),
                # transformers passes these to flash_attn_varlen_func (cu_seqlens int32, max lengths as ints)
                "cu_seq_lens_q": boundaries, "cu_seq_lens_k": boundaries,
                "max_length_q": longest, "max_length_k": longest,
                LENGTHS_KEY: torch.tensor([len(r["input_ids"]) for r in rows]),
                SQUARES_KEY: torch.tensor([_sum_of_squared_segments(r["position_ids"]) for r in rows])}


def pack_sequences(sequences: list[tuple[list[int], list[int]]], pad_token_id: int, width: int,
                   flatten: bool = False, groups: int = 1) -> tuple[dict, list[tuple[int, int]]]:
    """Padding-free rows of whole (input ids, labels) sequences, none wider than `width` (first fit, longest
    first), and where each sequence went (row, start). Position ids restart at 0 for each sequence, so no
    sequence attends to another; padding (sequence index len(sequences): none of them) is a position block of
    its own, which the block-diagonal mask keeps away from real tokens. A sequence's first token is no target
    (the previous sequence's last token would predict it). `SEQUENCE_INDEX` says whose each token is,
    `SEQUENCE_COUNT` how many there are. `groups=2`: the first and the second half of the sequences in rows of
    their own, the first half's first (`SECOND_GROUP_AT`: the row where the second starts), so either half can
    be run alone. `flatten` (flash-attention): all in one row, in order, with the boundaries its varlen kernel
    reads (`SECOND_GROUP_AT`: the token where the second half starts)."""
    lengths = [len(ids) for ids, _ in sequences]
    width = sum(lengths) if flatten else width
    size = len(sequences) // groups
    parts = [range(g * size, len(sequences) if g == groups - 1 else (g + 1) * size) for g in range(groups)]
    bins = [list(range(len(sequences)))] if flatten else \
        [members for part in parts for members in _first_fit(part, lengths, width)]
    batch = {"input_ids": [], "labels": [], "position_ids": [], SEQUENCE_INDEX: [], LENGTHS_KEY: [], SQUARES_KEY: []}
    placed = [(0, 0)] * len(sequences)
    for row_number, members in enumerate(bins):
        row = {key: [] for key in ("input_ids", "labels", "position_ids", SEQUENCE_INDEX)}
        for i in members:
            ids, labels = sequences[i]
            placed[i] = (row_number, len(row["input_ids"]))
            row["input_ids"] += list(ids)
            row["labels"] += [IGNORE_INDEX] + list(labels[1:])
            row["position_ids"] += list(range(len(ids)))
            row[SEQUENCE_INDEX] += [i] * len(ids)
        used, pad = len(row["input_ids"]), width - len(row["input_ids"])
        batch["input_ids"].append(row["input_ids"] + [pad_token_id] * pad)
        batch["labels"].append(row["labels"] + [IGNORE_INDEX] * pad)
        batch["position_ids"].append(row["position_ids"] + list(range(pad)))
        batch[SEQUENCE_INDEX].append(row[SEQUENCE_INDEX] + [len(sequences)] * pad)
        batch[LENGTHS_KEY].append(used)
        batch[SQUARES_KEY].append(sum(lengths[i] ** 2 for i in members))
    out = {k: torch.tensor(v, dtype=torch.long) for k, v in batch.items()}
    out[SEQUENCE_COUNT] = len(sequences)
    if groups == 2:
        out[SECOND_GROUP_AT] = sum(lengths[:size]) if flatten else \
            next(r for r, members in enumerate(bins) if members[0] >= size)
    if flatten:  # transformers hands these to flash_attn_varlen_func as they are (module docstring)
        starts = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
        out.update({"cu_seq_lens_q": starts, "cu_seq_lens_k": starts, "max_length_q": max(lengths),
                    "max_length_k": max(lengths), LENGTHS_KEY: torch.tensor(lengths),
                    SQUARES_KEY: torch.tensor(lengths) ** 2})
    return out, placed


def _first_fit(indices, lengths: list[int], width: int) -> list[list[int]]:
    """The sequences `indices` in rows of at most `width` tokens (first fit, longest first), each row's members
    in order, the rows ordered by their first member."""
    bins: list[list[int]] = []
    for i in sorted(indices, key=lambda i: -lengths[i]):
        fit = next((b for b in bins if sum(lengths[j] for j in b) + lengths[i] <= width), None)
        if fit is None:
            bins.append([i])
        else:
            fit.append(i)
    return sorted((sorted(b) for b in bins), key=min)


def _sum_of_squared_segments(position_ids) -> int:
    """Attention cost of a packed row: each example attends only within itself."""
    total, length = 0, 0
    for pos in position_ids:
        if pos == 0 and length:
            total += length * length
            length = 0
        length += 1
    return total + length * length


def count_targets(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Tokens that contribute to the causal-LM loss (labels are shifted by one inside the model, or came
    shifted as `shift_labels`). A tensor on the batch's device, so counting never forces a host sync."""
    if TARGETS_KEY in batch:  # context parallelism: the whole sequence is here until the loop's context cuts it
        return batch[TARGETS_KEY]
    if SHIFT_LABELS_KEY in batch:
        return (batch[SHIFT_LABELS_KEY] != IGNORE_INDEX).sum()
    return (batch["labels"][:, 1:] != IGNORE_INDEX).sum()


def shifted(labels: torch.Tensor) -> torch.Tensor:
    """Position t's target: labels[:, t + 1]; none at the last position."""
    return torch.cat([labels[:, 1:], labels.new_full((labels.shape[0], 1), IGNORE_INDEX)], dim=1)


def with_shift_labels(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The batch with `shift_labels` (made before any split of its sequences)."""
    return {**batch, SHIFT_LABELS_KEY: shifted(batch["labels"])}


@dataclass
class SequenceShard:
    """One process's slice of every sequence of the batches its sequence-parallel group shares (Ulysses: the
    sp processes of a group read the same rows; inside attention an all-to-all gives each one every position
    for 1/sp of the heads). The labels are shifted on the whole sequence before it is cut (shifting inside a
    slice would lose the target of its last position), positions are the whole sequence's, and the
    bookkeeping counts this slice only, so sums over all processes count every token once. Padding stays on
    the right (the collator pads each batch to a multiple of the slice count): Ulysses attends causally
    without a mask, which is exact for every real token of a right-padded row. Packed rows are refused
    before this runs (parallel/checks.py), since without a mask their examples would attend to each other."""

    collate: Collator
    index: int
    count: int

    def __post_init__(self):
        multiple = self.collate.pad_to_multiple_of or 1
        self.collate = replace(self.collate, pad_to_multiple_of=multiple * self.count // math.gcd(multiple, self.count))

    def __call__(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        batch = self.collate(rows)
        mask = batch.pop("attention_mask")
        size, length = batch["input_ids"].shape
        width = length // self.count
        part = slice(self.index * width, (self.index + 1) * width)
        positions = torch.arange(length).expand(size, length)
        squares = batch[SQUARES_KEY]  # attention cost: each process computes 1/count of the heads
        share = squares // self.count + (squares % self.count if self.index == 0 else 0)
        # contiguous: transformers' own loss views shift_labels flat (with 2+ rows a column slice is not)
        return {"input_ids": batch["input_ids"][:, part].contiguous(),
                # the unshifted labels of the slice ride along for transformers' own loss, which uses
                # shift_labels whenever they are given (the plain engine and the start-up self-check)
                "labels": batch["labels"][:, part].contiguous(),
                SHIFT_LABELS_KEY: shifted(batch["labels"])[:, part].contiguous(),
                "position_ids": positions[:, part].contiguous(),
                LENGTHS_KEY: mask[:, part].sum(1), SQUARES_KEY: share}


# what accelerate's context-parallel context cuts along the sequence, in place, for each micro-batch
CONTEXT_BUFFERS = ("input_ids", "labels", SHIFT_LABELS_KEY, "position_ids")


@dataclass
class ContextShard:
    """Whole sequences for one process of a context-parallel group (torch's ring attention under FSDP2): the
    cp processes of a group read the same rows, and accelerate's context cuts each micro-batch in place inside
    the loop (CONTEXT_BUFFERS), in torch's head-tail layout: the sequence in 2 x cp equal chunks, process r
    keeping chunks r and 2cp-1-r, so the causal attention work is even. Here: labels shifted on the whole
    sequence (shifting after the cut would lose the target at every chunk boundary), global position ids,
    right padding to a multiple of 2 x cp (what the head-tail layout needs), no attention mask (the ring
    attends causally; exact for every real token of a right-padded row), and the bookkeeping of this process's
    part only (its targets, tokens and attention-cost share), so sums over all processes count each once."""

    collate: Collator
    index: int
    count: int

    def __post_init__(self):
        multiple, chunks = self.collate.pad_to_multiple_of or 1, 2 * self.count
        self.collate = replace(self.collate, pad_to_multiple_of=multiple * chunks // math.gcd(multiple, chunks))

    def kept(self, length: int) -> torch.Tensor:
        """The positions this process keeps once the context has cut a sequence of `length` (head-tail)."""
        chunk = length // (2 * self.count)
        first, last = self.index * chunk, (2 * self.count - 1 - self.index) * chunk
        return torch.cat([torch.arange(first, first + chunk), torch.arange(last, last + chunk)])

    def __call__(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        batch = self.collate(rows)
        mask = batch.pop("attention_mask")
        size, length = batch["input_ids"].shape
        targets, mine = shifted(batch["labels"]), self.kept(length)
        squares = batch[SQUARES_KEY]  # attention cost: the head-tail layout gives each process an equal share
        share = squares // self.count + (squares % self.count if self.index == 0 else 0)
        return {"input_ids": batch["input_ids"], "labels": batch["labels"], SHIFT_LABELS_KEY: targets,
                "position_ids": torch.arange(length).expand(size, length).contiguous(),
                LENGTHS_KEY: mask[:, mine].sum(1), SQUARES_KEY: share,
                TARGETS_KEY: (targets[:, mine] != IGNORE_INDEX).sum()}


def make_loader(dataset, batch_size: int, collator: Collator, shuffle: bool, drop_last: bool, seed: int = 0):
    """A plain DataLoader; accelerator.prepare() shards it across ranks and seeds its shuffling.

    It gets its own generator: creating an iterator draws a seed from the loader's generator, and drawing
    it from the global RNG would shift dropout after a mid-epoch resume (which creates one extra iterator).
    """
    from torch.utils.data import DataLoader

    return DataLoader(dataset, batch_size=batch_size, shuffle=shuffle, drop_last=drop_last, collate_fn=collator,
                      generator=torch.Generator().manual_seed(seed))
