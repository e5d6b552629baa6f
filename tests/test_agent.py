"""Agentic rollouts' parts in one process (rl.tools, rl.environment; the launches are in test_agent_launch.py):

- the masks, exactly, on published chat templates with different tool-call formats (Qwen3's `<tool_call>` JSON
  and Llama 3.1's bare JSON with an `ipython` turn, as TRL ships them, and whitespace variants of them): a
  scripted policy calls a tool, the trajectory's text is the template's own rendering of the conversation, every
  token a tool's message added has no label and no weight, and the policy loss (its KL and importance ratios
  included) does not move when those positions' log-probs do;
- the loop's bounds: rl.max_tool_calling_iterations, rl.max_completion_length over the whole trajectory;
- tools that go wrong (raise, hang, return None, unknown arguments, unknown names) become tool messages; specs that
  cannot work are one line before the model loads; the Python sandbox's limits.
"""

from __future__ import annotations

import copy
import time
from pathlib import Path

import pytest
import torch

from conftest import REPO
from disttrain.data import IGNORE_INDEX
from disttrain.errors import DisttrainError
from disttrain.objectives import agent, rollout
from disttrain.objectives.policy_loss import policy_loss
from disttrain.objectives.rollout import MASK_KEY
from disttrain.objectives.sandbox import run_python
from disttrain.objectives.tools import Toolbox
from disttrain.recipe.schema import RLSection

TRL_TEMPLATES = Path(__import__("trl").__file__).parent / "chat_templates"
LOOKUP = "recipes/tiny/tools.py:lookup"
FAMILIES = {  # the special tokens each template's real tokenizer has
    "qwen3": {"eos": "<|im_end|>", "specials": ["<|im_start|>", "<|endoftext|>"],
              "added": ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]},
    "llama3_1": {"eos": "<|eot_id|>", "bos": "<|begin_of_text|>",
                 "specials": ["<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|python_tag|>"]},
}
FAMILIES["qwen2_5"], FAMILIES["llama3_2"] = FAMILIES["qwen3"], FAMILIES["llama3_1"]  # the earlier / later layouts
VARIANTS = ("as published", "statements without whitespace control")


def family_tokenizer(base, family: str, variant: str):
    """The tiny tokenizer with the family's special tokens and its published template (TRL's copy), or a
    whitespace variant of it; the response template TRL sets for the published one (a user's tokenizer_config
    carries it for a variant)."""
    from trl.chat_template_utils import add_response_schema

    spec = FAMILIES[family]
    tok = copy.deepcopy(base)
    tok.add_special_tokens({"additional_special_tokens": [t for t in (spec.get("bos"), spec["eos"],
                                                                       *spec["specials"]) if t]})
    tok.add_tokens(spec.get("added", []))
    tok.bos_token, tok.eos_token = spec.get("bos"), spec["eos"]
    published = (TRL_TEMPLATES / f"{family}.jinja").read_text()
    tok.chat_template = published
    add_response_schema(tok)
    assert tok.response_template is not None
    if variant != "as published":  # {%- ... -%} written {% ... %}, as community copies often do: transformers'
        tok.chat_template = published.replace("{%-", "{%").replace("-%}", "%}")  # trim_blocks / lstrip_blocks
        assert tok.chat_template != published                                  # decide what survives
    return tok


def _rendered(tok, messages, schemas, generation_prompt: bool) -> str:
    return tok.apply_chat_template(messages, tools=schemas, tokenize=False, add_generation_prompt=generation_prompt)


def _turn(tok, before: list[dict], message: dict, schemas) -> str:
    """The text the template writes for an assistant `message` after `before` when more follows it (a tool's
    reply), up to its end-of-turn token: what a policy that learned the template samples."""
    head = _rendered(tok, before, schemas, True)
    whole = _rendered(tok, before + [message, {"role": "tool", "name": "lookup", "content": "x"}], schemas, False)
    assert whole.startswith(head)
    text = whole[len(head):]
    return text[:text.index(tok.eos_token) + len(tok.eos_token)]


