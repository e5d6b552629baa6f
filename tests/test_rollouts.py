"""Online RL's sampling and what surrounds it, in one process (the launches: test_grpo_launch.py, the matrix's rl runs):

- a step's completions come out of one batched generate() call, each equal to what its seed samples alone (left
  padding, other rows, rl.rows_per_generate and the process's random state change nothing, and it is left alone);
- the Gumbel-max draws follow the filtered distribution (temperature, top-k, top-p, min-p) and the seeds never
  collide;
- the checkpoint's generation config does not reach the samples; the recipe's own settings do;
- TRL's reward-function extras (trainer_state, log_metric, log_extra) and factories with arguments;
- frac_reward_zero_std and the GSPO clip shares as TRL counts them; dropout off in the policy;
- the whole-model rule of FSDP2 / ZeRO-3 rollouts.
"""

from __future__ import annotations

import contextlib
import copy
import math
from types import SimpleNamespace

import pytest
import torch

from disttrain.errors import DisttrainError
from disttrain.objectives import rollout, sampling
from disttrain.recipe.schema import RLSection

PROMPTS = ("sort: stone green", "reverse the words: a b c d e f g", "count: x")


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def _rows(tokenizer, group=4, batch=0):
    prompts = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in PROMPTS]
    rows = [p for p in prompts for _ in range(group)]
    seeds = [sampling.completion_seed(42, batch, i, g) for i in range(len(prompts)) for g in range(group)]
    return rows, seeds


def _sample(model, tokenizer, cfg, rows, seeds):
    eos = rollout.eos_ids(tokenizer, model)
    return rollout.sample(model, cfg, rows, seeds, eos, tokenizer.pad_token_id, torch.device("cpu"), False)


# ------------------------------------------------------------------------------------------------ the sampling
def test_a_steps_completions_are_each_what_its_seed_samples_alone(model, tokenizer):
    cfg = RLSection(num_generations=4, max_completion_length=10)
    rows, seeds = _rows(tokenizer)
    torch.manual_seed(0)
    state = torch.get_rng_state()
    batched = _sample(model, tokenizer, cfg, rows, seeds)
    assert torch.equal(torch.get_rng_state(), state)  # dropout's stream is untouched
    torch.manual_seed(123)  # another process state, rows one by one, in another order: the same completions
    alone = [_sample(model, tokenizer, cfg, [r], [s])[0] for r, s in reversed(list(zip(rows, seeds)))][::-1]
    assert batched == alone
    chunked = _sample(model, tokenizer, cfg.model_copy(update={"rows_per_generate": 5}), rows, seeds)
    assert chunked == batched
    assert len({tuple(ids) for ids, _ in batched}) > 8  # sampled, not greedy
    assert all(len(ids) <= 10 for ids, _ in batched) and any(t for _, t in batched)
    assert _sample(model, tokenizer, cfg, rows, [s + 1 for s in seeds]) != batched


def test_a_repetition_penalty_does_not_reach_the_padding():
    """The pad token as EOS (Llama 3's usual setting) and a penalty: a left-padded row's scores after the
    recipe's processors equal the same row's unpadded (EOS is not penalised for the padding other rows' lengths
    give it), and the penalty still falls on the row's own tokens."""
    cfg = RLSection(repetition_penalty=3.0)
    eos = 2
    row = torch.tensor([[5, 7, 9]])
    padded = torch.tensor([[eos, eos, 5, 7, 9]])
    scores = torch.linspace(-1.0, 2.0, 12).unsqueeze(0)
    alone = sampling.processors(cfg, [11], 3, "cpu", [0])(row, scores.clone())
    beside = sampling.processors(cfg, [11], 5, "cpu", [2])(padded, scores.clone())
    torch.testing.assert_close(beside, alone)
    assert alone[0, eos] == scores[0, eos] + sampling.gumbel_noise(torch.tensor([11]), 0, 12)[0, eos]
    assert not torch.allclose(alone, sampling.processors(RLSection(), [11], 3, "cpu", [0])(row, scores.clone()))


