"""Preference tuning (training.objective: dpo), without launches: the losses against TRL's own code on the same
log-probs, the chunked gradient against autograd through full logits, and the pair data."""

import json
import os
from collections import defaultdict
from contextlib import nullcontext
from types import SimpleNamespace

import pytest
import torch

from conftest import REPO
from disttrain.recipe.schema import DataSection, PreferenceSection, load_recipe
from disttrain.data import IGNORE_INDEX, PAIR_INDEX, PairCollator, build_datasets
from disttrain.data.preference import truncate_pair
from disttrain.errors import DataError, RecipeError
from disttrain.objectives.preference import PreferenceLoss, log1mexp, pair_losses

torch.manual_seed(0)
N = 6
CHOSEN, REJECTED = -torch.rand(N) * 30 - 1, -torch.rand(N) * 30 - 1
REF_CHOSEN, REF_REJECTED = -torch.rand(N) * 30 - 1, -torch.rand(N) * 30 - 1
TOKENS_C, TOKENS_R = torch.randint(1, 20, (N,)).float(), torch.randint(1, 20, (N,)).float()


def _trl_dpo(loss_type: str, beta: float) -> torch.Tensor:
    """TRL's DPOTrainer._compute_loss (the code that computes the loss, run as it is) on per-token log-probs
    that sum to CHOSEN / REJECTED over TOKENS_C / TOKENS_R completion tokens, precomputed reference."""
    from trl import DPOTrainer

    width = int(max(TOKENS_C.max(), TOKENS_R.max())) + 1
    mask = torch.zeros(2 * N, width)
    per_token = torch.zeros(2 * N, width - 1)
    for i, (total, count) in enumerate(zip(torch.cat([CHOSEN, REJECTED]), torch.cat([TOKENS_C, TOKENS_R]))):
        n = int(count)
        mask[i, 1:1 + n] = 1
        per_token[i, :n] = total / n
    outputs = SimpleNamespace(log_probs=per_token, entropy=torch.zeros_like(per_token),
                              mean_logits=torch.zeros_like(per_token), is_top1=torch.zeros_like(per_token).bool())
    fake = SimpleNamespace(
        model=SimpleNamespace(training=True), aux_loss_enabled=False, ld_alpha=None, precompute_ref_logps=True,
        f_divergence_type="reverse_kl", loss_types=[loss_type], loss_weights=[1.0], beta=beta, label_smoothing=0.0,
        use_weighting=False, _metrics=defaultdict(lambda: defaultdict(list)), _total_train_tokens=0, _tp_size=1,
        accelerator=SimpleNamespace(device=torch.device("cpu"), gather=lambda t: t, gather_for_metrics=lambda t: t))
    inputs = {"input_ids": torch.zeros(2 * N, width, dtype=torch.long), "attention_mask": torch.ones(2 * N, width),
              "completion_mask": mask, "ref_chosen_logps": REF_CHOSEN, "ref_rejected_logps": REF_REJECTED}
    return DPOTrainer._compute_loss(fake, lambda **_: outputs, inputs, return_outputs=False)


@pytest.mark.parametrize("loss_type", ["sigmoid", "hinge", "ipo"])
def test_dpo_losses_equal_trl_dpo_trainer(loss_type):
    cfg = PreferenceSection(loss=loss_type, beta=0.3)
    ours, _, _ = pair_losses(cfg, CHOSEN, REJECTED, TOKENS_C, TOKENS_R, REF_CHOSEN, REF_REJECTED)
    torch.testing.assert_close(ours.mean(), _trl_dpo(loss_type, 0.3), rtol=1e-6, atol=1e-6)


def _cpo(loss_type: str, beta: float, smoothing: float, gamma: float = 0.0):
    from trl.experimental.cpo import CPOTrainer

    fake = SimpleNamespace(alpha=0.0, beta=beta, loss_type=loss_type, label_smoothing=smoothing, simpo_gamma=gamma,
                           accelerator=SimpleNamespace(device=torch.device("cpu")))
    return fake, CPOTrainer.cpo_loss


