"""The whole data path of a run: load each source -> render + tokenise + mask -> drop examples with nothing
to learn -> mix the sources -> pack or chunk. Runs on the main process first; the other ranks read the
`datasets` cache (the same fingerprints, so the same rows on every rank)."""

from __future__ import annotations

from dataclasses import dataclass, field

from disttrain.config import DataSection, SourceSection
from disttrain.data.formats import to_example
from disttrain.data.mixing import SOURCE_KEY, mix, per_source
from disttrain.data.packing import chunk_documents, pack_rows
from disttrain.data.sources import load_split
from disttrain.data.templates import IGNORE_INDEX, render_and_label
from disttrain.errors import DataError


@dataclass
class DataReport:
    examples: int
    rows: int
    dropped_no_target: int
    truncated: int
    target_tokens: int
    tokens: int = 0                      # non-padding input tokens of one epoch
    dropped_remainder_tokens: int = 0    # concat-and-chunk: the final partial row
    sources: dict[str, dict] = field(default_factory=dict)  # per source: examples, target_tokens (mixtures)


def tokenize_record(record, tokenizer, section: DataSection, source: SourceSection | None = None) -> dict:
    """One record -> input_ids, labels (IGNORE_INDEX on non-targets), n_targets, n_tokens, truncated.
    Documents are not truncated under concat_and_chunk (they are cut into rows later)."""
    ids, labels = render_and_label(to_example(record, source or section.all_sources()[0]), tokenizer)
    truncated = not section.concat_and_chunk and len(ids) > section.max_seq_len
    if not section.concat_and_chunk:
        ids, labels = ids[: section.max_seq_len], labels[: section.max_seq_len]
    # the first label is never predicted (nothing precedes it), so it does not count as a target
    n_targets = sum(1 for t in labels[1:] if t != IGNORE_INDEX)
    return {"input_ids": ids, "labels": labels, "n_targets": n_targets, "n_tokens": len(ids), "truncated": truncated}


def _tokenize_source(raw, tokenizer, section: DataSection, source: SourceSection, index: int, name: str):
    def _tokenize(record, i):
        try:  # parquet and hub data were not pre-scanned: name the record here
            return {**tokenize_record(record, tokenizer, section, source), SOURCE_KEY: index}
        except DataError as exc:
            raise DataError(f"{name} ({source.label()}) record {i}: {exc}") from None

    return raw.map(_tokenize, with_indices=True, remove_columns=raw.column_names, num_proc=section.num_proc,
                   desc=f"tokenising {name} ({source.label()})")


def prepare(parts: list[tuple[SourceSection, object]], tokenizer, section: DataSection, seed: int, name: str):
    """Tokenise, mask, drop all-masked examples (reported), mix, then pack or chunk. Returns (rows, report)."""
    tokenized = [_tokenize_source(raw, tokenizer, section, src, i, name) for i, (src, raw) in enumerate(parts)]
    n_before = sum(len(t) for t in tokenized)
    truncated = sum(sum(t["truncated"]) for t in tokenized)
    kept = [t.filter(lambda n: n > 0, input_columns="n_targets", num_proc=section.num_proc) for t in tokenized]
    if sum(len(k) for k in kept) == 0:
        raise DataError(f"{name}: all {n_before} examples have no target tokens after truncation to "
                        f"max_seq_len={section.max_seq_len} (prompts too long, or empty answers)")
    for (src, _), part in zip(parts, kept):
        if len(part) == 0:
            raise DataError(f"{name}: source {src.label()!r} ({src.path}) has no example with target tokens")
    names = [src.label() for src, _ in parts]
    mixed = mix(kept, [src.weight for src, _ in parts], seed)
    report = DataReport(n_before, 0, n_before - sum(len(k) for k in kept), truncated, sum(mixed["n_targets"]),
                        tokens=sum(mixed["n_tokens"]), sources=per_source(mixed, names) if len(parts) > 1 else {})
    rows = mixed.remove_columns(["n_targets", "n_tokens", "truncated", SOURCE_KEY])
    if section.concat_and_chunk:
        # one batch: documents are joined across the whole dataset, only the final remainder is dropped
        rows = rows.map(lambda b: chunk_documents(b["input_ids"], section.max_seq_len,
                                                  section.chunk_isolate_documents)[0],
                        batched=True, batch_size=None, remove_columns=rows.column_names, desc=f"chunking {name}")
        report.dropped_remainder_tokens = report.tokens - len(rows) * section.max_seq_len
        report.tokens = len(rows) * section.max_seq_len
        report.target_tokens = sum(sum(1 for t in labels[1:] if t != IGNORE_INDEX) for labels in rows["labels"])
    elif section.packing:
        if section.shuffle:
            rows = rows.shuffle(seed=seed)  # mix lengths before packing; the loader reshuffles rows
        rows = rows.map(lambda b: pack_rows(b["input_ids"], b["labels"], section.max_seq_len), batched=True,
                        batch_size=2000, remove_columns=rows.column_names, desc=f"packing {name}")
    report.rows = len(rows)
    return rows, report


def _eval_split(source: SourceSection, train_raw, seed: int):
    """(train part, eval part or None) of one source."""
    if source.eval_path or source.eval_split:
        return train_raw, load_split(source.eval_path or source.path, source.eval_split or "train", source)
    if source.eval_fraction:
        parts = train_raw.train_test_split(test_size=source.eval_fraction, seed=seed)
        return parts["train"], parts["test"]
    return train_raw, None


def build_datasets(section: DataSection, tokenizer, seed: int, main_process_first):
    """Returns (train rows, {eval set name: rows}, {name: DataReport}). One source's eval set is "eval";
    a mixture evaluates each source's eval set on its own, named after the source."""
    sources = section.all_sources()
    with main_process_first():
        train_parts, eval_parts = [], {}
        for src in sources:
            train_raw, eval_raw = _eval_split(src, load_split(src.path, src.split, src), seed)
            train_parts.append((src, train_raw))
            if eval_raw is not None:
                eval_parts["eval" if section.sources is None else src.label()] = (src, eval_raw)
        train, train_report = prepare(train_parts, tokenizer, section, seed, "train")
        reports, evals = {"train": train_report}, {}
        for name, part in eval_parts.items():
            evals[name], reports[name] = prepare([part], tokenizer, section, seed, name)
    return train, evals, reports
