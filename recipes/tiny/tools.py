"""The tiny tool task's tool, reward and environment (recipes/tiny/tool_grpo.yaml; docs/rl.md, 'Agents'): "What is
the code of <word>?" -- a code only the lookup tool knows, so the policy learns to call it and to answer with its
reply. Tools are plain functions with type hints and a Google-style docstring, as TRL takes them."""

from disttrain.tools.tiny import WORDS, code_of


def lookup(word: str) -> str:
    """Look up the secret code of a word.

    Args:
        word: The word whose code is wanted.
    """
    if word not in WORDS:
        raise ValueError(f"unknown word {word!r}")
    return code_of(word)


def code_answer(completions, answer, **kwargs) -> list[float]:
    """1 when the completion's last message is exactly the code, else 0."""
    return [float(c[-1]["content"].strip() == a) for c, a in zip(completions, answer)]


class CodeBook:
    """The same task as an environment (rl.environment): lookup is its method, and its own reward says whether the
    policy looked the right word up."""

    def reset(self, answer: str, **kwargs) -> None:
        self.answer, self.looked_up = answer, []

    def lookup(self, word: str) -> str:
        """Look up the secret code of a word.

        Args:
            word: The word whose code is wanted.
        """
        self.looked_up.append(word)
        return lookup(word)

    def get_reward(self) -> float:
        return float(any(code_of(w) == self.answer for w in self.looked_up if w in WORDS))
