"""Rows of max_seq_len tokens from examples: packing (several whole examples per row, isolated from each
other through position ids restarting at 0) and concat-and-chunk for continued pretraining (all documents
joined with EOS and cut into full rows; only the final remainder is dropped)."""

from __future__ import annotations

from disttrain.data.templates import IGNORE_INDEX


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


class DocumentChunker:
    """Concat-and-chunk over batches of documents taken in order: the tokens left after a batch's last full
    row open the next batch's first row, so the rows equal chunking the whole corpus at once while memory
    holds one batch. Each document already ends with EOS. With `isolate`, position ids restart at every
    document start inside a row and that first token is not a target (it would be predicted across the
    boundary), as in packing; without it a row is one causal sequence, the usual pretraining layout."""

    def __init__(self, max_len: int, isolate: bool):
        self.max_len, self.isolate = max_len, isolate
        self.carry: list[int] = []         # tokens of the row not yet full
        self.carry_starts: list[int] = []  # where documents start inside it

    def __call__(self, input_ids: list[list[int]]) -> dict:
        stream = self.carry + [t for doc in input_ids for t in doc]
        starts, offset = list(self.carry_starts), len(self.carry)
        for doc in input_ids:
            starts.append(offset)
            offset += len(doc)
        usable = len(stream) // self.max_len * self.max_len
        rows = self._rows(stream, set(starts), usable)
        self.carry, self.carry_starts = stream[usable:], [p - usable for p in starts if p >= usable]
        return rows

    def _rows(self, stream: list[int], starts: set[int], usable: int) -> dict:
        rows = {"input_ids": [], "labels": []}
        if self.isolate:
            rows["position_ids"] = []
        for begin in range(0, usable, self.max_len):
            ids = stream[begin:begin + self.max_len]
            rows["input_ids"].append(ids)
            if not self.isolate:
                rows["labels"].append(list(ids))
                continue
            labels, positions, pos = [], [], 0
            for i, token in enumerate(ids):
                if begin + i in starts:  # a document starts: positions restart, its first token is no target
                    pos = 0
                labels.append(IGNORE_INDEX if begin + i in starts else token)
                positions.append(pos)
                pos += 1
            rows["labels"].append(labels)
            rows["position_ids"].append(positions)
        return rows


def chunk_documents(input_ids: list[list[int]], max_len: int, isolate: bool) -> tuple[dict, int]:
    """Concatenate tokenised documents and cut them into rows of exactly max_len (see DocumentChunker).
    Returns (rows, tokens in the dropped final remainder)."""
    chunker = DocumentChunker(max_len, isolate)
    rows = chunker(input_ids)
    return rows, len(chunker.carry)
