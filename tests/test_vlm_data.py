"""Vision-language data: what is learned (exactly the replies and their end tokens, never an image token or a
prompt) on two tiny families' published chat templates and three more families' layouts (Qwen2-VL's ChatML, Llama
3.2 Vision's headers, Mistral's header-less [INST]), each also without whitespace control, with adversarial
conversations; the processor's own tokens; LLaVA's layout; batches; parts; every bad image in one
line."""

from __future__ import annotations

import json

import pytest
import torch

from disttrain.data import IGNORE_INDEX
from disttrain.data.pipeline import tokenize_record
from disttrain.data.vision import VisionCollator, image_ref, vision_of
from disttrain.data.collation import Collator
from disttrain.errors import DataError
from disttrain.recipe.schema import DataSection
from disttrain.tools.tiny import draw_shape

END = {"gemma3": "<end_of_turn>", "llava": "</s>"}


def loose(template: str) -> str:
    """The template without whitespace control, each tag on a line of its own, indented: its rendering gains
    blank lines and indentation around every turn (how many community templates are written)."""
    return template.replace("{%-", "{%").replace("-%}", "%}").replace("%}{%", "%}\n    {%").replace("}}{%", "}}\n  {%")


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    folder = tmp_path_factory.mktemp("images")
    paths = {}
    for shape, colour in (("circle", "red"), ("square", "blue"), ("triangle", "green")):
        path = folder / f"{colour}_{shape}.png"
        draw_shape(shape, colour).save(path)
        paths[colour] = str(path)
    return paths


def tokenizer_of(model_dir, template: str | None = None, **limits):
    from disttrain.model.loading import load_tokenizer
    from disttrain.recipe.schema import ModelSection

    tokenizer = load_tokenizer(ModelSection(name_or_path=str(model_dir)),
                               DataSection(path="x.jsonl", format="chat", **limits))
    if template is not None:
        tokenizer.chat_template = template
        vision_of(tokenizer).processor.chat_template = template
    return tokenizer


def adversarial(images) -> list[tuple[dict, list[str]]]:
    """(record, the replies it teaches): answers that occur in the question, a system prompt, two images, a
    second user turn with its own image, text parts around an image."""
    def text(t):
        return {"type": "text", "text": t}
    return [
        ({"messages": [{"role": "user", "content": [{"type": "image", "image": images["red"]},
                                                     text("Is the shape red or blue?")]},
                       {"role": "assistant", "content": [text("red")]}]}, ["red"]),
        ({"messages": [{"role": "system", "content": [text("Answer red or blue.")]},
                       {"role": "user", "content": [text("First"), {"type": "image", "image": images["blue"]},
                                                    text("then"), {"type": "image", "image": images["red"]},
                                                    text("Same colour? yes or no")]},
                       {"role": "assistant", "content": [text("no")]},
                       {"role": "user", "content": [{"type": "image", "image": images["green"]},
                                                    text("And this one: green?")]},
                       {"role": "assistant", "content": [text("green")]}]}, ["no", "green"]),
    ]


def learned_runs(ids: list[int], labels: list[int], tokenizer) -> list[str]:
    runs, current = [], []
    for t, label in zip(ids, labels):
        if label != IGNORE_INDEX:
            assert label == t
            current.append(t)
        elif current:
            runs.append(tokenizer.decode(current))
            current = []
    return runs + ([tokenizer.decode(current)] if current else [])


# The layouts of other published vision-language templates, each around the tiny LLaVA processor's `<image>`
# placeholder (their own image tokens differ; where the template writes them is what the masking must survive):
# Qwen2-VL's ChatML (a default system turn inserted, the image between vision markers, plain newlines), Llama 3.2
# Vision's headers, and Mistral/Pixtral's header-less [INST] turns with a system-prompt block.
QWEN2_VL = (
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}<|im_start|>system\n"
    "You are a helpful assistant.<|im_end|>\n{% endif %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n{% else %}"
    "{% for content in message['content'] %}{% if content['type'] == 'image' or 'image' in content %}"
    "<|vision_start|><image><|vision_end|>{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}"
    "<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
