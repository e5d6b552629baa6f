"""Rewards for GSM8K-style math (openai/gsm8k: `question`, and `answer` ending in `#### <number>`), written as TRL's
reward functions are, for the shipped GRPO recipes. The format reward is TRL's own (trl.rewards:think_format_reward).
"""

from __future__ import annotations

import re

NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def _text(completion) -> str:
    """The answer: a plain completion, or the last message of a chat one (with tools, the turn after the last
    tool reply)."""
    return completion[-1]["content"] if isinstance(completion, list) else completion


def _number(text: str) -> float | None:
    try:
        return float(text.replace(",", "").rstrip("."))
    except ValueError:
        return None


def final_number(text: str) -> float | None:
    """The number after the last `####` (the dataset's answers and the asked-for format), else the last number of
    the text after any reasoning block."""
    text = text.split("</think>")[-1]
    if "####" in text:
        found = NUMBER.findall(text.split("####")[-1])
        return _number(found[0]) if found else None
    found = NUMBER.findall(text)
    return _number(found[-1]) if found else None


def accuracy(completions, answer, **kwargs) -> list[float | None]:
    """1 when the completion's final number is the answer's, else 0; None (not scored) when the dataset's answer
    has no number."""
    rewards = []
    for completion, expected in zip(completions, answer):
        truth = final_number(expected or "")
        got = final_number(_text(completion))
        rewards.append(None if truth is None else float(got is not None and abs(got - truth) < 1e-6))
    return rewards
