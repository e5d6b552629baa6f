"""Assistant-only masking on chat templates with the structure of the families users bring, not only the
ChatML template the project ships.

Each family's template is written here with `{% generation %}` markers around what the model must produce
after the generation prompt (its reply and its end-of-turn token). The markers give the ground truth through
transformers' own assistant-token mask; the template users have is the same text WITHOUT the markers, which
disttrain masks from one rendering. Both must give exactly the same target tokens, for every family, in a
compact and in a whitespace-varied form (`<WS>`: nothing, or a newline and indentation), on conversations
whose short answers also occur in their prompts ("yes or no" -> "yes", "A or B" -> "B", "42 or 7" -> "42"),
with system prompts, tool calls and tool results. The compact forms are also checked against the target
runs written out by hand. Each fixture's tokenizer registers the family's special tokens as the real model's
tokenizer does (and its added, non-special ones such as `<think>`).
"""

import copy

import pytest

from disttrain.recipe.schema import DataSection
from disttrain.data import IGNORE_INDEX, tokenize_record
from disttrain.data.templates import assistant_spans, turn_layout
from disttrain.errors import DataError
from tests_support import target_runs

SYSTEM = {"role": "system", "content": "Answer with one word."}
SHORT = [{"role": "user", "content": "Is the sky blue? Answer yes or no."},
         {"role": "assistant", "content": "yes"},
         {"role": "user", "content": "Pick A or B: A is red, B is blue. Which is blue?"},
         {"role": "assistant", "content": "B"}]
CALL = {"type": "function", "function": {"name": "multiply", "arguments": {"a": 6, "b": 7}}}
TOOLS = [{"role": "user", "content": "Say 42 or 7: what is 6 times 7? Use the calculator."},
         {"role": "assistant", "content": "", "tool_calls": [CALL]},
         {"role": "tool", "content": "42"},
         {"role": "assistant", "content": "42"}]
REASONING = [{"role": "user", "content": "Say 42 or 7: what is 6 times 7?"},
             {"role": "assistant", "content": "<think>\n6 times 7 is 42.\n</think>\n\n42"},
             {"role": "user", "content": "And 6 or 7: what is 42 over 7?"},
             {"role": "assistant", "content": "<think>\n42 over 7 is 6.\n</think>\n\n6"}]

CONVERSATIONS = {"short": SHORT, "system": [SYSTEM, *SHORT], "tools": [SYSTEM, *TOOLS], "reasoning": REASONING}

G, E = "{% generation %}", "{% endgeneration %}"