def test_completion_seeds_never_collide():
    seeds = {sampling.completion_seed(42, b, r, g) for b in range(3) for r in range(0, 20_000, 7) for g in range(8)}
    assert len(seeds) == 3 * len(range(0, 20_000, 7)) * 8
    assert sampling.completion_seed(42, 1, 0, 0) != sampling.completion_seed(42, 0, 7919, 0)  # the old collision
    assert all(0 <= s < 2 ** 63 for s in seeds)


@pytest.mark.parametrize("settings", [{}, {"temperature": 0.7}, {"top_k": 3}, {"top_p": 0.8}, {"min_p": 0.3},
                                      {"temperature": 1.5, "top_k": 4, "top_p": 0.9}])
def test_the_draws_follow_the_filtered_distribution(settings):
    """40,000 draws of one 6-token distribution (counter-based noise: the same numbers every run) against the
    probabilities transformers' own warpers leave: within 0.01 each."""
    from transformers.generation.logits_process import (MinPLogitsWarper, TemperatureLogitsWarper, TopKLogitsWarper,
                                                        TopPLogitsWarper)

    cfg = RLSection(**settings)
    logits = torch.tensor([[2.0, 1.5, 0.3, -0.4, 0.9, -2.0]])
    expected = logits.clone()
    for warper in ([TemperatureLogitsWarper(cfg.temperature)] + ([TopKLogitsWarper(cfg.top_k)] if cfg.top_k else [])
                   + ([TopPLogitsWarper(cfg.top_p)] if cfg.top_p < 1 else [])
                   + ([MinPLogitsWarper(cfg.min_p)] if cfg.min_p else [])):
        expected = warper(None, expected)
    expected = torch.softmax(expected, -1)[0]
    draws, rows = torch.zeros(6), 10_000
    ids = torch.zeros(rows, 1, dtype=torch.long)
    for position in range(4):
        chain = sampling.processors(cfg, list(range(rows)), 1 - position, "cpu")
        picked = chain(ids, logits.expand(rows, -1).clone()).argmax(-1)
        draws += torch.bincount(picked, minlength=6)
    frequencies = draws / draws.sum()
    assert torch.allclose(frequencies, expected, atol=0.01), (frequencies, expected)
    assert (frequencies[expected == 0] == 0).all()  # filtered tokens are never drawn


def test_the_checkpoints_generation_config_does_not_reach_the_samples(model, tokenizer):
    cfg = RLSection(num_generations=4, max_completion_length=10)
    rows, seeds = _rows(tokenizer)
    plain = _sample(model, tokenizer, cfg, rows, seeds)
    theirs = copy.deepcopy(model)
    for key, value in {"repetition_penalty": 2.0, "no_repeat_ngram_size": 1, "min_p": 0.5, "do_sample": True,
                       "top_k": 2, "temperature": 0.3, "max_new_tokens": 3}.items():
        setattr(theirs.generation_config, key, value)
    assert _sample(theirs, tokenizer, cfg, rows, seeds) == plain
    assert theirs.generation_config.repetition_penalty == 2.0  # put back after the rollout
    # the recipe's own settings are used: each sampled token within min_p x the likeliest token's probability
    strict = cfg.model_copy(update={"min_p": 0.5})
    sampled = _sample(model, tokenizer, strict, rows, seeds)
    assert sampled != plain
    for prompt, (completion, _) in zip(rows, sampled):
        ids = torch.tensor([prompt + completion])
        probs = torch.softmax(model(ids).logits[0, len(prompt) - 1:-1], -1)
        chosen = probs.gather(1, torch.tensor(completion).unsqueeze(1))[:, 0]
        assert (chosen >= 0.5 * probs.max(-1).values - 1e-6).all()
    penalised = _sample(model, tokenizer, cfg.model_copy(update={"repetition_penalty": 3.0}), rows, seeds)
    assert penalised != plain


