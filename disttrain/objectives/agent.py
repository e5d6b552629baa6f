"""Multi-turn rollouts with tools (rl.tools, rl.environment): TRL's tool-calling loop, batched.

Each completion is a trajectory: the policy's turn is sampled; the turn is parsed with the tokenizer's own
response parser (transformers' parse_response over its response_template, or the one TRL knows for the chat
template); when it calls tools and ended at EOS, they are run (tools.py) and their messages, rendered by the chat
template, are appended as tokens; the policy continues from there. A trajectory ends at a turn without calls, at
rl.max_tool_calling_iterations rounds of calls, or when rl.max_completion_length -- counted over the whole
trajectory, tool tokens included, as TRL counts it -- is reached (a tool turn that would not fit ends it as it is).

Every turn of all the rank's unfinished trajectories is one generate() call (rl.rows_per_generate rows at most);
a trajectory's turn t draws from its own seed and t, so what it samples depends on nothing beside it and every
strategy samples what one process samples.

Only the policy's tokens are learned: `policy` is 1 at each of them and 0 at every token a tool's message added,
and training_rows() puts no label and no weight on the zeros (the loss, the KL, the entropy, the importance ratios
and the length normalisations all read that mask).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from disttrain.errors import DisttrainError
from disttrain.objectives import sampling


@dataclass
class Trajectory:
    prompt_ids: list[int]
    seed: int
    tools: dict[str, Callable]  # what this trajectory may call (its environment instance's methods included)
    environment: object | None = None
    ids: list[int] = field(default_factory=list)  # after the prompt: the policy's tokens and the tools' messages'
    policy: list[int] = field(default_factory=list)  # 1: a token the policy sampled; 0: a tool message's
    messages: list[dict] = field(default_factory=list)  # the assistant and tool messages, as TRL hands them on
    truncated: bool = False  # stopped by max_completion_length inside a policy turn
    turns: int = 0
    calls: int = 0
    failures: int = 0

    @property
    def completion(self) -> tuple[list[int], bool]:
        """(ids, truncated), the single-turn rollouts' form."""
        return self.ids, self.truncated


def turn_seed(seed: int, turn: int) -> int:
    """The seed of a trajectory's turn: its completion's seed at the first (a trajectory that calls no tool samples
    what a single-turn rollout samples), a hash of both after."""
    return seed if turn == 0 else sampling.completion_seed(seed, turn, -2, -2)


def check_template(tokenizer, name: str) -> None:
    """The chat template renders a whole tool exchange and a response parser exists for it (TRL's own response
    templates for the chat templates it knows are added here), else one line naming what is missing."""
    from trl.chat_template_utils import add_response_schema, supports_tool_calling

    if not supports_tool_calling(tokenizer):
        raise DisttrainError(f"rl.tools: the chat template of {name} cannot express tool calls (rendering user -> "
                             "assistant with tool_calls -> tool loses the call's name, its arguments or the tool's "
                             "message): use a model whose template renders them, or set model.chat_template")
    if getattr(tokenizer, "response_template", None) is None and getattr(tokenizer, "response_schema", None) is None:
        try:
            add_response_schema(tokenizer)
        except ValueError:  # "Unrecognized chat template": refused below, in one line
            pass
    if getattr(tokenizer, "response_template", None) is None and getattr(tokenizer, "response_schema", None) is None:
        raise DisttrainError(f"rl.tools: the tokenizer of {name} has no response_template (transformers' parser of "
                             "a turn's tool calls) and TRL knows none for its chat template: add one to its "
                             "tokenizer_config.json (docs/rl.md, 'Agents')")


