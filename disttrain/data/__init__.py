"""Records in, token batches out. One module per concern:

    sources.py     load a local file (checked record by record, file:line errors) or a hub dataset
    formats.py     alpaca / chat (OpenAI messages, tools) / sharegpt / text -> a conversation or a document
    templates.py   render a conversation once with the chat template, label only the assistant's tokens
    mixing.py      several sources mixed by weight (sampling probabilities), reported per source
    packing.py     packing examples into rows; concat-and-chunk for continued pretraining
    collation.py   rows -> batches (padding, flash-attention layout, bookkeeping for the loop)
    pipeline.py    the whole path, run on the main process first
    preference.py  {prompt, chosen, rejected} pairs: tokenised with truncation, batched side by side (DPO)
    unpaired.py    KTO's examples ({prompt, completion, label}, or pairs split in two), each with a KL partner
    prompts.py     prompts for online RL: rendered with the generation prompt, their records kept for rewards
    streaming.py   data.streaming: the same path lazily, per rank, with the stream position in checkpoints

Labels are -100 on every token the model should not learn to produce (prompts, system text, tool results,
padding), so the loss covers answers only.
"""

from disttrain.data.collation import (BOOKKEEPING_KEYS, LENGTHS_KEY, SHIFT_LABELS_KEY, SQUARES_KEY, TARGETS_KEY,
                                      Collator, count_targets, flattens_packed_rows, make_loader, with_shift_labels)
from disttrain.data.packing import chunk_documents, pack_rows
from disttrain.data.pipeline import DataReport, build_datasets, prepare, tokenize_record
from disttrain.data.preference import PAIR_INDEX, PairCollator
from disttrain.data.sources import load_split, validate_local_file
from disttrain.data.streaming import StreamLoader, shards_note, stream_rows
from disttrain.data.templates import IGNORE_INDEX, render_and_label

__all__ = ["BOOKKEEPING_KEYS", "IGNORE_INDEX", "LENGTHS_KEY", "PAIR_INDEX", "SHIFT_LABELS_KEY", "SQUARES_KEY",
           "TARGETS_KEY",
           "Collator", "DataReport",
           "PairCollator", "StreamLoader", "build_datasets", "chunk_documents", "count_targets", "flattens_packed_rows",
           "load_split", "make_loader", "pack_rows", "prepare", "render_and_label", "shards_note", "stream_rows",
           "tokenize_record", "validate_local_file", "with_shift_labels"]
