"""Images in conversations: what a vision-language model's processor needs, from the record to the micro-batch.

- **Records**: image parts in a message's content (transformers' chat format, `{"type": "image", "image": ...}`,
  also `path` / `url` keys), or an `images` (LLaVA: `image`) column whose entries fill the `<image>` marks of the
  text in order. An image is a local path (relative ones from the source's `image_dir`, default the data file's
  folder), embedded bytes (`{"bytes": ...}`, as `datasets` stores an Image column, or a `data:image/...;base64,`
  URI) or a decoded PIL image. URLs are refused (nothing is downloaded during training).
- **Tokenising** (`VisionInputs.expand`): the conversation is rendered and its assistant spans found as for
  text (data/templates.py); then the model's own processor expands each image placeholder of the rendering
  into the image's tokens (`return_text_replacement_offsets`: where each replacement went) and the spans move
  with the text, so image tokens can never be targets; a span that would hold an image is refused. The row
  keeps the token ids, the labels and its images (paths or bytes), not pixels.
- **Batches** (`VisionCollator`): the images of a micro-batch are loaded again and go through the processor's
  image processor; its pixel tensors (and the token types a family's attention needs, Gemma 3's
  `token_type_ids`) join the text collator's batch, with each row's image count for the loss self-check.
  A micro-batch of text-only rows gets one more row: a blank image in the template's user turn, every label
  ignored (`VisionInputs.blank_row`, as LLaMA-Factory pads such batches with a fake image). Without it the image
  encoder and projector sit out that micro-batch on that rank only: DDP's gradient all-reduce waits for their
  gradients until the collective timeout, and FSDP2 / ZeRO-3 gather their weights on the other ranks only. The
  row's loss is exactly zero and its gradients exactly zero (nothing reads its outputs); other rows never attend to
  it (a row of its own), so the losses equal one process's (the matrix's vision runs read image and text-only
  rows alternating).

Hand-written because transformers' processors tokenise and mask nothing for training (their assistant masks
need `{% generation %}` markers) and TRL's vision collator learns every text token of a conversation.
"""

from __future__ import annotations

import base64
import io
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from disttrain.data.collation import IMAGES_COUNT_KEY as COUNT_KEY
from disttrain.data.templates import IGNORE_INDEX
from disttrain.errors import DataError

IMAGES_KEY = "image_refs"  # a row's images (paths or data URIs) in the tokenised dataset; not "images": a map
# output column named as an input column keeps its features (an Image column would decode the refs back to PIL)
MARK = "<image>"  # where an `images` column's entries go in the text (LLaVA's layout)
_URL = re.compile(r"^[a-z][a-z0-9+.-]*://", re.IGNORECASE)


def image_ref(value, base: str | None, where: str) -> str:
    """One image of a record as the row stores it: an absolute path, or a data URI holding its bytes."""
    from PIL import Image

    if isinstance(value, Image.Image):
        buffer = io.BytesIO()
        value.save(buffer, format="PNG")
        return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    if isinstance(value, dict):  # datasets' Image feature, undecoded: {"bytes", "path"}
        if value.get("bytes"):
            return "data:image;base64," + base64.b64encode(value["bytes"]).decode()
        value = value.get("path")
    if not isinstance(value, str) or not value:
        raise DataError(f"{where}: an image must be a path, bytes or a data URI, got {type(value).__name__}")
    if value.startswith("data:"):
        return value
    if _URL.match(value):
        raise DataError(f"{where}: image {value!r} is a URL; disttrain downloads nothing while it trains: download "
                        "the images and give local paths (or embed their bytes)")
    path = Path(os.path.expanduser(value))
    return str(path if path.is_absolute() else Path(base or ".") / path)


def open_image(ref: str, max_pixels: int | None = None, min_pixels: int | None = None):
    """The image as RGB, scaled (aspect kept) to at most max_pixels and at least min_pixels; DataError if it
    is missing or unreadable."""
    from PIL import Image, UnidentifiedImageError

    shown = ref[:40] + "..." if ref.startswith("data:") else ref
    try:
        if ref.startswith("data:"):
            source = io.BytesIO(base64.b64decode(ref.split(",", 1)[1]))
        elif not os.path.isfile(ref):
            raise DataError(f"image {shown} not found (relative paths start at the source's image_dir, by "
                            "default the data file's folder)")
        else:
            source = ref
        with Image.open(source) as image:
            image = image.convert("RGB")
    except Image.DecompressionBombError as exc:  # PIL's guard against images that would fill memory
        raise DataError(f"image {shown} is too large to open safely ({str(exc).splitlines()[0]}); shrink it or "
                        "drop the record") from None
    except (UnidentifiedImageError, OSError, ValueError) as exc:
        raise DataError(f"image {shown} cannot be read as an image ({type(exc).__name__}: "
                        f"{str(exc).splitlines()[0] if str(exc) else ''})") from None
    pixels = image.width * image.height
    scale = 1.0
    if max_pixels and pixels > max_pixels:
        scale = (max_pixels / pixels) ** 0.5
    elif min_pixels and pixels < min_pixels:
        scale = (min_pixels / pixels) ** 0.5
    if scale != 1.0:
        size = (max(1, int(image.width * scale)), max(1, int(image.height * scale)))
        image = image.resize(size, Image.Resampling.BICUBIC)
    return image


