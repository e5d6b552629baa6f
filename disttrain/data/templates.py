"""Render a conversation once, as the model will see it, and learn only what the assistant says.

The conversation is rendered by the tokenizer's chat template exactly once (earlier turns as the template
writes them in the full conversation: Qwen3's, for one, drops the reasoning of earlier assistant turns), and
the assistant's tokens are found in that one rendering:
- templates with `{% generation %}` markers: transformers' assistant-token mask says which tokens are the
  assistant's;
- any other template: each assistant turn starts where the template's assistant header ends (the text that
  `add_generation_prompt` appends, e.g. `<|im_start|>assistant\\n`; templates without one start at the
  message content) and ends with the first special token after its content (`<|im_end|>`, `<|eot_id|>`,
  `</s>`): that end-of-turn token is learned too, so the model learns to stop. Tool calls rendered inside an
  assistant turn are targets; tool results, prompts and system text are not. Characters map to tokens
  through the fast tokenizer's offsets.
Without a chat template (base models) a plain `role: content` layout (Alpaca's prompt for alpaca records)
is used, each answer followed by the EOS token.
"""

from __future__ import annotations

from dataclasses import dataclass

from disttrain.data.formats import Conversation
from disttrain.errors import DataError

IGNORE_INDEX = -100

# Used only when the tokenizer has no chat template (base models).
ALPACA_PROMPT = ("Below is an instruction that describes a task{with_input}. Write a response that appropriately "
                 "completes the request.\n\n### Instruction:\n{instruction}\n\n{input_block}### Response:\n")

_HEADER_PROBE = [{"role": "user", "content": "x"}]


def has_generation_markers(template: str | None) -> bool:
    return bool(template) and "generation" in template and "endgeneration" in template


_HEADERS: dict[str, str] = {}  # chat template -> its assistant header (a cache; the tokenizer is not touched,
                               # so `datasets` fingerprints of the tokenising function stay the same on every rank)


def _assistant_header(tokenizer) -> str:
    """The text a template puts before an assistant's reply: what add_generation_prompt appends."""
    template = tokenizer.chat_template
    if template not in _HEADERS:
        try:
            without = tokenizer.apply_chat_template(_HEADER_PROBE, tokenize=False)
            with_prompt = tokenizer.apply_chat_template(_HEADER_PROBE, tokenize=False, add_generation_prompt=True)
            _HEADERS[template] = with_prompt[len(without):] if with_prompt.startswith(without) else ""
        except Exception:  # a template that refuses the probe: spans start at the message content
            _HEADERS[template] = ""
    return _HEADERS[template]


_ENDERS: dict[tuple, list[str]] = {}  # (template, special tokens) -> end-of-turn tokens (a cache, like _HEADERS)


def _end_of_turn_tokens(tokenizer, header: str) -> list[str]:
    """Special tokens that can close an assistant turn: all special tokens but BOS and those of the header."""
    key = (tokenizer.chat_template, tokenizer.bos_token, len(tokenizer))
    if key not in _ENDERS:
        _ENDERS[key] = _find_end_of_turn_tokens(tokenizer, header)
    return _ENDERS[key]


def _find_end_of_turn_tokens(tokenizer, header: str) -> list[str]:
    specials = set(tokenizer.all_special_tokens)
    specials |= {t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values() if t.special}
    return [t for t in specials if t and t != tokenizer.bos_token and t not in header]


def assistant_spans(text: str, messages: list[dict], tokenizer) -> list[tuple[int, int]]:
    """Character spans of the assistant turns in one rendering of `messages`, end-of-turn token included."""
    header = _assistant_header(tokenizer)
    enders = _end_of_turn_tokens(tokenizer, header)
    spans, cursor = [], 0
    for k, message in enumerate(m for m in messages if m["role"] == "assistant"):
        content = str(message.get("content") or "").strip()
        at_header = text.find(header, cursor) if header else -1
        at_content = text.find(content, cursor) if content and at_header < 0 else -1
        if at_header >= 0:  # the next assistant header after the previous turn is this turn's
            start = at_header + len(header)
        elif at_content >= 0:
            start = at_content
        else:
            raise DataError(f"assistant turn {k + 1} is not in the chat template's rendering of the conversation "
                            "(the template drops or rewrites it); check the data against the model's template")
        found = text.find(content, start) if content else -1
        after = found + len(content) if found >= 0 else start
        ends = [(text.find(t, after), t) for t in enders]
        ends = [(pos, t) for pos, t in ends if pos >= 0]
        end = min(pos + len(t) for pos, t in ends) if ends else after
        spans.append((start, end))
        cursor = end
    return spans