FAMILIES = {
    # Llama-2 chat: no assistant header at all, the system prompt inside the first [INST], trimmed contents
    "llama2": dict(bos="<s>", eos="</s>", template=(
        "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
        "{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
        "{% set system_message = false %}{% endif %}"
        "{% for message in loop_messages %}"
        "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
        "{% if loop.index0 == 0 and system_message != false %}"
        "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
        "{% else %}{% set content = message['content'] %}{% endif %}"
        "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
        "{% elif message['role'] == 'assistant' %}" + G + "<WS>{{ ' ' + content.strip() + ' ' + eos_token }}" + E +
        "<WS>{% endif %}{% endfor %}"),
     expected={"short": [" yes </s>", " B </s>"], "system": [" yes </s>", " B </s>"]}),
    # Mistral v0.1: [INST] ... [/INST]answer</s>, user and assistant roles only
    "mistral_v1": dict(bos="<s>", eos="</s>", template=(
        "{{ bos_token }}{% for message in messages %}"
        "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
        "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
        "{% elif message['role'] == 'assistant' %}" + G + "<WS>{{ message['content'] }}<WS>{{ eos_token }}" + E +
        "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}"),
     expected={"short": ["yes</s>", "B</s>"]}),
    # Mistral v0.3: the system prompt moves into the LAST user turn; tool calls and results as control tokens,
    # and no [/INST] before the reply to a tool result
    "mistral_v3": dict(bos="<s>", eos="</s>",
                       specials=("[INST]", "[/INST]", "[TOOL_CALLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]"),
                       template=(
        "{% if messages[0]['role'] == 'system' %}{% set system_message = messages[0]['content'] %}"
        "{% set loop_messages = messages[1:] %}{% else %}{% set loop_messages = messages %}{% endif %}"
        "{% set user_messages = loop_messages | selectattr('role', 'equalto', 'user') | list %}"
        "{{ bos_token }}{% for message in loop_messages %}"
        "{% if message['role'] == 'user' %}"
        "{% if message == user_messages[-1] and system_message is defined %}"
        "{{ '[INST] ' + system_message + '\\n\\n' + message['content'] + '[/INST]' }}"
        "{% else %}{{ '[INST] ' + message['content'] + '[/INST]' }}{% endif %}"
        "{% elif message['tool_calls'] %}" + G + "<WS>{{ '[TOOL_CALLS] [' }}"
        "{% for call in message['tool_calls'] %}{{ call['function'] | tojson }}{% endfor %}"
        "{{ ']' + eos_token }}" + E +
        "{% elif message['role'] == 'assistant' %}" + G + "<WS>{{ ' ' + message['content'] | trim }}<WS>"
        "{{ eos_token }}" + E + "<WS>"
        "{% elif message['role'] == 'tool' %}{{ '[TOOL_RESULTS] {\"content\": ' + message['content'] | string }}"
        "{{ '}[/TOOL_RESULTS]' }}{% endif %}{% endfor %}"),
     expected={"short": [" yes</s>", " B</s>"], "system": [" yes</s>", " B</s>"],
               "tools": ['[TOOL_CALLS] [{"name": "multiply", "arguments": {"a": 6, "b": 7}}]</s>', " 42</s>"]}),
    # ChatML as Qwen2.5 writes it: a default system prompt, <tool_call> JSON in the assistant turn (added
    # tokens, not special), tool results inside a user turn
    "qwen2.5": dict(eos="<|im_end|>", specials=("<|im_start|>", "<|im_end|>"),
                    added=("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"), template=(
        "{% if messages[0]['role'] == 'system' %}{{ '<|im_start|>system\\n' + messages[0]['content'] }}"
        "{% else %}{{ '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}"
        "{% endif %}{{ '<|im_end|>\\n' }}<WS>"
        "{% for message in messages %}"
        "{% if message['role'] == 'user' or (message['role'] == 'system' and not loop.first) %}"
        "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}<WS>"
        "{% elif message['role'] == 'assistant' %}{{ '<|im_start|>assistant\\n' }}" + G +
        "{{ message['content'] or '' }}{% for call in (message['tool_calls'] or []) %}"
        "{% if message['content'] or not loop.first %}{{ '\\n' }}{% endif %}"
        "{{ '<tool_call>\\n{\"name\": \"' + call['function']['name'] + '\", \"arguments\": ' }}"
        "{{ call['function']['arguments'] | tojson }}{{ '}\\n</tool_call>' }}{% endfor %}<WS>"
        "{{ '<|im_end|>' }}" + E + "{{ '\\n' }}<WS>"
        "{% elif message['role'] == 'tool' %}"
        "{% if loop.index0 == 0 or messages[loop.index0 - 1]['role'] != 'tool' %}{{ '<|im_start|>user' }}"
        "{% endif %}{{ '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
        "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{ '<|im_end|>\\n' }}{% endif %}<WS>"
        "{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"),
     expected={"short": ["yes<|im_end|>", "B<|im_end|>"], "system": ["yes<|im_end|>", "B<|im_end|>"],
               "tools": ['<tool_call>\n{"name": "multiply", "arguments": {"a": 6, "b": 7}}\n</tool_call><|im_end|>',
                         "42<|im_end|>"]}),
    # Qwen3: reasoning dropped from turns before the last user message, a <think> block in the later ones
    # (empty when the record has none); reasoning given inside the content as <think>...</think>
    "qwen3": dict(eos="<|im_end|>", specials=("<|im_start|>", "<|im_end|>"),
                  added=("<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"),
                  template=(
        "{% set ns = namespace(last_query=0) %}{% for m in messages %}{% if m['role'] == 'user' %}"
        "{% set ns.last_query = loop.index0 %}{% endif %}{% endfor %}"
        "{% for message in messages %}{% if message['role'] == 'assistant' %}"
        "{% set content = message['content'] or '' %}{% set reasoning = '' %}"
        "{% if '</think>' in content %}{% set reasoning = content.split('</think>')[0].split('<think>')[-1]"
        ".strip('\\n') %}{% set content = content.split('</think>')[-1].lstrip('\\n') %}{% endif %}"
        "{{ '<|im_start|>assistant\\n' }}<WS>" + G +
        "{% if loop.index0 > ns.last_query %}{{ '<think>\\n' + reasoning + '\\n</think>\\n\\n' }}{% endif %}"
        "{{ content }}{% for call in (message['tool_calls'] or []) %}"
        "{{ '<tool_call>\\n' + (call['function'] | tojson) + '\\n</tool_call>' }}{% endfor %}<WS>"
        "{{ '<|im_end|>' }}" + E + "{{ '\\n' }}"
        "{% elif message['role'] == 'tool' %}"
        "{{ '<|im_start|>user\\n<tool_response>\\n' + message['content'] + '\\n</tool_response><|im_end|>\\n' }}"
        "{% else %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}<WS>"
        "{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"),
     expected={"short": ["yes<|im_end|>", "<think>\n\n</think>\n\nB<|im_end|>"],
               "system": ["yes<|im_end|>", "<think>\n\n</think>\n\nB<|im_end|>"],
               "tools": ['<think>\n\n</think>\n\n<tool_call>\n{"name": "multiply", "arguments": {"a": 6, "b": 7}}'
                         '\n</tool_call><|im_end|>', "<think>\n\n</think>\n\n42<|im_end|>"],
               "reasoning": ["42<|im_end|>", "<think>\n42 over 7 is 6.\n</think>\n\n6<|im_end|>"]}),
    # Llama-3.1: BOS in the template, a default system block (dates: digits an answer may share), tool calls as
    # JSON, tool results as ipython turns written through tojson
    "llama3": dict(bos="<|begin_of_text|>", eos="<|eot_id|>",
                   specials=("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"), template=(
        "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set system_message = messages[0]['content'] %}"
        "{% set messages = messages[1:] %}{% else %}{% set system_message = '' %}{% endif %}"
        "{{ '<|start_header_id|>system<|end_header_id|>\\n\\nCutting Knowledge Date: December 2023\\n"
        "Today Date: 26 Jul 2024\\n\\n' + system_message + '<|eot_id|>' }}<WS>"
        "{% for message in messages %}"
        "{% if message['role'] == 'assistant' %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}<WS>"
        + G + "{% if message['tool_calls'] %}{% set call = message['tool_calls'][0]['function'] %}"
        "{{ '{\"name\": \"' + call['name'] + '\", \"parameters\": ' + (call['arguments'] | tojson) + '}' }}"
        "{% else %}{{ message['content'] | trim }}{% endif %}<WS>{{ '<|eot_id|>' }}" + E +
        "{% elif message['role'] == 'tool' %}{{ '<|start_header_id|>ipython<|end_header_id|>\\n\\n' }}"
        "{{ message['content'] | tojson }}{{ '<|eot_id|>' }}<WS>"
        "{% else %}{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}<WS>"
        "{{ message['content'] | trim }}{{ '<|eot_id|>' }}<WS>{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"),
     expected={"short": ["yes<|eot_id|>", "B<|eot_id|>"], "system": ["yes<|eot_id|>", "B<|eot_id|>"],
               "tools": ['{"name": "multiply", "parameters": {"a": 6, "b": 7}}<|eot_id|>', "42<|eot_id|>"]}),
    # Gemma 3: the `model` role, no system role (its text opens the first user turn), strict alternation
    "gemma": dict(bos="<bos>", eos="<eos>", specials=("<start_of_turn>", "<end_of_turn>"), template=(
        "{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
        "{% set first_user_prefix = messages[0]['content'] + '\\n\\n' %}{% set loop_messages = messages[1:] %}"
        "{% else %}{% set first_user_prefix = '' %}{% set loop_messages = messages %}{% endif %}"
        "{% for message in loop_messages %}"
        "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
        "{% if message['role'] == 'assistant' %}{{ '<start_of_turn>model\\n' }}<WS>" + G +
        "{{ message['content'] | trim }}<WS>{{ '<end_of_turn>' }}" + E + "{{ '\\n' }}"
        "{% else %}{{ '<start_of_turn>' + message['role'] + '\\n' + (first_user_prefix if loop.first else '') }}"
        "<WS>{{ message['content'] | trim }}{{ '<end_of_turn>\\n' }}<WS>{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"),
     expected={"short": ["yes<end_of_turn>", "B<end_of_turn>"], "system": ["yes<end_of_turn>", "B<end_of_turn>"]}),
    # Phi-3: <|role|> tokens, <|end|> closes every turn
    "phi3": dict(eos="<|endoftext|>", specials=("<|system|>", "<|user|>", "<|assistant|>", "<|end|>"), template=(
        "{% for message in messages %}"
        "{% if message['role'] == 'assistant' %}{{ '<|assistant|>\\n' }}<WS>" + G +
        "{{ message['content'] }}<WS>{{ '<|end|>' }}" + E + "{{ '\\n' }}"
        "{% else %}{{ '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}<WS>{% endif %}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% else %}{{ eos_token }}{% endif %}"),
     expected={"short": ["yes<|end|>", "B<|end|>"], "system": ["yes<|end|>", "B<|end|>"]}),
    # Zephyr: <|user|> and <|assistant|> are plain text for its tokenizer, </s> closes each turn
    "zephyr": dict(bos="<s>", eos="</s>", template=(
        "{% for message in messages %}"
        "{% if message['role'] == 'assistant' %}{{ '<|assistant|>\\n' }}<WS>" + G +
        "{{ message['content'] }}<WS>{{ eos_token }}" + E + "{{ '\\n' }}"
        "{% else %}{{ '<|' + message['role'] + '|>\\n' + message['content'] + eos_token + '\\n' }}<WS>{% endif %}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"),
     expected={"short": ["yes</s>", "B</s>"], "system": ["yes</s>", "B</s>"]}),
    # Vicuna v1.1: plain text roles on one line
    "vicuna": dict(bos="<s>", eos="</s>", template=(
        "{% for message in messages %}{% if message['role'] == 'system' %}{{ message['content'] + ' ' }}"
        "{% elif message['role'] == 'user' %}{{ 'USER: ' + message['content'] + ' ' }}<WS>"
        "{% elif message['role'] == 'assistant' %}{{ 'ASSISTANT:' }}" + G + "{{ ' ' + message['content'] }}<WS>"
        "{{ eos_token }}" + E + "{% endif %}{% endfor %}{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"),
     expected={"short": [" yes</s>", " B</s>"], "system": [" yes</s>", " B</s>"]}),
    # Alpaca-style as a chat template: markdown headers, no special token but the EOS
    "alpaca_style": dict(eos="</s>", template=(
        "{% for message in messages %}{% if message['role'] == 'system' %}{{ message['content'] + '\\n\\n' }}"
        "{% elif message['role'] == 'user' %}{{ '### Instruction:\\n' + message['content'] + '\\n\\n' }}<WS>"
        "{% elif message['role'] == 'assistant' %}{{ '### Response:\\n' }}<WS>" + G + "{{ message['content'] }}"
        "{{ eos_token }}" + E + "{{ '\\n\\n' }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '### Response:\\n' }}{% endif %}"),
     expected={"short": ["yes</s>", "B</s>"], "system": ["yes</s>", "B</s>"]}),
    # DeepSeek-R1: reasoning stripped from every turn, a <think> opener only in the generation prompt, tool
    # calls between special tokens, and no assistant header after tool outputs
    "deepseek_r1": dict(bos="<｜begin▁of▁sentence｜>", eos="<｜end▁of▁sentence｜>",
                        specials=("<｜User｜>", "<｜Assistant｜>", "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>",
                                  "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>",
                                  "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>",
                                  "<｜tool▁output▁end｜>"),
                        added=("<think>", "</think>"), template=(
        "{% set ns = namespace(system='', is_tool=false) %}{% for m in messages %}{% if m['role'] == 'system' %}"
        "{% set ns.system = m['content'] %}{% endif %}{% endfor %}{{ bos_token + ns.system }}<WS>"
        "{% for message in messages %}"
        "{% if message['role'] == 'user' %}{% set ns.is_tool = false %}{{ '<｜User｜>' + message['content'] }}<WS>"
        "{% elif message['role'] == 'assistant' and message['tool_calls'] %}{{ '<｜Assistant｜>' }}" + G +
        "{{ '<｜tool▁calls▁begin｜>' }}{% for call in message['tool_calls'] %}"
        "{{ '<｜tool▁call▁begin｜>function<｜tool▁sep｜>' + call['function']['name'] + '\\n```json\\n' }}"
        "{{ (call['function']['arguments'] | tojson) + '\\n```<｜tool▁call▁end｜>' }}{% endfor %}"
        "{{ '<｜tool▁calls▁end｜>' + eos_token }}" + E +
        "{% elif message['role'] == 'assistant' %}{% set content = message['content'] %}"
        "{% if '</think>' in content %}{% set content = content.split('</think>')[-1].lstrip() %}{% endif %}"
        "{% if ns.is_tool %}{{ '<｜tool▁outputs▁end｜>' }}{% set ns.is_tool = false %}"
        "{% else %}{{ '<｜Assistant｜>' }}{% endif %}" + G + "<WS>{{ content }}<WS>{{ eos_token }}" + E + "<WS>" +
        "{% elif message['role'] == 'tool' %}{% if not ns.is_tool %}{{ '<｜tool▁outputs▁begin｜>' }}{% endif %}"
        "{% set ns.is_tool = true %}{{ '<｜tool▁output▁begin｜>' + message['content'] + '<｜tool▁output▁end｜>' }}"
        "{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<｜Assistant｜><think>\\n' }}{% endif %}"),
     expected={"short": ["yes<｜end▁of▁sentence｜>", "B<｜end▁of▁sentence｜>"],
               "system": ["yes<｜end▁of▁sentence｜>", "B<｜end▁of▁sentence｜>"],
               "tools": ['<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>multiply\n```json\n'
                         '{"a": 6, "b": 7}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜>',
                         "42<｜end▁of▁sentence｜>"],
               "reasoning": ["42<｜end▁of▁sentence｜>", "6<｜end▁of▁sentence｜>"]}),
    # Granite 3: role markers as special tokens, a default system prompt, tool calls opened by the special
    # token <|tool_call|> (the old masking ended the turn there)
    "granite": dict(eos="<|end_of_text|>",
                    specials=("<|start_of_role|>", "<|end_of_role|>", "<|end_of_text|>", "<|tool_call|>"), template=(
        "{% if messages[0]['role'] == 'system' %}{% set system_message = messages[0]['content'] %}"
        "{% set loop_messages = messages[1:] %}{% else %}"
        "{% set system_message = 'Knowledge Cutoff Date: April 2024. You are Granite, developed by IBM.' %}"
        "{% set loop_messages = messages %}{% endif %}"
        "{{ '<|start_of_role|>system<|end_of_role|>' + system_message + '<|end_of_text|>\\n' }}<WS>"
        "{% for message in loop_messages %}"
        "{% if message['role'] == 'assistant' %}{{ '<|start_of_role|>assistant<|end_of_role|>' }}" + G + "<WS>" +
        "{% if message['tool_calls'] %}{{ '<|tool_call|>' + (message['tool_calls'] | map(attribute='function') "
        "| list | tojson) }}{% else %}{{ message['content'] }}{% endif %}<WS>{{ '<|end_of_text|>' }}" + E +
        "{{ '\\n' }}"
        "{% elif message['role'] == 'tool' %}"
        "{{ '<|start_of_role|>tool_response<|end_of_role|>' + message['content'] + '<|end_of_text|>\\n' }}<WS>"
        "{% else %}{{ '<|start_of_role|>' + message['role'] + '<|end_of_role|>' + message['content'] }}"
        "{{ '<|end_of_text|>\\n' }}<WS>{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|start_of_role|>assistant<|end_of_role|>' }}{% endif %}"),
     expected={"short": ["yes<|end_of_text|>", "B<|end_of_text|>"],
               "system": ["yes<|end_of_text|>", "B<|end_of_text|>"],
               "tools": ['<|tool_call|>[{"name": "multiply", "arguments": {"a": 6, "b": 7}}]<|end_of_text|>',
                         "42<|end_of_text|>"]}),
}

