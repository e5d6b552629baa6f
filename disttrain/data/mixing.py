"""Several sources in one training set: weights are sampling probabilities, not subsample fractions.

`datasets.interleave_datasets` draws the next example's source with the normalised weights from a seeded
generator until every source has been used up at least once (`all_exhausted`): a small source with a large
weight is repeated (oversampled), a large one with a small weight is still read to the end. The result is an
ordinary map-style dataset, the same on every rank for the same seed, so sharding, shuffling and exact
resume work as for one source. Each example keeps the index of its source for the mixture report.
"""

from __future__ import annotations

SOURCE_KEY = "source"


def mix(parts: list, weights: list[float], seed: int):
    if len(parts) == 1:
        return parts[0]
    from datasets import interleave_datasets

    total = sum(weights)
    return interleave_datasets(parts, probabilities=[w / total for w in weights], seed=seed,
                               stopping_strategy="all_exhausted")


def per_source(dataset, names: list[str]) -> dict[str, dict]:
    """Examples and target tokens the mixture really holds, per source."""
    import numpy as np

    counts = np.zeros((len(names), 2), dtype=np.int64)
    for block in dataset.select_columns([SOURCE_KEY, "n_targets"]).with_format("numpy").iter(batch_size=8_192):
        np.add.at(counts, block[SOURCE_KEY], np.stack([np.ones_like(block["n_targets"]), block["n_targets"]], 1))
    return {name: {"examples": int(counts[i, 0]), "target_tokens": int(counts[i, 1])} for i, name in enumerate(names)}