def _plain_rendering(conversation: Conversation, tokenizer) -> tuple[str, list[tuple[int, int]]]:
    """No chat template: the classic Alpaca prompt, or `role: content` lines; answers end with EOS."""
    eos = tokenizer.eos_token
    if conversation.alpaca is not None and conversation.messages[0]["role"] != "system":
        instruction, extra, output = conversation.alpaca
        prompt = ALPACA_PROMPT.format(with_input=", paired with an input" if extra else "", instruction=instruction,
                                      input_block=f"### Input:\n{extra}\n\n" if extra else "")
        return prompt + output + eos, [(len(prompt), len(prompt) + len(output) + len(eos))]
    text, spans = "", []
    for message in conversation.messages:
        if message["role"] == "assistant":
            text += "assistant: "
            spans.append((len(text), len(text) + len(str(message.get("content") or "")) + len(eos)))
            text += str(message.get("content") or "") + eos + "\n"
        else:
            text += f"{message['role']}: {message.get('content') or ''}\n"
    return text, spans


@dataclass
class Rendered:
    """One example ready for the (batched) tokenizer: its text, the character spans to learn, and token ids
    to put before it (BOS where the tokenizer adds one) that are never targets. Templates with generation
    markers are tokenised by transformers itself: `ids`/`labels` are set and `text` is None."""

    text: str | None
    spans: list[tuple[int, int]]
    prefix: list[int]
    ids: list[int] | None = None
    labels: list[int] | None = None


def _check_fast(tokenizer) -> None:
    if not tokenizer.is_fast:
        raise DataError(f"{type(tokenizer).__name__} is not a fast tokenizer: assistant-only masking needs the "
                        "character offsets only fast tokenizers give (AutoTokenizer loads the fast one by default)")


def _token_range(encoding, start: int, end: int) -> tuple[int, int] | None:
    """Tokens whose characters overlap [start, end): from the token holding the first covered character to
    the one holding the last. Overlap, not containment: byte-level BPE merges the space before an answer
    into its first word, and that token is learned."""
    first = next((t for c in range(start, end) if (t := encoding.char_to_token(c)) is not None), None)
    if first is None:  # no token covers any character of the span (e.g. whitespace a normalizer removed)
        return None
    last = next(t for c in range(end - 1, start - 1, -1) if (t := encoding.char_to_token(c)) is not None)
    return first, last + 1


def labels_from_spans(encoding, spans) -> list[int]:
    """Labels of one encoded text: its token ids inside the spans, IGNORE_INDEX elsewhere."""
    ids = encoding.ids
    labels = [IGNORE_INDEX] * len(ids)
    for start, end in spans:
        covered = _token_range(encoding, start, end)
        if covered is not None:
            labels[covered[0]:covered[1]] = ids[covered[0]:covered[1]]
    return labels


def _bos(tokenizer) -> list[int]:
    return [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None and getattr(tokenizer, "add_bos_token",
                                                                                      False) else []


def render(example: Conversation | str, tokenizer) -> Rendered:
    """The text the model sees for one example and what of it is learned; no tokenising (but for templates
    with generation markers, which transformers tokenises and masks in one call)."""
    if isinstance(example, str):  # a document: every token is learned
        text = example + tokenizer.eos_token
        return Rendered(text, [(0, len(text))], _bos(tokenizer))
    template = tokenizer.chat_template
    if not template:
        text, spans = _plain_rendering(example, tokenizer)
        return Rendered(text, spans, _bos(tokenizer))
    kwargs = {"tools": example.tools} if example.tools else {}
    if has_generation_markers(template):
        out = tokenizer.apply_chat_template(example.messages, tokenize=True, return_dict=True,
                                            return_assistant_tokens_mask=True, **kwargs)
        ids = list(out["input_ids"])
        return Rendered(None, [], [], ids, [t if m else IGNORE_INDEX for t, m in zip(ids, out["assistant_masks"])])
    text = tokenizer.apply_chat_template(example.messages, tokenize=False, **kwargs)
    return Rendered(text, assistant_spans(text, example.messages, tokenizer), [])


def tokenize_rendered(items: list[Rendered], tokenizer) -> list[tuple[list[int], list[int]]]:
    """(ids, labels) of each rendered example; every text goes through ONE batched fast-tokenizer call."""
    texts = [r.text for r in items if r.text is not None]
    if texts:
        _check_fast(tokenizer)
        encodings = iter(tokenizer(texts, add_special_tokens=False).encodings)  # Rust encodings: char_to_token
    out = []
    for r in items:
        if r.text is None:
            out.append((r.ids, r.labels))
            continue
        encoding = next(encodings)
        out.append((r.prefix + encoding.ids, [IGNORE_INDEX] * len(r.prefix) + labels_from_spans(encoding, r.spans)))
    return out


def render_and_label(example: Conversation | str, tokenizer) -> tuple[list[int], list[int]]:
    """Token ids and labels (IGNORE_INDEX on everything that is not a target) of one example."""
    return tokenize_rendered([render(example, tokenizer)], tokenizer)[0]
