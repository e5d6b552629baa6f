"""The embedded default: a tiny Llama-shaped model, its tokenizer and a small synthetic dataset, all made
locally (the Hub is never contacted), so `make train` and the tests run anywhere in minutes.

    python -m disttrain.tools.tiny model --out artifacts/tiny-llama   # tokenizer + random-init model
    python -m disttrain.tools.tiny student --out artifacts/tiny-student  # a smaller one, the same tokenizer
    python -m disttrain.tools.tiny vlm   --out artifacts/tiny-gemma3-vl [--family llava]   # + processor
    python -m disttrain.tools.tiny data  --out data                   # regenerates the shipped JSONL files
                                                                      # and data/tiny_vlm/'s images

The tasks (reverse, sort, count, copy words) are learnable by a 2-layer model, so the loss visibly falls. The
vision-language tasks ask for the colour or the shape of one drawn shape (or whether two have the same colour).
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

# How transformers parses a turn of that template (tokenizer.response_template, saved in tokenizer_config.json):
# the <tool_call> JSON objects, the text before them; what online RL's tool-calling rollouts read (docs/rl.md).
RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "tool_calls": {"open": "<tool_call>", "close_pattern": r"</tool_call>\s*", "repeats": True, "content": "json",
                       "transform": {"type": "function", "function": "{content}"}},
        "content": {"close_pattern": r"<\|im_end\|>\s*", "content": "text"},
    },
}


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


def code_of(word: str) -> str:
    """The tool task's secret: each word's code, another word (a fixed permutation only the lookup tool knows)."""
    return WORDS[(WORDS.index(word) * 7 + 3) % len(WORDS)]


def _lookup_schema() -> dict:
    """The JSON schema of recipes/tiny/tools.py:lookup, as transformers makes it for the chat template."""
    from transformers.utils import get_json_schema

    from disttrain.objectives.rewards import load_function

    return get_json_schema(load_function(str(Path(__file__).resolve().parents[2] / "recipes/tiny/tools.py")
                                         + ":lookup", "the tiny tool task"))


def tool_records(n: int, seed: int, prompts: bool, call_share: float = 0.6) -> list[dict]:
    """The tool task (recipes/tiny/tool_sft.yaml, tool_grpo.yaml): "What is the code of <word>?", answerable only
    through the lookup tool. prompts=False: chat transcripts for the SFT warm start, `call_share` of them calling
    the tool and answering with its reply, the others guessing a word (so GRPO has a tool-call rate to raise);
    prompts=True: online RL's prompts with the answer in a column of its own."""
    rng, schema = random.Random(seed), _lookup_schema()
    out = []
    for _ in range(n):
        word = rng.choice(WORDS)
        user = {"role": "user", "content": f"What is the code of {word}?"}
        if prompts:
            out.append({"prompt": [user], "answer": code_of(word)})
        elif rng.random() < call_share:
            call = {"type": "function", "function": {"name": "lookup", "arguments": {"word": word}}}
            out.append({"messages": [user, {"role": "assistant", "content": "", "tool_calls": [call]},
                                     {"role": "tool", "name": "lookup", "content": code_of(word)},
                                     {"role": "assistant", "content": code_of(word)}], "tools": [schema]})
        else:
            out.append({"messages": [user, {"role": "assistant", "content": rng.choice(WORDS)}], "tools": [schema]})
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
        "tiny_tool_sft.jsonl": tool_records(1200, seed=12, prompts=False),  # recipes/tiny/tool_sft.yaml
        "tiny_tool_prompts.jsonl": tool_records(400, seed=13, prompts=True),  # recipes/tiny/tool_grpo.yaml
    }
    images = write_images(out)  # recipes/tiny/vlm_sft.yaml: paths relative to the data file
    files["tiny_vlm.jsonl"] = vlm_records(480, seed=9, paths=images)
    files["tiny_vlm_eval.jsonl"] = vlm_records(48, seed=10, paths=images)
    files["tiny_llava.jsonl"] = vlm_records(160, seed=11, paths=images, layout="llava")
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