LLAMA32_VISION = (
    "{{- bos_token }}{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] | trim }}{%- else %}"
    "{%- for content in message['content'] %}{%- if content['type'] == 'image' %}{{- '<image>' }}"
    "{%- elif content['type'] == 'text' %}{{- content['text'] | trim }}{%- endif %}{%- endfor %}{%- endif %}"
    "{{- '<|eot_id|>' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif %}")
MISTRAL_INST = (
    "{{- bos_token }}{%- for message in messages %}{%- if message['role'] == 'system' %}"
    "{{- '[SYSTEM_PROMPT]' + (message['content'] if message['content'] is string else "
    "message['content'][0]['text']) + '[/SYSTEM_PROMPT]' }}"
    "{%- elif message['role'] == 'user' %}{{- '[INST]' }}{%- if message['content'] is string %}"
    "{{- message['content'] }}{%- else %}{%- for block in message['content'] %}{%- if block['type'] == 'text' %}"
    "{{- block['text'] }}{%- elif block['type'] == 'image' %}{{- '<image>' }}{%- endif %}{%- endfor %}{%- endif %}"
    "{{- '[/INST]' }}{%- elif message['role'] == 'assistant' %}"
    "{{- (message['content'] if message['content'] is string else message['content'][0]['text']) + eos_token }}"
    "{%- endif %}{%- endfor %}")
OTHER_LAYOUTS = {  # template, special tokens, (eos, pad, bos), the end of an assistant turn
    "qwen2_vl": (QWEN2_VL, ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                            "<image>"], ("<|im_end|>", "<|endoftext|>", None), "<|im_end|>"),
    "llama32_vision": (LLAMA32_VISION, ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                                        "<|eot_id|>", "<|finetune_right_pad_id|>", "<image>"],
                       ("<|eot_id|>", "<|finetune_right_pad_id|>", "<|begin_of_text|>"), "<|eot_id|>"),
    "mistral_inst": (MISTRAL_INST, ["<s>", "</s>", "<pad>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]",
                                    "[/SYSTEM_PROMPT]", "<image>"], ("</s>", "<pad>", "<s>"), "</s>"),
}
END.update({name: layout[3] for name, layout in OTHER_LAYOUTS.items()})


def layout_tokenizer(family: str, template: str):
    """A tokenizer with the layout's special tokens and template, carrying a LLaVA processor around it."""
    from transformers import LlavaProcessor
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    from disttrain.data.vision import VisionInputs, attach
    from disttrain.tools.tiny import _vlm_corpus, build_tokenizer

    _, specials, (eos, pad, bos), _ = OTHER_LAYOUTS[family]
    tokenizer = build_tokenizer(_vlm_corpus(), specials, template, eos_token=eos, pad_token=pad, bos_token=bos,
                                image_token="<image>")
    processor = LlavaProcessor(CLIPImageProcessorPil(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28}),
                               tokenizer, patch_size=7, vision_feature_select_strategy="default",
                               chat_template=template, num_additional_image_tokens=1)
    attach(tokenizer, VisionInputs(processor))
    return tokenizer


@pytest.mark.parametrize("style", ["published", "no_whitespace_control"])
@pytest.mark.parametrize("family", ["gemma3", "llava", *OTHER_LAYOUTS])
def test_only_the_replies_and_their_end_tokens_are_learned(family, style, tiny_vlm_dirs, images):
    from disttrain.tools.tiny import GEMMA3_TEMPLATE, LLAVA_TEMPLATE

    def tokenizer_for(written: str):
        if family in OTHER_LAYOUTS:
            return layout_tokenizer(family, written)
        return tokenizer_of(tiny_vlm_dirs[family], written)

    template = OTHER_LAYOUTS[family][0] if family in OTHER_LAYOUTS else {"gemma3": GEMMA3_TEMPLATE,
                                                                         "llava": LLAVA_TEMPLATE}[family]
    tokenizer = tokenizer_for(template if style == "published" else loose(template))
    if style != "published":  # the loose template renders otherwise: blank lines and indentation around turns
        probe = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Q?"}]},
                 {"role": "assistant", "content": [{"type": "text", "text": "red"}]}]
        assert tokenizer.apply_chat_template(probe, tokenize=False) != \
            tokenizer_for(template).apply_chat_template(probe, tokenize=False)
    vision = vision_of(tokenizer)
    section = DataSection(path="x.jsonl", format="chat", max_seq_len=512)
    for record, replies in adversarial(images):
        row = tokenize_record(record, tokenizer, section)
        ids, labels = row["input_ids"], row["labels"]
        runs = learned_runs(ids, labels, tokenizer)
        assert ["".join(r.split()) for r in runs] == [reply + END[family] for reply in replies], (style, runs)
        # the processor's own tokens for the same rendering and images
        messages = [{**m, "content": [{"type": p["type"], **({"text": p["text"]} if "text" in p else {})}
                                      for p in m["content"]]} for m in record["messages"]]
        text = tokenizer.apply_chat_template(messages, tokenize=False)
        pictures = vision.load(row["image_refs"])
        theirs = vision.processor(text=[text], images=[pictures])["input_ids"][0]
        assert list(ids) == list(theirs)
        image_positions = [i for i, t in enumerate(ids) if t in vision.image_ids]
        assert image_positions and all(labels[i] == IGNORE_INDEX for i in image_positions)
        assert len(row["image_refs"]) == sum(p["type"] == "image" for m in record["messages"] for p in m["content"])


