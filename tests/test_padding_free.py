"""Padding-free pair batches (data.packing with training.objective: dpo or reward; data/preference.py's
PairCollator): the layout, and every DPO-family loss, its gradients, its statistics, its eval rows and its
reference log-probs, KTO's loss, KL estimate and gradients (its examples and their partners packed apart), and a
reward model's scores, loss and gradients, equal to the padded batch's on the same pairs (full and LoRA; sdpa,
eager and transformers' flash path)."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch

from conftest import REPO
from disttrain.data import IGNORE_INDEX, PAIR_INDEX, PairCollator
from disttrain.data.collation import SECOND_GROUP_AT, SEQUENCE_COUNT, SEQUENCE_INDEX
from disttrain.data.unpaired import DESIRABLE, KL_PREFIX
from disttrain.errors import RecipeError
from disttrain.objectives.preference import PreferenceLoss, response_tokens, sequence_sums
from disttrain.objectives.reward_model import BradleyTerryLoss
from disttrain.recipe.schema import PreferenceSection, load_recipe
from test_preference import seeded_model

# chosen / rejected lengths with a long tail: padded, 8 rows of 23; padding-free, 4 rows
LENGTHS = [(9, 4), (3, 23), (12, 6), (5, 7)]


def _rows() -> list[dict]:
    """Pairs of a shared prompt (its tokens unscored) and two responses of the lengths above."""
    g = torch.Generator().manual_seed(0)
    rows = []
    for index, (c, r) in enumerate(LENGTHS):
        prompt = torch.randint(3, 200, (2,), generator=g).tolist()
        row = {PAIR_INDEX: index}
        for side, n in (("chosen_", c), ("rejected_", r)):
            response = torch.randint(3, 200, (n - 2,), generator=g).tolist()
            row[f"{side}input_ids"] = prompt + response
            row[f"{side}labels"] = [IGNORE_INDEX] * 2 + response
        rows.append(row)
    return rows


def test_padding_free_rows_hold_whole_sequences_apart_and_fewer_of_them():
    padded, packed = PairCollator(0)(_rows()), PairCollator(0, padding_free=True)(_rows())
    sequences = [(r["chosen_input_ids"], r["chosen_labels"]) for r in _rows()] + \
                [(r["rejected_input_ids"], r["rejected_labels"]) for r in _rows()]
    assert padded["input_ids"].shape == (8, 23)
    assert packed["input_ids"].shape == (4, 23) and "attention_mask" not in packed
    ids, index, positions = packed["input_ids"], packed[SEQUENCE_INDEX], packed["position_ids"]
    for i, (seq_ids, seq_labels) in enumerate(sequences):  # each sequence whole, in one row, positions from 0
        rows, cols = (index == i).nonzero(as_tuple=True)
        assert len(set(rows.tolist())) == 1 and cols.tolist() == list(range(cols[0], cols[0] + len(seq_ids)))
        assert ids[rows, cols].tolist() == seq_ids and positions[rows, cols].tolist() == list(range(len(seq_ids)))
        assert packed["labels"][rows, cols].tolist() == [IGNORE_INDEX] + seq_labels[1:]
    pad = index == len(sequences)
    assert (packed["labels"][pad] == IGNORE_INDEX).all() and int((~pad).sum()) == sum(map(sum, LENGTHS))
    assert packed["num_tokens"].tolist() == (~pad).sum(-1).tolist()
    assert packed[PAIR_INDEX].tolist() == [0, 1, 2, 3]
    tokens = response_tokens(packed)
    assert tokens.tolist() == response_tokens(padded).tolist() == [n - 2 for n in [c for c, _ in LENGTHS] +
                                                                   [r for _, r in LENGTHS]]
    flat = PairCollator(0, padding_free=True, flatten=True)(_rows())
    assert flat["input_ids"].shape == (1, sum(map(sum, LENGTHS)))
    assert flat["cu_seq_lens_q"].tolist() == [0, *torch.tensor([len(s[0]) for s in sequences]).cumsum(0).tolist()]
    assert sequence_sums(torch.ones(1, flat["input_ids"].shape[1]), flat).tolist() == [len(s[0]) for s in sequences]


def _losses(model, batch, cfg, reference):
    objective = PreferenceLoss(model, cfg, reference)
    table = torch.tensor([[-60.0, -40.0], [-20.0, -95.0], [-70.0, -30.0], [-35.0, -45.0]])
    objective.tables = {"train": table, "eval": table}
    loss = objective.training_loss(model, batch, torch.tensor(4.0))
    loss.backward()
    model.eval()
    with torch.no_grad():
        rows = objective.eval_rows(model, batch)
    model.train()
    return loss.detach(), objective._last, rows, {n: p.grad.clone() for n, p in model.named_parameters()
                                                  if p.grad is not None}


def _reward_losses(model, batch):
    objective = BradleyTerryLoss(0.01)
    loss = objective.training_loss(model, batch, torch.tensor(4.0))
    loss.backward()
    with torch.no_grad():
        rows = objective.eval_rows(model.eval(), batch)
    return loss.detach(), objective._window, rows, {n: p.grad.clone() for n, p in model.named_parameters()
                                                    if p.grad is not None}


@pytest.mark.parametrize("lora", [False, True])
def test_reward_model_scores_losses_and_gradients_equal_the_padded_batchs(lora, tiny_model_dir):
    """A reward model's scores (transformers' head reads a padded row's last token that is not the pad token; a
    response here ends in the pad token, as where pad = EOS), its loss with the centring term, statistics, eval
    rows and every gradient (score head included): padding-free == padded."""
    from transformers import AutoModelForSequenceClassification

    rows = _rows()
    rows[1]["chosen_input_ids"][-1] = 0  # the pad token, last: the score is read one token earlier

    def model():
        torch.manual_seed(3)  # the new score head's initial weights
        m = AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=1, pad_token_id=0,
                                                               dtype=torch.float32)
        if lora:
            from peft import LoraConfig, get_peft_model

            m = get_peft_model(m, LoraConfig(task_type="SEQ_CLS", r=4, lora_alpha=8, lora_dropout=0.0,
                                             target_modules=["q_proj", "v_proj"], init_lora_weights=False))
        return m

    (loss_a, stats_a, rows_a, grads_a), (loss_b, stats_b, rows_b, grads_b) = [
        _reward_losses(model(), collate(rows)) for collate in (PairCollator(0), PairCollator(0, padding_free=True))]
    torch.testing.assert_close(loss_b, loss_a, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(stats_b, stats_a, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rows_b, rows_a, rtol=1e-5, atol=1e-5)
    assert any("score" in name for name in grads_a) and set(grads_a) == set(grads_b)
    for name, grad in grads_a.items():
        torch.testing.assert_close(grads_b[name], grad, rtol=1e-5, atol=1e-5 * float(grad.abs().max()), msg=name)


# each loss once, sigmoid both ways: the per-token averages (ipo, simpo, orpo) and both references
@pytest.mark.parametrize("loss, lora", [("sigmoid", False), ("sigmoid", True), ("hinge", True), ("ipo", False),
                                        ("simpo", True), ("orpo", False)])
def test_every_dpo_loss_and_its_gradients_equal_the_padded_batchs(loss, lora, tiny_model_dir):
    """The loss (through lm_head's chunked forward and the per-position weights of its gradient), the logged
    statistics, the eval rows and every parameter's gradient: padding-free == padded to 1e-5. LoRA's reference is
    the policy with its adapters disabled, full fine-tuning's a precomputed table."""
    cfg = PreferenceSection(loss=loss, beta=0.5)
    reference = "none" if cfg.reference_free() else "adapters" if lora else "precomputed"
    results = [_losses(seeded_model(tiny_model_dir, lora), collate(_rows()), cfg, reference)
               for collate in (PairCollator(0), PairCollator(0, padding_free=True))]
    (loss_a, stats_a, rows_a, grads_a), (loss_b, stats_b, rows_b, grads_b) = results
    torch.testing.assert_close(loss_b, loss_a, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(stats_b, stats_a, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rows_b, rows_a, rtol=1e-5, atol=1e-5)
    assert grads_a and set(grads_a) == set(grads_b)
    for name, grad in grads_a.items():  # float32 sums in another order: 1e-5 of the tensor's largest entry
        torch.testing.assert_close(grads_b[name], grad, rtol=1e-5, atol=1e-5 * float(grad.abs().max()), msg=name)


@pytest.mark.parametrize("implementation", ["eager", "flash_attention_2"])
def test_sequence_log_probs_equal_the_padded_ones_for_every_attention_implementation(implementation,
                                                                                     tiny_model_dir):
    """Each sequence's summed log-probs, padding-free as train.py collates for this implementation (flash: one
    row with its boundaries, through transformers' own flash dispatch with CPU reference kernels), equal the
    padded batch's under sdpa."""
    from transformers import AutoModelForCausalLM

    from disttrain.data import flattens_packed_rows
    from flash_cpu import cpu_flash_attention

    flash = implementation.startswith("flash")

    def logps(attn, batch, context=nullcontext):
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation=attn).eval()
        objective = PreferenceLoss(model, PreferenceSection(loss="simpo"), "none")
        with context(model):
            return objective._sequence_logps(model, batch)

    padded = logps("sdpa", PairCollator(0)(_rows()))
    packed_batch = PairCollator(0, padding_free=True, flatten=flattens_packed_rows(implementation))(_rows())
    packed = logps("sdpa" if flash else implementation, packed_batch,
                   (lambda m: cpu_flash_attention(m, implementation)) if flash else nullcontext)
    torch.testing.assert_close(packed, padded, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------- KTO: examples and their KL partners
def _kto_rows() -> list[dict]:
    """_rows' pairs as KTO rows: the chosen response is the example (desirable in turn), the rejected its partner."""
    return [{"input_ids": r["chosen_input_ids"], "labels": r["chosen_labels"], "kl_input_ids": r["rejected_input_ids"],
             "kl_labels": r["rejected_labels"], DESIRABLE: i % 2 == 0, PAIR_INDEX: r[PAIR_INDEX]}
            for i, r in enumerate(_rows())]


def _kto_collator(**layout) -> PairCollator:
    return PairCollator(0, sides=("", KL_PREFIX), carried=(DESIRABLE,), sides_apart=True, **layout)


def test_kto_batches_hold_the_examples_rows_apart_from_their_partners():
    """Padding-free KTO: the examples' sequences fill rows of their own, the partners' come after, so halves()
    gives each group alone -- sequences, labels and positions those of the padded halves, numbered from 0."""
    from disttrain.objectives.kto import halves

    padded = halves(PairCollator(0, sides=("", KL_PREFIX), carried=(DESIRABLE,))(_kto_rows()))
    for flatten in (False, True):
        batch = _kto_collator(padding_free=True, flatten=flatten)(_kto_rows())
        assert batch[SEQUENCE_COUNT] == 8
        if flatten:
            assert batch["input_ids"].shape[0] == 1 and batch[SECOND_GROUP_AT] == sum(c for c, _ in LENGTHS)
        else:  # rows of 23 (the longest): the examples 12+9 and 5+3, then the partners 23 and 7+6+4
            index = batch[SEQUENCE_INDEX]
            assert batch[SECOND_GROUP_AT] == 2 and batch["input_ids"].shape == (4, 23)
            assert (index[:2][index[:2] < 8] < 4).all() and (index[2:][index[2:] < 8] >= 4).all()
        for half, ref in zip(halves(batch), padded):
            assert half[SEQUENCE_COUNT] == 4 and half[PAIR_INDEX].tolist() == [0, 1, 2, 3]
            assert int((half[SEQUENCE_INDEX] < 4).sum()) == int(ref["attention_mask"].sum())
            for i in range(4):  # each sequence whole, positions from 0, its first target dropped
                mine = half[SEQUENCE_INDEX] == i
                n = int(ref["attention_mask"][i].sum())
                assert half["input_ids"][mine].tolist() == ref["input_ids"][i, :n].tolist()
                assert half["position_ids"][mine].tolist() == list(range(n))
                assert half["labels"][mine].tolist()[1:] == ref["labels"][i, 1:n].tolist()
            assert response_tokens(half).tolist() == response_tokens(ref).tolist()
            if flatten:
                bounds = half["cu_seq_lens_q"].tolist()
                assert bounds[0] == 0 and bounds[-1] == half["input_ids"].shape[1] and len(bounds) == 5


@pytest.mark.parametrize("lora, flatten", [(False, False), (True, False), (False, True)],
                         ids=["full", "lora", "full-flash"])
def test_kto_loss_z_and_gradients_equal_the_padded_batchs(lora, flatten, tiny_model_dir):
    """KTO padding-free (the examples' rows with gradients, the partners' without, z from them, the reference
    precomputed or the adapters disabled; flash: one row through transformers' flash dispatch with CPU reference
    kernels): loss, z, statistics, eval rows and every gradient equal the padded batch's to 1e-5."""
    from disttrain.objectives.kto import KTOLoss
    from flash_cpu import cpu_flash_attention

    cfg = PreferenceSection(loss="kto", beta=0.5, desirable_weight=1.2)
    results = []
    for collate in (PairCollator(0, sides=("", KL_PREFIX), carried=(DESIRABLE,)),
                    _kto_collator(padding_free=True, flatten=flatten)):
        batch = collate(_kto_rows())
        model = seeded_model(tiny_model_dir, lora)
        objective = KTOLoss(model, cfg, "adapters" if lora else "precomputed")
        table = torch.tensor([[-60.0, -40.0], [-20.0, -95.0], [-70.0, -30.0], [-35.0, -45.0]])
        objective.tables = {"train": table, "eval": table}
        with cpu_flash_attention(model) if flatten and SEQUENCE_INDEX in batch else nullcontext():
            loss = objective.training_loss(model, batch, torch.tensor(4.0))
            loss.backward()
            z = objective._kl
            model.eval()
            with torch.no_grad():
                rows = objective.eval_rows(model, batch)
        results.append((loss.detach(), z, objective._last, rows,
                        {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    (loss_a, z_a, stats_a, rows_a, grads_a), (loss_b, z_b, stats_b, rows_b, grads_b) = results
    assert float(z_a) > 0  # z estimated, not clamped: the partners' pass counts
    torch.testing.assert_close(loss_b, loss_a, rtol=1e-5, atol=1e-6)
    # z: a mean difference of log-probs near -100 (LoRA: the adapters-off reference's), summed in another order
    torch.testing.assert_close(z_b, z_a, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(stats_b, stats_a, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rows_b, rows_a, rtol=1e-5, atol=1e-5)
    assert grads_a and set(grads_a) == set(grads_b)
    for name, grad in grads_a.items():
        torch.testing.assert_close(grads_b[name], grad, rtol=1e-5, atol=1e-5 * float(grad.abs().max()), msg=name)


def test_padding_free_batches_are_the_dpo_familys_kto_and_reward_models():
    dpo = ["training.objective=dpo", "data.path=data/tiny_dpo.jsonl", "data.format=preference", "data.eval_path=null"]
    assert load_recipe(REPO / "recipes/tiny/sft.yaml", dpo + ["data.packing=true"]).data.packing
    assert load_recipe(REPO / "recipes/tiny/sft.yaml", dpo[1:] + ["training.objective=reward",
                                                                  "data.packing=true"]).data.packing
    assert load_recipe(REPO / "recipes/tiny/sft.yaml", dpo + ["data.packing=true", "preference.loss=kto"]).data.packing
    cases = [(dpo + ["data.streaming=true"], "concat_and_chunk and streaming are not supported with it "
                                             "\\(data.packing is")]
    for overrides, message in cases:
        with pytest.raises(RecipeError, match=message):
            load_recipe(REPO / "recipes/tiny/sft.yaml", overrides)


def test_the_bench_draws_long_tailed_pairs_and_counts_real_tokens_after_the_warm_up():
    """make bench-pairs' data and arithmetic (its launches: docs/benchmarks.md)."""
    from disttrain.bench.pairs import long_tailed_pairs, summarize

    words = sorted(len(r[side].split()) for r in long_tailed_pairs(400, 0, 12, 1.0, 256)
                   for side in ("chosen", "rejected"))
    assert words[len(words) // 2] in range(10, 15) and words[int(0.9 * len(words))] >= 3 * words[len(words) // 2]
    assert words[-1] <= 256
    steps = [{"step": s, "step_time_s": 2.0, "tokens": 100 * s, "padded_tokens_per_s_per_device": 150.0 * s,
              "loss": 1.0} for s in (1, 2, 3)]
    row = summarize("padded", steps, warmup=1)
    assert row["steps"] == 2 and row["real_tokens_per_s"] == 500 / 4 and row["computed_per_real_token"] == 3.0


# ----------------------------------------------------------------------------------- online RL's training rows
def _agent_rows(tokenizer) -> dict:
    """_rollout_batch's rows as an agent's trajectories: inside two completions a tool's reply (its tokens neither
    labelled nor weighted, agent.py's `policy` zeros), the policy's own tokens on both sides of it."""
    from disttrain.objectives import rollout
    from test_grpo import _rollout_batch

    padded = _rollout_batch(tokenizer)
    prompts, completions, policy = [], [], []
    for row in range(padded["input_ids"].shape[0]):
        ids = padded["input_ids"][row, :int(padded["attention_mask"][row].sum())].tolist()
        start = int((padded["labels"][row] != IGNORE_INDEX).nonzero()[0])
        reply = tokenizer(" 42 ", add_special_tokens=False)["input_ids"] if row % 2 == 0 else []
        completion = ids[start:start + 1] + reply + ids[start + 1:]
        prompts.append(ids[:start])
        completions.append((completion, row == 3))
        policy.append([1] + [0] * len(reply) + [1] * (len(completion) - 1 - len(reply)))
    rows = rollout.training_rows(prompts, completions, tokenizer.pad_token_id, False, "cpu", policy=policy)
    rows[rollout.ADVANTAGES_KEY] = padded[rollout.ADVANTAGES_KEY]
    # the replies are in the rows, neither labelled nor weighted
    assert int((rows["labels"] != IGNORE_INDEX).sum()) == int(rows[rollout.MASK_KEY].sum()) == sum(map(sum, policy))
    assert sum(map(len, policy)) > sum(map(sum, policy))
    return rows


@pytest.mark.parametrize("case, one_row, tools", [(dict(loss="dapo", entropy_coef=0.3), False, False),
                                                  (dict(loss="grpo", beta=0.1), True, False),
                                                  (dict(loss="dr_grpo", importance_sampling="sequence"), False, False),
                                                  (dict(loss="cispo", epsilon_high=1.1, beta=0.05), True, False),
                                                  (dict(loss="grpo", beta=0.1, entropy_coef=0.1), False, True),
                                                  (dict(loss="dapo"), True, True)],
                         ids=["dapo-entropy", "grpo-kl-one_row", "dr_grpo-sequence", "cispo-kl-one_row",
                              "grpo-kl-entropy-tools", "dapo-tools-one_row"])
def test_rollout_rows_train_and_score_as_the_padded_ones(case, one_row, tools, tiny_model_dir, tokenizer):
    """GRPO's training rows padding-free (several completions per row, or all in one row as for flash-attention,
    through transformers' own flash dispatch with CPU reference kernels: it reads restarting position ids as
    sequences at batch size 1): the policy loss (old policy,
    reference, entropy bonus, sequence-level ratios), every gradient and the no-gradient log-probs of the old
    policy and the reference equal the padded rows'; the loss's per-position tensors stay in the padded layout.
    `tools`: an agent's trajectories, a tool's reply inside the completion, unlearned either way."""
    from transformers import AutoModelForCausalLM

    from disttrain.objectives import rollout
    from disttrain.objectives.grpo import GRPOLoss
    from disttrain.recipe.schema import RLSection
    from flash_cpu import cpu_flash_attention
    from test_grpo import ITEMS, _rollout_batch

    cfg = RLSection(temperature=0.7, max_completion_length=8, **case)
    padded = _agent_rows(tokenizer) if tools else _rollout_batch(tokenizer)
    packed = rollout.without_padding({k: v for k, v in padded.items() if k != rollout.ADVANTAGES_KEY},
                                     tokenizer.pad_token_id, one_row)
    packed[rollout.ADVANTAGES_KEY] = padded[rollout.ADVANTAGES_KEY]
    assert packed["input_ids"].shape[0] == 1 if one_row else packed["input_ids"].shape[1] == max(
        padded["num_tokens"].tolist())
    assert "attention_mask" not in packed and packed[rollout.MASK_KEY].shape == padded[rollout.MASK_KEY].shape
    generator = torch.Generator().manual_seed(0)
    mask = padded[rollout.MASK_KEY]
    extra = {rollout.OLD_KEY: torch.randn(mask.shape, generator=generator) * 0.2 * mask}
    if cfg.beta:
        extra[rollout.REF_KEY] = torch.randn(mask.shape, generator=generator) * 0.3 * mask
    results = []
    for batch in (padded, packed):
        torch.manual_seed(1)
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        loss = GRPOLoss(model, cfg, "none")
        # one row: as train.py lays it out for flash-attention, through transformers' flash dispatch (CPU kernels)
        with cpu_flash_attention(model) if one_row and batch is packed else nullcontext():
            value = loss.training_loss(model, {**batch, **extra}, torch.tensor(ITEMS))
            value.backward()
            logps = loss.token_logps(model, batch)
        results.append((value.detach(), logps, {n: p.grad for n, p in model.named_parameters()
                                                if p.grad is not None}))
    (loss_a, logps_a, grads_a), (loss_b, logps_b, grads_b) = results
    torch.testing.assert_close(loss_b, loss_a, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(logps_b, logps_a, rtol=1e-5, atol=1e-5)
    assert grads_a and set(grads_a) == set(grads_b)
    for name, grad in grads_a.items():
        torch.testing.assert_close(grads_b[name], grad, rtol=1e-5, atol=1e-5 * float(grad.abs().max()), msg=name)
