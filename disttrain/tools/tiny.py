"""The embedded default: a tiny Llama-shaped model, its tokenizer and a small synthetic dataset, all made
locally (the Hub is never contacted), so `make train` and the tests run anywhere in minutes.

    python -m disttrain.tools.tiny model --out artifacts/tiny-llama   # tokenizer + random-init model
    python -m disttrain.tools.tiny data  --out data                   # regenerates the shipped JSONL files

The tasks (reverse, sort, count, copy words) are learnable by a 2-layer model, so the loss visibly falls.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

WORDS = (
    "apple river stone cloud green quick light north table music orange silver winter garden yellow "
    "planet window forest purple bridge candle dragon rocket pencil tiger violet ocean mountain paper"
).split()

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# ChatML, the format Qwen uses, with Qwen-style tool calls; a real template so the chat path is exercised end
# to end (tools are listed in a system turn, calls are <tool_call> JSON inside the assistant turn).
CHAT_TEMPLATE = (
    "{% if tools %}{{ '<|im_start|>system\nTools: ' + (tools | tojson) + '<|im_end|>\n' }}{% endif %}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + (message['content'] or '') }}"
    "{% for call in (message['tool_calls'] or []) if message['tool_calls'] is defined %}"
    "{{ '<tool_call>' + (call['function'] | tojson) + '</tool_call>' }}"
    "{% endfor %}"
    "{{ '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _task(rng: random.Random) -> tuple[str, str, str]:
    words = rng.sample(WORDS, rng.randint(2, 6))
    kind = rng.choice(["reverse", "sort", "count", "copy"])
    text = " ".join(words)
    if kind == "reverse":
        return "Reverse the order of the words.", text, " ".join(reversed(words))
    if kind == "sort":
        return "Sort the words alphabetically.", text, " ".join(sorted(words))
    if kind == "count":
        return "How many words are there?", text, str(len(words))
    return "Repeat the words.", "", text


def alpaca_records(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [dict(zip(("instruction", "input", "output"), _task(rng))) for _ in range(n)]


def chat_records(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        messages = [{"role": "system", "content": "You are a careful assistant."}]
        for _turn in range(rng.randint(1, 2)):
            instruction, inp, answer = _task(rng)
            messages.append({"role": "user", "content": f"{instruction} {inp}".strip()})
            messages.append({"role": "assistant", "content": answer})
        out.append({"messages": messages})
    return out


COUNT_TOOL = {"type": "function", "function": {"name": "count_words", "description": "Count the words of a text.",
                                               "parameters": {"type": "object",
                                                              "properties": {"text": {"type": "string"}}}}}


def sharegpt_records(n: int, seed: int) -> list[dict]:
    """ShareGPT turns; every fourth conversation answers a counting task through a tool call."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        instruction, inp, answer = _task(rng)
        turns = [{"from": "human", "value": f"{instruction} {inp}".strip()}]
        if i % 4 == 0:
            words = inp or answer
            turns = [{"from": "human", "value": f"How many words are there? {words}"},
                     {"from": "function_call",
                      "value": json.dumps({"name": "count_words", "arguments": {"text": words}})},
                     {"from": "observation", "value": str(len(words.split()))},
                     {"from": "gpt", "value": str(len(words.split()))}]
            out.append({"conversations": turns, "tools": json.dumps([COUNT_TOOL])})
            continue
        turns.append({"from": "gpt", "value": answer})
        out.append({"conversations": turns, "system": "You are a careful assistant."})
    return out


