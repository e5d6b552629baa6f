"""Records in, token batches out: load (local file or hub) -> render + tokenise + mask -> pack -> batches.

Labels are -100 on every token the model should not learn to produce (prompts, system text, padding), so
the loss covers answers only. Packing puts several examples in one row with position ids restarting at 0
for each. sdpa and eager turn that into a block-diagonal causal mask (no attention across examples) for any
batch size when no attention_mask is passed and the KV cache is off (use_cache=False, as the loop runs).
flash-attention does not: transformers' flash path reads position ids as packed only at batch size 1
(`_is_packed_sequence`), so a micro-batch of several packed rows would attend across examples. For flash
implementations the collator therefore flattens a packed micro-batch into one row and passes the example
boundaries (`cu_seq_lens_*`, `max_length_*`), which transformers hands to flash_attn_varlen_func as they are.
tests/test_data.py checks isolation on the real model, flash included (through transformers' own flash code
with CPU reference kernels).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from disttrain.config import DataSection, looks_local
from disttrain.errors import DataError

IGNORE_INDEX = -100
LENGTHS_KEY = "num_tokens"  # per-row non-padding length; popped by the loop before the forward pass
SQUARES_KEY = "seq_len_sq"  # per-row sum of squared sequence lengths (attention FLOPs); popped likewise
BOOKKEEPING_KEYS = (LENGTHS_KEY, SQUARES_KEY)

# Used only when the tokenizer has no chat template (base models).
ALPACA_PROMPT = ("Below is an instruction that describes a task{with_input}. Write a response that appropriately "
                 "completes the request.\n\n### Instruction:\n{instruction}\n\n{input_block}### Response:\n")


# ---------------------------------------------------------------- loading + validation
def _required(fmt: str, section: DataSection) -> tuple[str, ...]:
    return {"alpaca": ("instruction", "output"), "chat": (section.messages_field,),
            "text": (section.text_field,)}[fmt]


def _check_record(record, where: str, section: DataSection) -> None:
    if not isinstance(record, Mapping):
        raise DataError(f"{where}: expected a JSON object, got {type(record).__name__}")
    for key in _required(section.format, section):
        if key not in record or record[key] is None:
            raise DataError(f"{where}: missing field {key!r} required by data.format={section.format}")
    if section.format == "chat":
        messages = record[section.messages_field]
        if not isinstance(messages, list) or not messages:
            raise DataError(f"{where}: {section.messages_field!r} must be a non-empty list of messages")
        for i, m in enumerate(messages):
            if not isinstance(m, Mapping) or "role" not in m or "content" not in m:
                raise DataError(f"{where}: message {i} needs 'role' and 'content'")
        if not any(m["role"] == "assistant" for m in messages):
            raise DataError(f"{where}: conversation has no assistant message, nothing to learn from")


def validate_local_file(path: str, section: DataSection) -> int:
    """Scan a local file so a bad record is reported as file:line before any tokenising. Returns #records."""
    p = Path(path)
    if p.suffix == ".parquet":
        return -1  # columnar: each record is checked during tokenisation (its index is named)
    text = p.read_text(encoding="utf-8")
    if p.suffix == ".json" and text.lstrip().startswith("["):
        try:
            records = json.loads(text)
        except json.JSONDecodeError as exc:
            raise DataError(f"{path}:{exc.lineno}: invalid JSON: {exc.msg}") from None
        for i, rec in enumerate(records):
            _check_record(rec, f"{path}: record {i}", section)
        return len(records)
    count = 0
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(f"{path}:{lineno}: invalid JSON ({exc.msg} at column {exc.colno})") from None
        _check_record(record, f"{path}:{lineno}", section)
        count += 1
    return count


def load_split(path: str, split: str, section: DataSection):
    """A `datasets.Dataset` from a local file (validated first) or a hub dataset name."""
    import datasets

    if looks_local(path):
        if validate_local_file(path, section) == 0:
            raise DataError(f"{path}: the file holds no records")
        builder = "parquet" if path.endswith(".parquet") else "json"
        return datasets.load_dataset(builder, data_files={"train": path}, split="train")
    try:
        return datasets.load_dataset(path, split=split)
    except Exception as exc:  # hub unreachable, unknown name, bad split: say which and why
        raise DataError(f"data.path={path!r} (split {split!r}): could not load from the hub or cache: "
                        f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}") from None