def test_llava_layout_equals_the_chat_layout(tiny_vlm_dirs, images):
    tokenizer = tokenizer_of(tiny_vlm_dirs["llava"])
    section = DataSection(path="x.jsonl", format="sharegpt", max_seq_len=512)
    llava = {"image": [images["blue"], images["red"]],
             "conversations": [{"from": "human", "value": "<image>\n<image>\nSame colour?"},
                               {"from": "gpt", "value": "no"}]}
    chat = {"messages": [{"role": "user", "content": [{"type": "image", "image": images["blue"]},
                                                      {"type": "image", "image": images["red"]},
                                                      {"type": "text", "text": "Same colour?"}]},
                         {"role": "assistant", "content": "no"}]}
    ours = tokenize_record(llava, tokenizer, section)
    theirs = tokenize_record(chat, tokenizer, DataSection(path="x.jsonl", format="chat", max_seq_len=512))
    assert ours["input_ids"] == theirs["input_ids"] and ours["labels"] == theirs["labels"]
    assert ours["image_refs"] == theirs["image_refs"] == [images["blue"], images["red"]]


def test_embedded_bytes_and_pil_images_equal_the_file(tiny_vlm_dirs, images):
    from PIL import Image

    with open(images["red"], "rb") as f:
        raw = f.read()
    for value in ({"bytes": raw, "path": None}, Image.open(images["red"])):
        ref = image_ref(value, None, "image 1")
        assert ref.startswith("data:")
        vision = vision_of(tokenizer_of(tiny_vlm_dirs["gemma3"]))
        assert torch.equal(vision.pixels([ref])["pixel_values"], vision.pixels([images["red"]])["pixel_values"])


def test_the_collator_adds_pixels_token_types_and_image_counts(tiny_vlm_dirs, images):
    tokenizer = tokenizer_of(tiny_vlm_dirs["gemma3"])
    section = DataSection(path="x.jsonl", format="chat", max_seq_len=512)
    rows = [tokenize_record(record, tokenizer, section) for record, _ in adversarial(images)]
    rows = [{k: r[k] for k in ("input_ids", "labels", "image_refs")} for r in rows]
    batch = VisionCollator(Collator(tokenizer.pad_token_id), vision_of(tokenizer))(rows)
    assert batch["num_images"].tolist() == [1, 3]
    assert batch["pixel_values"].shape == (4, 3, 28, 28)
    soft = tokenizer.convert_tokens_to_ids("<image_soft_token>")
    assert torch.equal(batch["token_type_ids"], (batch["input_ids"] == soft).long())  # Gemma 3's image blocks


