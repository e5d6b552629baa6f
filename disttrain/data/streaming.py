"""data.streaming: training data read as a stream, never materialised on disk or in RAM.

Each source becomes a `datasets` IterableDataset (local files, a glob of files, or a hub dataset), split
between ranks source by source before anything is tokenised: with a number of shards (files) divisible by
the world size every rank reads only its own files (`IterableDataset.shard`); otherwise every rank reads all
of them but keeps, and tokenises, only one record in world_size. (`split_dataset_by_node` is not used: it
decides at iteration time on the whole pipeline, so in its examples mode every rank tokenised and packed the
whole stream and kept one packed row in N, and a mixture's mode followed its smallest shard count.) Records
are then tokenised in batches, examples without targets dropped, sources interleaved by weight and rows
packed or chunked, all lazily.

Exact resume without replaying the stream: `IterableDataset.state_dict()` records, for every stage, where
its current batch started and how many outputs were already handed out. The loader keeps the state after
each micro-batch it yields and checkpoints store it per rank, so a resumed run re-reads at most the current
shard's prefix with Arrow (skipping whole tables, no tokenising) and re-tokenises at most one batch, whatever
the position. Shuffling is by shard order only (a shuffle buffer's content would be lost on resume).
A pass over a rank's share ends, the next pass starts (shard order reshuffled by pass); an incomplete last
micro-batch of a pass is dropped, like drop_last.
"""

from __future__ import annotations

import torch

from disttrain.recipe.schema import DataSection, SourceSection, looks_local
from disttrain.data.mixing import mix
from disttrain.data.packing import chunk_documents, pack_rows
from disttrain.data.pipeline import EXAMPLE_COLUMNS, MAP_BATCH, tokenize_batch
from disttrain.data.sources import builder_of, local_files, validate_local_file
from disttrain.errors import DataError

ROWS_BATCH = 1000  # examples packed (or documents chunked) together; the remainder of each batch is a short row


def _open(source: SourceSection):
    import datasets

    if looks_local(source.path):
        files = local_files(source.path)
        return datasets.load_dataset(builder_of(source.path), data_files={"train": files}, split="train",
                                     streaming=True)
    try:
        return datasets.load_dataset(source.path, source.subset, split=source.split, streaming=True)
    except Exception as exc:
        raise DataError(f"data source {source.path!r} (split {source.split!r}): could not open it as a stream: "
                        f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}") from None


def _tokenizer_fn(source: SourceSection, tokenizer, section: DataSection):
    def _tokenize(batch, indices):
        records = [dict(zip(batch, values)) for values in zip(*batch.values())]
        try:
            return tokenize_batch(records, tokenizer, section, source,
                                  where=lambda i: f"{source.label()}: record {indices[i]} of this rank's stream")
        except DataError:
            if looks_local(source.path):  # name the first bad record of the files as file:line
                validate_local_file(source.path, source)
            raise
    return _tokenize


def _reads_own_shards(raw, world_size: int) -> bool:
    return raw.num_shards % world_size == 0


def _rank_share(raw, rank: int, world_size: int):
    """This rank's records of one source, chosen before anything is tokenised: its own shards, or (shards not
    divisible by the ranks) every world_size-th record of the stream."""
    if world_size == 1:
        return raw
    if _reads_own_shards(raw, world_size):
        return raw.shard(num_shards=world_size, index=rank, contiguous=False)
    return raw.filter(lambda _, indices: [i % world_size == rank for i in indices], with_indices=True,
                      batched=True, batch_size=MAP_BATCH)


def shards_note(section: DataSection, world_size: int) -> list[str]:
    """A line per source whose shards cannot be split evenly between ranks (each rank then reads everything)."""
    notes = []
    for source in section.all_sources():
        raw = _open(source)
        if world_size > 1 and not _reads_own_shards(raw, world_size):
            notes.append(f"data[train]: streaming {source.label()}: {raw.num_shards} shard(s) for {world_size} "
                         f"ranks, so every rank reads all of them and keeps 1 record in {world_size}; give a multiple "
                         f"of {world_size} files (e.g. a glob) for each rank to read only its own")
    return notes


def stream_rows(section: DataSection, tokenizer, seed: int, rank: int, world_size: int):
    """This rank's rows (input_ids, labels[, position_ids]) as a `datasets.IterableDataset`."""
    parts = []
    for source in section.all_sources():
        raw = _rank_share(_open(source), rank, world_size)
        if section.shuffle:
            raw = raw.shuffle(seed=seed, buffer_size=1)  # shard order per pass; no buffer to lose on resume
        tokenized = raw.map(_tokenizer_fn(source, tokenizer, section), with_indices=True, batched=True,
                            batch_size=MAP_BATCH, remove_columns=raw.column_names)
        tokenized = tokenized.select_columns(list(EXAMPLE_COLUMNS))
        parts.append(tokenized.filter(lambda ns: [n > 0 for n in ns], input_columns="n_targets", batched=True,
                                      batch_size=MAP_BATCH))
    rows = mix(parts, [s.weight for s in section.all_sources()], seed).select_columns(["input_ids", "labels"])
    if section.concat_and_chunk:
        return rows.map(lambda b: chunk_documents(b["input_ids"], section.max_seq_len,
                                                  section.chunk_isolate_documents)[0],
                        batched=True, batch_size=ROWS_BATCH, remove_columns=["input_ids", "labels"])
    if section.packing:
        return rows.map(lambda b: pack_rows(b["input_ids"], b["labels"], section.max_seq_len), batched=True,
                        batch_size=ROWS_BATCH, remove_columns=["input_ids", "labels"])
    return rows


class StreamLoader:
    """Micro-batches of one rank's stream, on its device, endlessly (pass after pass), with the stream's
    position after the last yielded micro-batch as `state_dict()` (saved per rank in checkpoints)."""

    resumes_itself = True  # the loop must not skip batches on resume: load_state_dict() has placed it

    def __init__(self, rows, batch_size: int, collator, device):
        self.rows, self.batch_size, self.collator, self.device = rows, batch_size, collator, device
        self.passes = 0
        self._state: dict | None = None

    def set_epoch(self, epoch: int) -> None:
        """Epochs are not counted on a stream (its passes are): nothing to do."""

    def _to_device(self, batch: dict) -> dict:
        return {k: v.to(self.device, non_blocking=True) if isinstance(v, torch.Tensor) else v
                for k, v in batch.items()}

    def __iter__(self):
        while True:
            self.rows.set_epoch(self.passes)
            from_start = self._state is None or self._state["stream"] is None  # not resumed inside this pass
            pending, yielded = [], False
            for row in self.rows:
                pending.append(row)
                if len(pending) == self.batch_size:
                    self._state = {"passes": self.passes, "stream": self.rows.state_dict()}
                    yield self._to_device(self.collator(pending))
                    pending, yielded = [], True
            if from_start and not yielded:
                raise DataError(f"the training stream holds fewer than micro_batch_size={self.batch_size} rows "
                                "for this rank: add data or lower training.micro_batch_size")
            self.passes += 1
            self._state = {"passes": self.passes, "stream": None}

    def state_dict(self) -> dict:
        return self._state or {"passes": self.passes, "stream": None}

    def load_state_dict(self, state: dict) -> None:
        self.passes = state["passes"]
        if state["stream"] is not None:
            self.rows.load_state_dict(state["stream"])
        self._state = state