# ----------------------------------------------------------------------------------------- rewards, metrics
def _write(tmp_path, body: str) -> str:
    path = tmp_path / "trl_style.py"
    path.write_text(body)
    return str(path)


def test_trls_reward_function_extras_are_given_not_refused_as_columns(tmp_path):
    from disttrain.objectives.rl_metrics import RolloutWindow
    from disttrain.objectives.rewards import Rewards

    path = _write(tmp_path, "def staged(completions, trainer_state, log_metric, log_extra, **kw):\n"
                            "    log_metric('staged/step', trainer_state.global_step)\n"
                            "    log_extra('length', [len(c) for c in completions])\n"
                            "    return [float(trainer_state.global_step)] * len(completions)\n"
                            "def plain(prompts, completions, completion_ids, answer):\n"
                            "    return [1.0] * len(completions)\n")  # no **kwargs: given no extras
    rewards = Rewards(RLSection(rewards=[{"function": f"{path}:staged"}, {"function": f"{path}:plain"}]))
    rewards.check_columns({"answer"}, "d.jsonl")  # trainer_state & co. are not dataset columns
    window, extra = RolloutWindow(["staged", "plain"]), {}
    table = rewards.score(prompts=["p", "p"], completions=["ab", "abc"], completion_ids=[[1], [2]],
                          columns={"answer": ["x", "y"]}, where=str,
                          extras={"trainer_state": SimpleNamespace(global_step=7, epoch=0, max_steps=9),
                                  "log_metric": window.log_metric,
                                  "log_extra": lambda c, v: extra.setdefault(c, []).extend(v)})
    assert table.tolist() == [[7.0, 1.0], [7.0, 1.0]] and extra == {"length": [2, 3]}
    one = SimpleNamespace(num_processes=1, device=torch.device("cpu"), is_main_process=True,
                          reduce=lambda t, reduction: t)
    assert window.metrics(one)["staged/step"] == 7.0


def test_a_reward_factory_takes_its_arguments_from_the_recipe():
    from trl.rewards import get_soft_overlong_punishment

    from disttrain.objectives.rewards import Rewards

    args = {"max_completion_len": 10, "soft_punish_cache": 4}
    rewards = Rewards(RLSection(rewards=[{"function": "trl.rewards:get_soft_overlong_punishment", "args": args}]))
    ids = [[1] * n for n in (3, 7, 9, 12)]
    table = rewards.score(prompts=["p"] * 4, completions=["c"] * 4, completion_ids=ids, columns={}, where=str)
    assert table[:, 0].tolist() == pytest.approx(get_soft_overlong_punishment(**args)(completion_ids=ids))
    with pytest.raises(DisttrainError, match=r"rl.rewards\[0\]: trl.rewards:get_soft_overlong_punishment\(\*\*args\) "
                                             "raised TypeError"):
        Rewards(RLSection(rewards=[{"function": "trl.rewards:get_soft_overlong_punishment", "args": {"x": 1}}]))
    with pytest.raises(DisttrainError, match=r"json:dumps\(\*\*args\) returned str, not a reward function"):
        Rewards(RLSection(rewards=[{"function": "json:dumps", "args": {"obj": 4}}]))


