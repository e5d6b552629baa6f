"""Every format becomes one of two shapes: a conversation (messages, optional tools) or a text document.

    alpaca     {"instruction", "input"?, "output", "system"?}          -> system? + user + assistant
    chat       {"messages": [{"role", "content", "tool_calls"?}], "tools"?, "images"?}   (OpenAI messages; a
               content may be a list of text and image parts: transformers' chat format)
    sharegpt   {"conversations": [{"from", "value"}], "tools"?, "system"?, "images"?}   (from: human/gpt/system/
               function_call/observation, more through the source's `roles`; LLaVA's layout: an `image(s)` column
               and `<image>` in the text)
    text       {"text"}
    preference {"prompt", "chosen", "rejected"}: strings, or message lists (chat template applied; only the
               responses are scored); when chosen and rejected are whole conversations (they open with the
               user's turn), the prompt is what they share and a "prompt" field is ignored (Anthropic HH,
               UltraFeedback layouts)
    unpaired   {"prompt", "completion", "label"}: one response judged alone (TRL's unpaired preference layout for
               KTO): prompt and completion as in preference, label true (desirable) or false (undesirable)
    prompt     {"prompt", "tools"?, any other columns}: a string (used as it is, or as the user's turn with the
               source's chat_prompt) or chat messages ending with the user's turn (chat template applied with the
               generation prompt): online RL (docs/rl.md); the other columns go to the reward functions

Field names are the defaults; a source's `columns` maps them to its dataset's own. A source's
`system_prompt` is added to conversations that have no system message. Errors are raised as DataError
without a location; sources.check_record adds the file:line.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from pathlib import Path
from dataclasses import dataclass, field

from disttrain.recipe.schema import SourceSection
from disttrain.errors import DataError

# ShareGPT `from` values (LLaMA-Factory's and the common Hub spellings) -> roles
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system",
                  "function_call": "function_call", "observation": "tool", "tool": "tool", "function": "tool"}
ROLES = ("system", "user", "assistant", "tool")


@dataclass
class Conversation:
    messages: list[dict]
    tools: list[dict] | None = None
    alpaca: tuple[str, str, str] | None = field(default=None, repr=False)  # for the no-template Alpaca prompt
    images: list[str] = field(default_factory=list)  # in the order the messages show them (data/vision.py)


def column(source: SourceSection, name: str) -> str:
    return source.columns.get(name, name)


def _field(record: Mapping, source: SourceSection, name: str, required: bool = True):
    key = column(source, name)
    value = record.get(key)
    if value is None and required:
        raise DataError(f"missing field {key!r} required by data.format={source.format}")
    return value


def _json_list(value, what: str) -> list | None:
    """Tools and tool-call arguments come as lists/dicts or as JSON strings (ShareGPT files store strings)."""
    if value is None or value == "":
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise DataError(f"{what} is not valid JSON ({exc.msg})") from None
    return value if isinstance(value, list) else [value]


def _with_system(messages: list[dict], system: str | None) -> list[dict]:
    if system and not (messages and messages[0]["role"] == "system"):
        return [{"role": "system", "content": system}, *messages]
    return messages


def _valid_messages(messages, key: str, expected: str = "a non-empty list of messages", where: str = "") -> list:
    """Copies of the messages, each with a known role and content (or tool calls); `where` prefixes errors."""
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{key!r} must be {expected}")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or m.get("role") not in ROLES:
            raise DataError(f"{where}message {i} needs a 'role' among {', '.join(ROLES)}")
        content = m.get("content")
        if content is None and not m.get("tool_calls"):
            raise DataError(f"{where}message {i} ({m['role']}) needs 'content' (or 'tool_calls')")
        if not (content is None or isinstance(content, str) or _content_parts(content)):
            raise DataError(f"{where}message {i} ({m['role']}): 'content' must be a string (or a list of "
                            f"{{'type': 'text', 'text': ...}} and {{'type': 'image', ...}} parts), got "
                            f"{type(content).__name__} {content!r:.40}; quote it in the data")
    return [dict(m) for m in messages]


def _content_parts(content) -> bool:
    """An OpenAI / transformers content list of text and image parts."""
    return isinstance(content, list) and all(
        isinstance(p, Mapping) and (p.get("type") in ("image", "image_url")
                                    or (p.get("type") == "text" and isinstance(p.get("text"), str)))
        for p in content)


def _images_column(record, source):
    """The record's `images` column (LLaVA's single `image` where the dataset has no `images`), or None."""
    if "images" in source.columns:
        return record.get(source.columns["images"])
    return record.get("images", record.get("image"))


def _with_images(conversation: Conversation, record, source) -> Conversation:
    """Image parts made bare for the template, the images listed in order (data/vision.py) and resolved."""
    from disttrain.data.vision import image_ref, take_images

    messages, images = take_images(conversation.messages, _images_column(record, source))
    base = source.image_dir or _folder(source.path)
    conversation.messages = messages
    conversation.images = [image_ref(image, base, f"image {k + 1}") for k, image in enumerate(images)]
    return conversation


@functools.lru_cache(maxsize=64)
def _folder(path: str) -> str | None:
    """The folder of a local data file (relative image paths start there), None for a hub dataset."""
    folder = Path(path).parent
    return str(folder) if folder.is_dir() else None


def _check_messages(messages, key: str) -> list[dict]:
    messages = _valid_messages(messages, key)
    if not any(m["role"] == "assistant" for m in messages):
        raise DataError("conversation has no assistant message, nothing to learn from")
    return messages


def _alpaca(record, source) -> Conversation:
    instruction, output = str(_field(record, source, "instruction")), str(_field(record, source, "output"))
    extra = _field(record, source, "input", required=False) or ""
    prompt = instruction + (f"\n\n{extra}" if extra else "")
    messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": output}]
    system = _field(record, source, "system", required=False) or source.system_prompt
    return Conversation(_with_system(messages, system), alpaca=(instruction, str(extra), output))


def _chat(record, source) -> Conversation:
    key = column(source, "messages")
    messages = _check_messages(_field(record, source, "messages"), key)
    tools = _json_list(_field(record, source, "tools", required=False), column(source, "tools"))
    return _with_images(Conversation(_with_system(messages, source.system_prompt), tools), record, source)


def _sharegpt(record, source) -> Conversation:
    key = column(source, "conversations")
    turns = _field(record, source, "conversations")
    if not isinstance(turns, list) or not turns:
        raise DataError(f"{key!r} must be a non-empty list of {{'from', 'value'}} turns")
    roles = {**SHAREGPT_ROLES, **source.roles}
    messages = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, Mapping) or "from" not in turn or "value" not in turn:
            raise DataError(f"turn {i} needs 'from' and 'value'")
        role = roles.get(turn["from"])
        if role is None:
            raise DataError(f"turn {i}: unknown 'from' value {turn['from']!r}; map it with the source's roles, e.g. "
                            f"roles: {{{turn['from']}: assistant}}")
        if role == "function_call":  # the assistant calling a tool: a target, like any assistant output
            calls = _json_list(turn["value"], f"turn {i} (function_call)")
            messages.append({"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": call} for call in calls]})
        else:
            messages.append({"role": role, "content": str(turn["value"])})
    system = _field(record, source, "system", required=False) or source.system_prompt
    messages = _check_messages(_with_system(messages, system), key)
    tools = _json_list(_field(record, source, "tools", required=False), column(source, "tools"))
    return _with_images(Conversation(messages, tools), record, source)


def _text(record, source) -> str:
    return str(_field(record, source, "text"))


@dataclass
class PreferencePair:
    """One preference record: the prompt's messages and each response's messages (assistant turns)."""

    prompt: list[dict]
    chosen: list[dict]
    rejected: list[dict]
    tools: list[dict] | None = None


def _turns(value, key: str, default_role: str) -> list[dict]:
    if isinstance(value, str):
        return [{"role": default_role, "content": value}]
    return _valid_messages(value, key, "a string or a non-empty list of messages", where=f"{key!r}: ")


def _preference(record, source) -> PreferencePair:
    keys = {name: column(source, name) for name in ("prompt", "chosen", "rejected")}
    chosen = _turns(_field(record, source, "chosen"), keys["chosen"], "assistant")
    rejected = _turns(_field(record, source, "rejected"), keys["rejected"], "assistant")
    raw_prompt = _field(record, source, "prompt", required=False)
    whole = chosen[0]["role"] != "assistant" and rejected[0]["role"] != "assistant"
    if raw_prompt is None or whole:  # whole conversations (UltraFeedback repeats the prompt in a field of its own)
        shared = 0
        while shared < min(len(chosen), len(rejected)) - 1 and chosen[shared] == rejected[shared]:
            shared += 1
        prompt, chosen, rejected = chosen[:shared], chosen[shared:], rejected[shared:]
        if not prompt:
            raise DataError(f"no {keys['prompt']!r} field, and {keys['chosen']!r} and {keys['rejected']!r} share no "
                            "opening messages to use as the prompt")
    else:
        prompt = _turns(raw_prompt, keys["prompt"], "user")
    for name, turns in (("chosen", chosen), ("rejected", rejected)):
        if not any(m["role"] == "assistant" for m in turns):
            raise DataError(f"{keys[name]!r} has no assistant message to score")
    tools = _json_list(_field(record, source, "tools", required=False), column(source, "tools"))
    return PreferencePair(_with_system(prompt, source.system_prompt), chosen, rejected, tools)


@dataclass
class UnpairedExample:
    """One unpaired preference record (KTO): the prompt's messages, the response's, and whether it is desirable."""

    prompt: list[dict]
    completion: list[dict]
    desirable: bool
    tools: list[dict] | None = None


def _unpaired(record, source) -> UnpairedExample:
    keys = {name: column(source, name) for name in ("prompt", "completion", "label")}
    prompt = _turns(_field(record, source, "prompt"), keys["prompt"], "user")
    completion = _turns(_field(record, source, "completion"), keys["completion"], "assistant")
    if not any(m["role"] == "assistant" for m in completion):
        raise DataError(f"{keys['completion']!r} has no assistant message to score")
    label = _field(record, source, "label")
    if not isinstance(label, bool):
        raise DataError(f"{keys['label']!r} must be true or false (is the completion desirable?), got "
                        f"{type(label).__name__} {label!r:.40}")
    tools = _json_list(_field(record, source, "tools", required=False), column(source, "tools"))
    return UnpairedExample(_with_system(prompt, source.system_prompt), completion, label, tools)


@dataclass
class Prompt:
    """One prompt for online RL: plain text (used as it is) or a conversation ending with the user's turn."""

    text: str | None = None
    conversation: Conversation | None = None


