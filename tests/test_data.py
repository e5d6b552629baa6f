import json
from contextlib import nullcontext

import pytest
import torch

from conftest import REPO
from disttrain.recipe.schema import DataSection
from disttrain.data import (IGNORE_INDEX, Collator, build_datasets, count_targets, pack_rows, tokenize_record,
                            validate_local_file)
from disttrain.errors import DataError


def section(**kw):
    return DataSection(**{"path": "x.jsonl", "format": "alpaca", "max_seq_len": 256, **kw})


def decode_targets(tokenizer, item):
    return tokenizer.decode([t for t in item["labels"] if t != IGNORE_INDEX])


def test_alpaca_masks_the_prompt_and_learns_answer_plus_eos(tokenizer):
    item = tokenize_record({"instruction": "Reverse the order of the words.", "input": "apple river",
                            "output": "river apple"}, tokenizer, section())
    assert len(item["input_ids"]) == len(item["labels"])
    assert decode_targets(tokenizer, item).startswith("river apple<|im_end|>")
    full = tokenizer.decode(item["input_ids"])
    assert full.startswith("<|im_start|>user\nReverse the order of the words.\n\napple river<|im_end|>")
    n_prompt = next(i for i, t in enumerate(item["labels"]) if t != IGNORE_INDEX)
    assert tokenizer.decode(item["input_ids"][:n_prompt]).endswith("<|im_start|>assistant\n")


def test_chat_learns_only_assistant_turns(tokenizer):
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Repeat the words. tiger"}, {"role": "assistant", "content": "tiger"},
                {"role": "user", "content": "How many words are there? a b"}, {"role": "assistant", "content": "2"}]
    item = tokenize_record({"messages": messages}, tokenizer, section(format="chat"))
    targets = decode_targets(tokenizer, item)
    assert targets == "tiger<|im_end|>2<|im_end|>"  # the end-of-turn token is learned, the newline after it is not
    assert "Be brief" not in targets and "Repeat" not in targets
    # rendering is exactly the tokenizer's chat template
    assert tokenizer.decode(item["input_ids"]) == tokenizer.apply_chat_template(messages, tokenize=False)


def test_without_chat_template_falls_back_to_plain_prompts(tokenizer):
    plain = tokenizer.__class__.from_pretrained(tokenizer.name_or_path)
    plain.chat_template = None
    item = tokenize_record({"instruction": "Sort the words alphabetically.", "input": "b a", "output": "a b"},
                           plain, section())
    assert "### Instruction:" in plain.decode(item["input_ids"])
    assert decode_targets(plain, item) == "a b<|im_end|>"


def test_text_format_learns_everything(tokenizer):
    item = tokenize_record({"text": "apple river stone"}, tokenizer, section(format="text"))
    assert all(t != IGNORE_INDEX for t in item["labels"])
    assert item["n_targets"] == len(item["labels"]) - 1


def test_truncation_and_all_masked_examples(tokenizer):
    long_prompt = {"instruction": "apple " * 100, "input": "", "output": "river"}
    item = tokenize_record(long_prompt, tokenizer, section(max_seq_len=32))
    assert len(item["input_ids"]) == 32 and item["truncated"] and item["n_targets"] == 0