def test_conservative_dpo_equals_trl_label_smoothing():
    """sigmoid with label_smoothing (cDPO): TRL's CPO trainer applies the same smoothed formula to the
    log-prob differences it is given; given the log-ratios it is cDPO."""
    cfg = PreferenceSection(loss="sigmoid", beta=0.2, label_smoothing=0.15)
    ours, _, _ = pair_losses(cfg, CHOSEN, REJECTED, TOKENS_C, TOKENS_R, REF_CHOSEN, REF_REJECTED)
    fake, cpo_loss = _cpo("sigmoid", 0.2, 0.15)
    theirs, _, _ = cpo_loss(fake, CHOSEN - REF_CHOSEN, REJECTED - REF_REJECTED)
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_simpo_equals_trl(smoothing):
    """SimPO on average log-probs (TRL's CPO trainer averages them for simpo)."""
    cfg = PreferenceSection(loss="simpo", beta=2.0, simpo_gamma=0.7, label_smoothing=smoothing)
    ours, reward_c, reward_r = pair_losses(cfg, CHOSEN, REJECTED, TOKENS_C, TOKENS_R)
    fake, cpo_loss = _cpo("simpo", 2.0, smoothing, 0.7)
    theirs, their_c, their_r = cpo_loss(fake, CHOSEN / TOKENS_C, REJECTED / TOKENS_R)
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close((reward_c, reward_r), (their_c, their_r))


def test_orpo_equals_trl_odds_ratio_plus_the_chosen_nll():
    from trl.experimental.orpo import ORPOTrainer

    cfg = PreferenceSection(loss="orpo", beta=0.25)
    avg_c, avg_r = CHOSEN / TOKENS_C, REJECTED / TOKENS_R
    ours, _, _ = pair_losses(cfg, CHOSEN, REJECTED, TOKENS_C, TOKENS_R)
    fake = SimpleNamespace(beta=0.25, accelerator=SimpleNamespace(device=torch.device("cpu")))
    ratio_term, *_ = ORPOTrainer.odds_ratio_loss(fake, avg_c, avg_r)
    # TRL: loss = nll(chosen) - mean(beta * logsigmoid(log odds)); per pair, the NLL is the chosen tokens' mean
    torch.testing.assert_close(ours, -avg_c - ratio_term, rtol=1e-6, atol=1e-6)
    x = torch.tensor([-1e-6, -0.5, -5.0, -40.0])
    torch.testing.assert_close(log1mexp(x), torch.log(1 - torch.exp(x.double())).float(), rtol=1e-5, atol=1e-6)


def _pair_batch(pad_id: int):
    rows = [{"chosen_input_ids": [5, 6, 7, 8, 9], "chosen_labels": [IGNORE_INDEX, IGNORE_INDEX, 7, 8, 9],
             "rejected_input_ids": [5, 6, 11, 12], "rejected_labels": [IGNORE_INDEX, IGNORE_INDEX, 11, 12],
             PAIR_INDEX: 0},
            {"chosen_input_ids": [4, 13, 14], "chosen_labels": [IGNORE_INDEX, 13, 14],
             "rejected_input_ids": [4, 15, 16, 17, 18, 19], "rejected_labels": [IGNORE_INDEX, 15, 16, 17, 18, 19],
             PAIR_INDEX: 1}]
    return PairCollator(pad_id)(rows)