@pytest.mark.parametrize("family", ["gemma3", "llava"])
def test_a_micro_batch_without_images_gets_a_blank_images_row_that_changes_no_loss(family, tiny_vlm_dirs, images):
    """Text-only rows (plain-string content, a system prompt) get one more row: the template's user turn with a
    blank image, nothing learned from it. The image path runs (the projector gets a gradient: every rank's
    collectives stay in step), the loss equals the rows' own and the projector's gradient is exactly zero."""
    from transformers import AutoModelForImageTextToText

    tokenizer = tokenizer_of(tiny_vlm_dirs[family])
    section = DataSection(path="x.jsonl", format="chat", max_seq_len=512)
    records = [{"messages": [{"role": "user", "content": "What colour is snow?"},
                             {"role": "assistant", "content": "white"}]},
               {"messages": [{"role": "system", "content": "Answer with one word."},
                             {"role": "user", "content": [{"type": "text", "text": "What colour is grass?"}]},
                             {"role": "assistant", "content": [{"type": "text", "text": "green"}]}]}]
    rows = [{k: r[k] for k in ("input_ids", "labels", "image_refs")}
            for r in (tokenize_record(record, tokenizer, section) for record in records)]
    vision = vision_of(tokenizer)
    batch = VisionCollator(Collator(tokenizer.pad_token_id), vision)(rows)
    text = Collator(tokenizer.pad_token_id)([{k: r[k] for k in ("input_ids", "labels")} for r in rows])
    assert batch["num_images"].tolist() == [0, 0, 1] and batch["pixel_values"].shape[0] >= 1
    assert (batch["labels"][2] == IGNORE_INDEX).all()
    assert any(int(t) in vision.image_ids for t in batch["input_ids"][2])  # the processor's image tokens
    width = text["input_ids"].shape[1]
    assert torch.equal(batch["labels"][:2, :width], text["labels"])
    assert torch.equal(batch["input_ids"][:2, :width], text["input_ids"])
    model = AutoModelForImageTextToText.from_pretrained(tiny_vlm_dirs[family], dtype=torch.float32)
    inputs = {k: v for k, v in batch.items() if k != "num_images"}
    loss = model(**inputs).loss
    loss.backward()
    projector = [p for n, p in model.named_parameters() if "projector" in n]
    assert projector and all(p.grad is not None and not p.grad.any() for p in projector)
    alone = model(**{k: v for k, v in text.items() if k in ("input_ids", "labels", "attention_mask")}).loss
    assert float(loss.detach()) == pytest.approx(float(alone.detach()), rel=1e-6)
    with_image = VisionCollator(Collator(tokenizer.pad_token_id), vision)([*rows, {**rows[0], "image_refs": [
        images["red"]]}])
    assert with_image["num_images"].tolist() == [0, 0, 1] and len(with_image["input_ids"]) == 3  # no blank row


def test_the_parts_freeze_and_lora_targets_follow_the_names(tiny_vlm_dirs):
    from transformers import AutoModelForImageTextToText

    from disttrain.model import parts

    for family in ("gemma3", "llava"):
        model = AutoModelForImageTextToText.from_pretrained(tiny_vlm_dirs[family])
        kinds = {parts.part_of(name) for name, _ in model.named_parameters()}
        assert kinds == {"vision", "projector", "language"}, family
        parts.freeze(model, ("vision",))
        assert all(p.requires_grad == (parts.part_of(n) != "vision") for n, p in model.named_parameters())
        targets = parts.lora_targets(model, "all-linear", ("vision",))
        assert targets and all(parts.part_of(t) != "vision" for t in targets)
        assert all("lm_head" not in t for t in targets)
        assert set(parts.lora_targets(model, ["q_proj"], ("vision", "projector"))) == {
            n for n, _ in model.named_modules() if n.endswith("language_model.layers.0.self_attn.q_proj")
            or n.endswith("language_model.layers.1.self_attn.q_proj")}


def _bad(images, tmp_path):
    unreadable = tmp_path / "not_an_image.png"
    unreadable.write_text("plain text")
    user = [{"type": "image", "image": images["red"]}, {"type": "text", "text": "Colour?"}]
    ok = [{"role": "user", "content": user}, {"role": "assistant", "content": "red"}]
    return [
        ({"messages": [{"role": "user", "content": [{"type": "image", "image": str(tmp_path / "gone.png")}]},
                       ok[1]]}, "not found"),
        ({"messages": [{"role": "user", "content": [{"type": "image", "image": str(unreadable)}]}, ok[1]]},
         "cannot be read as an image"),
        ({"messages": [{"role": "user", "content": [{"type": "image", "image": "https://x.org/a.png"}]}, ok[1]]},
         "is a URL"),
        ({"messages": [{"role": "user", "content": user * 3}, ok[1]]}, "more than data.max_images=2"),
        ({"messages": [ok[0], {"role": "assistant", "content": user}]}, "only prompts may hold images"),
        ({"messages": [{"role": "user", "content": "<image> Colour?"}, ok[1]],
          "images": [images["red"], images["blue"]]}, "2 image(s) but its messages mark 1"),
    ]