def _prompt(record, source) -> Prompt:
    key = column(source, "prompt")
    value = _field(record, source, "prompt")
    if isinstance(value, str):
        if not value:
            raise DataError(f"{key!r} is empty")
        if not source.chat_prompt:
            return Prompt(text=value)
        value = [{"role": "user", "content": value}]
    messages = _valid_messages(value, key, "a string or a non-empty list of messages", where=f"{key!r}: ")
    if messages[-1]["role"] != "user":
        raise DataError(f"{key!r} must end with the user's turn (its last message is {messages[-1]['role']!r}): the "
                        "policy writes the next assistant turn")
    tools = _json_list(_field(record, source, "tools", required=False), column(source, "tools"))
    return Prompt(conversation=Conversation(_with_system(messages, source.system_prompt), tools))


_READERS = {"alpaca": _alpaca, "chat": _chat, "sharegpt": _sharegpt, "text": _text, "preference": _preference,
            "unpaired": _unpaired, "prompt": _prompt}


def to_example(record: Mapping, source: SourceSection) -> (Conversation | str | PreferencePair | UnpairedExample
                                                            | Prompt):
    """The record as a conversation (alpaca, chat, sharegpt), a document (text), a preference pair, an unpaired
    example or a prompt."""
    return _READERS[source.format](record, source)