STYLES = {"compact": "", "indented": "\n    "}
CASES = [(family, conversation, style) for family, spec in FAMILIES.items() for conversation in spec["expected"]
         for style in STYLES]


def family_tokenizer(base, family: str, style: str, markers: bool):
    spec = FAMILIES[family]
    tok = copy.deepcopy(base)
    specials = [t for t in (spec.get("bos"), spec["eos"], *spec.get("specials", ())) if t]
    tok.add_special_tokens({"additional_special_tokens": specials})
    tok.add_tokens(list(spec.get("added", ())))
    tok.bos_token, tok.eos_token = spec.get("bos"), spec["eos"]
    template = spec["template"].replace("<WS>", STYLES[style])
    # without markers: the same blocks as plain ifs, so Jinja's whitespace handling renders the same text
    tok.chat_template = template if markers else template.replace(G, "{% if true %}").replace(E, "{% endif %}")
    return tok


def section():
    return DataSection(path="x.jsonl", format="chat", max_seq_len=1024)


@pytest.mark.parametrize("family, conversation, style", CASES)
def test_targets_equal_the_templates_own_generation_mask(family, conversation, style, tokenizer):
    messages = CONVERSATIONS[conversation]
    plain = family_tokenizer(tokenizer, family, style, markers=False)
    ours = tokenize_record({"messages": messages}, plain, section())
    # ground truth: transformers' assistant mask of the same template with its {% generation %} markers
    marked = family_tokenizer(tokenizer, family, style, markers=True)
    truth = marked.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    assert ours["input_ids"] == list(truth["input_ids"])  # one rendering, as the template writes it
    truth_labels = [t if m else IGNORE_INDEX for t, m in zip(truth["input_ids"], truth["assistant_masks"])]
    assert target_runs(plain, ours["input_ids"], ours["labels"]) == target_runs(plain, truth["input_ids"],
                                                                                truth_labels)
    assert ours["labels"] == truth_labels
    if style == "compact":
        assert target_runs(plain, ours["input_ids"], ours["labels"]) == FAMILIES[family]["expected"][conversation]