def test_every_bad_image_is_one_line_naming_the_record(tiny_vlm_dirs, images, tmp_path):
    tokenizer = tokenizer_of(tiny_vlm_dirs["gemma3"], max_images=2)
    section = DataSection(path="x.jsonl", format="chat", max_seq_len=512, max_images=2)
    for record, says in _bad(images, tmp_path):
        with pytest.raises(DataError) as caught:
            tokenize_record(record, tokenizer, section)
        assert says in str(caught.value) and "\n" not in str(caught.value), (says, str(caught.value))
    short = DataSection(path="x.jsonl", format="chat", max_seq_len=16)
    record = {"messages": [{"role": "user", "content": [{"type": "text", "text": "red " * 20},
                                                        {"type": "image", "image": images["red"]}]},
                           {"role": "assistant", "content": "red"}]}
    cut = tokenize_record(record, tokenizer, short)  # dropped and counted by the pipeline, not a stop
    assert (cut["image_cut"], cut["n_targets"]) == (True, 0)


def test_an_image_too_large_to_open_safely_is_one_line(tiny_vlm_dirs, images, monkeypatch):
    """PIL's DecompressionBombError (an image over twice PIL's pixel limit: a 14000 x 14000 photo) is a DataError
    naming the image, not a traceback; the limit is lowered here instead of writing such a file."""
    from PIL import Image

    from disttrain.data.vision import open_image

    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)
    with pytest.raises(DataError, match=r"red_circle.png is too large to open safely") as caught:
        open_image(images["red"])
    assert "\n" not in str(caught.value)


def test_a_bad_image_in_a_file_names_its_line(tiny_vlm_dirs, images, tmp_path):
    from disttrain.data.pipeline import build_datasets
    from contextlib import nullcontext

    good = {"messages": [{"role": "user", "content": [{"type": "image", "image": "red.png"},
                                                      {"type": "text", "text": "Colour?"}]},
                         {"role": "assistant", "content": [{"type": "text", "text": "red"}]}]}
    draw_shape("circle", "red").save(tmp_path / "red.png")
    bad = json.loads(json.dumps(good))
    bad["messages"][0]["content"][0]["image"] = "missing.png"
    (tmp_path / "vlm.jsonl").write_text("\n".join(json.dumps(r) for r in (good, good, bad)) + "\n")
    section = DataSection(path=str(tmp_path / "vlm.jsonl"), format="chat", max_seq_len=128)
    with pytest.raises(DataError, match=r"vlm.jsonl:3: .*missing.png not found"):
        build_datasets(section, tokenizer_of(tiny_vlm_dirs["gemma3"]), 0, nullcontext)