def preference_records(n: int, seed: int, messages: bool) -> list[dict]:
    """{prompt, chosen, rejected}: the answer against a shouted one (upper case and "!", a style a 2-layer model
    learns to avoid in a few dozen steps), or against words the prompt does not hold / a wrong count (only
    learnable with the task itself), as strings or as message lists (one file holds one layout: Arrow columns
    have one type)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        instruction, inp, answer = _task(rng)
        prompt = f"{instruction} {inp}".strip()
        if rng.random() < 0.9:
            wrong = answer.upper() + "!"
        elif answer.isdigit():
            wrong = str(int(answer) + rng.randint(1, 3))
        else:
            unused = [w for w in WORDS if w not in (inp or answer).split()]
            wrong = " ".join(rng.sample(unused, len(answer.split())))
        if messages:
            out.append({"prompt": [{"role": "user", "content": prompt}],
                        "chosen": [{"role": "assistant", "content": answer}],
                        "rejected": [{"role": "assistant", "content": wrong}]})
        else:
            out.append({"prompt": prompt, "chosen": answer, "rejected": wrong})
    return out


def choice_records(n: int, seed: int) -> list[dict]:
    """The evaluation task's rows (eval_tasks/disttrain_tiny): the alpaca tasks' user turn as the training data
    renders it (instruction, a blank line, the input), the right answer and three wrong ones (other orders of
    the same words, other counts) as multiple choice, and the answer alone for generation."""
    rng = random.Random(seed)
    out = []
    while len(out) < n:
        instruction, text, answer = _task(rng)
        words = (text or answer).split()
        if instruction.startswith("How many"):
            wrong = [str(k) for k in range(1, 8) if str(k) != answer]
        else:
            wrong = list({" ".join(rng.sample(words, len(words))) for _ in range(20)} - {answer})
        if len(wrong) < 3:
            continue  # two words have only one other order
        choices = [answer, *sorted(rng.sample(sorted(wrong), 3))]
        rng.shuffle(choices)
        out.append({"prompt": instruction + (f"\n\n{text}" if text else ""), "choices": choices,
                    "label": choices.index(answer), "answer": answer})
    return out


def prompt_records(n: int, seed: int) -> list[dict]:
    """Online RL's prompts (data.format: prompt): the tasks' user turn as messages, the answer in a column of its
    own that the reward functions read (recipes/tiny/rewards.py)."""
    rng = random.Random(seed)
    out = []
    while len(out) < n:
        instruction, text, answer = _task(rng)
        if text:  # "Repeat the words." holds its words in the answer only: nothing a policy could find
            out.append({"prompt": [{"role": "user", "content": f"{instruction} {text}"}], "answer": answer})
    return out


def text_records(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"text": " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 40)))} for _ in range(n)]


def write_data(out_dir: str | Path) -> list[Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = {
        "tiny_alpaca.jsonl": alpaca_records(2000, seed=0),
        "tiny_alpaca_eval.jsonl": alpaca_records(100, seed=1),
        "tiny_chat.jsonl": chat_records(500, seed=2),
        "tiny_text.jsonl": text_records(500, seed=3),
        "tiny_sharegpt.jsonl": sharegpt_records(300, seed=4),
        "tiny_dpo.jsonl": preference_records(800, seed=5, messages=True),
        "tiny_dpo_eval.jsonl": preference_records(64, seed=6, messages=False),
        "tiny_tasks_eval.jsonl": choice_records(100, seed=7),  # eval_tasks/disttrain_tiny (make eval)
        "tiny_prompts.jsonl": prompt_records(400, seed=8),  # recipes/tiny/grpo.yaml
    }
    written = []
    for name, records in files.items():
        path = out / name
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
        written.append(path)
    return written


def _corpus() -> list[str]:
    lines = []
    for rec in alpaca_records(500, seed=0):
        lines.append(" ".join(rec.values()))
    lines += ["user assistant system You are a careful assistant."] * 5
    return lines


def build_tokenizer():
    """A byte-level BPE trained on the task text: small vocab, deterministic, with a ChatML template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   bos_token=None, unk_token=None)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_llama_config(vocab_size: int, **overrides):
    from transformers import LlamaConfig

    settings = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                    tie_word_embeddings=False, rms_norm_eps=1e-6)
    settings.update(overrides)
    return LlamaConfig(**settings)


def build_model_dir(out_dir: str | Path, seed: int = 0) -> Path:
    """Write tokenizer + randomly initialised tiny Llama to out_dir (idempotent: same seed, same bytes)."""
    import torch
    from transformers import AutoModelForCausalLM

    out = Path(out_dir)
    tokenizer = build_tokenizer()
    config = tiny_llama_config(len(tokenizer), eos_token_id=tokenizer.eos_token_id,
                               pad_token_id=tokenizer.pad_token_id, bos_token_id=None)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["model", "data"])
    parser.add_argument("--out", help="output directory (default: artifacts/tiny-llama or data)")
    args = parser.parse_args(argv)
    if args.what == "model":
        path = build_model_dir(args.out or "artifacts/tiny-llama")
        print(f"tiny model + tokenizer written to {path}")
    else:
        for path in write_data(args.out or "data"):
            print(f"wrote {path}")


if __name__ == "__main__":
    main()
