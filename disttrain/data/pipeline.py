"""The whole data path of a run: load each source -> render + tokenise + mask (in batches, `data.num_proc`
workers) -> drop examples with nothing to learn -> mix the sources -> pack or chunk. Runs on the main process
first; the other ranks read the `datasets` cache (the same fingerprints, so the same rows on every rank)."""

from __future__ import annotations

import functools
import hashlib
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow.compute as pc

from disttrain.recipe.schema import DataSection, SourceSection, looks_local
from disttrain.data.formats import to_example
from disttrain.data.mixing import SOURCE_KEY, mix, per_source
from disttrain.data.packing import DocumentChunker, pack_rows
from disttrain.data.preference import PAIR_INDEX, render_pair, render_response, tokenize_pairs
from disttrain.data.prompts import PROMPT_INDEX, prompt_text, tokenize_prompts
from disttrain.data.sources import load_split, validate_local_file
from disttrain.data.templates import IGNORE_INDEX, Rendered, render, tokenize_rendered
from disttrain.data.unpaired import tokenize_examples, with_kl_partners
from disttrain.data.vision import IMAGES_KEY, vision_of
from disttrain.errors import DataError


EXAMPLE_COLUMNS = ("input_ids", "labels", "n_targets", "n_tokens", "truncated", "image_cut")
MAP_BATCH = 1000        # records per tokenizer call
MAX_WORKERS = 16        # default data.num_proc is the CPU count, bounded by this
ROWS_PER_WORKER = 20_000  # ... and by the rows: a worker process costs about a second to start
COLUMN_BLOCK = 8_192    # rows per block when summing a column


@dataclass
class DataReport:
    examples: int
    rows: int
    dropped_no_target: int
    truncated: int
    target_tokens: int
    tokens: int = 0                      # non-padding input tokens of one epoch
    dropped_remainder_tokens: int = 0    # concat-and-chunk: the final partial row
    dropped_image_cut: int = 0           # image rows whose image tokens reach past max_seq_len (not truncated)
    sources: dict[str, dict] = field(default_factory=dict)  # per source: examples, target_tokens (mixtures)
    images: str | None = None            # how the processor sizes images, where it counts their pixels
    # this rank only: seconds spent loading + preparing (after waiting for the main process), and whether it
    # tokenised (wrote cache files) itself instead of reading the main process's cache
    prepare_s: float = 0.0
    tokenised_here: bool = False


def _example_fields(ids: list[int], labels: list[int], section: DataSection) -> dict:
    """Truncation (not under concat_and_chunk: documents are cut into rows later) and the counts kept per
    example: targets (the first label is never predicted, nothing precedes it), tokens, truncated."""
    truncated = not section.concat_and_chunk and len(ids) > section.max_seq_len
    if truncated:
        ids, labels = ids[: section.max_seq_len], labels[: section.max_seq_len]
    n_targets = len(labels) - labels.count(IGNORE_INDEX) - (labels[0] != IGNORE_INDEX) if labels else 0
    return {"input_ids": ids, "labels": labels, "n_targets": n_targets, "n_tokens": len(ids), "truncated": truncated,
            "image_cut": False}


