"""Online RL's parts in one process (training.objective: grpo; the launches are in test_grpo_launch.py):

- prompts as the families' own templates render them with the generation prompt (every family fixture of
  test_chat_families.py, compact and indented), plain prompts as they are, and bad prompts in one line;
- the chunked head's loss and gradients equal autograd through the full logits at the sampling temperature
  (old policy, reference, every loss type);
- rewards called as TRL calls them (TRL's own reward function works as it is), and every way a reward
  function can go wrong in one line naming it and the completion; advantages as TRL computes them;
- the sampling itself: tests/test_rollouts.py.
"""

from __future__ import annotations

import json

import pytest
import torch

from conftest import REPO, base_recipe, write_recipe
from disttrain.data import IGNORE_INDEX, tokenize_record
from disttrain.errors import DataError, DisttrainError, RecipeError
from disttrain.objectives import rollout
from disttrain.objectives.grpo import GRPOLoss
from disttrain.objectives.policy_loss import entropy_bonus, policy_loss
from disttrain.objectives.rewards import Rewards, advantages, nanstd
from disttrain.recipe.schema import DataSection, RLSection, load_recipe
from test_chat_families import CONVERSATIONS, FAMILIES, STYLES, family_tokenizer
from test_template_corpus import COMMUNITY, VARIANTS, _pair, _respaced

PROMPT_SECTION = DataSection(path="x.jsonl", format="prompt", max_seq_len=1024)


def _prompt_of(messages: list[dict]) -> list[dict]:
    """The conversation up to its last user turn: what a policy is asked."""
    last_user = max(i for i, m in enumerate(messages) if m["role"] == "user")
    return messages[:last_user + 1]


PROMPT_CASES = [(family, conversation, style) for family, spec in FAMILIES.items() for conversation in spec["expected"]
                for style in STYLES]


@pytest.mark.parametrize("family, conversation, style", PROMPT_CASES)
def test_a_chat_prompt_is_what_the_familys_template_renders_with_its_generation_prompt(family, conversation, style,
                                                                                      tokenizer):
    tok = family_tokenizer(tokenizer, family, style, markers=False)
    messages = _prompt_of(CONVERSATIONS[conversation])
    ours = tokenize_record({"prompt": messages, "answer": "42"}, tok, PROMPT_SECTION)
    truth = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=True)
    assert ours["prompt_ids"] == list(truth["input_ids"])
    assert json.loads(ours["record"]) == {"prompt": messages, "answer": "42"}  # the rest goes to the rewards


WRITTEN_AS = [("community", name, "as published") for name in COMMUNITY] + \
    [("community", name, variant) for name in COMMUNITY for variant in ("blank_lines", "crlf")] + \
    [("family", family, variant) for family in FAMILIES for variant in ("blank_lines", "indented_lines")]


@pytest.mark.parametrize("source, name, variant", WRITTEN_AS)
def test_prompts_of_templates_written_without_whitespace_control_are_the_templates_own(source, name, variant,
                                                                                      tokenizer):
    """Community templates as published and respaced, family templates without Jinja whitespace control: the
    prompt the policy continues is exactly transformers' rendering with the generation prompt."""
    spec = COMMUNITY[name] if source == "community" else FAMILIES[name]
    template = spec["template"].replace("<WS>", "")
    if variant != "as published":
        template = _respaced(template, **VARIANTS[variant])
    tok, _ = _pair(tokenizer, spec, template)
    for conversation in ("short", "system"):
        messages = _prompt_of(CONVERSATIONS[conversation])
        try:
            truth = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=True)
        except Exception:  # the template refuses this conversation (a system turn): so must we, in one line
            with pytest.raises(DataError, match="record 0: the chat template refused"):
                tokenize_record({"prompt": messages}, tok, PROMPT_SECTION)
            continue
        assert tokenize_record({"prompt": messages}, tok, PROMPT_SECTION)["prompt_ids"] == list(truth["input_ids"])