def tool_turn_ids(tokenizer, tool_messages: list[dict], eos: list[int]) -> list[int]:
    """The tokens the chat template puts after an assistant turn that ended at EOS: the tool messages and the next
    assistant header. Found by rendering a short exchange with and without them (the real tool name: some
    templates name the tool in its message's header): what follows the EOS that ends the assistant's turn is
    theirs. The turn is found by counting end-of-turn tokens (`eos`: where the policy's turns end -- the
    tokenizer's EOS and the generation config's, e.g. Gemma's <end_of_turn>), not by comparing the renderings'
    beginnings: a template may render the last assistant turn differently from an earlier one (Qwen3 adds an empty
    think block to the last), and the policy's own tokens are kept as it sampled them whichever way."""
    calls = [{"type": "function", "function": {"name": tool_messages[0]["name"], "arguments": {}}}]
    head = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "", "tool_calls": calls}]
    before = list(tokenizer.apply_chat_template(head, tokenize=True, add_generation_prompt=False, return_dict=False))
    after = list(tokenizer.apply_chat_template(head + tool_messages, tokenize=True, add_generation_prompt=True,
                                               return_dict=False))
    turns = sum(token in eos for token in before)
    ends = [i for i, token in enumerate(after) if token in eos]
    if not turns or len(ends) < turns:
        raise DisttrainError(f"rl.tools: the chat template ends an assistant turn with none of the tokens "
                             f"generation stops at ({tokenizer.convert_ids_to_tokens(eos)}), so the tools' replies "
                             "cannot be placed after a sampled turn: set the tokenizer's eos_token (or the generation "
                             "config's eos_token_id) to the template's end-of-turn token")
    return after[ends[turns - 1] + 1:]


def parse_turn(tokenizer, ids: list[int], prefix: list[int], schemas: list[dict]) -> dict:
    """The assistant message of a sampled turn (TRL's parse_response: a malformed call is plain text)."""
    from trl.chat_template_utils import parse_response

    return parse_response(tokenizer, ids, prefix=prefix, tools=schemas)


def roll_out(trajectories: list[Trajectory], generate, more, tokenizer, toolbox, rl, eos: list[int]) -> None:
    """Every trajectory played to its end, in place. `generate(prompts, seeds, max_new_tokens)` samples one turn of
    each row ((ids, truncated) each), ending at a token of `eos`; `more(rows)` says whether any rank still has
    rows to sample (every rank makes the same calls where generate() is synced) -- with none here, generate is
    called with no rows."""
    active, turn = list(trajectories), 0
    while more(len(active)):
        budgets = [rl.max_completion_length - len(t.ids) for t in active]
        sampled = generate([t.prompt_ids + t.ids for t in active], [turn_seed(t.seed, turn) for t in active],
                           max(budgets, default=1))
        still = []
        for t, (ids, truncated), budget in zip(active, sampled, budgets):
            if len(ids) > budget:  # the other rows' budgets made the call longer: cut where this one's ends
                ids, truncated = ids[:budget], True
            prefix = t.prompt_ids + t.ids
            t.ids, t.policy, t.turns = t.ids + ids, t.policy + [1] * len(ids), t.turns + 1
            message = parse_turn(tokenizer, ids, prefix, toolbox.schemas) if ids else {}
            if message:
                t.messages.append(message)
            calls = message.get("tool_calls") or []
            rounds_left = rl.max_tool_calling_iterations is None or t.turns <= rl.max_tool_calling_iterations
            if truncated:
                t.truncated = True
            elif calls and rounds_left and _call_tools(t, calls, tokenizer, toolbox, rl.max_completion_length, eos):
                still.append(t)
        active, turn = still, turn + 1


def _call_tools(t: Trajectory, calls: list[dict], tokenizer, toolbox, budget: int, eos: list[int]) -> bool:
    """The turn's calls run, their messages appended; False (nothing appended) when they would not fit."""
    replies = [toolbox.call(t.tools, call) for call in calls]
    messages = [{"role": "tool", "name": name, "content": content} for name, content, _ in replies]
    suffix = tool_turn_ids(tokenizer, messages, eos)
    t.calls += len(replies)
    t.failures += sum(failed for _, _, failed in replies)
    if len(t.ids) + len(suffix) >= budget:  # no room for the reply and a token after it: the trajectory ends here
        return False
    t.messages += messages
    t.ids, t.policy = t.ids + suffix, t.policy + [0] * len(suffix)
    return True
