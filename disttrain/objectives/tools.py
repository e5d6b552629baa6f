"""The tools of agentic rollouts (rl.tools, rl.environment), as TRL's GRPOTrainer takes them: plain functions with
type hints and a Google-style docstring, and an environment class whose public methods are tools (one instance per
completion, reset before it; get_reward(), when it has one, scores it). Their JSON schemas are transformers' own
(get_json_schema), rendered by the model's chat template.

Everything a user can get wrong here is one line before the model loads: a spec that does not import, a function
transformers cannot describe, an environment without reset(). What a tool does wrong during a rollout is the
policy's problem, not the run's: an exception, a call past rl.tool_timeout, unknown arguments or a result that is
not a string (or a number) becomes a tool message saying so, as TRL's `{'error': ...}`, and is counted
(tools/failure_frequency).

A call runs in a daemon thread of the trainer, so that a call past its timeout can be left behind: a function
cannot be stopped from outside its process, and an environment's state lives in this one. Code the model writes
never runs here: the shipped Python tool (sandbox.py) runs it in a subprocess with limits.
"""

from __future__ import annotations

import inspect
import threading
from typing import Callable

from disttrain.errors import DisttrainError
from disttrain.objectives.rewards import load_function

EXCLUDED = ("reset", "get_reward")  # an environment's methods that are not tools


def describe(function: Callable, where: str) -> dict:
    """transformers' JSON schema of a tool, or one line saying what it lacks."""
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(function)
    except Exception as exc:  # TypeError / DocstringParsingException: no docstring, no type hint, no Args entry
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DisttrainError(f"{where}: transformers cannot describe {getattr(function, '__name__', function)!r} to "
                             f"the model: {reason} (a tool needs a type hint on every argument and a Google-style "
                             "docstring with an Args: entry for each)") from None


def environment_methods(instance) -> list[Callable]:
    """An environment's tools: its public methods, except reset and get_reward (listed on the class, as TRL does:
    reading them on the instance would evaluate its properties)."""
    return [getattr(instance, name) for name, _ in inspect.getmembers(type(instance), predicate=inspect.isfunction)
            if name not in EXCLUDED and not name.startswith("_")]


class Toolbox:
    """rl.tools and rl.environment, loaded and described; environment instances pooled and handed out one per
    completion of a rollout (constructed once, reset before every use: TRL's contract)."""

    def __init__(self, rl):
        self.timeout = rl.tool_timeout
        self.functions = [load_function(spec, f"rl.tools[{i}]") for i, spec in enumerate(rl.tools)]
        self.environment = None
        self.pool: list = []
        self.handed = 0  # instances of the pool handed out in this step's rollout
        if rl.environment is not None:
            self.environment = load_function(rl.environment, "rl.environment")
            if not inspect.isclass(self.environment):
                raise DisttrainError(f"rl.environment: {rl.environment} is not a class (its public methods are the "
                                     "tools, reset() starts a completion)")
            try:
                self.pool.append(self.environment())
            except Exception as exc:
                raise DisttrainError(f"rl.environment: {rl.environment}() raised {type(exc).__name__}: "
                                     f"{str(exc)[:200]} (it is constructed with no arguments)") from None
            if not callable(getattr(self.pool[0], "reset", None)):
                raise DisttrainError(f"rl.environment: {rl.environment} has no reset() method (called before each "
                                     "completion with the prompt's record; it may return text for the user's turn)")
        methods = environment_methods(self.pool[0]) if self.pool else []
        if not self.functions and not methods:
            raise DisttrainError(f"rl.environment: {rl.environment} has no public method to offer as a tool")
        where = [f"rl.tools[{i}]" for i in range(len(self.functions))] + ["rl.environment"] * len(methods)
        self.schemas = [describe(f, w) for f, w in zip(self.functions + methods, where)]
        names = [s["function"]["name"] for s in self.schemas]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise DisttrainError(f"rl.tools / rl.environment: two tools are named {repeated[0]!r}: the model calls "
                                 "a tool by its name, so each needs its own")
        self.rewarding = self.pool and callable(getattr(self.pool[0], "get_reward", None))

    @property
    def reward_name(self) -> str | None:
        """The environment's reward's name in the metrics (rewards/<class>/mean), when it has get_reward()."""
        return self.environment.__name__ if self.rewarding else None

    def rewind(self) -> None:
        """A step's rollout begins: every pooled instance may be handed out (and reset) again."""
        self.handed = 0

    def instances(self, count: int) -> list:
        """`count` environment instances (None each without an environment), none handed out before in this step:
        a resampled group gets fresh ones while the others' still hold their state for the rewards."""
        if self.environment is None:
            return [None] * count
        while len(self.pool) < self.handed + count:
            self.pool.append(self.environment())
        self.handed += count
        return self.pool[self.handed - count:self.handed]

    def callables(self, instance) -> dict[str, Callable]:
        """{name: function} a completion may call: the functions and its environment instance's methods."""
        methods = environment_methods(instance) if instance is not None else []
        return {f.__name__: f for f in self.functions + methods}

    def call(self, tools: dict[str, Callable], call: dict) -> tuple[str, str, bool]:
        """(tool name, the tool message's content, failed) of one parsed call."""
        function = call.get("function") if isinstance(call, dict) else None
        name = str(function.get("name", "unknown")) if isinstance(function, dict) else "unknown"
        try:
            if not isinstance(function, dict) or call.get("type", "function") != "function":
                raise ValueError(f"unsupported tool call: {str(call)[:100]}")
            if name not in tools:
                raise ValueError(f"Tool {name} not found.")
            arguments = function.get("arguments") or {}
            if not isinstance(arguments, dict):
                raise TypeError(f"the arguments of {name} must be an object, not {type(arguments).__name__}")
            _check_arguments(name, tools[name], arguments)
            result = _within(tools[name], arguments, self.timeout)
            if not isinstance(result, (str, int, float)):  # TRL renders numbers (and bools) with str()
                raise TypeError(f"{name} returned {type(result).__name__}: a tool returns a string (or a number)")
            return name, str(result), False
        except Exception as exc:
            return name, str({"error": str(exc) or type(exc).__name__}), True


def _check_arguments(name: str, function: Callable, arguments: dict) -> None:
    """Unknown or missing arguments, named before the tool runs (the policy reads the message)."""
    signature = inspect.signature(function)
    accepted = [p.name for p in signature.parameters.values() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if not any(p.kind == p.VAR_KEYWORD for p in signature.parameters.values()):
        unknown = sorted(set(arguments) - set(accepted))
        if unknown:
            raise TypeError(f"{name} has no argument {unknown[0]!r} (it takes: {', '.join(accepted) or 'none'})")
    try:
        signature.bind(**arguments)
    except TypeError as exc:
        raise TypeError(f"{name}: {exc}") from None


def _within(function: Callable, arguments: dict, seconds: float):
    """function(**arguments), or TimeoutError after `seconds` (the call is left running in its daemon thread)."""
    outcome: dict = {}

    def run():
        try:
            outcome["value"] = function(**arguments)
        except BaseException as exc:  # noqa: BLE001 -- handed to the caller, who turns it into a tool message
            outcome["error"] = exc

    thread = threading.Thread(target=run, daemon=True, name="disttrain-tool")
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        raise TimeoutError(f"the call took longer than rl.tool_timeout={seconds:g}s")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]