# ---------------------------------------------------------------- rendering + masking
def _chat_segments(tokenizer, messages: list[dict]):
    """(text, is_target) pieces of one conversation; assistant answers (with their end token) are targets.

    With a chat template, each assistant turn is located by rendering the conversation up to it with and
    without the answer: the template stays the single source of the format.
    """
    if tokenizer.chat_template:
        done = ""
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            prompt = tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True)
            full = tokenizer.apply_chat_template(messages[: i + 1], tokenize=False)
            if not (prompt.startswith(done) and full.startswith(prompt)):
                raise DataError("the tokenizer's chat template renders earlier turns differently once later "
                                "turns are added; masking needs a prefix-stable template")
            yield prompt[len(done):], False
            yield full[len(prompt):], True
            done = full
        return
    for message in messages:
        if message["role"] == "assistant":
            yield "assistant: ", False
            yield message["content"] + tokenizer.eos_token, True
            yield "\n", False
        else:
            yield f"{message['role']}: {message['content']}\n", False


def _alpaca_messages(record: dict) -> list[dict]:
    prompt = record["instruction"] + (f"\n\n{record['input']}" if record.get("input") else "")
    return [{"role": "user", "content": prompt}, {"role": "assistant", "content": str(record["output"])}]


def _segments(record: dict, tokenizer, section: DataSection):
    if section.format == "text":
        yield record[section.text_field] + tokenizer.eos_token, True
    elif section.format == "chat":
        yield from _chat_segments(tokenizer, record[section.messages_field])
    elif tokenizer.chat_template:
        yield from _chat_segments(tokenizer, _alpaca_messages(record))
    else:
        has_input = bool(record.get("input"))
        yield ALPACA_PROMPT.format(with_input=", paired with an input" if has_input else "",
                                   instruction=record["instruction"],
                                   input_block=f"### Input:\n{record['input']}\n\n" if has_input else ""), False
        yield str(record["output"]) + tokenizer.eos_token, True


def tokenize_record(record: dict, tokenizer, section: DataSection) -> dict:
    input_ids: list[int] = []
    labels: list[int] = []
    if tokenizer.bos_token_id is not None and getattr(tokenizer, "add_bos_token", False):
        input_ids.append(tokenizer.bos_token_id)
        labels.append(IGNORE_INDEX)
    for text, is_target in _segments(record, tokenizer, section):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        input_ids += ids
        labels += ids if is_target else [IGNORE_INDEX] * len(ids)
    truncated = len(input_ids) > section.max_seq_len
    input_ids, labels = input_ids[: section.max_seq_len], labels[: section.max_seq_len]
    # the first label is never predicted (nothing precedes it), so it does not count as a target
    n_targets = sum(1 for t in labels[1:] if t != IGNORE_INDEX)
    return {"input_ids": input_ids, "labels": labels, "n_targets": n_targets, "truncated": truncated}


# ---------------------------------------------------------------- packing
def pack_rows(input_ids: list[list[int]], labels: list[list[int]], max_len: int) -> dict:
    """Greedy, order-preserving packing of examples into rows of at most max_len tokens."""
    rows = {"input_ids": [], "labels": [], "position_ids": []}
    cur_ids: list[int] = []
    cur_labels: list[int] = []
    cur_pos: list[int] = []

    def flush():
        if cur_ids:
            rows["input_ids"].append(list(cur_ids))
            rows["labels"].append(list(cur_labels))
            rows["position_ids"].append(list(cur_pos))
            cur_ids.clear(), cur_labels.clear(), cur_pos.clear()

    for ids, labs in zip(input_ids, labels):
        if len(cur_ids) + len(ids) > max_len:
            flush()
        cur_ids.extend(ids)
        # the first token of an example must not be predicted from the previous example's last token
        cur_labels.extend([IGNORE_INDEX] + list(labs[1:]))
        cur_pos.extend(range(len(ids)))
    flush()
    return rows