@pytest.mark.parametrize("family", ["llama2", "mistral_v3", "zephyr", "vicuna", "alpaca_style", "deepseek_r1"])
def test_a_short_answer_that_occurs_in_the_question_is_never_learned_there(family, tokenizer):
    """The defect found from outside: header-less and R1-style templates started the span at the first
    occurrence of the answer after the previous turn, inside the user's message."""
    tok = family_tokenizer(tokenizer, family, "compact", markers=False)
    messages = [{"role": "user", "content": "A or B: A is red, B is blue. Which is red?"},
                {"role": "assistant", "content": "A"}]
    text = tok.apply_chat_template(messages, tokenize=False)
    (start, end), = assistant_spans(text, messages, tok)
    assert text.index("Which is red?") + len("Which is red?") < start
    assert "".join(text[start:end].split()) == "A" + tok.eos_token


# one-letter turns, each a letter of the families' markup (`<|im_start|>`, `<|im_end|>`, `<|eot_id|>`, `[INST]`,
# `<end_of_turn>`, `</s>`): found inside a special token's text, they once moved the span there
LETTERS = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "d"},
           {"role": "user", "content": "t"}, {"role": "assistant", "content": "e"}]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_one_letter_turns_that_occur_inside_the_markup_mask_exactly(family, tokenizer):
    """The defect found with KTO's data: a user's "a" was found in `<|im_start|>` and a reply "d" in
    `<|im_end|>`, so the whole prompt after it was learned. Every family now equals its template's own mask or
    refuses in one line (the conversation has no system turn and plain one-letter contents)."""
    plain = family_tokenizer(tokenizer, family, "compact", markers=False)
    marked = family_tokenizer(tokenizer, family, "compact", markers=True)
    try:
        ours = tokenize_record({"messages": LETTERS}, plain, section())
    except DataError as err:
        assert "\n" not in str(err)
        return
    truth = marked.apply_chat_template(LETTERS, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    truth_labels = [t if m else IGNORE_INDEX for t, m in zip(truth["input_ids"], truth["assistant_masks"])]
    assert target_runs(plain, ours["input_ids"], ours["labels"]) == target_runs(plain, truth["input_ids"],
                                                                                truth_labels)
    assert ours["labels"] == truth_labels


def test_layouts_learned_from_the_templates(tokenizer):
    layouts = {f: turn_layout(family_tokenizer(tokenizer, f, "compact", markers=False)) for f in FAMILIES}
    assert layouts["llama2"].header == ("[/INST]",) and layouts["llama2"].end == "</s>"  # header-less
    assert layouts["deepseek_r1"].header == ("<｜Assistant｜>",) and layouts["deepseek_r1"].openers == ("<think>",)
    assert layouts["granite"].end == "<|end_of_text|>"  # not <|tool_call|>
    assert layouts["qwen3"].header == ("<|im_start|>", "assistant") and layouts["qwen3"].end == "<|im_end|>"
    assert layouts["zephyr"].header == ("<|assistant|>",) and layouts["zephyr"].closing == ""
    strict = family_tokenizer(tokenizer, "zephyr", "compact", markers=False)  # refuses a conversation without
    strict.chat_template = ("{% if messages[0]['role'] != 'system' %}{{ raise_exception('A system message is '"
                            "'required') }}{% endif %}" + strict.chat_template)  # a system turn: probed with one
    assert turn_layout(strict) == layouts["zephyr"]


def test_template_refusals_and_wrong_content_types_are_one_line_naming_the_record(tokenizer, tmp_path):
    from disttrain.data import build_datasets

    tok = family_tokenizer(tokenizer, "mistral_v1", "compact", markers=False)
    data = tmp_path / "chat.jsonl"
    good = '{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}\n'
    data.write_text(good + '{"messages": [{"role": "user", "content": "Hi"}, {"role": "user", "content": "Hi"},'
                    ' {"role": "assistant", "content": "Hello"}]}\n')
    sec = DataSection(path=str(data), format="chat", max_seq_len=64)
    with pytest.raises(DataError) as err:
        build_datasets(sec, tok, 0, _nothing)
    assert str(err.value) == (f"{data}:2: the chat template refused this conversation: Conversation roles must "
                              "alternate user/assistant/user/assistant/...")
    data.write_text(good + '{"messages": [{"role": "user", "content": "6 times 7?"},'
                    ' {"role": "assistant", "content": 42}]}\n')
    with pytest.raises(DataError) as err:
        build_datasets(sec, tok, 0, _nothing)
    assert str(err.value).startswith(f"{data}:2: message 1 (assistant): 'content' must be a string")
    assert "got int 42" in str(err.value) and "\n" not in str(err.value)


def test_a_turn_the_rendering_does_not_contain_is_refused(tokenizer):
    tok = family_tokenizer(tokenizer, "zephyr", "compact", markers=False)
    tok.chat_template = tok.chat_template.replace("message['content'] + eos_token", "'(redacted)' + eos_token")
    with pytest.raises(DataError, match=r"user message before it is not found verbatim.*\{% generation %\}"):
        tokenize_record({"messages": SHORT}, tok, section())


def _nothing():
    from contextlib import nullcontext

    return nullcontext()