class Scripted:
    """generate() of a policy that samples given turns: each trajectory's next one, found by its tokens so far."""

    def __init__(self, tok, scripts: dict[tuple, list[str]]):
        self.tok, self.scripts, self.calls = tok, {k: list(v) for k, v in scripts.items()}, []

    def __call__(self, prompts, seeds, max_new_tokens):
        self.calls.append(len(prompts))
        out = []
        for prompt in prompts:
            key = next(k for k in self.scripts if tuple(prompt[:len(k)]) == k)
            text = self.scripts[key].pop(0) if self.scripts[key] else self.tok.eos_token
            ids = self.tok.encode(text, add_special_tokens=False)
            truncated = len(ids) > max_new_tokens
            out.append((ids[:max_new_tokens], truncated))
        return out


def _rl(**fields) -> RLSection:
    return RLSection(tools=[LOOKUP], rewards=[{"function": "recipes/tiny/tools.py:code_answer"}], **fields)


def _question(word: str) -> str:
    """The task's question, with its answer in it too (a mask found by searching the text would hit it there)."""
    from disttrain.tools.tiny import code_of

    return f"What is the code of {word}? It is not {code_of(word)}, is it?"


def _play(tok, words: list[str], scripts_for, rl: RLSection):
    toolbox = Toolbox(rl)
    trajectories, scripts = [], {}
    for i, word in enumerate(words):
        user = [{"role": "user", "content": _question(word)}]
        prompt = tok.apply_chat_template(user, tools=toolbox.schemas, tokenize=True, add_generation_prompt=True,
                                         return_dict=False)
        trajectories.append(agent.Trajectory(list(prompt), seed=i, tools=toolbox.callables(None)))
        scripts[tuple(prompt)] = scripts_for(user, word, toolbox.schemas)
    generate = Scripted(tok, scripts)
    agent.roll_out(trajectories, generate, lambda rows: rows > 0, tok, toolbox, rl, [tok.eos_token_id])
    return trajectories, toolbox, generate