# ---------------------------------------------------------------- batches
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
        """One row of all examples. Every example's first label is already IGNORE_INDEX (pack_rows), so no
        token is trained to predict the next row's first token; the loss equals the unflattened batch's."""
        ids, labels, positions = [], [], []
        for r in rows:
            ids += r["input_ids"]
            labels += r["labels"]
            positions += r["position_ids"]
        starts = [i for i, p in enumerate(positions) if p == 0] + [len(positions)]
        longest = max(b - a for a, b in zip(starts, starts[1:]))
        boundaries = torch.tensor(starts, dtype=torch.int32)
        return {"input_ids": torch.tensor([ids]), "labels": torch.tensor([labels]),
                "position_ids": torch.tensor([positions]),
                # transformers passes these to flash_attn_varlen_func (cu_seqlens int32, max lengths as ints)
                "cu_seq_lens_q": boundaries, "cu_seq_lens_k": boundaries,
                "max_length_q": longest, "max_length_k": longest,
                LENGTHS_KEY: torch.tensor([len(r["input_ids"]) for r in rows]),
                SQUARES_KEY: torch.tensor([_sum_of_squared_segments(r["position_ids"]) for r in rows])}


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
    """Tokens that contribute to the causal-LM loss (labels are shifted by one inside the model).
    A tensor on the batch's device, so counting never forces a host sync."""
    return (batch["labels"][:, 1:] != IGNORE_INDEX).sum()




# ---------------------------------------------------------------- the whole pipeline
@dataclass
class DataReport:
    examples: int
    rows: int
    dropped_no_target: int
    truncated: int
    target_tokens: int


def prepare_split(raw, tokenizer, section: DataSection, seed: int, name: str):
    """Tokenise, mask, drop all-masked examples (reported), pack. Cached by `datasets` fingerprints."""
    columns = raw.column_names

    def _tokenize(record, index):
        _check_record(record, f"{name} record {index}", section)  # parquet/hub data was not pre-scanned
        return tokenize_record(record, tokenizer, section)

    tokenized = raw.map(_tokenize, with_indices=True, remove_columns=columns, num_proc=section.num_proc,
                        desc=f"tokenising {name}")
    n_before = len(tokenized)
    truncated = sum(tokenized["truncated"])
    kept = tokenized.filter(lambda n: n > 0, input_columns="n_targets", num_proc=section.num_proc)
    dropped = n_before - len(kept)
    if len(kept) == 0:
        raise DataError(f"{name}: all {n_before} examples have no target tokens after truncation to "
                        f"max_seq_len={section.max_seq_len} (prompts too long, or empty answers)")
    target_tokens = sum(kept["n_targets"])
    kept = kept.remove_columns(["n_targets", "truncated"])
    if section.packing:
        if section.shuffle:
            kept = kept.shuffle(seed=seed)  # mix lengths before packing; the loader reshuffles rows
        kept = kept.map(lambda b: pack_rows(b["input_ids"], b["labels"], section.max_seq_len),
                        batched=True, batch_size=2000, remove_columns=kept.column_names, desc=f"packing {name}")
    return kept, DataReport(n_before, len(kept), dropped, truncated, target_tokens)


def build_datasets(section: DataSection, tokenizer, seed: int, main_process_first):
    """Returns (train, eval or None, [reports]). Tokenises on the main process first; others hit the cache."""
    with main_process_first():
        train_raw = load_split(section.path, section.split, section)
        eval_raw = None
        if section.eval_path or section.eval_split:
            eval_raw = load_split(section.eval_path or section.path, section.eval_split or "train", section)
        elif section.eval_fraction:
            parts = train_raw.train_test_split(test_size=section.eval_fraction, seed=seed)
            train_raw, eval_raw = parts["train"], parts["test"]
        train, train_report = prepare_split(train_raw, tokenizer, section, seed, "train")
        reports = {"train": train_report}
        evaluation = None
        if eval_raw is not None:
            evaluation, reports["eval"] = prepare_split(eval_raw, tokenizer, section, seed, "eval")
    return train, evaluation, reports


def make_loader(dataset, batch_size: int, collator: Collator, shuffle: bool, drop_last: bool, seed: int = 0):
    """A plain DataLoader; accelerator.prepare() shards it across ranks and seeds its shuffling.

    It gets its own generator: creating an iterator draws a seed from the loader's generator, and drawing
    it from the global RNG would shift dropout after a mid-epoch resume (which creates one extra iterator).
    """
    from torch.utils.data import DataLoader

    return DataLoader(dataset, batch_size=batch_size, shuffle=shuffle, drop_last=drop_last, collate_fn=collator,
                      generator=torch.Generator().manual_seed(seed))