def tokenize_batch(records: list, tokenizer, section: DataSection, source: SourceSection, where=None) -> dict:
    """Records -> columns input_ids, labels (IGNORE_INDEX on non-targets), n_targets, n_tokens, truncated.
    Each conversation is rendered once; all texts of the batch go through one fast-tokenizer call.
    Preference records give data.preference.PAIR_COLUMNS instead, prompts data.prompts.PROMPT_COLUMNS, and KTO's
    examples (unpaired records, or pairs split in two) data.unpaired.TOKEN_COLUMNS. `where(i)` names record i in
    an error (file:line or record index)."""
    rendered = []
    name = where or (lambda i: f"record {i}")
    for i, record in enumerate(records):
        try:
            rendered.append(to_example(record, source) if source.format == "prompt" else
                            render_record(record, tokenizer, source))
        except DataError as exc:
            raise DataError(f"{name(i)}: {exc}") from None
    if source.format == "prompt":
        return tokenize_prompts(rendered, records, tokenizer, section.max_seq_len,
                                source.columns.get("prompt", "prompt"), name)
    if section.unpaired_examples():
        return tokenize_examples(rendered, tokenizer, section.max_seq_len)
    if source.format == "preference":
        return tokenize_pairs(rendered, tokenizer, section.max_seq_len)
    vision = vision_of(tokenizer)
    examples = []
    for r, (ids, labels) in zip(rendered, tokenize_rendered(rendered, tokenizer)):
        example = _example_fields(ids, labels, section)
        if vision is not None and r.images and vision.cuts_image(ids, section.max_seq_len):
            example.update(n_targets=0, image_cut=True)  # dropped with the empty ones, counted apart (a large photo
        examples.append(example)                         # must not stop a whole dataset's tokenisation)
    columns = {key: [e[key] for e in examples] for key in EXAMPLE_COLUMNS}
    if vision is not None:  # every row has the column (a text-only record: no image), so sources mix
        columns[IMAGES_KEY] = [r.images or [] for r in rendered]
    return columns


def render_record(record, tokenizer, source: SourceSection):
    """One record as the template renders it, with what is learned (a preference pair: both sides); raises
    DataError for what the format or the chat template cannot take. A conversation with images: its
    placeholders expanded by the model's processor (data/vision.py)."""
    example = to_example(record, source)
    if source.format == "prompt":
        return prompt_text(example, tokenizer)
    if source.format == "preference":
        return render_pair(example, tokenizer)
    if source.format == "unpaired":
        return render_response(example.prompt, example.completion, example.tools, tokenizer), example.desirable
    images = getattr(example, "images", None)
    if not images:
        return render(example, tokenizer)
    vision = vision_of(tokenizer)
    if vision is None:
        raise DataError(f"the record holds {len(images)} image(s) but the model reads text only; train a "
                        "vision-language model (docs/vlm.md) or drop the images")
    rendered = render(example, tokenizer, text_spans=True)
    text, spans = vision.expand(rendered.text, rendered.spans, images)
    return Rendered(text, spans, rendered.prefix, images=images)


def tokenize_record(record, tokenizer, section: DataSection, source: SourceSection | None = None) -> dict:
    """One record -> input_ids, labels, n_targets, n_tokens, truncated (tokenize_batch of one)."""
    columns = tokenize_batch([record], tokenizer, section, source or section.all_sources()[0])
    return {key: values[0] for key, values in columns.items()}


def _records_of(batch: dict) -> list[dict]:
    return [dict(zip(batch, values)) for values in zip(*batch.values())]


def _tokenize_source(raw, origin: str | None, tokenizer, section: DataSection, source: SourceSection, index: int,
                     name: str):
    def _tokenize(batch, indices):
        columns = tokenize_batch(_records_of(batch), tokenizer, section, source,
                                 where=lambda i: f"{name} ({source.label()}) record {indices[i]}")
        return {**columns, SOURCE_KEY: [index] * len(next(iter(columns.values())))}  # KTO: a pair gives 2 rows

    try:
        return raw.map(_tokenize, with_indices=True, batched=True, batch_size=MAP_BATCH,
                       remove_columns=raw.column_names, num_proc=workers(section, len(raw)),
                       new_fingerprint=tokenized_fingerprint(raw, tokenizer, section, source, index),
                       desc=f"tokenising {name} ({source.label()})")
    except DataError:
        if origin is not None and looks_local(origin):  # name the file's first bad record as file:line
            validate_local_file(origin, source, check=lambda record: render_record(record, tokenizer, source))
        raise