def seeded_model(model_dir, lora: bool):
    """The tiny model, the same weights at every call; with LoRA, adapters not at zero (their gradients show)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(1)
    m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if lora:
        from peft import LoraConfig, get_peft_model

        m = get_peft_model(m, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                                         lora_dropout=0.0, init_lora_weights=False))
    return m


@pytest.mark.parametrize("loss", ["sigmoid", "ipo", "simpo", "orpo"])
@pytest.mark.parametrize("lora", [False, True])
def test_chunked_gradient_equals_autograd_through_full_logits(loss, lora, tiny_model_dir, tokenizer):
    """The loss made inside lm_head (log-probs without gradients, then one weighted chunked pass) has the value
    and the gradients of the same loss computed by autograd from the full logits."""
    def model():
        return seeded_model(tiny_model_dir, lora)

    cfg = PreferenceSection(loss=loss, beta=0.5)
    batch = _pair_batch(tokenizer.pad_token_id)
    ref = torch.tensor([[-20.0, -25.0], [-9.0, -30.0]])

    plain = model()
    logits = plain(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    labels = batch["labels"][:, 1:]
    logp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, labels.clamp(min=0)[..., None])[..., 0]
    seq = (logp * (labels != IGNORE_INDEX)).sum(-1)
    tokens = (labels != IGNORE_INDEX).sum(-1)
    refs = (ref[:, 0], ref[:, 1]) if not cfg.reference_free() else (None, None)
    expected = pair_losses(cfg, seq[:2], seq[2:], tokens[:2], tokens[2:], *refs)[0].sum()
    expected.backward()

    chunked = model()
    objective = PreferenceLoss(chunked, cfg, "none" if cfg.reference_free() else "precomputed")
    objective.tables = {"train": ref}
    got = objective.training_loss(chunked, batch, torch.tensor(1.0))
    got.backward()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    grads = {n: p.grad for n, p in plain.named_parameters() if p.grad is not None}
    assert grads
    for name, p in chunked.named_parameters():
        if name in grads:
            torch.testing.assert_close(p.grad, grads[name], rtol=1e-4, atol=1e-6, msg=name)


def test_moe_preference_loss_adds_the_router_loss_as_trl_does():
    """A tiny Qwen3-MoE with output_router_logits (coefficient 1, so that it shows): the DPO loss made inside
    lm_head plus router_aux_loss_coef x the forward's load-balancing loss of the pair batch -- what TRL's
    DPOTrainer adds (loss + aux_loss_coef * aux_loss) -- in value and in every gradient, the router's included."""
    from test_loss_families import tiny

    cfg = PreferenceSection(loss="sigmoid", beta=0.5)
    batch = _pair_batch(0)  # the tiny MoE's pad id
    ref = torch.tensor([[-20.0, -25.0], [-9.0, -30.0]])

    plain = tiny("qwen3_moe")
    out = plain(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    labels = batch["labels"][:, 1:]
    logp = torch.log_softmax(out.logits[:, :-1].float(), -1).gather(-1, labels.clamp(min=0)[..., None])[..., 0]
    seq = (logp * (labels != IGNORE_INDEX)).sum(-1)
    tokens = (labels != IGNORE_INDEX).sum(-1)
    dpo = pair_losses(cfg, seq[:2], seq[2:], tokens[:2], tokens[2:], ref[:, 0], ref[:, 1])[0].sum()
    assert out.aux_loss > 1e-2  # the router loss changes the total: the equality below proves it is added
    expected = dpo + plain.config.router_aux_loss_coef * out.aux_loss
    expected.backward()

    chunked = tiny("qwen3_moe")
    objective = PreferenceLoss(chunked, cfg, "precomputed")
    objective.tables = {"train": ref}
    got = objective.training_loss(chunked, batch, torch.tensor(1.0))
    got.backward()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    grads = {n: p.grad for n, p in plain.named_parameters() if p.grad is not None}
    assert any("gate" in n for n in grads)
    for name, p in chunked.named_parameters():
        if name in grads:
            # fp32 summation order only: gradients up to ~70 here (lm_head x 40), differences ~1e-5
            torch.testing.assert_close(p.grad, grads[name], rtol=1e-4, atol=1e-4, msg=name)


def test_pairs_stay_together_and_truncation_keeps_prompt_end_and_response_start(tokenizer):
    batch = _pair_batch(tokenizer.pad_token_id)
    assert batch["input_ids"].shape[0] == 4 and batch[PAIR_INDEX].tolist() == [0, 1]
    assert batch["labels"][0, 2:5].tolist() == [7, 8, 9] and batch["labels"][2, 2:4].tolist() == [11, 12]
    prompt = list(range(100, 110))
    chosen = (prompt + [1, 2, 3, 4], [IGNORE_INDEX] * 10 + [1, 2, 3, 4])
    rejected = (prompt + [5, 6, 7, 8, 9, 10, 11, 12], [IGNORE_INDEX] * 10 + [5, 6, 7, 8, 9, 10, 11, 12])
    c, r, truncated = truncate_pair(chosen, rejected, 12)
    # the responses get half the row (they need more than the prompt leaves them), the prompt keeps its end
    assert truncated and r[0] == [104, 105, 106, 107, 108, 109, 5, 6, 7, 8, 9, 10]
    assert c[0] == [104, 105, 106, 107, 108, 109, 1, 2, 3, 4]  # the same prompt tokens on both sides
    assert r[1][:6] == [IGNORE_INDEX] * 6 and r[1][6:] == [5, 6, 7, 8, 9, 10]


def test_preference_data_formats_drops_and_errors(tmp_path, tokenizer):
    path = tmp_path / "pairs.jsonl"
    pairs = [  # whole conversations: the shared opening is the prompt (UltraFeedback's own prompt field ignored)
        {"prompt": "Repeat the words. apple",
         "chosen": [{"role": "user", "content": "Repeat the words. apple"}, {"role": "assistant", "content": "apple"}],
         "rejected": [{"role": "user", "content": "Repeat the words. apple"},
                      {"role": "assistant", "content": "APPLE!"}]},
        {"prompt": "apple " * 80,
         "chosen": [{"role": "user", "content": "apple " * 80}, {"role": "assistant", "content": "x"}],
         "rejected": [{"role": "user", "content": "apple " * 80}, {"role": "assistant", "content": "y"}]}]
    path.write_text("".join(json.dumps(p) + "\n" for p in pairs))
    train, _, reports = build_datasets(DataSection(path=str(path), format="preference", max_seq_len=32), tokenizer, 0,
                                       nullcontext)
    # the long prompt is cut from its start, so both of its responses keep their tokens: nothing to drop
    assert len(train) == 2 and reports["train"].truncated == 1 and reports["train"].dropped_no_target == 0
    assert max(len(ids) for ids in train["rejected_input_ids"]) <= 32
    row = train[0]
    assert tokenizer.decode([t for t in row["chosen_labels"] if t != IGNORE_INDEX]) == "apple<|im_end|>"
    assert tokenizer.decode(row["rejected_input_ids"]).count("Repeat the words. apple") == 1
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "x", "chosen": "a", "rejected": "b"}) + "\n"
                   + json.dumps({"prompt": "x", "chosen": "a"}) + "\n")
    with pytest.raises(DataError, match=r"bad.jsonl:2: missing field 'rejected' required by data.format=preference"):
        build_datasets(DataSection(path=str(bad), format="preference"), tokenizer, 0, nullcontext)