def test_an_image_row_longer_than_max_seq_len_is_dropped_and_counted_not_a_stop(tiny_vlm_dirs, tmp_path):
    """A conversation whose image tokens reach past max_seq_len (a large photo under a family that counts tokens by
    size) is dropped and counted in the data report; the rest of the file trains."""
    from contextlib import nullcontext

    from disttrain.data.pipeline import build_datasets

    def record(question):
        return {"messages": [{"role": "user", "content": [{"type": "text", "text": question},
                                                          {"type": "image", "image": "red.png"}]},
                             {"role": "assistant", "content": [{"type": "text", "text": "red"}]}]}
    draw_shape("circle", "red").save(tmp_path / "red.png")
    records = [record("Colour?"), record("red " * 40 + "Colour?"), record("Which colour?")]
    (tmp_path / "vlm.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    section = DataSection(path=str(tmp_path / "vlm.jsonl"), format="chat", max_seq_len=40)
    built = build_datasets(section, tokenizer_of(tiny_vlm_dirs["gemma3"]), 0, nullcontext)
    train, report = built[0], built[2]["train"]
    assert (len(train), report.dropped_image_cut, report.dropped_no_target) == (2, 1, 0)


def test_a_text_model_refuses_records_with_images(tokenizer, images):
    record = {"messages": [{"role": "user", "content": [{"type": "image", "image": images["red"]}]},
                           {"role": "assistant", "content": "red"}]}
    with pytest.raises(DataError, match="the model reads text only"):
        tokenize_record(record, tokenizer, DataSection(path="x.jsonl", format="chat"))


def test_a_parquet_file_with_an_image_column_as_the_hub_datasets_store_it(tiny_vlm_dirs, tmp_path):
    """LLaVA-Instruct-Mix's layout (HuggingFaceH4/llava-instruct-mix-vsft): messages whose parts carry an `index`
    (Arrow fills the missing keys with null) and an `images` column of datasets' Image feature, read back as PIL
    images: the rows equal the same conversation given as a file path."""
    from contextlib import nullcontext

    import datasets

    from disttrain.data.pipeline import build_datasets

    picture = tmp_path / "red.png"
    draw_shape("circle", "red").save(picture)
    messages = [{"role": "user", "content": [{"index": 0, "text": None, "type": "image"},
                                             {"index": None, "text": "Is it red or blue?", "type": "text"}]},
                {"role": "assistant", "content": [{"index": None, "text": "red", "type": "text"}]}]
    table = datasets.Dataset.from_dict({"messages": [messages], "images": [[str(picture)]]})
    table.cast_column("images", datasets.Sequence(datasets.Image())).to_parquet(tmp_path / "mix.parquet")
    tokenizer = tokenizer_of(tiny_vlm_dirs["gemma3"])
    rows, _, _ = build_datasets(DataSection(path=str(tmp_path / "mix.parquet"), format="chat", max_seq_len=128),
                                tokenizer, 0, nullcontext)
    plain = {"messages": [{"role": "user", "content": [{"type": "image", "image": str(picture)},
                                                       {"type": "text", "text": "Is it red or blue?"}]},
                          {"role": "assistant", "content": "red"}]}
    expected = tokenize_record(plain, tokenizer, DataSection(path="x.jsonl", format="chat", max_seq_len=128))
    assert rows[0]["input_ids"] == expected["input_ids"] and rows[0]["labels"] == expected["labels"]
    vision = vision_of(tokenizer)
    ours, theirs = vision.pixels(rows[0]["image_refs"]), vision.pixels([str(picture)])
    assert torch.equal(ours["pixel_values"], theirs["pixel_values"])


def test_llama_32_vision_is_refused_in_one_line_before_any_weight(tmp_path):
    """Mllama reads images through cross-attention layers (a cross_attention_mask per row, image tiles) that the
    data path does not build: its config alone (transformers' MllamaConfig, tiny) stops the run in one line, as
    the launch checks it before loading (parallel/checks.py)."""
    from transformers import MllamaConfig

    from disttrain.errors import DisttrainError
    from disttrain.parallel import checks
    from disttrain.recipe.schema import load_recipe
    from conftest import REPO

    MllamaConfig(vision_config={"hidden_size": 32, "num_hidden_layers": 2, "num_global_layers": 1,
                                "attention_heads": 2, "intermediate_size": 64, "image_size": 56, "patch_size": 14,
                                "vision_output_dim": 64, "intermediate_layers_indices": [0]},
                 text_config={"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
                              "num_key_value_heads": 2, "intermediate_size": 64, "vocab_size": 300,
                              "cross_attention_layers": [1], "bos_token_id": 1, "eos_token_id": 2,
                              "pad_token_id": 0}).save_pretrained(tmp_path)
    recipe = load_recipe(REPO / "recipes/tiny/vlm_sft.yaml", [f"model.name_or_path={tmp_path}"])
    with pytest.raises(DisttrainError, match="reading images through cross-attention layers") as caught:
        checks.check_model_config(recipe, 1, 1, 1, 1)
    assert "Mllama" in str(caught.value) and "\n" not in str(caught.value)


PADDLE_TEMPLATE = (  # PaddleOCR-VL's layout: the image between its markers, then the question; ChatML-like turns
    "{%- for message in messages %}<|im_start|>{{ message['role'] }}\n{%- if message['content'] is string %}"
    "{{ message['content'] }}{%- else %}{%- for part in message['content'] %}{%- if part['type'] == 'image' %}"
    "<|IMAGE_START|><|IMAGE_PLACEHOLDER|><|IMAGE_END|>{%- else %}{{ part['text'] }}{%- endif %}{%- endfor %}"
    "{%- endif %}<|im_end|>\n{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}")


@pytest.fixture(scope="module")
def pixel_sized_dir(tmp_path_factory):
    """A processor that sizes images by their pixel count (PaddleOCR-VL's: Qwen2-VL's image processor layout,
    without the video processor that needs torchvision), built locally, beside its family's config."""
    from transformers import PaddleOCRVLConfig, PaddleOCRVLProcessor
    from transformers.models.paddleocr_vl.image_processing_pil_paddleocr_vl import PaddleOCRVLImageProcessorPil

    from disttrain.tools.tiny import _vlm_corpus, build_tokenizer

    folder = tmp_path_factory.mktemp("paddle")
    tokenizer = build_tokenizer(_vlm_corpus(), ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|IMAGE_START|>",
                                                "<|IMAGE_END|>", "<|IMAGE_PLACEHOLDER|>"], PADDLE_TEMPLATE,
                                eos_token="<|im_end|>", pad_token="<|endoftext|>", bos_token=None,
                                image_token="<|IMAGE_PLACEHOLDER|>")
    processor = PaddleOCRVLProcessor(PaddleOCRVLImageProcessorPil(), tokenizer, chat_template=PADDLE_TEMPLATE)
    processor.save_pretrained(folder)
    PaddleOCRVLConfig().save_pretrained(folder)
    return folder