def build_tokenizer(corpus: list[str] | None = None, special_tokens: list[str] = SPECIAL_TOKENS,
                    template: str = CHAT_TEMPLATE, **tokens):
    """A byte-level BPE trained on the task text: small vocab, deterministic, with a ChatML template (`tokens`:
    eos_token, pad_token, bos_token and the named extra tokens a processor reads, e.g. image_token)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=special_tokens, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus or _corpus(), trainer=trainer)
    settings = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None, "unk_token": None}
    settings.update(tokens)
    named = {k: v for k, v in settings.items() if k not in ("eos_token", "pad_token", "bos_token", "unk_token")}
    base = {k: v for k, v in settings.items() if k not in named}
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, **base, **({"extra_special_tokens": named} if named else {}))
    fast.chat_template = template
    if template == CHAT_TEMPLATE:
        fast.response_template = RESPONSE_TEMPLATE
    return fast


# ------------------------------------------------------------------------------------------- vision-language
COLOURS = {"red": (220, 30, 30), "green": (30, 170, 60), "blue": (40, 60, 220), "yellow": (230, 210, 30)}
SHAPES = ("circle", "square", "triangle")
IMAGE_SIDE = 32


def draw_shape(shape: str, colour: str, side: int = IMAGE_SIDE):
    """One shape in one colour on white (PIL, no randomness: the same bytes on every machine)."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (side, side), (255, 255, 255))
    draw, m = ImageDraw.Draw(image), side // 6
    box = (m, m, side - m, side - m)
    if shape == "circle":
        draw.ellipse(box, fill=COLOURS[colour])
    elif shape == "square":
        draw.rectangle(box, fill=COLOURS[colour])
    else:
        draw.polygon([(side // 2, m), (side - m, side - m), (m, side - m)], fill=COLOURS[colour])
    return image


def write_images(out_dir: str | Path) -> dict[tuple[str, str], str]:
    """Every (shape, colour) as a PNG in out_dir/tiny_vlm/; -> its path relative to out_dir."""
    folder = Path(out_dir) / "tiny_vlm"
    folder.mkdir(parents=True, exist_ok=True)
    paths = {}
    for shape in SHAPES:
        for colour in COLOURS:
            name = f"tiny_vlm/{colour}_{shape}.png"
            draw_shape(shape, colour).save(Path(out_dir) / name, format="PNG")
            paths[shape, colour] = name
    return paths


def vlm_records(n: int, seed: int, paths: dict[tuple[str, str], str], layout: str = "chat") -> list[dict]:
    """Questions about drawn shapes, answers a 2-layer model learns: the colour, the shape (the answer among the
    question's words in half of them: "Is it red or blue?"), and, one conversation in eight, two images and
    whether their colours match. layout chat: transformers' message parts ({"type": "image", "image": path});
    llava: an `image` column and `<image>` in the human turn (LLaVA's layout)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        shape, colour = rng.choice(SHAPES), rng.choice(list(COLOURS))
        images = [paths[shape, colour]]
        if i % 8 == 7:
            other = rng.choice(list(COLOURS))
            images.append(paths[rng.choice(SHAPES), other])
            question, answer = "Do the two shapes have the same colour?", "yes" if other == colour else "no"
        elif rng.random() < 0.5:
            wrong = rng.choice([c for c in COLOURS if c != colour])
            pair = [colour, wrong] if rng.random() < 0.5 else [wrong, colour]
            question, answer = f"Is the shape {pair[0]} or {pair[1]}?", colour
        else:
            question, answer = rng.choice([("What colour is the shape?", colour), ("What shape is this?", shape)])
        if layout == "llava":
            marks = "<image>\n" * len(images)
            out.append({"image": images if len(images) > 1 else images[0],
                        "conversations": [{"from": "human", "value": marks + question},
                                          {"from": "gpt", "value": answer}]})
            continue
        # every content a list of parts (a file that mixes strings and lists has no one Arrow type)
        parts = [{"type": "image", "image": path} for path in images] + [{"type": "text", "text": question}]
        messages = [{"role": "user", "content": parts}, {"role": "assistant", "content": _text_part(answer)}]
        if i % 4 == 0:
            messages.insert(0, {"role": "system", "content": _text_part("Answer with one word.")})
        out.append({"messages": messages})
    return out


def _text_part(text: str) -> list[dict]:
    return [{"type": "text", "text": text}]


def _vlm_corpus() -> list[str]:
    words = " ".join([*COLOURS, *SHAPES, "What colour is the shape? What shape is this? Is the shape or",
                      "Do the two shapes have the same colour? yes no Answer with one word. user model assistant"])
    return _corpus() + [words] * 20


# Gemma 3's chat template as published (system text prefixed to the first user turn, `model` as the assistant's
# role, images as <start_of_image>, turns closed by <end_of_turn>), and LLaVA-style `USER: ... ASSISTANT: ...`
GEMMA3_TEMPLATE = (
    "{{ bos_token }}{%- if messages[0]['role'] == 'system' -%}{%- if messages[0]['content'] is string -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}{%- else -%}"
    "{%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}{%- endif -%}"
    "{%- set loop_messages = messages[1:] -%}{%- else -%}{%- set first_user_prefix = '' -%}"
    "{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{%- endif -%}"
    "{%- if (message['role'] == 'assistant') -%}{%- set role = 'model' -%}{%- else -%}"
    "{%- set role = message['role'] -%}{%- endif -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{%- if message['content'] is string -%}{{ message['content'] | trim }}"
    "{%- elif message['content'] is iterable -%}{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'image' -%}{{ '<start_of_image>' }}{%- elif item['type'] == 'text' -%}"
    "{{ item['text'] | trim }}{%- endif -%}{%- endfor -%}{%- else -%}"
    "{{ raise_exception('Invalid content type') }}{%- endif -%}{{ '<end_of_turn>\n' }}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}")
LLAVA_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] != 'system' %}{{ message['role'].upper() + ': ' }}{% endif %}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for item in message['content'] %}{% if item['type'] == 'image' %}{{ '<image>\\n' }}"
    "{% elif item['type'] == 'text' %}{{ item['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{% if message['role'] == 'assistant' %}{{ '</s>' }}{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}")
VLM_FAMILIES = ("gemma3", "llava")


def build_vlm_dir(out_dir: str | Path, family: str = "gemma3", seed: int = 0) -> Path:
    """A tiny vision-language model with the structure of a real family -- Gemma 3 (SigLIP tower, pooled
    projector, Gemma 3 text model with sliding layers; 4 image tokens) or LLaVA (CLIP tower, MLP projector,
    Llama; 16 image tokens) -- its tokenizer, chat template and processor (PIL image processors: no
    torchvision), random-init, written to out_dir; AutoModelForImageTextToText and AutoProcessor load it."""
    import torch
    from transformers import AutoModelForImageTextToText

    out = Path(out_dir)
    torch.manual_seed(seed)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=28,
                  patch_size=7)
    text = dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=1024)
    if family == "gemma3":
        from transformers import Gemma3Config, Gemma3Processor
        from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

        tokenizer = build_tokenizer(_vlm_corpus(), ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>",
                                                    "<start_of_image>", "<end_of_image>", "<image_soft_token>"],
                                    GEMMA3_TEMPLATE, eos_token="<eos>", pad_token="<pad>", bos_token="<bos>",
                                    boi_token="<start_of_image>", eoi_token="<end_of_image>",
                                    image_token="<image_soft_token>")
        processor = Gemma3Processor(Gemma3ImageProcessorPil(size={"height": 28, "width": 28}), tokenizer,
                                    chat_template=GEMMA3_TEMPLATE, image_seq_length=4)
        ids = tokenizer.convert_tokens_to_ids
        config = Gemma3Config(text_config=dict(vocab_size=len(tokenizer), head_dim=16, sliding_window=64,
                                               pad_token_id=tokenizer.pad_token_id, **text),
                              vision_config=vision, mm_tokens_per_image=4,
                              image_token_index=ids("<image_soft_token>"), boi_token_index=ids("<start_of_image>"),
                              eoi_token_index=ids("<end_of_image>"),
                              eos_token_id=[tokenizer.eos_token_id, ids("<end_of_turn>")],
                              pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id)
    elif family == "llava":
        from transformers import LlavaConfig, LlavaProcessor
        from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

        tokenizer = build_tokenizer(_vlm_corpus(), ["<unk>", "<s>", "</s>", "<image>", "<pad>"], LLAVA_TEMPLATE,
                                    eos_token="</s>", pad_token="<pad>", image_token="<image>")
        processor = LlavaProcessor(CLIPImageProcessorPil(size={"shortest_edge": 28},
                                                         crop_size={"height": 28, "width": 28}), tokenizer,
                                   patch_size=7, vision_feature_select_strategy="default", chat_template=LLAVA_TEMPLATE,
                                   num_additional_image_tokens=1)
        config = LlavaConfig(text_config=dict(model_type="llama", vocab_size=len(tokenizer), **text),
                             vision_config=dict(model_type="clip_vision_model", projection_dim=32, **vision),
                             image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
                             vision_feature_select_strategy="default", vision_feature_layer=-1,
                             eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    else:
        raise ValueError(f"unknown family {family!r}: one of {', '.join(VLM_FAMILIES)}")
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    processor.save_pretrained(out)
    return out


def tiny_llama_config(vocab_size: int, **overrides):
    from transformers import LlamaConfig

    settings = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                    tie_word_embeddings=False, rms_norm_eps=1e-6)
    settings.update(overrides)
    return LlamaConfig(**settings)


# distillation's student (recipes/tiny/distill.yaml): half the width, one layer, the tiny model's tokenizer
STUDENT_SHAPE = dict(hidden_size=32, intermediate_size=88, num_hidden_layers=1, num_attention_heads=2,
                     num_key_value_heads=1)


def build_model_dir(out_dir: str | Path, seed: int = 0, **shape) -> Path:
    """Write tokenizer + randomly initialised tiny Llama to out_dir (idempotent: same seed, same bytes); `shape`:
    config fields other than tiny_llama_config's (the student: STUDENT_SHAPE)."""
    import torch
    from transformers import AutoModelForCausalLM

    out = Path(out_dir)
    tokenizer = build_tokenizer()
    config = tiny_llama_config(len(tokenizer), eos_token_id=tokenizer.eos_token_id,
                               pad_token_id=tokenizer.pad_token_id, bos_token_id=None, **shape)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["model", "student", "vlm", "data"])
    parser.add_argument("--out", help="output directory (default: artifacts/tiny-llama, artifacts/tiny-student, "
                        "artifacts/tiny-<family>-vl or data)")
    parser.add_argument("--family", choices=VLM_FAMILIES, default="gemma3", help="vlm: the family's structure")
    args = parser.parse_args(argv)
    if args.what == "model":
        path = build_model_dir(args.out or "artifacts/tiny-llama")
        print(f"tiny model + tokenizer written to {path}")
    elif args.what == "student":
        path = build_model_dir(args.out or "artifacts/tiny-student", seed=1, **STUDENT_SHAPE)
        print(f"tiny student (distillation) + tokenizer written to {path}")
    elif args.what == "vlm":
        path = build_vlm_dir(args.out or f"artifacts/tiny-{args.family}-vl", args.family)
        print(f"tiny vision-language model + processor written to {path}")
    else:
        for path in write_data(args.out or "data"):
            print(f"wrote {path}")


if __name__ == "__main__":
    main()