def test_a_group_with_an_unscored_completion_is_zero_std_as_trl_counts_it():
    from trl.trainer.utils import nanstd as trl_nanstd

    from disttrain.objectives.rl_metrics import RolloutWindow

    nan = math.nan
    summed = torch.tensor([1.0, nan, 0.0, 1.0,   # spread among the scored: signal
                           2.0, 2.0, nan, 2.0,   # the scored ones equal: no signal
                           3.0, nan, nan, nan])  # one scored: TRL's nanstd is NaN, not zero
    window = RolloutWindow(["f"])
    window.add_rollout(summed.unsqueeze(1), summed, [([1], False)] * 12, 4)
    trl = torch.isclose(trl_nanstd(summed.view(3, 4), dim=1), torch.zeros(3)).sum()
    zero_std = window.sums[6]
    assert float(zero_std) == float(trl) == 1.0


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_the_clip_shares_are_per_token_or_per_completion_as_trl_logs_them(level):
    from test_policy_loss import MAX_COMPLETION, _micro_batch, _trl_trainer, trl_grpo

    from disttrain.objectives.policy_loss import clip_units, policy_loss

    epsilon = 0.02 if level == "token" else 0.002  # a completion's mean log-ratio strays less than its tokens'
    cfg = RLSection(loss="grpo", epsilon=epsilon, epsilon_high=1.5 * epsilon, importance_sampling=level)
    batch = _micro_batch(torch.Generator().manual_seed(1), old=True)
    _, stats = policy_loss(cfg, batch["logps"], batch["mask"], batch["advantages"], batch["old"])
    stub = _trl_trainer(cfg, 1)
    logps = batch["logps"]
    stub._get_per_token_logps_and_entropies = lambda *a, **k: (logps, torch.zeros_like(logps), None)
    rows = batch["mask"].shape[0]
    empty = torch.zeros(rows, 0, dtype=torch.long)
    inputs = {"prompt_ids": empty, "prompt_mask": empty,
              "completion_ids": torch.zeros(rows, MAX_COMPLETION, dtype=torch.long),
              "completion_mask": batch["mask"].long(), "advantages": batch["advantages"],
              "old_per_token_logps": batch["old"], "num_items_in_batch": batch["mask"].sum()}
    trl_grpo.GRPOTrainer._compute_loss(stub, None, inputs)
    logged = stub._metrics["train"]
    denominator = float(stats[0] if clip_units(cfg) == "tokens" else stats[1])
    for index, key in ((3, "low"), (4, "high"), (5, "region")):
        assert float(stats[index]) / denominator == pytest.approx(logged[f"clip_ratio/{key}_mean"][0], rel=1e-6)
    assert 0 < float(stats[5]) < denominator  # some clipped, not all


def test_dropout_is_off_in_the_policy_so_the_first_ratio_is_one(tiny_model_dir, tokenizer):
    """LoRA with dropout 0.5: after GRPO's prepare, a forward in train mode equals one in eval mode (the old
    policy's log-probs are taken in eval mode)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from disttrain.objectives.grpo import GRPO

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    policy = get_peft_model(base, LoraConfig(r=4, lora_dropout=0.5, target_modules="all-linear",
                                             init_lora_weights=False))
    ids = torch.tensor([tokenizer("sort: stone green", add_special_tokens=False)["input_ids"]])
    objective = GRPO(SimpleNamespace(rl=RLSection(rewards=[{"function": "math:sqrt"}])))
    policy.train()
    torch.manual_seed(0)
    assert not torch.equal(policy(ids).logits, policy.eval()(ids).logits)  # dropout on: they differ
    objective.without_dropout(policy)
    assert torch.equal(policy.train()(ids).logits, policy.eval()(ids).logits)


# --------------------------------------------------------------------------------------- the whole-model rule
def test_the_whole_model_rule_decides_once_says_so_and_keeps_the_forward_collective_free_or_synced(
        model, monkeypatch):
    """RolloutWeights with the tiny model standing in for a sharded one: whole when the model and the KV cache fit
    in 90% of the free memory (no synced_gpus), per layer when not (synced_gpus), forced either way by
    rl.generation_weights; decided once for a shape, again for a larger one; the log line at each change."""
    from disttrain.runtime import rollout_weights
    from disttrain.runtime.rollout_weights import HEADROOM, RolloutWeights, kv_cache_bytes

    said = []
    accelerator = SimpleNamespace(device=torch.device("cpu"), num_processes=1, print=said.append,
                                  mixed_precision="no", unwrap_model=lambda m, keep_torch_compile: m,
                                  distributed_type="NO", state=SimpleNamespace(
                                      deepspeed_plugin=None, fsdp_plugin=SimpleNamespace(mixed_precision_policy=None)))
    weights_bytes = sum(p.numel() * 4 for p in model.parameters())
    cache = kv_cache_bytes(model.config, 8, 100, 4)
    free = [(weights_bytes + cache) / HEADROOM + 1]
    monkeypatch.setattr(rollout_weights, "free_device_bytes", lambda device: free[0])

    def decide(rl, shape=(8, 100)):
        holder = RolloutWeights(accelerator, rl) if rl is not None else held
        holder.sharding = "fsdp2"
        with holder.model(model, shape) as (_, synced):
            return holder, synced

    held, synced = decide(RLSection())
    assert not synced and said[-1].startswith("rollouts: the whole model gathered once per rollout")
    free[0] -= 2  # no longer fits, but the shape was decided on: the decision stands, nothing said
    assert decide(None) == (held, False) and len(said) == 1
    assert decide(None, (8, 101))[1] is True  # a larger shape: decided again, per layer now
    assert said[-1].startswith("rollouts: each layer gathered for every generated token") and len(said) == 2
    assert decide(RLSection(generation_weights="whole"))[1] is False
    assert decide(RLSection(generation_weights="per_layer"), (1, 1))[1] is True


@pytest.fixture
def one_process_group():
    """A one-process gloo group in this process (FSDP2 needs one), taken down after."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("policy", [{}, {"param_dtype": torch.bfloat16}, {"param_dtype": torch.bfloat16,
                                                                          "output_dtype": torch.float32}])