def test_malformed_lines_are_named_by_file_and_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"instruction": "a", "output": "b"}\n\n{"instruction": "a", "output": \n')
    with pytest.raises(DataError, match=r"bad.jsonl:3: invalid JSON"):
        validate_local_file(str(bad), section(path=str(bad)))
    missing = tmp_path / "missing.jsonl"
    missing.write_text('{"instruction": "a", "output": "b"}\n{"instruction": "a"}\n')
    with pytest.raises(DataError, match=r"missing.jsonl:2: missing field 'output' required by data.format=alpaca"):
        validate_local_file(str(missing), section(path=str(missing)))
    no_answer = tmp_path / "chat.jsonl"
    no_answer.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    with pytest.raises(DataError, match=r"chat.jsonl:1: conversation has no assistant message"):
        validate_local_file(str(no_answer), section(path=str(no_answer), format="chat"))


def test_empty_and_all_masked_datasets_are_errors(tmp_path, tokenizer):
    from contextlib import nullcontext

    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(DataError, match="holds no records"):
        build_datasets(section(path=str(empty)), tokenizer, 0, nullcontext)
    masked = tmp_path / "masked.jsonl"
    masked.write_text("".join(json.dumps({"instruction": "apple " * 50, "output": "x"}) + "\n" for _ in range(3)))
    with pytest.raises(DataError, match="all 3 examples have no target tokens"):
        build_datasets(section(path=str(masked), max_seq_len=16), tokenizer, 0, nullcontext)


def test_dropped_examples_are_reported(tmp_path, tokenizer):
    from contextlib import nullcontext

    path = tmp_path / "mixed.jsonl"
    rows = [{"instruction": "apple " * 50, "output": "x"}, {"instruction": "Repeat.", "output": "river"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    train, _, reports = build_datasets(section(path=str(path), max_seq_len=24), tokenizer, 0, nullcontext)
    assert len(train) == 1 and reports["train"].dropped_no_target == 1 and reports["train"].truncated == 1


def test_packing_resets_positions_and_masks_boundaries():
    rows = pack_rows([[1, 2, 3], [4, 5], [6, 7, 8, 9]], [[-100, 2, 3], [4, 5], [6, 7, 8, 9]], max_len=6)
    assert rows["input_ids"] == [[1, 2, 3, 4, 5], [6, 7, 8, 9]]
    assert rows["position_ids"] == [[0, 1, 2, 0, 1], [0, 1, 2, 3]]
    # the first token of each example is never a target (it would be predicted from the previous example)
    assert rows["labels"] == [[-100, 2, 3, -100, 5], [-100, 7, 8, 9]]


def test_packed_examples_do_not_attend_to_each_other(tiny_model_dir, tokenizer):
    """Logits of an example inside a packed row equal its logits alone: no cross-example attention."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="sdpa").eval()
    a = tokenizer("apple river stone cloud")["input_ids"]
    b = tokenizer("green quick light")["input_ids"]
    row = {k: v[0] for k, v in pack_rows([a, b], [a, b], max_len=64).items()}
    packed = Collator(tokenizer.pad_token_id)([row])
    # use_cache=False matters: with a KV cache transformers skips packed-sequence detection (the loop and
    # load_model both turn the cache off)
    with torch.no_grad():
        together = model(input_ids=packed["input_ids"], position_ids=packed["position_ids"],
                         use_cache=False).logits[0, len(a):]
        alone = model(input_ids=torch.tensor([b]), use_cache=False).logits[0]
        leaky = model(input_ids=packed["input_ids"], use_cache=False).logits[0, len(a):]  # one causal mask
    torch.testing.assert_close(together, alone, atol=1e-5, rtol=1e-4)
    assert not torch.allclose(leaky, alone, atol=1e-3)


def _two_packed_rows(tokenizer):
    texts = ["apple river stone cloud", "green quick light", "stone apple", "cloud river green quick stone"]
    examples = [tokenizer(t)["input_ids"] for t in texts]
    pairs = [pack_rows(examples[i:i + 2], examples[i:i + 2], max_len=64) for i in (0, 2)]
    return examples, [{k: v[0] for k, v in rows.items()} for rows in pairs]  # two rows of two examples


@pytest.mark.parametrize("implementation", ["eager", "sdpa", "flash_attention_2"])
def test_packed_micro_batches_stay_isolated_for_every_attention_implementation(implementation, tiny_model_dir,
                                                                                tokenizer):
    """A micro-batch of two packed rows, collated as train.py collates it for this implementation: every
    example's logits equal its logits alone. flash_attention_2 runs transformers' own flash dispatch with CPU
    reference kernels (tests/flash_cpu.py); without flattening, its rows would attend across examples."""
    from transformers import AutoModelForCausalLM

    from disttrain.data import flattens_packed_rows
    from flash_cpu import cpu_flash_attention

    flash = implementation.startswith("flash")
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="sdpa" if flash else
                                                 implementation).eval()
    examples, rows = _two_packed_rows(tokenizer)
    collate = Collator(tokenizer.pad_token_id, flatten_packed=flattens_packed_rows(implementation))
    batch = collate(rows)
    inputs = {k: v for k, v in batch.items() if k not in ("labels", "num_tokens", "seq_len_sq")}
    with torch.no_grad():
        alone = [model(input_ids=torch.tensor([e]), use_cache=False).logits[0] for e in examples]
        with cpu_flash_attention(model, implementation) if flash else nullcontext():
            logits = model(**inputs, use_cache=False).logits.reshape(-1, alone[0].shape[-1])
            if flash:  # the collation the fix replaced: one causal sequence per row
                padded = Collator(tokenizer.pad_token_id)(rows)
                leaky = model(input_ids=padded["input_ids"], position_ids=padded["position_ids"],
                              use_cache=False).logits
    if not flattens_packed_rows(implementation):  # rows side by side, padded to the longest
        logits = torch.cat([logits[i * batch["input_ids"].shape[1]:][:n] for i, n in
                            enumerate(batch["num_tokens"].tolist())])
    torch.testing.assert_close(logits, torch.cat(alone), atol=1e-5, rtol=1e-4)
    if flash:
        second = leaky[0, len(examples[0]):len(examples[0]) + len(examples[1])]
        assert not torch.allclose(second, alone[1], atol=1e-3), "the control should leak across examples"


def test_flattened_packed_batch_has_the_same_loss_targets_and_eval_rows(tiny_model_dir, tokenizer):
    """Flattening changes the layout only: same token-normalised loss, target count and per-row eval sums."""
    from transformers import AutoModelForCausalLM
    from transformers.modeling_flash_attention_utils import _is_packed_sequence

    from disttrain.objectives.token_loss import _per_row_sums

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="sdpa").eval()
    _, rows = _two_packed_rows(tokenizer)
    side_by_side = Collator(tokenizer.pad_token_id)(rows)
    flat = Collator(tokenizer.pad_token_id, flatten_packed=True)(rows)
    # upstream's decision: position ids mean "packed" to flash-attention at batch size 1 only
    assert not _is_packed_sequence(side_by_side["position_ids"], batch_size=2)
    assert flat["cu_seq_lens_q"].tolist()[-1] == flat["input_ids"].shape[1] == sum(flat["num_tokens"].tolist())
    assert int(count_targets(flat)) == int(count_targets(side_by_side))
    results = []
    for batch in (side_by_side, flat):
        inputs = {k: v for k, v in batch.items() if k not in ("num_tokens", "seq_len_sq")}
        with torch.no_grad():
            out = model(**inputs, use_cache=False, num_items_in_batch=count_targets(batch))
        labels = batch["labels"][:, 1:]
        per_token = torch.nn.functional.cross_entropy(out.logits[:, :-1].float().transpose(1, 2), labels,
                                                      ignore_index=IGNORE_INDEX, reduction="none")
        results.append((out.loss, _per_row_sums(per_token, labels, batch)))
    torch.testing.assert_close(results[0][0], results[1][0], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(results[0][1], results[1][1], atol=1e-5, rtol=1e-5)
    assert results[1][1].shape == (2, 2)


def test_flattened_chunks_that_start_mid_document_train_nothing_across_rows(tokenizer):
    """concat_and_chunk + chunk_isolate_documents: rows start mid-document with a label on their first token.
    Side by side nothing predicts it; flattened, the previous row's last token must not either."""
    from disttrain.data import chunk_documents

    docs = [tokenizer("apple river stone tiger")["input_ids"] * 3, tokenizer("paper window")["input_ids"] * 4]
    rows, _ = chunk_documents(docs, 8, isolate=True)
    rows = [dict(zip(rows, values)) for values in zip(*rows.values())][:3]
    assert any(r["labels"][0] != IGNORE_INDEX for r in rows[1:]), "the data must hold a row that starts mid-document"
    side_by_side = Collator(tokenizer.pad_token_id)(rows)
    flat = Collator(tokenizer.pad_token_id, flatten_packed=True)(rows)
    assert int(count_targets(flat)) == int(count_targets(side_by_side))
    for start in flat["cu_seq_lens_q"].tolist()[:-1]:
        assert flat["labels"][0, start] == IGNORE_INDEX


def test_collator_pads_right_and_counts(tokenizer):
    batch = Collator(tokenizer.pad_token_id)([{"input_ids": [5, 6, 7], "labels": [-100, 6, 7]},
                                              {"input_ids": [8, 9], "labels": [-100, 9]}])
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 9, tokenizer.pad_token_id]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]
    assert batch["labels"].tolist() == [[-100, 6, 7], [-100, 9, -100]]
    assert batch["num_tokens"].tolist() == [3, 2]
    assert batch["seq_len_sq"].tolist() == [9, 4]
    packed = Collator(0)([{"input_ids": [1, 2, 3, 4, 5], "labels": [-100] * 5, "position_ids": [0, 1, 2, 0, 1]}])
    assert packed["seq_len_sq"].tolist() == [3 * 3 + 2 * 2]  # examples attend within themselves only
    assert int(count_targets(batch)) == 3


def test_shipped_data_matches_its_generator(tmp_path):
    from disttrain.tools.tiny import write_data

    for path in write_data(tmp_path):
        assert path.read_text() == (REPO / "data" / path.name).read_text(), f"regenerate with make data: {path.name}"


def test_tokenised_rows_are_cached_under_what_they_depend_on(tokenizer, monkeypatch):
    """The tokenised rows' `datasets` cache key is made from what they depend on, not by hashing the tokenising
    function (dill disassembles all the code it reaches): a second preparation reads the first's rows without
    tokenising, and the key changes with the raw rows, the tokenizer's chat template, the data settings (KTO's
    examples or pairs included), the source's and its place in a mixture."""
    import copy

    import disttrain.data.pipeline as pipeline
    from disttrain.data.sources import load_split

    section = DataSection(path=str(REPO / "data/tiny_alpaca.jsonl"), format="alpaca", max_seq_len=64)
    first = build_datasets(section, tokenizer, 0, nullcontext)[0]
    calls = []
    original = pipeline.tokenize_batch
    monkeypatch.setattr(pipeline, "tokenize_batch", lambda *a, **k: calls.append(1) or original(*a, **k))
    again = build_datasets(section, tokenizer, 0, nullcontext)[0]
    assert not calls and again["input_ids"] == first["input_ids"]

    source = section.all_sources()[0]
    raw = load_split(source.path, "train", source)
    key = pipeline.tokenized_fingerprint(raw, tokenizer, section, source, 0)
    assert key == pipeline.tokenized_fingerprint(load_split(source.path, "train", source), tokenizer, section,
                                                 source, 0)
    other_template = copy.deepcopy(tokenizer)
    other_template.chat_template = tokenizer.chat_template.replace("assistant", "bot")
    changed = [pipeline.tokenized_fingerprint(raw.select(range(3)), tokenizer, section, source, 0),
               pipeline.tokenized_fingerprint(raw, other_template, section, source, 0),
               pipeline.tokenized_fingerprint(raw, tokenizer, section.model_copy(update={"max_seq_len": 32}),
                                              source, 0),
               pipeline.tokenized_fingerprint(raw, tokenizer, section,
                                              source.model_copy(update={"system_prompt": "Be brief."}), 0),
               pipeline.tokenized_fingerprint(raw, tokenizer, section, source, 1)]
    kto = section.model_copy()
    kto._unpaired = True  # (the recipe sets it for preference.loss: kto: the same file prepared as KTO's examples)
    changed.append(pipeline.tokenized_fingerprint(raw, tokenizer, kto, source, 0))
    assert len({key, *changed}) == 7