@pytest.mark.parametrize("limits, tokens, source", [
    ({}, 3009, "the processor's own"),                                 # its own largest: 2359296 pixels
    ({"max_seq_len": 2048}, 1024, "half of data.max_seq_len"),          # one image at most half the row
    ({"max_seq_len": 2048, "max_pixels": 28 * 28 * 64}, 64, "data.max_pixels")])
def test_a_processor_that_counts_pixels_gets_the_limits_and_the_export_keeps_them(pixel_sized_dir, tmp_path, limits,
                                                                                   tokens, source):
    """A 2000x1500 photo under a processor that sizes images by pixels: without data.max_pixels the processor's
    own limit stays, lowered where one image would fill more than half of max_seq_len (its row is trained, not
    dropped); data.max_pixels wins. The processor itself resizes (as at inference), and the processor written
    beside the exported model gives the training row's tokens for the same conversation."""
    from PIL import Image
    from transformers import AutoProcessor

    from contextlib import nullcontext

    from disttrain.data.pipeline import build_datasets
    from disttrain.data.vision import saved_with

    Image.new("RGB", (2000, 1500), (200, 30, 30)).save(tmp_path / "photo.png")
    record = {"messages": [{"role": "user", "content": [{"type": "image", "image": "photo.png"},
                                                       {"type": "text", "text": "Colour?"}]},
                           {"role": "assistant", "content": [{"type": "text", "text": "red"}]}]}
    (tmp_path / "vlm.jsonl").write_text(json.dumps(record) + "\n")
    section = {"max_seq_len": 8192, **limits}
    tokenizer = tokenizer_of(pixel_sized_dir, **section)
    built = build_datasets(DataSection(path=str(tmp_path / "vlm.jsonl"), format="chat", **section), tokenizer, 0,
                           nullcontext)
    row, report = built[0][0], built[2]["train"]
    image_id = vision_of(tokenizer).processor.image_token_id
    assert tokens * 0.8 < row["input_ids"].count(image_id) <= tokens  # the grid rounds down
    assert source in report.images and report.dropped_image_cut == 0

    saved_with(tokenizer).save_pretrained(tmp_path / "export")
    exported = AutoProcessor.from_pretrained(tmp_path / "export")
    text = exported.apply_chat_template(record["messages"], tokenize=False)
    ids = exported(text=[text], images=[[Image.open(tmp_path / "photo.png")]])["input_ids"][0]
    assert list(ids) == row["input_ids"]