def _image_part(part) -> bool:
    return isinstance(part, dict) and part.get("type") in ("image", "image_url")


def split_marks(text: str) -> list[dict]:
    """A string with `<image>` marks as content parts: an image part per mark, the text between as text. A mark's
    own line break (LLaVA writes `<image>\\n` before the question) goes with it: the template writes the
    family's placeholder, with its own layout, for the image part."""
    parts = []
    for i, piece in enumerate(re.split(re.escape(MARK) + r"\n?", text)):
        if i:
            parts.append({"type": "image"})
        if piece.strip():
            parts.append({"type": "text", "text": piece})
    return parts


def take_images(messages: list[dict], column) -> tuple[list[dict], list]:
    """Messages whose image parts are bare `{"type": "image"}` (what chat templates read), and the images in the
    order they appear: inline ones (`image` / `path` / `url` keys) or, with an `images` column, its entries in the
    order of the `<image>` marks (or image parts). Parts lose the keys Arrow filled with None (a file's parts
    share one struct type: {"type": "text", "text": .., "image": None} must not look like an image to a template).
    Images in an assistant message are refused: the model would have to write them."""
    listed = [] if column is None else (list(column) if isinstance(column, (list, tuple)) else [column])
    images, out = [], []
    for i, message in enumerate(messages):
        content = message.get("content")
        if isinstance(content, str) and listed and MARK in content:
            content = split_marks(content)
        if isinstance(content, list):
            parts = []
            for part in content:
                part = {k: v for k, v in part.items() if v is not None} if isinstance(part, dict) else part
                if _image_part(part):
                    inline = part.get("image") or part.get("path") or part.get("url") or part.get("image_url")
                    if isinstance(inline, dict):  # OpenAI's {"image_url": {"url": ...}}
                        inline = inline.get("url")
                    if inline is not None and listed:
                        raise DataError(f"message {i} holds an image of its own and the record an images column "
                                        "too: give each image once")
                    images.append(inline)
                    part = {"type": "image"}
                parts.append(part)
            if any(_image_part(p) for p in parts) and message["role"] == "assistant":
                raise DataError(f"message {i} (assistant) holds an image: only prompts may hold images")
            message = {**message, "content": parts}
        out.append(message)
    if listed:
        if len(images) != len(listed):
            raise DataError(f"the record has {len(listed)} image(s) but its messages mark {len(images)} ({MARK} in "
                            "the text or image parts): one mark per image")
        images = listed
    return out, images


def pixels_per_token(image_processor) -> int | None:
    """How many pixels one image token stands for, where the image processor sizes images by their pixel count
    (Qwen2-VL's layout, which Qwen2.5/3-VL, GLM-4V, PaddleOCR-VL and others share: `size` holds the smallest and
    largest pixel counts as shortest_edge / longest_edge, tokens are patches merged merge_size x merge_size);
    None for processors that resize every image to one resolution (a fixed token count)."""
    kwargs = getattr(getattr(type(image_processor), "valid_kwargs", None), "__annotations__", {})
    size, patch = getattr(image_processor, "size", None), getattr(image_processor, "patch_size", None)
    if "max_pixels" not in kwargs or not getattr(size, "longest_edge", None) or not isinstance(patch, int):
        return None
    return (patch * (getattr(image_processor, "merge_size", None) or 1)) ** 2