def tokenized_fingerprint(raw, tokenizer, section: DataSection, source: SourceSection, index: int) -> str:
    """The `datasets` cache key of a source's tokenised rows: what they depend on -- the raw rows (their own
    fingerprint), the tokenizer (or processor), the data settings (and whether records become KTO's examples),
    the source's, its place in the mixture and the code that tokenises (CODE_FILES). Given to map() as it is:
    map's default hashes the function, and dill then disassembles every function the tokenising code reaches
    (~0.5 CPU-s per source and split on every rank, measured with py-spy over the suite)."""
    from datasets.fingerprint import Hasher

    return Hasher.hash([raw._fingerprint, Hasher.hash(tokenizer), section.model_dump(mode="json"),
                        section.unpaired_examples(),  # (set by the recipe, not a field: KTO's examples or pairs)
                        source.model_dump(mode="json"), index, _code_hash()])


CODE_FILES = ("data/*.py", "recipe/schema.py", "errors.py")  # what tokenising runs, under disttrain/


@functools.cache
def _code_hash() -> str:
    root = Path(__file__).resolve().parent.parent
    digest = hashlib.sha256()
    for path in sorted(p for pattern in CODE_FILES for p in root.glob(pattern)):
        digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()


def workers(section: DataSection, rows: int) -> int | None:
    """data.num_proc, or by default one process per CPU this process may use (at most MAX_WORKERS), and only
    for datasets large enough to repay starting them (ROWS_PER_WORKER rows each)."""
    if section.num_proc is not None:
        return section.num_proc
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    n = min(cpus, MAX_WORKERS, rows // ROWS_PER_WORKER)
    return n if n > 1 else None


def _with_target_counts(rows: dict) -> dict:
    rows["n_targets"] = [len(labels) - labels.count(IGNORE_INDEX) - (labels[0] != IGNORE_INDEX) if labels else 0
                         for labels in rows["labels"]]
    return rows


def column_sum(dataset, name: str) -> int:
    """Sum of an integer/bool column, read through Arrow in blocks (no Python object per row; reading a
    filtered dataset's whole column at once builds one Arrow chunk per row, ~0.5 kB each)."""
    column = dataset.select_columns([name]).with_format("arrow")
    return sum(int(pc.sum(block[name]).as_py() or 0) for block in column.iter(batch_size=COLUMN_BLOCK))


@dataclass
class Part:
    """One source's records for one split, and the local file(s) they came from (None: the hub)."""

    source: SourceSection
    records: object  # datasets.Dataset
    origin: str | None


def prepare(parts: list[Part], tokenizer, section: DataSection, seed: int, name: str):
    """Tokenise, mask, drop all-masked examples (reported), mix, then pack or chunk. Returns (rows, report)."""
    tokenized = [_tokenize_source(p.records, p.origin, tokenizer, section, p.source, i, name)
                 for i, p in enumerate(parts)]
    n_before = sum(len(t) for t in tokenized)
    truncated = sum(column_sum(t, "truncated") for t in tokenized)
    image_cut = sum(column_sum(t, "image_cut") for t in tokenized if "image_cut" in t.column_names)
    kept = [t.filter(lambda ns: [n > 0 for n in ns], input_columns="n_targets", batched=True,
                     batch_size=MAP_BATCH, num_proc=workers(section, len(t))) for t in tokenized]
    if sum(len(k) for k in kept) == 0:
        raise DataError(f"{name}: all {n_before} examples have no target tokens after truncation to "
                        f"max_seq_len={section.max_seq_len} (prompts too long, or empty answers)")
    for part, rows in zip(parts, kept):
        if len(rows) == 0:
            raise DataError(f"{name}: source {part.source.label()!r} ({part.source.path}) has no example with "
                            "target tokens")
    names = [p.source.label() for p in parts]
    mixed = mix(kept, [p.source.weight for p in parts], seed)
    report = DataReport(n_before, 0, n_before - sum(len(k) for k in kept) - image_cut, truncated,
                        column_sum(mixed, "n_targets"), tokens=column_sum(mixed, "n_tokens"),
                        sources=per_source(mixed, names) if len(parts) > 1 else {}, dropped_image_cut=image_cut,
                        images=vision.describe_limits() if (vision := vision_of(tokenizer)) else None)
    rows = mixed.remove_columns([c for c in ("n_targets", "n_tokens", "truncated", "image_cut", SOURCE_KEY)
                                 if c in mixed.column_names])
    if section.concat_and_chunk:
        # batches in order, one process: a row may continue into the next batch (DocumentChunker); only the
        # final remainder is dropped
        chunker = DocumentChunker(section.max_seq_len, section.chunk_isolate_documents)
        rows = rows.map(lambda b: _with_target_counts(chunker(b["input_ids"])), batched=True,
                        batch_size=MAP_BATCH, remove_columns=rows.column_names, desc=f"chunking {name}")
        report.dropped_remainder_tokens = report.tokens - len(rows) * section.max_seq_len
        report.tokens = len(rows) * section.max_seq_len
        report.target_tokens = column_sum(rows, "n_targets")
        rows = rows.remove_columns("n_targets")
    elif section.unpaired_examples():  # KTO: each example's KL partner, and the row's number (as a pair's)
        rows = with_kl_partners(rows, section.max_seq_len, name, both_labels=name == "train")
    elif parts[0].source.format in ("preference", "prompt"):  # the row's number: a pair's precomputed reference
        index = PAIR_INDEX if parts[0].source.format == "preference" else PROMPT_INDEX  # log-probs, a prompt's seed
        rows = rows.map(lambda _, indices: {index: indices}, with_indices=True, batched=True,
                        batch_size=MAP_BATCH, desc=f"indexing {name}")
    elif section.packing:
        if section.shuffle:
            rows = rows.shuffle(seed=seed)  # mix lengths before packing; the loader reshuffles rows
        rows = rows.map(lambda b: pack_rows(b["input_ids"], b["labels"], section.max_seq_len), batched=True,
                        batch_size=2000, remove_columns=rows.column_names, desc=f"packing {name}")
    report.rows = len(rows)
    return rows, report


def _origin(path: str) -> str | None:
    return path if looks_local(path) else None


def _train_and_eval(source: SourceSection, seed: int, streaming: bool) -> tuple[Part | None, Part | None]:
    """One source's train part (None when the training data is streamed) and its eval part (None without
    eval data)."""
    train = None if streaming else Part(source, load_split(source.path, source.split, source), _origin(source.path))
    if source.eval_path or source.eval_split:
        path = source.eval_path or source.path
        return train, Part(source, load_split(path, source.eval_split or "train", source), _origin(path))
    if source.eval_fraction and train is not None:
        split = train.records.train_test_split(test_size=source.eval_fraction, seed=seed)
        return Part(source, split["train"], train.origin), Part(source, split["test"], train.origin)
    return train, None


def build_datasets(section: DataSection, tokenizer, seed: int, main_process_first):
    """Returns (train rows, {eval set name: rows}, {name: DataReport}). One source's eval set is "eval";
    a mixture evaluates each source's eval set on its own, named after the source. With data.streaming the
    train rows are None (streaming.stream_rows reads them) and only the eval sets are prepared here."""
    sources = section.all_sources()
    with main_process_first():
        started, wall_start = time.perf_counter(), time.time()
        train_parts, eval_parts = [], {}
        for src in sources:
            train_part, eval_part = _train_and_eval(src, seed, section.streaming)
            train_parts.append(train_part)
            if eval_part is not None:
                eval_parts["eval" if section.sources is None else src.label()] = eval_part
        train, reports, evals = None, {}, {}
        if not section.streaming:
            train, reports["train"] = prepare(train_parts, tokenizer, section, seed, "train")
        for name, part in eval_parts.items():
            evals[name], reports[name] = prepare([part], tokenizer, section, seed, name)
        for name, report in reports.items():
            report.prepare_s = time.perf_counter() - started
            report.tokenised_here = written_since(train if name == "train" else evals[name], wall_start)
    return train, evals, reports


def written_since(dataset, wall_start: float) -> bool:
    """Whether this process wrote any of the dataset's cache files (else it read another process's cache).
    An in-memory dataset (caching disabled) was necessarily computed here."""
    files = [f["filename"] for f in dataset.cache_files]
    return not files or any(os.path.getmtime(f) >= wall_start for f in files if os.path.exists(f))