def test_objective_and_reference_settings_are_checked():
    dpo = ["training.objective=dpo", "data.path=data/tiny_dpo.jsonl", "data.format=preference",
           "data.eval_path=null"]
    assert load_recipe(REPO / "recipes/tiny/sft.yaml", dpo).reference_mode() == "precomputed"
    lora = load_recipe(REPO / "recipes/tiny/sft.yaml", dpo + ["lora.r=4"])
    assert lora.reference_mode() == "adapters"
    assert load_recipe(REPO / "recipes/tiny/sft.yaml", dpo + ["preference.loss=simpo"]).reference_mode() == "none"
    cases = [(["training.objective=dpo"], "needs data.format: preference"),
             (dpo[1:], "set training.objective: dpo"),
             (dpo + ["data.streaming=true"], "concat_and_chunk and streaming are not supported"),
             (dpo + ["preference.loss=orpo", "preference.reference=precomputed"], "reference-free"),
             (dpo + ["preference.reference=none"], "compares the policy with a reference"),
             (dpo + ["training.loss_impl=plain"], "remove training.loss_impl: plain")]
    for overrides, message in cases:
        with pytest.raises(RecipeError, match=message):
            load_recipe(REPO / "recipes/tiny/sft.yaml", overrides)


LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
LLAMA3 = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
          "{{ m['content'] }}<|eot_id|>{% endfor %}"
          "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")