@dataclass
class VisionInputs:
    """A vision-language model's processor and the recipe's image limits; what the data pipeline and the
    collator ask about images (data/templates.py renders the text as for any conversation).

    A processor that sizes images by their pixel count gets the limits itself (`pixel_limits`), so it resizes
    exactly as the exported processor will at inference; without data.max_pixels its own largest size is kept,
    lowered where one image would fill more than half of max_seq_len (its row would be dropped, not trained)."""

    processor: object
    max_pixels: int | None = None
    min_pixels: int | None = None
    max_images: int = 8
    max_seq_len: int | None = None
    image_ids: tuple[int, ...] = field(init=False)
    pixel_limits: tuple[int, int, str] | None = field(init=False, default=None)  # (min, max, where max came from)
    _blank: dict | None = field(init=False, default=None, repr=False)

    def __post_init__(self):
        ids = getattr(self.processor, "image_token_ids", None) or [getattr(self.processor, "image_token_id", None)]
        tokenizer = self.processor.tokenizer
        extra = getattr(tokenizer, "image_token_id", None) if hasattr(tokenizer, "image_token") else None
        self.image_ids = tuple(sorted({i for i in [*ids, extra] if isinstance(i, int)}))
        per_token = pixels_per_token(self.processor.image_processor)
        if per_token is not None:
            self.pixel_limits = self._limit_processor(per_token)

    def _limit_processor(self, per_token: int) -> tuple[int, int, str]:
        size = self.processor.image_processor.size
        largest, source = self.max_pixels, "data.max_pixels"
        if largest is None:
            largest, source = size.longest_edge, "the processor's own"
            if self.max_seq_len and largest // per_token > self.max_seq_len // 2:
                largest, source = per_token * (self.max_seq_len // 2), "half of data.max_seq_len"
        smallest = min(self.min_pixels or size.shortest_edge or per_token, largest)
        size.longest_edge, size.shortest_edge = largest, smallest  # written with the processor at export
        return smallest, largest, source

    def describe_limits(self) -> str | None:
        """The log's line on image sizes, for a processor that sizes images by pixels."""
        if self.pixel_limits is None:
            return None
        smallest, largest, source = self.pixel_limits
        per_token = pixels_per_token(self.processor.image_processor)
        return (f"images scaled to {smallest}..{largest} pixels (at most {largest // per_token} tokens each; the "
                f"largest from {source}) by the processor, which the exported model keeps")

    def load(self, refs: list[str]) -> list:
        if self.pixel_limits is not None:  # the processor scales them itself, as it will at inference
            return [open_image(ref) for ref in refs]
        return [open_image(ref, self.max_pixels, self.min_pixels) for ref in refs]

    def expand(self, text: str, spans: list[tuple[int, int]], refs: list[str]) -> tuple[str, list[tuple[int, int]]]:
        """The rendering with each image placeholder replaced by the image's tokens (by the processor itself),
        and the assistant spans moved with it."""
        if len(refs) > self.max_images:
            raise DataError(f"{len(refs)} images in one conversation, more than data.max_images={self.max_images}")
        images = self.load(refs)
        try:
            out = self.processor(text=[text], images=[images] if images else None,
                                 return_text_replacement_offsets=True)
        except (ValueError, TypeError) as exc:  # placeholders and images that do not pair up, sizes it refuses
            said = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise DataError(f"the processor refused this conversation's {len(images)} image(s): {said}") from None
        replaced = out.get("text_replacement_offsets", [[]])[0] if images else []
        if len(replaced) != len(images):
            raise DataError(f"the chat template wrote {len(replaced)} image placeholder(s) for {len(images)} image(s)")
        pieces, moves, last = [], [], 0
        for r in replaced:
            (start, end), new = r["span"], r["replacement"]
            if any(a < end and start < b for a, b in spans):
                raise DataError("an image placeholder falls inside an assistant reply in the chat template's "
                                "rendering: only prompts may hold images")
            pieces += [text[last:start], new]
            moves.append((end, len(new) - (end - start)))
            last = end
        pieces.append(text[last:])

        def moved(at: int) -> int:  # a character after a placeholder moves by what each earlier one added
            return at + sum(delta for end, delta in moves if end <= at)
        return "".join(pieces), [(moved(a), moved(b)) for a, b in spans]

    def blank_row(self, like: dict) -> dict:
        """A row holding one blank image in the chat template's user turn, no label learned: what a micro-batch
        without images adds so that every rank runs the image path (the module docstring says why)."""
        if self._blank is None:
            from PIL import Image

            buffer = io.BytesIO()
            Image.new("RGB", (64, 64), (127, 127, 127)).save(buffer, format="PNG")
            ref = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
            tokenizer = self.processor.tokenizer
            text = tokenizer.apply_chat_template([{"role": "user", "content": [{"type": "image"}]}], tokenize=False)
            try:
                ids = self.processor(text=[text], images=[self.load([ref])])["input_ids"][0]
            except (ValueError, TypeError) as exc:
                raise DataError("a micro-batch without images needs a blank image's row, and the processor refused "
                                f"the chat template's image turn: {str(exc).strip().splitlines()[0]}") from None
            ids = [int(i) for i in ids]
            self._blank = {"input_ids": ids, "labels": [IGNORE_INDEX] * len(ids), IMAGES_KEY: [ref]}
        row = {**like, **self._blank}
        if "position_ids" in like:
            row["position_ids"] = list(range(len(row["input_ids"])))
        return row

    def cuts_image(self, ids: list[int], max_seq_len: int) -> bool:
        """Whether truncation to max_seq_len would cut an image's tokens (the model needs all of them or none):
        such a row is dropped and counted, not truncated (data/pipeline.py)."""
        return any(t in self.image_ids for t in ids[max_seq_len:])

    def pixels(self, refs: list[str]) -> dict[str, torch.Tensor]:
        """The images' model inputs from the image processor (pixel_values, and e.g. Qwen's image_grid_thw)."""
        processor = self.processor.image_processor
        out = processor(images=self.load(refs), return_tensors="pt")
        wanted = set(self.processor.model_input_names)
        return {k: v for k, v in out.items() if k in wanted}

    def token_types(self, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """The per-token modality types the family's forward takes (Gemma 3: token_type_ids, for the
        bidirectional attention within an image), as the processor makes them."""
        names = self.processor.model_input_names
        name = next((n for n in ("token_type_ids", "mm_token_type_ids") if n in names), None)
        if name is None:
            return {}
        return {name: torch.tensor(self.processor.create_mm_token_type_ids(input_ids.tolist()), dtype=torch.long)}


_ATTRIBUTE = "_disttrain_vision"


def attach(tokenizer, vision: VisionInputs) -> None:
    """The tokenizer carries its model's processor wherever the data path takes it (the pipeline, the
    objective's collator, the export), so none of their signatures changes for images."""
    setattr(tokenizer, _ATTRIBUTE, vision)


def vision_of(tokenizer) -> VisionInputs | None:
    """The processor and image limits of a vision-language model's tokenizer; None for a text model."""
    return getattr(tokenizer, _ATTRIBUTE, None)


def saved_with(tokenizer):
    """What an exported model dir holds beside the weights: the processor (tokenizer, image processor, chat
    template) for a vision-language model, else the tokenizer."""
    vision = vision_of(tokenizer)
    return vision.processor if vision is not None else tokenizer


def with_images(collator, tokenizer):
    """The objective's collator, wrapped to add pixels where the tokenizer's model reads images."""
    vision = vision_of(tokenizer)
    return VisionCollator(collator, vision) if vision is not None else collator


@dataclass
class VisionCollator:
    """The text collator's batch, plus the micro-batch's pixels and token types (rows without images add none; a
    micro-batch without any gets a blank image's row)."""

    collate: object  # data.collation.Collator
    vision: VisionInputs

    @property
    def pad_token_id(self) -> int:
        return self.collate.pad_token_id

    def __call__(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        if not any(r.get(IMAGES_KEY) for r in rows):  # every rank runs the image path (module docstring)
            rows = [*rows, self.vision.blank_row(rows[0])]
        refs = [list(r.get(IMAGES_KEY) or []) for r in rows]
        batch = self.collate([{k: v for k, v in r.items() if k != IMAGES_KEY} for r in rows])
        batch[COUNT_KEY] = torch.tensor([len(r) for r in refs], dtype=torch.long)
        flat = [ref for row in refs for ref in row]
        if flat:
            batch.update(self.vision.pixels(flat))
        batch.update(self.vision.token_types(batch["input_ids"]))
        return batch


def row_images(batch: dict, part: dict, row: int = 0) -> dict:
    """The loss self-check's one sequence (`part`, cut from row `row` of the batch's 2-D tensors) with its own
    images: that row's pixels (per image, or per patch where the processor gives a grid per image, Qwen-VL)."""
    if COUNT_KEY not in batch:
        return part
    before, n = int(batch[COUNT_KEY][:row].sum()), int(batch[COUNT_KEY][row])
    grid = next((k for k in batch if k.endswith("grid_thw")), None)
    out = {k: v for k, v in part.items() if k not in ("pixel_values", grid)}
    if "pixel_values" in batch and n:
        start = int(batch[grid][:before].prod(-1).sum()) if grid else before
        rows = int(batch[grid][before:before + n].prod(-1).sum()) if grid else n
        out["pixel_values"] = batch["pixel_values"][start:start + rows]
        if grid:
            out[grid] = batch[grid][before:before + n]
    return out
