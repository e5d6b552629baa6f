"""Render a conversation once, as the model will see it, and learn only what the assistant says.

The conversation is rendered by the tokenizer's chat template exactly once (earlier turns as the template
writes them in the full conversation: Qwen3's, for one, drops the reasoning of earlier assistant turns), and
the assistant's tokens are found in that one rendering:
- templates with `{% generation %}` markers: transformers' assistant-token mask says which tokens are the
  assistant's;
- any other template: what the template writes around a reply is learned once from probe renderings
  (`TurnLayout`: its assistant header, what closes the previous turn, its end-of-turn token). Then every
  message is located in order in the rendering: a user or tool message moves a cursor past its own content,
  so a reply starts after the message before it, never inside it, even when a short answer ("yes", "A",
  "42") also occurs in the question. A reply starts after its header (header-less `[INST] ... [/INST]`
  templates: after the user turn's closing) and ends with the template's end-of-turn token (`<|im_end|>`,
  `<|eot_id|>`, `</s>`), which is learned too, so the model learns to stop. Tool calls rendered inside an
  assistant turn are targets, even when their opener is a special token (Granite's `<|tool_call|>`); tool
  results, prompts and system text are not. A turn that cannot be located is refused in one line.
  Characters map to tokens through the fast tokenizer's offsets.
Hand-written because transformers masks assistant tokens only for templates with generation markers, which
few shipped templates have (TRL's assistant_only_loss needs them too).
Without a chat template (base models) a plain `role: content` layout (Alpaca's prompt for alpaca records)
is used, each answer followed by the EOS token.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass

from disttrain.data.formats import Conversation
from disttrain.errors import DataError

IGNORE_INDEX = -100

# Used only when the tokenizer has no chat template (base models).
ALPACA_PROMPT = ("Below is an instruction that describes a task{with_input}. Write a response that appropriately "
                 "completes the request.\n\n### Instruction:\n{instruction}\n\n{input_block}### Response:\n")


def has_generation_markers(template: str | None) -> bool:
    return bool(template) and "generation" in template and "endgeneration" in template


# Probe conversation: texts no template rewrites and no default system prompt contains.
_PROBE_USER, _PROBE_REPLY, _PROBE_NEXT = "disttrain-probe-question", "disttrain-probe-reply", "disttrain-probe-next"


@dataclass(frozen=True)
class TurnLayout:
    """What one chat template writes around an assistant's reply, learned once from probe renderings.

    header: the pieces (special tokens, words) of the assistant header as histories write it, matched with any
        whitespace between them: what add_generation_prompt appends, as far as a rendered history repeats it
        (DeepSeek-R1's `<think>` opener is only in the prompt), or, for header-less templates (`[INST] ...
        [/INST] answer</s>`), what closes the user's turn; then `openers`, the prompt's further pieces, are
        skipped where a history has them too.
    closing: what the template writes between the previous message and the header, once markup (special and
        added tokens) and whitespace are removed; a header counts for a turn only after that and nothing else.
    end: the token that closes an assistant turn, from what the rendering puts right after a reply
        (`<|im_end|>`, `</s>`, `<|eot_id|>`, `<end_of_turn>`); a tool-call opener is never an end.
    """

    header: tuple[str, ...]
    openers: tuple[str, ...]
    closing: str
    end: str | None
    markup: re.Pattern | None
    # the whitespace the generation prompt ends with after its header and openers: the prompt ends there, so a
    # reply starts after as much of it as a rendering has (_header_end)
    gap: str = ""


_LAYOUTS: dict[tuple, TurnLayout] = {}  # a cache per (template, vocabulary); the tokenizer is not touched, so
                                         # `datasets` fingerprints of the tokenising function stay the same


def _markup_tokens(tokenizer) -> list[str]:
    tokens = set(tokenizer.all_special_tokens)
    tokens |= {t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values()}
    return sorted((t for t in tokens if t), key=len, reverse=True)


def _pieces(text: str, markup: re.Pattern | None) -> tuple[str, ...]:
    """`text` as a sequence of markup tokens and whitespace-separated words."""
    parts = markup.split(text) if markup else [text]
    out: list[str] = []
    for i, part in enumerate(parts):
        out.extend([part] if i % 2 else part.split())  # re.split with one group: odd items are the tokens
    return tuple(out)


def _header_regex(pieces: tuple[str, ...]) -> re.Pattern:
    return re.compile(r"\s*".join(map(re.escape, pieces)))


_TAG = re.compile(r"<[^<>\s]{1,40}>")  # tags a template writes as text (`</tool_response>` where it is no token)


def _strip_markup(text: str, markup: re.Pattern | None) -> str:
    """`text` without markup tokens, tags and whitespace: what is left is prose."""
    return "".join(_TAG.sub("", markup.sub("", text) if markup else text).split())


def _render_probe(tokenizer, messages, **kwargs) -> str | None:
    """The probe rendered, or None where the template refuses it; templates that demand a system turn get
    one."""
    for opening in ([], [{"role": "system", "content": "disttrain-probe-system"}]):
        try:
            return tokenizer.apply_chat_template([*opening, *messages], tokenize=False, **kwargs)
        except Exception:
            continue
    return None


def turn_layout(tokenizer) -> TurnLayout:
    key = (tokenizer.chat_template, len(tokenizer), tokenizer.bos_token, tokenizer.eos_token)
    if key not in _LAYOUTS:
        try:
            _LAYOUTS[key] = _learn_layout(tokenizer)
        except Exception as exc:  # a template shape the probes do not cover: one line, not a traceback
            said = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            raise DataError(f"the chat template of {tokenizer.name_or_path} could not be read for assistant-only "
                            f"masking ({type(exc).__name__}: {said}); "
                            "add {% generation %} markers around the assistant's replies in the model's chat template "
                            "(chat_template.jinja or tokenizer_config.json; docs/data.md#chat-templates)") from None
    return _LAYOUTS[key]


def _learn_layout(tokenizer) -> TurnLayout:
    tokens = _markup_tokens(tokenizer)
    markup = re.compile("(" + "|".join(map(re.escape, tokens)) + ")") if tokens else None
    user = [{"role": "user", "content": _PROBE_USER}]
    reply = {"role": "assistant", "content": _PROBE_REPLY}
    prompt, history = _render_probe(tokenizer, user, add_generation_prompt=True), _render_probe(tokenizer, user)
    # what add_generation_prompt appends (Phi-3's template writes EOS instead when it is off: compare the two
    # renderings from where they part)
    shared = len(os.path.commonprefix([prompt, history])) if prompt and history else 0
    generation = prompt[shared:] if shared else ""
    text = (_render_probe(tokenizer, [*user, reply, {"role": "user", "content": _PROBE_NEXT}])
            or _render_probe(tokenizer, [*user, reply]) or "")
    glue, after = "", ""
    if _PROBE_USER in text and _PROBE_REPLY in text:
        between = text.index(_PROBE_USER) + len(_PROBE_USER)
        reply_at = text.index(_PROBE_REPLY, between)
        glue, after = text[between:reply_at], text[reply_at + len(_PROBE_REPLY):]
    wanted = _pieces(generation, markup)
    # how much of the generation prompt a rendered history repeats (R1's history lacks its `<think>` opener)
    matched = next((n for n in range(len(wanted), 0, -1) if _header_regex(wanted[:n]).search(glue)), 0)
    if matched:
        header, openers = wanted[:matched], wanted[matched:]
        # search, not match: a template without whitespace control may start the prompt with blank lines
        gap = _leading_space(generation[_header_regex(wanted).search(generation).end():])
    else:  # header-less ([INST] ... [/INST] answer): the reply follows what closes the user's turn, and the
        # whitespace the prompt ends with (a newline after `[/INST]` where the template writes one)
        prompt_end = prompt or history or ""
        header, openers, gap = _pieces(glue, markup), (), prompt_end[len(prompt_end.rstrip()):]
    closing = ""
    if header and (found := _header_regex(header).search(glue)):
        closing = _strip_markup(glue[:found.start()], markup)
    bos = tokenizer.bos_token
    ends = [m.group(0) for m in markup.finditer(after) if m.group(0) != bos] if markup else []
    return TurnLayout(header, openers, closing, ends[0] if ends else None, markup, gap)


def _leading_space(text: str) -> str:
    return text[:len(text) - len(text.lstrip())]


def _layout_length(space: str) -> int:
    """How much of the whitespace before a reply is the template's layout: up to its last line break (a history
    written on more lines than the prompt); spaces after that are the reply's own (Llama-2's " answer")."""
    return max(space.rfind("\n"), space.rfind("\r")) + 1


def _refuse(k: int, what: str) -> DataError:
    return DataError(f"assistant turn {k + 1}: {what} in the chat template's rendering, so its tokens cannot be "
                     "told apart from the prompt's; use a template with {% generation %} markers "
                     "(docs/data.md#chat-templates) or check the record against the model's template")


def _find_text(text: str, needle: str, start: int, markup: list[tuple[int, int]]) -> int:
    """text.find(needle, start), skipping occurrences that cut into a markup token: a one-letter reply "d" is
    not the "d" of `<|im_end|>`, a user's "a" not the "a" of `<|im_start|>`."""
    at = text.find(needle, start)
    while at >= 0 and any(s < at + len(needle) and at < e and not (at <= s and e <= at + len(needle))
                          for s, e in markup):
        at = text.find(needle, at + 1)
    return at


def _find_message(text: str, content: str, cursor: int, markup: list[tuple[int, int]]) -> int:
    """End of a prompt message's content in the rendering after `cursor`, or -1. Templates write it as it is
    (trimmed) or as JSON (Llama-3.1's tool results)."""
    found = [(at, -len(c)) for c in (content, json.dumps(content, ensure_ascii=False))
             if (at := _find_text(text, c, cursor, markup)) >= 0]
    if not found:
        return -1
    at, minus_length = min(found)  # the first occurrence; at one place the JSON form, which encloses the text
    return at - minus_length


def _message_end(text: str, message: dict, cursor: int, markup: list[tuple[int, int]]) -> tuple[int, int]:
    """(start, end) of a prompt message in the rendering after `cursor`, or (-1, -1): its content, or each text
    part of a content list in order (images between them are written as placeholders)."""
    content = message.get("content")
    pieces = ([p.get("text") or "" for p in content if isinstance(p, dict)] if isinstance(content, list)
              else [message_text(message)])
    start = -1
    for piece in (p.strip() for p in pieces):
        if piece:
            cursor = _find_message(text, piece, cursor, markup)
            if cursor < 0:
                return -1, -1
            start = cursor - len(piece) if start < 0 else start
    return start, cursor


def _reply_anchor(text: str, message: dict, cursor: int, layout: TurnLayout, markup: list[tuple[int, int]]) -> int:
    """End of the message right before a reply: its first occurrence after `cursor` that the reply's header
    follows, or its first occurrence where none does (header-less templates). A short message ("no", "a") also
    occurs earlier, in text the template writes itself (Llama-3.1's "Cutting Knowledge Date", Qwen2.5's default
    system prompt, Alpaca's "### Instruction"): the reply never starts there."""
    first = -1
    search = cursor
    while True:
        start, end = _message_end(text, message, search, markup)
        if end < 0:
            return first
        if first < 0:
            first = end
        if start < 0 or _header_end(text, end, layout) >= 0:  # start < 0: no text to find (an image alone)
            return end
        search = start + 1


def _header_end(text: str, cursor: int, layout: TurnLayout) -> int:
    """Where this turn's header ends (openers and whitespace skipped), or -1 when the header that follows the
    previous message is not there (R1 writes no header after tool results)."""
    if not layout.header:
        return -1
    found = _header_regex(layout.header).search(text, cursor)
    if not found or _strip_markup(text[cursor:found.start()], layout.markup) not in ("", layout.closing):
        return -1
    end, consumed = found.end(), 0
    for piece in layout.openers:  # the prompt's openers, where the history writes them too
        opener = re.compile(r"\s*" + re.escape(piece)).match(text, end)
        if not opener:
            break
        end, consumed = opener.end(), consumed + 1
    # the prompt's whitespace there, as far as the rendering has it (none where the history leaves out an opener
    # the prompt has: R1's `<think>`); further whitespace up to the last line break is layout too (a history
    # written on more lines than the prompt), spaces after it the reply's own (Llama-2's " answer")
    gap = layout.gap if consumed == len(layout.openers) else ""
    end += len(os.path.commonprefix([gap, text[end:end + len(gap)]]))
    return end + _layout_length(_leading_space(text[end:]))


def assistant_spans(text: str, messages: list[dict], tokenizer) -> list[tuple[int, int]]:
    """Character spans of the assistant turns in one rendering of `messages`, end-of-turn token included.

    Every message is located in order: a user or tool message moves the cursor past its own content (a system
    message only when nothing else precedes the reply: templates move it, into the first or the last user
    turn), so a reply can never start inside the prompt, even when its text also occurs there."""
    layout = turn_layout(tokenizer)
    markup = [m.span() for m in layout.markup.finditer(text)] if layout.markup else []
    spans, cursor, waiting = [], 0, []
    for message in messages:
        if message["role"] != "assistant":
            waiting.append(message)
            continue
        prompt = [m for m in waiting if m["role"] != "system"] or waiting
        for i, m in enumerate(prompt):
            found = (_reply_anchor(text, m, cursor, layout, markup) if i == len(prompt) - 1 else
                     _message_end(text, m, cursor, markup)[1])
            if found < 0 and m["role"] != "system":
                raise _refuse(len(spans), f"the {m['role']} message before it is not found verbatim")
            cursor = max(cursor, found)
        waiting = []
        k = len(spans)
        content = message_text(message).strip()
        start = _header_end(text, cursor, layout)
        if start < 0:  # no header for this turn: the reply starts at its own content, with the whitespace
            # the model writes before it (" answer</s>")
            at = _find_text(text, content, cursor, markup) if content else -1
            if at < 0:
                raise _refuse(k, "neither its header nor its content is found")
            start = cursor + len(text[cursor:at].rstrip())
            start += _layout_length(text[start:at])  # as after a header
        at = _find_text(text, content, start, markup) if content else -1
        if at >= 0 and layout.end and layout.end in text[start:at]:
            at = -1  # that occurrence belongs to a later turn: the template rewrote this reply
        after = at + len(content) if at >= 0 else start
        closed = text.find(layout.end, after) if layout.end else -1
        if closed >= 0:
            end = closed + len(layout.end)
        elif at >= 0:
            end = after  # templates that close replies with no token (plain text ones)
        else:
            raise _refuse(k, "its end is not found")
        spans.append((start, end))
        cursor = end
    return spans


def message_text(message: dict) -> str:
    """A message's text: its content string, or the text parts of an OpenAI content list."""
    content = message.get("content")
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return content or ""


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
            spans.append((len(text), len(text) + len(message_text(message)) + len(eos)))
            text += message_text(message) + eos + "\n"
        else:
            text += f"{message['role']}: {message_text(message)}\n"
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
    opening: int = 0  # characters of `text` a truncation keeps first (preference pairs: BOS, system, header)
    images: list[str] | None = None  # a conversation with images: them, in order (its placeholders expanded)


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


def render(example: Conversation | str, tokenizer, text_spans: bool = False) -> Rendered:
    """The text the model sees for one example and what of it is learned; no tokenising (but for templates
    with generation markers, which transformers tokenises and masks in one call, unless `text_spans`: the
    rendering's character spans are wanted, as for a conversation with images, whose placeholders the
    processor expands in the text)."""
    if isinstance(example, str):  # a document: every token is learned
        text = example + tokenizer.eos_token
        return Rendered(text, [(0, len(text))], _bos(tokenizer))
    template = tokenizer.chat_template
    if not template:
        text, spans = _plain_rendering(example, tokenizer)
        return Rendered(text, spans, _bos(tokenizer))
    if has_generation_markers(template) and not text_spans:
        out = apply_template(tokenizer, example, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        ids = list(out["input_ids"])
        return Rendered(None, [], [], ids, [t if m else IGNORE_INDEX for t, m in zip(ids, out["assistant_masks"])])
    text = apply_template(tokenizer, example, tokenize=False)
    return Rendered(text, assistant_spans(text, example.messages, tokenizer), [])


def apply_template(tokenizer, conversation: Conversation, **kwargs):
    """The chat template applied to a conversation; its own refusals (`raise_exception(...)`: "Conversation
    roles must alternate", "System role not supported") and its failures become one DataError line."""
    if conversation.tools:
        kwargs["tools"] = conversation.tools
    try:
        return tokenizer.apply_chat_template(conversation.messages, **kwargs)
    except Exception as exc:  # jinja2's TemplateError for raise_exception, TypeError/KeyError inside a template
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DataError(f"the chat template refused this conversation: {message}") from None


def tokenize_rendered(items: list[Rendered], tokenizer, openings: bool = False) -> list[tuple]:
    """(ids, labels) of each rendered example; every text goes through ONE batched fast-tokenizer call.
    With `openings`: (ids, labels, the number of tokens before the example's `opening` character)."""
    texts = [r.text for r in items if r.text is not None]
    if texts:
        _check_fast(tokenizer)
        encodings = iter(tokenizer(texts, add_special_tokens=False).encodings)  # Rust encodings: char_to_token
    out = []
    for r in items:
        if r.text is None:
            out.append((r.ids, r.labels, len(r.prefix)) if openings else (r.ids, r.labels))
            continue
        encoding = next(encodings)
        ids, labels = r.prefix + encoding.ids, [IGNORE_INDEX] * len(r.prefix) + labels_from_spans(encoding, r.spans)
        if openings:
            token = encoding.char_to_token(r.opening) if 0 < r.opening < len(r.text) else None
            out.append((ids, labels, len(r.prefix) + (token or 0)))
        else:
            out.append((ids, labels))
    return out


def render_and_label(example: Conversation | str, tokenizer) -> tuple[list[int], list[int]]:
    """Token ids and labels (IGNORE_INDEX on everything that is not a target) of one example."""
    return tokenize_rendered([render(example, tokenizer)], tokenizer)[0]