@pytest.mark.parametrize("system, opening", [
    ("Answer with one word.", "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nAnswer with one word."
                              "<|eot_id|><|start_header_id|>user<|end_header_id|>\n\n"),
    ("Be brief. " * 30, "<|begin_of_text|>"),  # no room for the whole opening: BOS alone
])
def test_truncation_keeps_bos_and_the_system_turn_and_cuts_the_oldest_prompt_text(system, opening, tokenizer):
    """A long prompt is cut in its middle: BOS, the system turn and the user header stay (before the fix the
    prompt lost its start, BOS and system prompt included), its last words and both responses stay."""
    import copy

    from disttrain.data.pipeline import tokenize_batch

    tok = copy.deepcopy(tokenizer)
    tok.add_special_tokens({"additional_special_tokens": LLAMA3_SPECIALS})
    tok.bos_token, tok.chat_template = "<|begin_of_text|>", LLAMA3
    pair = {"prompt": [{"role": "system", "content": system},
                       {"role": "user", "content": "apple river " * 40 + "Which word came first?"}],
            "chosen": "apple", "rejected": "river"}
    sec = DataSection(path="x.jsonl", format="preference", max_seq_len=64)
    columns = tokenize_batch([pair], tok, sec, sec.all_sources()[0])
    assert columns["truncated"] == [True] and columns["n_targets"][0] > 0
    for side, answer in (("chosen", "apple"), ("rejected", "river")):
        ids = columns[f"{side}_input_ids"][0]
        text = tok.decode(ids)
        assert len(ids) <= 64 and text.startswith(opening), text
        assert text.endswith("Which word came first?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
                             f"{answer}<|eot_id|>"), text
        labels = columns[f"{side}_labels"][0]
        assert tok.decode([t for t in labels if t != IGNORE_INDEX]) == f"{answer}<|eot_id|>"
    chosen, rejected = columns["chosen_input_ids"][0], columns["rejected_input_ids"][0]
    assert chosen[:-3] == rejected[:-3]  # the same prompt tokens on both sides


def test_saved_reference_log_probs_belong_to_their_model_and_data(tmp_path, tiny_model_dir):
    """A restart in the same output.dir with another model (an SFT checkpoint, say) must not reuse the old
    model's reference log-probs (they were keyed by the data only)."""
    import shutil

    from safetensors.torch import save_file

    from disttrain.errors import DisttrainError
    from disttrain.objectives.preference import read_reference, reference_key

    model_dir = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model_dir)
    recipe = load_recipe(REPO / "recipes/tiny/dpo.yaml", [f"model.name_or_path={model_dir}"])
    data = SimpleNamespace(_fingerprint="abc")
    key = reference_key(recipe, data, {})
    path = tmp_path / "reference_logps.safetensors"
    save_file({"train": torch.zeros(3, 2)}, str(path), metadata=key)
    assert read_reference(path, {"train": 3}, key)["train"].shape == (3, 2)  # a resume: read back
    other_dtype = load_recipe(REPO / "recipes/tiny/dpo.yaml", [f"model.name_or_path={model_dir}",
                                                               "model.dtype=bfloat16"])
    weights = next(model_dir.glob("*.safetensors"))
    for changed in (reference_key(other_dtype, data, {}),
                    (os.utime(weights, ns=(1, 1)), reference_key(recipe, data, {}))[1]):  # weights rewritten
        with pytest.raises(DisttrainError, match="reference log-probs of another model"):
            read_reference(path, {"train": 3}, changed)
    with pytest.raises(DisttrainError, match="reference log-probs of other data"):
        read_reference(path, {"train": 3}, {**key, "data": "train:xyz"})


@pytest.mark.parametrize("precision, dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16), ("no", torch.float32)])
def test_a_live_reference_under_zero1_2_runs_in_the_policys_precision(precision, dtype, tiny_model_dir):
    """Under DeepSpeed the policy's weights are bf16/fp16 and accelerate does not autocast, so the frozen copy
    must be cast too (ZeRO-1/2; ZeRO-3's copy is a DeepSpeed engine of the same config); it stayed fp32 and
    the two differed at step 0."""
    from accelerate.utils import DistributedType

    from disttrain.objectives.preference import live_reference

    recipe = load_recipe(REPO / "recipes/tiny/dpo.yaml", [f"model.name_or_path={tiny_model_dir}",
                                                          f"training.mixed_precision={precision}"])
    deepspeed = SimpleNamespace(distributed_type=DistributedType.DEEPSPEED, device=torch.device("cpu"),
                                state=SimpleNamespace(deepspeed_plugin=SimpleNamespace(zero_stage=2)))
    model, _ = live_reference(deepspeed, recipe, sharded=False, local_device=None)
    assert {p.dtype for p in model.parameters()} == {dtype} and not model.training