def _call(word: str) -> dict:
    return {"role": "assistant", "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "lookup", "arguments": {"word": word}}}]}


# Llama 3's templates without their whitespace control render a prompt that is not the beginning of the same
# conversation rendered further (a blank line more before the generation prompt): left out, the policy's turn is
# not the template's to find there.
CASES = [(family, "as published") for family in FAMILIES] + [("qwen3", VARIANTS[1]), ("qwen2_5", VARIANTS[1])]


@pytest.mark.parametrize("family, variant", CASES)
def test_tool_tokens_have_no_label_and_no_weight_in_the_loss_the_kl_or_the_ratios(family, variant, tokenizer):
    from disttrain.tools.tiny import code_of

    tok = family_tokenizer(tokenizer, family, variant)

    def script(user, word, schemas):
        return [_turn(tok, user, _call(word), schemas), code_of(word) + tok.eos_token]

    rl = _rl(max_completion_length=400)
    words = ["apple", "tiger"]  # "tiger" is also a code (of another word): the answer occurs in the prompt's
    played, toolbox, _ = _play(tok, words, script, rl)  # vocabulary
    for t, word in zip(played, words):
        user = [{"role": "user", "content": _question(word)}]
        reply = {"role": "tool", "name": "lookup", "content": code_of(word)}
        call_turn = _turn(tok, user, _call(word), toolbox.schemas)
        prompt_text = _rendered(tok, user, toolbox.schemas, True)
        before_answer = _rendered(tok, user + [_call(word), reply], toolbox.schemas, True)
        # what the policy was shown before its answer is the template's own rendering of the conversation
        assert tok.decode(t.prompt_ids + t.ids) == before_answer + code_of(word) + tok.eos_token
        assert (t.turns, t.calls, t.failures, t.truncated) == (2, 1, 0, False)
        assert t.messages[0]["tool_calls"][0]["function"] == {"name": "lookup", "arguments": {"word": word}}
        assert t.messages[1] == reply and t.messages[2]["content"] == code_of(word)
        # the tool's tokens, exactly: what the template writes between the call's end of turn and the answer
        tool_text = before_answer[len(prompt_text) + len(call_turn):]
        assert code_of(word) in tool_text
        assert tok.decode([i for i, p in zip(t.ids, t.policy) if p == 0]) == tool_text
        assert tok.decode([i for i, p in zip(t.ids, t.policy) if p == 1]) == call_turn + code_of(word) + tok.eos_token
        first_tool = t.policy.index(0)
        assert t.policy == [1] * first_tool + [0] * (len(t.policy) - first_tool - len(tok.encode(
            code_of(word) + tok.eos_token, add_special_tokens=False))) + [1] * (len(t.policy) - t.policy.index(
                1, first_tool))

    rows = rollout.training_rows([t.prompt_ids for t in played], [t.completion for t in played], 0, False, "cpu",
                                 policy=[t.policy for t in played])
    for r, t in enumerate(played):
        start = len(t.prompt_ids)
        for j, mine in enumerate(t.policy):
            assert (rows["labels"][r, start + j] != IGNORE_INDEX) == bool(mine)
            assert rows[MASK_KEY][r, start + j - 1] == float(mine)  # the position predicting token j
        assert rows[MASK_KEY][r].sum() == sum(t.policy)
    mask = rows[MASK_KEY]
    tool_positions = (mask == 0) & (rows["attention_mask"].roll(-1, dims=1) == 1)
    tool_positions[:, -1] = False
    torch.manual_seed(0)
    logps = -torch.rand(mask.shape, dtype=torch.float64)
    old, ref = logps + 0.1 * torch.randn_like(logps), logps + 0.2 * torch.randn_like(logps)
    noise = torch.where(tool_positions, torch.randn_like(logps), torch.zeros_like(logps))
    for loss in ("grpo", "dapo", "dr_grpo", "bnpo", "cispo"):
        cfg = _rl(loss=loss, beta=0.1, max_completion_length=400, **({"epsilon_high": 2.0} if loss == "cispo" else {}))
        values = []
        for shift in (0.0, 1.0):  # the log-probs, the old ones and the reference's moved at the tool positions
            leaf = (logps + shift * noise).requires_grad_()
            total, _ = policy_loss(cfg, leaf, mask.double(), torch.tensor([1.0, -0.5], dtype=torch.float64),
                                   old + shift * noise, ref - shift * noise, 400)
            (grad,) = torch.autograd.grad(total, leaf)
            assert torch.all(grad[tool_positions] == 0), loss
            values.append(total.item())
        assert values[0] == values[1], (loss, values)


def test_iterations_and_the_trajectorys_length_bound_the_loop(tokenizer):
    tok = family_tokenizer(tokenizer, "qwen3", "as published")

    def always_calls(user, word, schemas):
        return [_turn(tok, user, _call(word), schemas)] * 10

    played, _, generate = _play(tok, ["apple", "river"], always_calls, _rl(max_completion_length=2000,
                                                                            max_tool_calling_iterations=3))
    assert [(t.turns, t.calls) for t in played] == [(4, 3), (4, 3)]  # three rounds of calls, then no more
    assert generate.calls == [2, 2, 2, 2]  # one generate per turn, across both trajectories
    call_tokens = len(tok.encode(_turn(tok, [{"role": "user", "content": "x"}], _call("apple"), None),
                                 add_special_tokens=False))
    played, _, _ = _play(tok, ["apple"], always_calls, _rl(max_completion_length=call_tokens + 5))
    t = played[0]  # the call fits, its reply does not: the trajectory ends after the call, nothing appended
    assert (t.turns, t.calls, sum(t.policy), len(t.ids), t.truncated) == (1, 1, call_tokens, call_tokens, False)
    played, _, _ = _play(tok, ["apple"], always_calls, _rl(max_completion_length=call_tokens - 3))
    assert played[0].truncated and len(played[0].ids) == call_tokens - 3 and played[0].calls == 0


def _hangs(seconds: float) -> str:
    """Sleeps.

    Args:
        seconds: How long.
    """
    time.sleep(seconds)
    return "late"


def test_a_tool_that_goes_wrong_becomes_a_tool_message_and_the_rollout_goes_on():
    toolbox = Toolbox(RLSection(tools=[LOOKUP], tool_timeout=0.5))
    tools = {**toolbox.callables(None), "hangs": _hangs, "nothing": lambda: None, "number": lambda: 7}

    def call(name, **arguments):
        return toolbox.call(tools, {"type": "function", "function": {"name": name, "arguments": arguments}})

    assert call("lookup", word="apple") == ("lookup", "cloud", False)
    name, content, failed = call("lookup", word="banana")  # raises
    assert failed and content == str({"error": "unknown word 'banana'"})
    started = time.perf_counter()
    name, content, failed = call("hangs", seconds=30)
    assert failed and "rl.tool_timeout=0.5s" in content and time.perf_counter() - started < 5
    assert call("nothing")[1:] == (str({"error": "nothing returned NoneType: a tool returns a string (or a "
                                                 "number)"}), True)
    assert call("number") == ("number", "7", False)  # a number, as TRL renders it
    assert call("lookup", term="apple")[2] and "term" in call("lookup", term="apple")[1]  # unknown argument
    assert call("lookup")[2]  # a missing one
    assert call("search", query="x")[1:] == (str({"error": "Tool search not found."}), True)
    assert toolbox.call(tools, {"type": "function", "function": {"name": "lookup", "arguments": "apple"}})[2]


BAD_SPECS = [
    ({"tools": ["recipes/tiny/missing.py:lookup"]}, "rl.tools[0]: recipes/tiny/missing.py is not a file"),
    ({"tools": ["recipes/tiny/tools.py:absent"]}, "rl.tools[0]: recipes/tiny/tools.py has no function 'absent'"),
    ({"tools": ["recipes/tiny/tools.py:code_answer"]}, "rl.tools[0]: transformers cannot describe 'code_answer'"),
    ({"tools": [LOOKUP, "recipes/tiny/tools.py:lookup"]}, "two tools are named 'lookup'"),
    ({"environment": "recipes/tiny/tools.py:lookup"}, "rl.environment: recipes/tiny/tools.py:lookup is not a class"),
    ({"environment": "disttrain.objectives.tools:Toolbox"}, "rl.environment: disttrain.objectives.tools:Toolbox() "
                                                            "raised TypeError"),
    ({"environment": "collections:OrderedDict"}, "rl.environment: collections:OrderedDict has no reset() method"),
]


@pytest.mark.parametrize("fields, said", BAD_SPECS, ids=[s[:40] for _, s in BAD_SPECS])
def test_tools_that_cannot_work_are_one_line_before_the_model_loads(fields, said):
    with pytest.raises(DisttrainError) as info:
        Toolbox(RLSection(**fields))
    assert said in str(info.value) and "\n" not in str(info.value), str(info.value)


@pytest.mark.parametrize("template", sorted(p.stem for p in TRL_TEMPLATES.glob("*.jinja")
                                             if not p.stem.endswith("_training")))
def test_every_published_template_is_taken_or_refused_in_one_line(template, tokenizer):
    """TRL's copies of the published templates (Gemma 1-4, Phi-3, Llama 3, Cohere, DeepSeek, GPT-OSS, GLM, LFM,
    Nemotron, Qwen 2.5-3.8, the VLMs'): a tool exchange renders and a response parser exists, or one line says
    which is missing; never a traceback."""
    tok = copy.deepcopy(tokenizer)
    tok.chat_template, tok.response_template = (TRL_TEMPLATES / f"{template}.jinja").read_text(), None
    try:
        agent.check_template(tok, template)
    except DisttrainError as exc:
        assert "\n" not in str(exc) and ("cannot express tool calls" in str(exc) or "no response_template" in
                                          str(exc)), str(exc)
    else:
        assert tok.response_template is not None or tok.response_schema is not None


def test_templates_that_cannot_call_tools_are_one_line(tokenizer):
    from disttrain.tools.tiny import CHAT_TEMPLATE

    plain = copy.deepcopy(tokenizer)
    plain.chat_template = (TRL_TEMPLATES / "llama3.jinja").read_text()  # reads message['content'] only
    with pytest.raises(DisttrainError, match="the chat template of m cannot express tool calls"):
        agent.check_template(plain, "m")
    unparsed = copy.deepcopy(tokenizer)
    unparsed.chat_template, unparsed.response_template = CHAT_TEMPLATE + " ", None  # a template TRL does not know
    with pytest.raises(DisttrainError, match="the tokenizer of m has no response_template"):
        agent.check_template(unparsed, "m")
    agent.check_template(copy.deepcopy(tokenizer), "m")  # the tiny tokenizer carries its own


def test_an_environment_is_one_instance_per_completion_reset_with_its_record():
    toolbox = Toolbox(RLSection(environment="recipes/tiny/tools.py:CodeBook"))
    assert [s["function"]["name"] for s in toolbox.schemas] == ["lookup"] and toolbox.reward_name == "CodeBook"
    first, second = toolbox.instances(2)
    third = toolbox.instances(1)[0]  # a resampled group's, in the same step: a fresh instance
    assert len({id(first), id(second), id(third)}) == 3
    toolbox.rewind()
    assert toolbox.instances(3) == [first, second, third]  # pooled: constructed once, reset before each use
    first.reset(prompt=[], answer="cloud")
    second.reset(prompt=[], answer="cloud")
    tools = toolbox.callables(first)
    assert toolbox.call(tools, {"function": {"name": "lookup", "arguments": {"word": "apple"}}})[1] == "cloud"
    assert (first.get_reward(), second.get_reward()) == (1.0, 0.0)


def test_the_sandbox_runs_code_in_a_subprocess_with_limits(tmp_path):
    assert run_python("print(6 * 7)") == "42\n"
    assert run_python("import os; print(os.getcwd() != %r)" % str(REPO)) == "True\n"  # a scratch directory
    assert run_python("while True: pass", seconds=1) == "error: the program ran longer than 1 s and was stopped"
    assert "MemoryError" in run_python("x = bytearray(2 << 30)", memory_mb=256)
    assert run_python("raise SystemExit('bye')").strip() == "bye"
    assert run_python("import os; print(sorted(os.environ))").startswith("['HOME', 'LANG'")  # nothing inherited
    assert run_python("import sys; print(sys.argv, __name__)") == "['-c'] __main__\n"  # as `python -c code`


def test_make_cost_plans_a_trajectory_with_its_tools_replies(capsys, monkeypatch):
    import json

    from disttrain.tools.cost import main

    monkeypatch.chdir(REPO)
    main(["--recipe", "recipes/qwen3-1.7b/grpo_python_gsm8k.yaml", "--gpus", "8", "--tokens", "1e8", "--json"])
    model = json.loads(capsys.readouterr().out)["model"]
    assert "multi-turn with tools: a trajectory of at most 1536 tokens" in model and "4 turns at most" in model


def test_a_turn_ends_where_generation_stops_even_when_that_is_not_the_tokenizers_eos(tokenizer):
    tok = family_tokenizer(tokenizer, "qwen3", "as published")
    reply = [{"role": "tool", "name": "lookup", "content": "cloud"}]
    end_of_turn = tok.convert_tokens_to_ids("<|im_end|>")
    expected = agent.tool_turn_ids(tok, reply, [end_of_turn])
    assert tok.decode(expected) == "\n<|im_start|>user\n<tool_response>\ncloud\n</tool_response><|im_end|>\n" \
                                   "<|im_start|>assistant\n"
    tok.eos_token = "<|endoftext|>"  # a base model's EOS; the generation config stops at <|im_end|> (Gemma-style)
    assert agent.tool_turn_ids(tok, reply, [tok.eos_token_id, end_of_turn]) == expected
    with pytest.raises(DisttrainError, match="ends an assistant turn with none of the tokens generation stops at"):
        agent.tool_turn_ids(tok, reply, [tok.eos_token_id])
