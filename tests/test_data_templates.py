"""Assistant-only targets from ONE rendering of each conversation, for every kind of chat template, and the
formats that produce the conversations. Each test asserts the exact target tokens, turn by turn."""

import copy
import json

import pytest

import tests_support
from disttrain.recipe.schema import DataSection
from disttrain.data import tokenize_record
from disttrain.errors import DataError

CHATML = None  # the tiny tokenizer's own template (ChatML with Qwen-style tool calls)
LLAMA3 = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
          "{{ m['content'] }}<|eot_id|>{% endfor %}"
          "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
# Qwen3's behaviour, written small: the reasoning of assistant turns before the last user message is dropped,
# so earlier turns render differently once later turns exist (the old prefix-based masking refused it)
QWEN3_LIKE = ("{% set ns = namespace(last_user=0) %}{% for m in messages %}{% if m['role'] == 'user' %}"
              "{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}"
              "{% for m in messages %}{% if m['role'] == 'assistant' %}<|im_start|>assistant\n"
              "{% if loop.index0 > ns.last_user and m['reasoning_content'] is defined %}"
              "<think>\n{{ m['reasoning_content'] }}\n</think>\n\n{% endif %}{{ m['content'] }}<|im_end|>\n"
              "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
              "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
MARKERS = ("{% for m in messages %}{% if m['role'] == 'assistant' %}<|im_start|>assistant\n"
           "{% generation %}{{ m['content'] }}<|im_end|>{% endgeneration %}\n"
           "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
           "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

MESSAGES = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Repeat the words. tiger"},
            {"role": "assistant", "content": "tiger", "reasoning_content": "copy it"},
            {"role": "user", "content": "How many words are there? a b"},
            {"role": "assistant", "content": "2", "reasoning_content": "count them"}]


def with_template(tokenizer, template, specials=()):
    tok = copy.deepcopy(tokenizer)
    if specials:
        tok.add_special_tokens({"additional_special_tokens": list(specials)})
    if template == "bos":
        tok.add_special_tokens({"bos_token": "<|begin_of_text|>"})
        template = LLAMA3
    tok.chat_template = template
    return tok


def section(fmt="chat", **kw):
    return DataSection(path="x.jsonl", format=fmt, max_seq_len=512, **kw)


def target_runs(tokenizer, item) -> list[str]:
    """The targets as runs of consecutive tokens, each decoded: one run per assistant turn."""
    return tests_support.target_runs(tokenizer, item["input_ids"], item["labels"])


@pytest.mark.parametrize("name, template, specials, expected", [
    ("chatml", CHATML, (), ["tiger<|im_end|>", "2<|im_end|>"]),
    ("llama3", "bos", ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"), ["tiger<|eot_id|>", "2<|eot_id|>"]),
    ("qwen3_like", QWEN3_LIKE, ("<think>", "</think>"),
     ["tiger<|im_end|>", "<think>\ncount them\n</think>\n\n2<|im_end|>"]),
    ("generation_markers", MARKERS, (), ["tiger<|im_end|>", "2<|im_end|>"]),
])
def test_assistant_turns_and_their_end_of_turn_token_are_the_only_targets(name, template, specials, expected,
                                                                          tokenizer):
    tok = with_template(tokenizer, tokenizer.chat_template if template is None else template, specials)
    item = tokenize_record({"messages": MESSAGES}, tok, section())
    assert target_runs(tok, item) == expected
    # the tokens are those of the template's one rendering of the whole conversation
    assert tok.decode(item["input_ids"]) == tok.apply_chat_template(MESSAGES, tokenize=False)


def test_without_a_template_answers_end_with_eos(tokenizer):
    plain = with_template(tokenizer, None)
    item = tokenize_record({"messages": MESSAGES}, plain, section())
    # `assistant: tiger`: byte-level BPE gives " tiger" one token, which the answer starts with
    assert target_runs(plain, item) == [" tiger<|im_end|>", " 2<|im_end|>"]
    item = tokenize_record({"instruction": "Sort the words alphabetically.", "input": "b a", "output": "a b"},
                           plain, section("alpaca"))
    assert "### Instruction:" in plain.decode(item["input_ids"]) and target_runs(plain, item) == ["a b<|im_end|>"]


def test_openai_tool_calls_are_targets_and_tool_results_are_not(tokenizer):
    call = {"type": "function", "function": {"name": "count_words", "arguments": {"text": "a b c"}}}
    record = {"messages": [{"role": "user", "content": "How many words? a b c"},
                           {"role": "assistant", "content": "", "tool_calls": [call]},
                           {"role": "tool", "content": "3"},
                           {"role": "assistant", "content": "There are 3."}],
              "tools": [{"type": "function", "function": {"name": "count_words"}}]}
    item = tokenize_record(record, tokenizer, section())
    rendered = tokenizer.decode(item["input_ids"])
    assert rendered.startswith('<|im_start|>system\nTools: [{"type": "function"')  # tools reach the template
    assert target_runs(tokenizer, item) == [
        '<tool_call>{"name": "count_words", "arguments": {"text": "a b c"}}</tool_call><|im_end|>',
        "There are 3.<|im_end|>"]


def test_sharegpt_roles_function_calls_system_and_custom_names(tokenizer):
    record = {"dialog": [{"from": "person", "value": "How many words? a b"},
                         {"from": "function_call", "value": json.dumps({"name": "count_words",
                                                                         "arguments": {"text": "a b"}})},
                         {"from": "observation", "value": "2"},
                         {"from": "gpt", "value": "2"}],
              "sys": "Count carefully."}
    src = section("sharegpt", columns={"conversations": "dialog", "system": "sys"}, roles={"person": "user"})
    item = tokenize_record(record, tokenizer, src)
    rendered = tokenizer.decode(item["input_ids"])
    assert rendered.startswith("<|im_start|>system\nCount carefully.<|im_end|>\n<|im_start|>user\nHow many words?")
    assert "<|im_start|>tool\n2<|im_end|>" in rendered
    assert target_runs(tokenizer, item) == [
        '<tool_call>{"name": "count_words", "arguments": {"text": "a b"}}</tool_call><|im_end|>', "2<|im_end|>"]
    with pytest.raises(DataError, match="unknown 'from' value 'robot'.*roles: {robot: assistant}"):
        tokenize_record({"conversations": [{"from": "robot", "value": "x"}]}, tokenizer, section("sharegpt"))


def test_system_prompt_is_added_only_where_records_have_none(tokenizer):
    src = section(system_prompt="You are terse.")
    without = tokenize_record({"messages": MESSAGES[1:3]}, tokenizer, src)
    assert tokenizer.decode(without["input_ids"]).startswith("<|im_start|>system\nYou are terse.<|im_end|>")
    own = tokenize_record({"messages": MESSAGES[:3]}, tokenizer, src)
    assert "You are terse." not in tokenizer.decode(own["input_ids"])


def test_column_mapping_reads_other_field_names(tokenizer):
    src = section("alpaca", columns={"instruction": "prompt", "output": "response"})
    item = tokenize_record({"prompt": "Repeat the words.", "response": "tiger"}, tokenizer, src)
    assert target_runs(tokenizer, item) == ["tiger<|im_end|>"]
    with pytest.raises(DataError, match="missing field 'response' required by data.format=alpaca"):
        tokenize_record({"prompt": "x"}, tokenizer, src)