def test_a_plain_prompt_is_its_text_and_bad_prompts_are_one_line_naming_the_record(tokenizer):
    ours = tokenize_record({"prompt": "Sort the words alphabetically. stone green"}, tokenizer, PROMPT_SECTION)
    assert ours["prompt_ids"] == tokenizer("Sort the words alphabetically. stone green",
                                           add_special_tokens=False)["input_ids"]
    cases = {"must end with the user's turn": {"prompt": [{"role": "user", "content": "a"},
                                                          {"role": "assistant", "content": "b"}]},
             "missing field 'prompt'": {"question": "a"},
             "'prompt' is empty": {"prompt": ""},
             "over data.max_seq_len=16": {"prompt": "word " * 40}}
    for says, record in cases.items():
        with pytest.raises(DataError, match="record 0: .*" + says.replace("(", r"\(")):
            tokenize_record(record, tokenizer, DataSection(path="x.jsonl", format="prompt", max_seq_len=16))


def test_the_recipe_refuses_what_grpo_cannot_take(tmp_path, tiny_model_dir):
    reward = [{"function": "recipes/tiny/rewards.py:answer_words"}]
    prompts = {"path": str(REPO / "data/tiny_prompts.jsonl"), "format": "prompt"}
    cases = {"needs data.format: prompt": ({}, {}, {"rewards": reward}),
             "needs rl.rewards": (prompts, {}, {}),
             "set training.objective: grpo": (prompts, {"objective": "sft"}, {}),
             "no held-out evaluation": ({**prompts, "eval_path": str(REPO / "data/tiny_prompts.jsonl")}, {},
                                        {"rewards": reward}),
             "data.streaming does not apply": ({**prompts, "streaming": True}, {}, {"rewards": reward}),
             "rl.reference: adapters needs a lora section": (prompts, {}, {"rewards": reward, "beta": 0.1,
                                                                           "reference": "adapters"})}
    for says, (data, training, rl) in cases.items():
        tree = base_recipe(tiny_model_dir, tmp_path / "run", data=data, training={"objective": "grpo", **training},
                           rl=rl)
        with pytest.raises(RecipeError, match=says.replace("(", r"\(")):
            load_recipe(write_recipe(tmp_path / "r.yaml", tree))


# ---------------------------------------------------------------------------------------- the chunked gradient
def _rollout_batch(tokenizer, device="cpu"):
    prompts = [tokenizer("sort: stone green", add_special_tokens=False)["input_ids"],
               tokenizer("count: a b c d", add_special_tokens=False)["input_ids"]]
    words = ["green stone", "green green stone stone", "4", "three"]
    completions = [(tokenizer(w, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id], False)
                   for w in words]
    completions[3] = (completions[3][0][:-1], True)  # truncated: no EOS
    rows = rollout.training_rows([prompts[0], prompts[0], prompts[1], prompts[1]], completions,
                                 tokenizer.pad_token_id, False, device)
    rows[rollout.ADVANTAGES_KEY] = torch.tensor([0.9, -0.9, 0.7, -0.7])
    return rows


ITEMS = 3.0  # the loop's denominator in the chunked test