def test_an_fsdp2_model_gathered_whole_samples_what_its_hooks_sample_and_gets_them_back_in_order(
        policy, tiny_model_dir, tokenizer, one_process_group):
    """FSDP2 (the decoder layers, then the final norm with the LM head grouped as accelerate groups them, then the
    root) under a mixed-precision policy or none: gathered whole for a rollout, its forward hooks are off -- or,
    where the policy casts, only its casts stay -- the greedy samples and the last logits equal what the model
    with every hook in place computes, and every hook dict is back, same hooks, same order."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import AutoModelForCausalLM

    from disttrain.runtime.rollout_weights import _fsdp2_whole

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    mp = MixedPrecisionPolicy(**policy)
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=mp)
    fully_shard([model.model.norm, model.lm_head], mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    hooked = [m for m in model.modules() if m._forward_pre_hooks or m._forward_hooks]
    before = [(list(m._forward_pre_hooks.items()), list(m._forward_hooks.items())) for m in hooked]
    ids = tokenizer([PROMPTS[0]], return_tensors="pt", add_special_tokens=False)["input_ids"]

    def greedy():
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=6, do_sample=False, output_logits=True,
                                 return_dict_in_generate=True, pad_token_id=tokenizer.pad_token_id)
        return out.sequences, out.logits[-1]

    with torch.no_grad():
        model(ids)  # the root's lazy initialisation, as training's first forward does it
    expected = greedy()
    with _fsdp2_whole(model):
        left = [m for m in model.modules() if m._forward_pre_hooks or m._forward_hooks]
        casts = bool(policy)  # param_dtype set: the inputs cast; output_dtype: the outputs too
        assert bool(left) == casts and all(len(m._forward_pre_hooks) == 1 for m in left)
        assert all(bool(m._forward_hooks) == ("output_dtype" in policy) for m in left)
        ours = greedy()
    assert torch.equal(ours[0], expected[0])
    assert ours[1].dtype == expected[1].dtype and torch.equal(ours[1], expected[1])
    assert [(list(m._forward_pre_hooks.items()), list(m._forward_hooks.items())) for m in hooked] == before


def test_the_static_cache_engine_samples_what_generate_samples(model, tokenizer):
    cfg = RLSection(num_generations=4, max_completion_length=10)
    rows, seeds = _rows(tokenizer)
    assert _sample(model, tokenizer, cfg.model_copy(update={"engine": "static"}), rows, seeds) == \
        _sample(model, tokenizer, cfg, rows, seeds)


# ------------------------------------------------------------------------------------------- the vLLM engine
def _serving(status: int):
    """A loopback HTTP server answering /health with `status`: (url, stop)."""
    import http.server
    import threading

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(status)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()

    def stop():
        server.shutdown()
        server.server_close()
    return f"http://127.0.0.1:{server.server_address[1]}", stop


def test_the_vllm_engine_refuses_what_it_cannot_take_in_one_line(monkeypatch):
    from disttrain.objectives import vllm_engine

    def rl(**kw):
        return RLSection(engine="vllm", rewards=[{"function": "math:sqrt"}], **kw)

    with pytest.raises(DisttrainError, match=r"rl.engine: vllm samples on the server.*remove rl.rows_per_generate"):
        vllm_engine.check(rl(rows_per_generate=4))
    url, stop = _serving(200)
    stop()  # nothing listens there now
    with pytest.raises(DisttrainError, match=rf"rl.vllm.server: no vLLM server answers at {url}/health "
                                             r"\(ConnectionError\)"):
        vllm_engine.check(rl(vllm={"server": url, "timeout_s": 0.5}))
    url, stop = _serving(503)
    try:
        with pytest.raises(DisttrainError, match=r"no vLLM server answers .*it answered, but not healthy"):
            vllm_engine.check(rl(vllm={"server": url, "timeout_s": 2}))
    finally:
        stop()
    url, stop = _serving(200)
    monkeypatch.setattr(vllm_engine.importlib.util, "find_spec", lambda name: None)
    try:
        with pytest.raises(DisttrainError, match=r"rl.engine: vllm needs vLLM in the trainer's environment too"):
            vllm_engine.check(rl(vllm={"server": url, "timeout_s": 2}))
    finally:
        stop()
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="engine"):
        RLSection(engine="sglang")


class _StandIn:
    """TRL's VLLMClient as the engine calls it: what it was asked, fixed answers."""

    def __init__(self, **kwargs):
        self.kwargs, self.requests, self.pushed, self.events = kwargs, [], {}, []

    def init_communicator(self, device):
        self.events.append(("communicator", str(device)))

    @contextlib.contextmanager
    def weight_update(self):
        self.events.append("start")
        yield
        self.events.append("finish")

    def update_named_params(self, metadata, named):
        for (name, dtype, shape), (same, tensor) in zip(metadata, named):
            assert name == same and list(tensor.shape) == shape and dtype == str(tensor.dtype).split(".")[1]
            self.pushed[name] = tensor.clone()

    def reset_prefix_cache(self):
        self.events.append("reset")

    def generate(self, prompts, n, **params):
        self.requests.append((prompts, n, params))
        ids = [[5, 6, 2], [7] * params["max_tokens"]][:n] + [[8, 2]] * (n - 2)
        return {"completion_ids": ids, "logprobs": [[[-0.5]] * len(c) for c in ids]}


