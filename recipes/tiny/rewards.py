"""Reward functions of recipes/tiny/grpo.yaml, written as TRL's are: keyword arguments by name (the dataset's
`answer` column among them), one number per completion. A completion is a list of messages here (the prompts are
chat messages), the assistant's text in its one message."""

from __future__ import annotations


def _text(completion) -> str:
    return completion[0]["content"] if isinstance(completion, list) else completion


def answer_words(completions, answer, **kwargs) -> list[float]:
    """The share of the expected answer's words that the completion holds (anywhere, in any order): partial
    credit, so it rises long before the first exact answer."""
    rewards = []
    for completion, expected in zip(completions, answer):
        text, wanted = _text(completion), expected.split()
        rewards.append(sum(word in text for word in wanted) / len(wanted))
    return rewards


def exact_answer(completions, answer, **kwargs) -> list[float]:
    """1 for the exact answer (whitespace aside), else 0: the verifiable reward."""
    return [float(" ".join(_text(c).split()) == " ".join(a.split())) for c, a in zip(completions, answer)]


def letters(completions, **kwargs) -> list[float]:
    """The share of the completion's characters that are lowercase letters or spaces (the tasks' alphabet): a
    dense shaping reward, different for nearly every completion of a random model, rising as the policy stops
    writing stray bytes."""
    return [sum(ch.islower() or ch == " " for ch in _text(c)) / max(len(_text(c)), 1) for c in completions]


def starts_with_a_word(completions, log_metric=None, **kwargs) -> list[float]:
    """1 when the completion starts with a lowercase letter, else 0: a coarse reward whose groups often score all
    alike (no signal), what rl.dynamic_sampling redraws. Logs its share through TRL's log_metric when given."""
    rewards = [float(_text(c)[:1].islower()) for c in completions]
    if log_metric is not None:
        log_metric("starts_with_a_word/share", sum(rewards) / len(rewards))
    return rewards
