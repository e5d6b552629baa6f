"""Mixtures of sources (weights = sampling probabilities, deterministic from the seed, reported per source,
evaluated per source) and concat-and-chunk for continued pretraining. Launch-level proofs (resume of a
mixture under DDP and FSDP2, the same rows on every rank, the tiny recipes under make) are in
tests/test_resume.py and tests/test_launch_ddp.py."""

import json
from contextlib import nullcontext

import pytest

from conftest import REPO
from disttrain.recipe.schema import DataSection
from disttrain.data import IGNORE_INDEX, build_datasets, chunk_documents
from disttrain.data.packing import DocumentChunker
from disttrain.errors import RecipeError

ALPACA, CHAT, SHAREGPT = (str(REPO / "data" / f) for f in ("tiny_alpaca.jsonl", "tiny_chat.jsonl",
                                                           "tiny_sharegpt.jsonl"))


def write_subset(tmp_path, source: str, n: int) -> str:
    path = tmp_path / f"{n}_{source.rsplit('/', 1)[-1]}"
    path.write_text("".join(open(source).readlines()[:n]))
    return str(path)


def mixture(tmp_path, weights=(3.0, 1.0), sizes=(200, 40), **kw):
    sources = [{"path": write_subset(tmp_path, ALPACA, sizes[0]), "format": "alpaca", "name": "alpaca",
                "weight": weights[0]},
               {"path": write_subset(tmp_path, SHAREGPT, sizes[1]), "format": "sharegpt", "name": "tools",
                "weight": weights[1]}]
    return DataSection(sources=sources, max_seq_len=128, **kw)


def rows(dataset):
    return [tuple(r) for r in dataset["input_ids"]]


def test_a_mixture_is_deterministic_from_the_seed_and_reported(tmp_path, tokenizer):
    section = mixture(tmp_path)
    a, _, reports = build_datasets(section, tokenizer, 7, nullcontext)
    b, _, _ = build_datasets(section, tokenizer, 7, nullcontext)
    c, _, _ = build_datasets(section, tokenizer, 8, nullcontext)
    assert rows(a) == rows(b) and rows(a) != rows(c)
    counts = reports["train"].sources
    assert set(counts) == {"alpaca", "tools"}
    assert sum(c["examples"] for c in counts.values()) == len(a) == reports["train"].rows
    assert sum(c["target_tokens"] for c in counts.values()) == reports["train"].target_tokens


def test_weights_are_sampling_probabilities_so_small_sources_are_oversampled(tmp_path, tokenizer):
    """40 tool conversations at weight 1 next to 200 alpaca rows at weight 1: drawn half the time until every
    source is used up, the small source is repeated (~200 draws) instead of staying at 40."""
    _, _, reports = build_datasets(mixture(tmp_path, weights=(1.0, 1.0)), tokenizer, 0, nullcontext)
    counts = reports["train"].sources
    assert counts["alpaca"]["examples"] == 200
    assert 120 <= counts["tools"]["examples"] <= 300  # about as many as alpaca: far above its 40 rows


def test_each_source_has_its_own_eval_set_and_name(tmp_path, tokenizer):
    section = mixture(tmp_path)
    section.sources[0].eval_path = str(REPO / "data/tiny_alpaca_eval.jsonl")
    section.sources[1].eval_fraction = 0.25
    _, evals, reports = build_datasets(section, tokenizer, 0, nullcontext)
    assert set(evals) == {"alpaca", "tools"}
    assert len(evals["alpaca"]) == 100 and reports["tools"].examples == 10
    assert len(evals["tools"]) == 10 - reports["tools"].dropped_no_target


def test_recipe_forms_are_exclusive_and_names_unique():
    with pytest.raises(ValueError, match="either path/format or sources"):
        DataSection(path="a.jsonl", format="alpaca", sources=[{"path": "b.jsonl", "format": "chat"}])
    with pytest.raises(ValueError, match="source names must differ"):
        DataSection(sources=[{"path": "a/x.jsonl", "format": "chat"}, {"path": "b/x.jsonl", "format": "chat"}])
    with pytest.raises(ValueError, match="concat_and_chunk applies to format: text only"):
        DataSection(path="a.jsonl", format="chat", concat_and_chunk=True)


def test_a_missing_source_file_is_named_by_its_key(tmp_path):
    from conftest import base_recipe, write_recipe
    from disttrain.recipe.schema import load_recipe

    recipe = base_recipe(tmp_path, tmp_path / "out", data={"path": None, "format": None,
                                                           "sources": [{"path": ALPACA, "format": "alpaca"},
                                                                       {"path": "nope.jsonl", "format": "chat"}]})
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(RecipeError, match=r"data.sources.1.path: data file 'nope.jsonl' not found"):
        load_recipe(write_recipe(tmp_path / "r.yaml", recipe))


def test_chunking_joins_documents_and_drops_only_the_final_remainder():
    docs = [[1, 2, 3, 0], [4, 5, 0], [6, 7, 8, 9, 0], [10, 0]]  # 14 tokens, EOS = 0
    plain, left = chunk_documents(docs, 4, isolate=False)
    assert plain["input_ids"] == [[1, 2, 3, 0], [4, 5, 0, 6], [7, 8, 9, 0]] and left == 2
    assert plain["labels"] == plain["input_ids"] and "position_ids" not in plain
    isolated, _ = chunk_documents(docs, 4, isolate=True)
    assert isolated["position_ids"] == [[0, 1, 2, 3], [0, 1, 2, 0], [0, 1, 2, 3]]  # every row starts at 0
    # a document's first token is not predicted from the previous document
    assert isolated["labels"][1] == [IGNORE_INDEX, 5, 0, IGNORE_INDEX]


@pytest.mark.parametrize("isolate", [False, True])
def test_chunking_batch_by_batch_equals_chunking_everything_at_once(isolate):
    """The pipeline chunks 1,000 documents at a time (bounded memory); rows crossing batch boundaries carry
    over, so the result is the same as joining the whole corpus."""
    docs = [list(range(100 * d, 100 * d + 1 + d % 7)) + [0] for d in range(50)]
    whole, left = chunk_documents(docs, 8, isolate)
    chunker = DocumentChunker(8, isolate)
    parts = [chunker(docs[i:i + 3]) for i in range(0, len(docs), 3)]
    assert {k: [row for p in parts for row in p[k]] for k in whole} == whole and len(chunker.carry) == left


def test_continued_pretraining_reports_tokens_per_epoch_and_the_dropped_remainder(tmp_path, tokenizer):
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": " ".join(["apple river stone"] * k)}) + "\n" for k in range(1, 30)))
    section = DataSection(path=str(path), format="text", max_seq_len=32, concat_and_chunk=True)
    train, _, reports = build_datasets(section, tokenizer, 0, nullcontext)
    r = reports["train"]
    assert all(len(row) == 32 for row in train["input_ids"]) and r.tokens == 32 * len(train)
    assert 0 <= r.dropped_remainder_tokens < 32 and r.truncated == 0
    documents = [tokenizer(json.loads(line)["text"])["input_ids"] + [tokenizer.eos_token_id]
                 for line in path.read_text().splitlines()]
    stream = [t for d in documents for t in d]
    assert [t for row in train["input_ids"] for t in row] == stream[: r.tokens]  # in order, nothing lost mid-way
    assert r.tokens + r.dropped_remainder_tokens == len(stream)