def test_the_vllm_engine_pushes_merged_weights_by_their_checkpoint_names_and_asks_per_prompt(tiny_model_dir):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from disttrain.objectives.vllm_engine import VLLMEngine

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    names = set(dict(base.named_parameters()))
    policy = get_peft_model(base, LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False))
    merged = {k: v.clone() for k, v in copy.deepcopy(policy).merge_and_unload().state_dict().items()}
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    cfg = RLSection(engine="vllm", num_generations=3, max_completion_length=4, top_k=5, min_p=0.1,
                    rewards=[{"function": "math:sqrt"}])
    made = []
    engine = VLLMEngine(cfg, client_factory=lambda **kw: made.append(_StandIn(**kw)) or made[-1])
    main = SimpleNamespace(is_main_process=True, device=torch.device("cpu"))
    engine.push(main, policy, step=3)
    client = made[0]
    assert client.kwargs == {"base_url": "http://localhost:8000", "group_port": 51216, "connection_timeout": 240.0}
    assert client.events == [("communicator", "cpu"), "start", "finish", "reset"]
    assert set(client.pushed) == names  # every weight, by the plain model's names; no adapter, no peft prefix
    for name, tensor in client.pushed.items():
        torch.testing.assert_close(tensor, merged[name], msg=name)  # the adapters merged in
    assert all(torch.equal(v, before[k]) for k, v in policy.state_dict().items())  # and taken out again
    engine.push(main, policy, step=3)
    assert client.events.count("start") == 1  # once per optimizer step
    groups = engine.sample([[1, 2], [3]], [11, 12], eos=[2])
    assert [r[0] for r in client.requests] == [[[1, 2]], [[3]]]
    assert {r[2]["generation_kwargs"]["seed"] for r in client.requests} == {11, 12}
    assert client.requests[0][1] == 3 and client.requests[0][2]["top_k"] == 5 and client.requests[0][2]["min_p"] == 0.1
    assert groups[0] == [([5, 6, 2], False, [-0.5] * 3), ([7] * 4, True, [-0.5] * 4), ([8, 2], False, [-0.5] * 2)]


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
def test_the_engine_correction_is_trls(mode):
    """The weights as TRL's _generate_and_score_completions makes them (transcribed: exp of the masked log-prob
    differences, NaN -> ratio 1, per token or summed per completion, clipped or masked), and the loss they
    correct equal to TRL's _compute_loss with use_vllm and the same ratios."""
    from test_policy_loss import MAX_COMPLETION, _micro_batch, _trl_trainer, trl_grpo

    from disttrain.objectives.policy_loss import policy_loss
    from disttrain.objectives.vllm_engine import engine_weights

    cfg = RLSection(loss="dapo", beta=0.04, vllm={"importance_sampling": mode, "importance_sampling_min": 0.5,
                                                   "importance_sampling_max": 1.6})
    batch = _micro_batch(torch.Generator().manual_seed(5), old=True, ref=True)
    mask = batch["mask"]
    noise = torch.randn(mask.shape, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    sampled = batch["old"] + noise * 0.3
    sampled[0, 1] = math.nan
    weights = engine_weights(batch["old"], sampled, mask, cfg.vllm)
    diff = torch.nan_to_num((batch["old"] - sampled) * mask, nan=0.0)
    diff = diff.sum(-1, keepdim=True) if mode.startswith("sequence") else diff
    ratio = torch.exp(diff)
    outside = (ratio < 0.5) | (ratio > 1.6)
    expected = ratio.clamp(0.5, 1.6) if mode.endswith("truncate") else ratio.masked_fill(outside, 0)
    torch.testing.assert_close(weights, expected)
    assert weights.shape[-1] == (1 if mode.startswith("sequence") else MAX_COMPLETION)
    logps = batch["logps"].clone().requires_grad_()
    ours, _ = policy_loss(cfg, logps, mask, batch["advantages"], batch["old"], batch["ref"], MAX_COMPLETION, weights)
    stub = _trl_trainer(cfg, 1)
    stub.use_vllm = stub.vllm_importance_sampling_correction = True
    stub._get_per_token_logps_and_entropies = lambda *a, **k: (logps, torch.zeros_like(logps), None)
    rows = mask.shape[0]
    empty = torch.zeros(rows, 0, dtype=torch.long)
    inputs = {"prompt_ids": empty, "prompt_mask": empty,
              "completion_ids": torch.zeros(rows, MAX_COMPLETION, dtype=torch.long), "completion_mask": mask.long(),
              "advantages": batch["advantages"], "old_per_token_logps": batch["old"],
              "ref_per_token_logps": batch["ref"],
              "importance_sampling_ratio": weights, "num_items_in_batch": mask.sum()}
    theirs = trl_grpo.GRPOTrainer._compute_loss(stub, None, inputs)
    torch.testing.assert_close(ours / mask.sum(), theirs, rtol=1e-6, atol=1e-9)


def test_a_vllm_run_without_a_server_stops_before_the_model_loads(tmp_path, tiny_model_dir):
    import subprocess
    import sys

    from conftest import REPO, base_recipe, write_recipe

    url, stop = _serving(200)
    stop()
    recipe = write_recipe(tmp_path / "r.yaml", base_recipe(
        tiny_model_dir, tmp_path / "out", data={"path": str(REPO / "data/tiny_prompts.jsonl"), "format": "prompt"},
        training={"objective": "grpo", "max_steps": 2},
        rl={"engine": "vllm", "vllm": {"server": url, "timeout_s": 0.5}, "num_generations": 2,
            "rewards": [{"function": "recipes/tiny/rewards.py:letters"}]}))
    proc = subprocess.run([sys.executable, str(REPO / "train.py"), "--recipe", str(recipe)], capture_output=True,
                          text=True, cwd=REPO, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and f"no vLLM server answers at {url}/health" in errors[0], proc.stderr
    assert "Loading weights" not in proc.stderr + proc.stdout


def test_bench_rollouts_keeps_the_median_launch_and_checks_the_rewards():
    from disttrain.bench.rollouts import compare, median_of, parse_runs, summarize

    assert parse_runs("ddp, fsdp:per_layer") == [("ddp", "auto"), ("fsdp", "per_layer")]
    with pytest.raises(DisttrainError, match="no accelerate_configs/nope.yaml"):
        parse_runs("ddp,nope")
    with pytest.raises(DisttrainError, match="rl.generation_weights is one of auto, whole, per_layer"):
        parse_runs("fsdp:sometimes")

    def launch(seconds, rewards=(0.1, 0.2)):
        records = [{"step": s + 1, "reward": r, "rollout_s": seconds / len(rewards), "step_time_s": seconds,
                    "rollout_tokens_per_s": 100.0} for s, r in enumerate(rewards)]
        return summarize("x", records)

    ddp = median_of([launch(3.0), launch(2.0), launch(4.0)])
    fsdp = median_of([launch(3.3), launch(9.0), launch(3.0)])
    other = median_of([launch(3.0, (0.1, 0.25))])
    compare([ddp, fsdp, other])
    assert ddp["rollout_s"] == pytest.approx(3.0) and ddp["rollout_s_launches"] == pytest.approx([3.0, 2.0, 4.0])
    assert fsdp["rollout_ratio"] == pytest.approx(3.3 / 3.0) and fsdp["rewards_equal"] and fsdp["repeatable"]
    assert not other["rewards_equal"]
    assert ddp["sampling_share"] == pytest.approx(0.5)


def test_make_cost_says_where_a_rollout_gathers_the_whole_model():
    """Qwen2.5-7B's shape, 16 rows x 1536 tokens: 15.2 GB of bf16 weights + 0.9 GB of KV cache fit beside a
    strategy needing 40 GB of an 80 GB card, not beside one needing 65 GB."""
    from disttrain.metrics.flops import ModelShape
    from disttrain.tools.cost import Workload, rollout_weights_lines

    shape = ModelShape(params=7.6e9, matmul_params=7e9, layers=28, heads=28, head_dim=128, hidden=3584,
                       vocab=152064, kv_heads=4)
    w = Workload(params=7.6e9, shape=shape, tokens=1e8, seq_len=1536, micro_batch=16, gradient_checkpointing=False,
                 rollout_rows=16, rollout_tokens=1536)
    result = {"gpu": {"memory_gb": 80}, "rows": [{"strategy": "ddp", "need_gb": 70.0},
                                                 {"strategy": "fsdp", "need_gb": 40.0},
                                                 {"strategy": "zero3", "need_gb": 65.0}]}
    (line,) = rollout_weights_lines(w, result)
    kv = 2 * 28 * 4 * 128 * 16 * 1536 * 2 / 1e9
    assert f"({7.6e9 * 2 / 1e9:.1f} GB in bf16)" in line and f"({kv:.1f} GB)" in line
    assert line.endswith("fsdp whole, zero3 per layer (docs/rl.md).")  # ddp holds the model: no line for it
    assert rollout_weights_lines(Workload(params=1e9, shape=shape, tokens=1, seq_len=1, micro_batch=1,
                                          gradient_checkpointing=False), result) == []