@pytest.mark.parametrize("case", [dict(loss="dapo"), dict(loss="grpo", beta=0.1), dict(loss="bnpo"),
                                  dict(loss="dr_grpo", importance_sampling="sequence"),
                                  dict(loss="cispo", epsilon_high=1.1, beta=0.05),
                                  dict(loss="dapo", entropy_coef=0.3), dict(loss="grpo", entropy_coef=0.1, beta=0.1)],
                         ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_the_chunked_loss_and_gradients_equal_autograd_through_full_logits(case, tiny_model_dir, tokenizer):
    from transformers import AutoModelForCausalLM

    cfg = RLSection(temperature=0.7, max_completion_length=8, **case)
    batch = _rollout_batch(tokenizer)
    mask = batch[rollout.MASK_KEY]
    generator = torch.Generator().manual_seed(0)
    old = torch.randn(mask.shape, generator=generator) * 0.2
    ref = torch.randn(mask.shape, generator=generator) * 0.3

    def model():
        torch.manual_seed(1)
        return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)

    plain = model()
    logits = plain(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits / cfg.temperature
    targets = torch.cat([batch["labels"][:, 1:], torch.full_like(batch["labels"][:, :1], IGNORE_INDEX)], dim=1)
    logps = torch.log_softmax(logits.float(), -1).gather(-1, targets.clamp(min=0)[..., None])[..., 0]
    logps = logps * (targets != IGNORE_INDEX)
    old_logps, ref_logps = (logps.detach() + old) * mask, (logps.detach() + ref) * mask
    expected, _ = policy_loss(cfg, logps, mask, batch[rollout.ADVANTAGES_KEY], old_logps,
                              ref_logps if cfg.beta else None, cfg.max_completion_length)
    expected = expected / ITEMS  # the loop's denominator divides the policy loss; the entropy bonus is a mean
    if cfg.entropy_coef:  # the entropy of the full distribution at each position, at the sampling temperature
        log_probs = torch.log_softmax(logits.float(), -1)
        entropies = -(log_probs.exp() * log_probs).sum(-1)
        expected = expected + entropy_bonus(cfg, entropies, mask)
    expected.backward()

    chunked = model()
    loss = GRPOLoss(chunked, cfg, "none")
    batch[rollout.OLD_KEY] = old_logps
    if cfg.beta:
        batch[rollout.REF_KEY] = ref_logps
    got = loss.training_loss(chunked, batch, torch.tensor(ITEMS))
    got.backward()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    grads = {n: p.grad for n, p in plain.named_parameters() if p.grad is not None}
    assert grads
    for name, p in chunked.named_parameters():
        torch.testing.assert_close(p.grad, grads[name], rtol=1e-4, atol=1e-6, msg=name)
    # the no-gradient pass (old policy, reference) gives the same log-probs, at the same temperature
    torch.testing.assert_close(loss.token_logps(chunked, batch), logps.detach(), rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------- the rewards
def _write(tmp_path, body: str) -> str:
    path = tmp_path / "my_rewards.py"
    path.write_text(body)
    return str(path)


def _rewards(*functions) -> Rewards:
    return Rewards(RLSection(rewards=[{"function": f} for f in functions]))


def _score(rewards: Rewards, n=4):
    completions = [[{"role": "assistant", "content": f"<think>x</think>answer {i}"}] for i in range(n)]
    return rewards.score(prompts=[[{"role": "user", "content": "q"}]] * n, completions=completions,
                         completion_ids=[[1, 2]] * n, columns={"answer": ["answer 0", "answer 9", "no", None]},
                         where=lambda i: f"completion {i} of training row 7")


def test_trls_own_reward_function_and_a_recipes_file_are_called_as_trl_calls_them(tmp_path):
    path = _write(tmp_path, "def exact(completions, answer, **kwargs):\n"
                            "    return [None if a is None else float(c[0]['content'] == a) for c, a in "
                            "zip(completions, answer)]\n")
    rewards = _rewards("trl.rewards:think_format_reward", f"{path}:exact")
    table = _score(rewards)
    assert table[:, 0].tolist() == [1.0] * 4  # <think>...</think> then the answer: TRL's format reward
    assert table[:3, 1].tolist() == [0.0, 0.0, 0.0] and torch.isnan(table[3, 1])  # None: not scored
    rewards.check_columns({"answer"}, "data.jsonl")


@pytest.mark.parametrize("body, says", [
    ("def f(completions, **kw):\n    return [1 / (int(c[0]['content'][-1]) - 2) for c in completions]\n",
     r"rl.rewards\[0\] \(f\) raised ZeroDivisionError: division by zero on completion 2 of training row 7"),
    ("def f(completions, **kw):\n    return ['high'] * len(completions)\n",
     r"rl.rewards\[0\] \(f\) returned 'high' for completion 0 of training row 7: a reward is a number"),
    ("def f(completions, **kw):\n    return [1.0]\n", r"returned 1 rewards for 4 completions"),
    ("def f(completions, **kw):\n    return 3\n", r"returned int, not a list"),
])
def test_a_reward_function_going_wrong_is_one_line_naming_it_and_the_completion(tmp_path, body, says):
    with pytest.raises(DisttrainError, match=says):
        _score(_rewards(f"{_write(tmp_path, body)}:f"))


def test_a_reward_function_that_cannot_be_loaded_or_needs_a_missing_column_is_one_line(tmp_path):
    path = _write(tmp_path, "def f(completions, solution, **kw):\n    return [0.0] * len(completions)\n")
    with pytest.raises(DisttrainError, match=r"rl.rewards\[0\] \(f\) needs the column 'solution', which d.jsonl "
                                             r"does not have \(its columns: answer\)"):
        _rewards(f"{path}:f").check_columns({"answer"}, "d.jsonl")
    for spec, says in [("nowhere.py:f", "nowhere.py is not a file"), (f"{path}:g", "has no function 'g'"),
                       ("no_such_module_xyz:f", "importing no_such_module_xyz failed: ModuleNotFoundError"),
                       ("just_a_name", "is not module:function")]:
        with pytest.raises(DisttrainError, match=r"rl.rewards\[0\]: .*" + says):
            _rewards(spec)


ESTIMATOR_REWARDS = torch.tensor([[1.0, 0.5], [0.0, float("nan")], [0.0, 0.0], [1.0, 1.0],
                                  [2.0, 0.0], [float("nan"), float("nan")], [0.5, 0.0], [3.0, -1.0],
                                  [float("nan"), float("nan")], [1.0, 0.0], [float("nan"), float("nan")],
                                  [float("nan"), float("nan")]])  # 3 groups of 4; the last with one scored
ESTIMATOR_WEIGHTS = torch.tensor([1.0, 2.0])


def trl_rloo(rewards_per_func, weights, group, normalize):
    """TRL 1.16 RLOOTrainer's advantages (rloo_trainer.py, _generate_and_score_completions), written out per
    completion: the weighted nansum, unscorable rows NaN, the leave-one-out mean of the group's scorable others,
    optionally whitened with torch.nanmean and TRL's nanstd, NaN to 0."""
    from trl.trainer.utils import nanstd as trl_nanstd

    rewards = (rewards_per_func * weights).nansum(dim=1)
    rewards[torch.isnan(rewards_per_func).all(dim=1)] = float("nan")
    out = torch.empty_like(rewards)
    for i in range(len(rewards)):
        first = i - i % group
        others = [float(rewards[j]) for j in range(first, first + group) if j != i and not torch.isnan(rewards[j])]
        out[i] = rewards[i] - sum(others) / len(others) if others else float("nan")
    if normalize:
        out = (out - torch.nanmean(out)) / (trl_nanstd(out) + 1e-4)
    return torch.nan_to_num(out, nan=0.0)


def verl_reinforce_pp_baseline(scores, response_mask, group):
    """verl's compute_reinforce_plus_plus_baseline_outcome_advantage (core_algos.py) on scores already summed:
    the score minus its prompt group's mean, broadcast to the response tokens, then masked_whiten over every
    response token of the batch (masked mean, unbiased masked variance, rsqrt(var + 1e-8))."""
    centred = scores.clone()
    for i in range(len(scores)):
        first = i - i % group
        centred[i] = scores[i] - scores[first:first + group].mean()
    values = centred.unsqueeze(-1) * response_mask
    count = response_mask.sum()
    mean = (values * response_mask).sum() / count
    variance = (((values - mean) ** 2) * response_mask).sum() / count * count / (count - 1)
    return (values - mean) * torch.rsqrt(variance + 1e-8) * response_mask


@pytest.mark.parametrize("scale", ["none", "batch"])
def test_rloo_advantages_are_trls(scale):
    """rl.advantage=rloo: the leave-one-out baseline over the group's scored others (a group with one scored
    completion gives it 0), scale_rewards none (TRL's default) or batch (TRL's normalize_advantages); the batch
    statistics from all completions, as the step's gather hands them over."""
    from disttrain.objectives.rewards import baselined, step_statistics, weighted_sum

    summed = weighted_sum(ESTIMATOR_REWARDS, ESTIMATOR_WEIGHTS)
    stats = step_statistics("rloo", scale, baselined(summed, 4, "rloo"), torch.ones(12))
    ours = advantages(ESTIMATOR_REWARDS, ESTIMATOR_WEIGHTS, 4, "rloo", scale, stats)[0]
    torch.testing.assert_close(ours, trl_rloo(ESTIMATOR_REWARDS, ESTIMATOR_WEIGHTS, 4, scale == "batch"))
    assert ours[8:].tolist() == [0.0] * 4 and float(ours[5]) == 0.0  # one scored in its group; unscored
    assert bool((ours[[0, 1, 2, 3, 4, 6, 7]] != 0).all())


def test_reinforce_pp_advantages_are_verls_whitened_over_the_tokens_trained_on():
    """rl.advantage=reinforce_pp (scale batch, its default): per token equal to verl's REINFORCE++-baseline on the
    same scores and response mask (completions of different lengths weigh by their tokens); the step split over
    two ranks gives the statistics of the whole (gathered, as the rollout gathers them)."""
    from disttrain.objectives.rewards import baselined, step_statistics, weighted_sum

    rewards = ESTIMATOR_REWARDS[:8].nan_to_num(0.0)  # verl scores every completion
    lengths = torch.tensor([3, 1, 5, 2, 4, 4, 1, 2])
    mask = (torch.arange(5).unsqueeze(0) < lengths.unsqueeze(1)).float()
    summed = weighted_sum(rewards, ESTIMATOR_WEIGHTS)
    stats = step_statistics("reinforce_pp", "batch", baselined(summed, 4, "reinforce_pp"), lengths.float())
    ours = advantages(rewards, ESTIMATOR_WEIGHTS, 4, "reinforce_pp", "batch", stats)[0]
    torch.testing.assert_close(ours.unsqueeze(-1) * mask, verl_reinforce_pp_baseline(summed, mask, 4))
    halves = [step_statistics("reinforce_pp", "batch", baselined(summed[h], 4, "reinforce_pp"), lengths[h].float())
              for h in (slice(0, 4), slice(4, 8))]
    assert not torch.allclose(halves[0][0], stats[0])  # one rank's statistics alone would be another scale


def test_an_estimator_with_grpos_group_scale_is_one_line():
    with pytest.raises(ValueError, match="scale_rewards=group divides by each group's std"):
        RLSection(advantage="rloo", scale_rewards="group", rewards=[{"function": "m:f"}])
    assert RLSection(advantage="reinforce_pp", rewards=[{"function": "m:f"}]).reward_scale == "batch"
    assert RLSection(advantage="rloo", rewards=[{"function": "m:f"}]).reward_scale == "none"
    assert RLSection(rewards=[{"function": "m:f"}]).reward_scale == "group"


def test_advantages_are_trls():
    from trl.trainer.utils import nanstd as trl_nanstd

    rewards = torch.tensor([[1.0, 0.5], [0.0, float("nan")], [0.0, 0.0], [1.0, 1.0],  # group 1
                            [2.0, 0.0], [2.0, 0.0], [2.0, 0.0], [float("nan"), float("nan")]])  # group 2: equal
    weights = torch.tensor([1.0, 2.0])
    group = advantages(rewards, weights, 4, "grpo", "group")[0]
    summed = torch.tensor([2.0, 0.0, 0.0, 3.0])
    torch.testing.assert_close(group[:4], (summed - summed.mean()) / (summed.std() + 1e-4))
    assert group[4:].tolist() == [0.0] * 4  # no spread: no signal; the unscored completion gets 0
    std = torch.tensor(1.7)
    torch.testing.assert_close(advantages(rewards, weights, 4, "grpo", "batch", (torch.zeros(()), std + 1e-4))[0][:4],
                               (summed - summed.mean()) / (std + 1e-4))
    torch.testing.assert_close(advantages(rewards, weights, 4, "grpo", "none")[0][:4], summed - summed.mean())
    values = torch.tensor([[1.0, float("nan"), 3.0, 4.0], [2.0, 2.0, 5.0, float("nan")]])
    torch.testing.assert_close(nanstd(values, dim=1), trl_nanstd(values, dim=1))


@pytest.mark.parametrize("family", ["granite", "cohere", "gemma2", "qwen3_moe"])
def test_the_families_transforms_and_router_loss_are_in_the_rl_loss_at_the_sampling_temperature(family):
    """Logit scaling (Granite, Cohere), softcapping (Gemma 2) and the MoE router loss (Qwen3-MoE), with the sampling
    temperature on top and the entropy bonus: the chunked GRPO loss and gradients equal autograd through the model's
    own logits (which apply the family's transform) divided by the temperature, plus its router loss."""
    from test_loss_families import tiny

    cfg = RLSection(temperature=0.7, max_completion_length=8, loss="dapo", entropy_coef=0.1, beta=0.05)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(1, 128, (n,), generator=g).tolist() for n in (5, 5, 7, 7)]
    completions = [(torch.randint(1, 128, (n,), generator=g).tolist(), False) for n in (4, 6, 3, 8)]
    batch = rollout.training_rows(prompts, completions, 0, False, "cpu")
    batch[rollout.ADVANTAGES_KEY] = torch.tensor([1.0, -1.0, 0.5, -0.5])
    mask = batch[rollout.MASK_KEY]
    ref = torch.randn(mask.shape, generator=g) * 0.3

    plain = tiny(family)
    out = plain(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    targets = torch.cat([batch["labels"][:, 1:], torch.full_like(batch["labels"][:, :1], IGNORE_INDEX)], dim=1)
    log_probs = torch.log_softmax(out.logits.float() / cfg.temperature, -1)
    logps = log_probs.gather(-1, targets.clamp(min=0)[..., None])[..., 0] * (targets != IGNORE_INDEX)
    ref_logps = (logps.detach() + ref) * mask
    expected, _ = policy_loss(cfg, logps, mask, batch[rollout.ADVANTAGES_KEY], None, ref_logps, 8)
    expected = expected / ITEMS + entropy_bonus(cfg, -(log_probs.exp() * log_probs).sum(-1), mask)
    if getattr(out, "aux_loss", None) is not None:
        expected = expected + plain.config.router_aux_loss_coef * out.aux_loss
    expected.backward()

    chunked = tiny(family)
    loss = GRPOLoss(chunked, cfg, "none")
    batch[rollout.REF_KEY] = ref_logps
    got = loss.training_loss(chunked, batch, torch.tensor(ITEMS))
    got.backward()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    grads = dict(plain.named_parameters())
    for name, p in chunked.named_parameters():
        if p.grad is not None or grads[name].grad is not None:  # to 1e-6 of the tensor's largest entry (fp32
            scale = float(grads[name].grad.abs().max())         # sums of the x40 head's large logits)
            torch.testing.assert_close(p.grad, grads[name].grad, rtol=1e-4, atol=1e-6 * max(scale, 1.0), msg=name)
