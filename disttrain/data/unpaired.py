"""Unpaired preference examples (KTO) -> token rows, each with a mismatched partner for the KL estimate.

An example is a prompt, one response and whether the response is desirable: data.format: unpaired ({prompt,
completion, label}, TRL's layout), or a preference pair split in two, its chosen response desirable and its
rejected one not (TRL's unpair_preference_dataset: within a batch of records the chosen examples come first,
then the rejected ones). Rendering, masking and truncation are the pairs' (data/preference.py), one response at
a time.

KTO's KL term compares the policy with the reference on mismatched examples: one example's prompt followed by
another's response. TRL rotates the responses inside each of its sequential micro-batches, so it needs a
sequential sampler and more than one example per device. Here each example's partner is fixed before training:
the response of the next example (in the prepared order, wrapping around) whose prompt differs. The loader may
then shuffle, a micro-batch may hold a single example, and the reference log-probs of the partners can be
precomputed with the responses' (objectives/kto.py). The estimate is of the same quantity, the expected log-ratio
of a response given an unrelated prompt.

Row columns: input_ids, labels (the example), kl_input_ids, kl_labels (its prompt and the partner's response,
cut at max_seq_len), desirable, PAIR_INDEX (its row, for precomputed reference log-probs).
"""

from __future__ import annotations

from disttrain.data.preference import PAIR_INDEX, prompt_length, targets, truncate_pair
from disttrain.data.templates import IGNORE_INDEX, tokenize_rendered
from disttrain.errors import DataError

DESIRABLE = "desirable"
KL_PREFIX = "kl_"
PROMPT_KEY = "prompt_key"  # a hash of the prompt's tokens: partners must have another prompt
TOKEN_COLUMNS = ("input_ids", "labels", DESIRABLE, PROMPT_KEY, "n_targets", "n_tokens", "truncated")


def tokenize_examples(rendered: list[tuple], tokenizer, max_len: int) -> dict:
    """Columns TOKEN_COLUMNS for a batch of rendered records: (Rendered, desirable) of an unpaired record, or
    (chosen Rendered, rejected Rendered) of a pair, whose chosen side becomes a desirable example and rejected
    side an undesirable one (the batch's chosen examples first). One fast-tokenizer call for all texts."""
    singles = [item for item in rendered if isinstance(item[1], bool)]
    pairs = [item for item in rendered if not isinstance(item[1], bool)]
    examples = singles + [(pair[0], True) for pair in pairs] + [(pair[1], False) for pair in pairs]
    encoded = tokenize_rendered([side for side, _ in examples], tokenizer, openings=True)
    columns = {key: [] for key in TOKEN_COLUMNS}
    for (_, desirable), side in zip(examples, encoded):
        (ids, labels), _, truncated = truncate_pair(side, side, max_len, tokenizer.bos_token_id)
        columns["input_ids"].append(ids)
        columns["labels"].append(labels)
        columns[DESIRABLE].append(desirable)
        columns[PROMPT_KEY].append(hash(tuple(ids[:prompt_length(labels)])))  # ints hash the same in every process
        columns["n_targets"].append(targets(labels))
        columns["n_tokens"].append(len(ids))
        columns["truncated"].append(truncated)
    return columns


def partner_rows(keys: list[int]) -> list[int]:
    """For each row, the next row (wrapping around) whose prompt key differs; one pass from the end."""
    n = len(keys)
    if len(set(keys)) < 2:
        raise DataError(f"all {n} examples share one prompt: KTO's KL estimate pairs each prompt with the response "
                        "of an example with another prompt")
    doubled = keys + keys
    following = [0] * (2 * n)
    following[-1] = 2 * n  # never read: some row of the first half differs before it
    for i in range(2 * n - 2, -1, -1):
        following[i] = i + 1 if doubled[i + 1] != doubled[i] else following[i + 1]
    return [following[i] % n for i in range(n)]


def _kl_columns(batch: dict, indices: list[int], max_len: int) -> dict:
    ids_out, labels_out = [], []
    for ids, labels, partner_ids, partner_labels in zip(batch["input_ids"], batch["labels"],
                                                         batch["partner_input_ids"], batch["partner_labels"]):
        own, theirs = prompt_length(labels), prompt_length(partner_labels)
        ids_out.append((ids[:own] + partner_ids[theirs:])[:max_len])
        labels_out.append(([IGNORE_INDEX] * own + partner_labels[theirs:])[:max_len])
    return {f"{KL_PREFIX}input_ids": ids_out, f"{KL_PREFIX}labels": labels_out, PAIR_INDEX: indices}


def with_kl_partners(rows, max_len: int, name: str, both_labels: bool):
    """The prepared examples with their KL partners' columns and PAIR_INDEX. `both_labels` (the training set):
    one line when the examples are all desirable or all undesirable (KTO learns from both)."""
    from datasets import concatenate_datasets

    desirable = sum(rows[DESIRABLE])
    if both_labels and desirable in (0, len(rows)):
        raise DataError(f"{name}: preference.loss: kto needs desirable and undesirable examples (label true and "
                        f"false); all {len(rows)} are {'desirable' if desirable else 'undesirable'}")
    try:
        partners = partner_rows(list(rows[PROMPT_KEY]))
    except DataError as exc:
        raise DataError(f"{name}: {exc}") from None
    chosen = rows.select(partners).select_columns(["input_ids", "labels"]).flatten_indices()
    chosen = chosen.rename_columns({"input_ids": "partner_input_ids", "labels": "partner_labels"})
    joined = concatenate_datasets([rows.flatten_indices(), chosen], axis=1)
    return joined.map(_kl_columns, with_indices=True, batched=True, batch_size=1000,
                      fn_kwargs={"max_len": max_len}, remove_columns=["partner_input_ids", "partner_labels",
                                                                      PROMPT_KEY],
                      desc=f"pairing {name} with KL partners")
