"""KTO (preference.loss: kto), without launches: the loss and its gradients against TRL's KTOTrainer code on the
same log-probs, the chunked gradient against autograd through full logits, the unpaired data and its KL
partners, and the one-line refusals."""

import json
from collections import defaultdict
from contextlib import nullcontext
from types import SimpleNamespace

import pytest
import torch

from conftest import REPO
from disttrain.data import IGNORE_INDEX, PAIR_INDEX, build_datasets
from disttrain.data.preference import PairCollator
from disttrain.data.unpaired import DESIRABLE, KL_PREFIX, partner_rows
from disttrain.errors import DataError, RecipeError
from disttrain.objectives.kto import KTOLoss, balance_note, kl_estimate, kto_losses
from disttrain.recipe.schema import DataSection, PreferenceSection, load_recipe

torch.manual_seed(0)
N = 7
LOGPS, REF = -torch.rand(N, dtype=torch.float64) * 30 - 1, -torch.rand(N, dtype=torch.float64) * 30 - 1
TOKENS = torch.randint(1, 12, (N,))
DESIRABLE_MASK = torch.tensor([True, False, True, True, False, False, True])


def _trl_kto(cfg: PreferenceSection, logps: torch.Tensor, kl_logps: torch.Tensor, ref_kl: torch.Tensor):
    """TRL's KTOTrainer._compute_loss (its code, run as it is) on per-token log-probs that sum to `logps` over
    TOKENS completion tokens, with precomputed reference log-probs REF and the KL sequences' log-probs given."""
    from trl.trainer.kto_trainer import KTOTrainer

    width = int(TOKENS.max()) + 1
    mask = torch.zeros(N, width, dtype=torch.long)
    spread = torch.zeros(N, width - 1, dtype=torch.float64)
    for i, count in enumerate(TOKENS.tolist()):
        mask[i, 1:1 + count] = 1
        spread[i, :count] = 1.0 / count
    per_token = logps[:, None] * spread  # differentiable in logps
    outputs = SimpleNamespace(log_probs=per_token, entropy=torch.zeros_like(per_token),
                              mean_logits=torch.zeros_like(per_token))
    fake = SimpleNamespace(
        model=SimpleNamespace(training=True), precompute_ref_logps=True, calculate_KL=True, loss_type="kto",
        beta=cfg.beta, desirable_weight=cfg.desirable_weight, undesirable_weight=cfg.undesirable_weight,
        aux_loss_enabled=False, _metrics=defaultdict(lambda: defaultdict(list)), _total_train_tokens=0, _tp_size=1,
        _compute_kl_logps=lambda model, batch: kl_logps,
        accelerator=SimpleNamespace(device=torch.device("cpu"), gather_for_metrics=lambda t: t.reshape(-1)))
    inputs = {"input_ids": torch.zeros(N, width, dtype=torch.long), "attention_mask": torch.ones(N, width),
              "completion_mask": mask, "label": DESIRABLE_MASK.clone(), "ref_logps": REF, "ref_KL_logps": ref_kl}
    return KTOTrainer._compute_loss(fake, lambda **_: outputs, inputs, return_outputs=False)


@pytest.mark.parametrize("kl_shift, weights", [(-2.0, (1.0, 1.0)), (1.5, (1.3, 0.7))])
def test_kto_loss_and_gradients_equal_trl_kto_trainer(kl_shift, weights):
    """The same loss and gradient with respect to every example's log-prob, z positive (the partners more likely
    under the policy) and z clamped to 0; desirable_weight / undesirable_weight as given."""
    cfg = PreferenceSection(loss="kto", beta=0.3, desirable_weight=weights[0], undesirable_weight=weights[1])
    kl_logps = -torch.rand(N, dtype=torch.float64) * 20
    ref_kl = kl_logps - kl_shift  # policy - reference = kl_shift on average
    ours_in, theirs_in = LOGPS.clone().requires_grad_(), LOGPS.clone().requires_grad_()
    z = kl_estimate(kl_logps, ref_kl)
    assert float(z) == pytest.approx(max(kl_shift, 0.0))
    losses, rewards = kto_losses(cfg, ours_in, REF, DESIRABLE_MASK, z)
    ours = losses.mean()
    theirs = _trl_kto(cfg, theirs_in, kl_logps, ref_kl)
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)
    ours.backward()
    theirs.backward()
    torch.testing.assert_close(ours_in.grad, theirs_in.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(rewards, cfg.beta * (LOGPS - REF))


def _kto_batch(pad_id: int):
    """Two examples (one desirable) and their KL partners: each prompt with the other's response."""
    rows = [{"input_ids": [5, 6, 7, 8, 9], "labels": [IGNORE_INDEX, IGNORE_INDEX, 7, 8, 9],
             "kl_input_ids": [5, 6, 11, 12], "kl_labels": [IGNORE_INDEX, IGNORE_INDEX, 11, 12],
             DESIRABLE: True, PAIR_INDEX: 0},
            {"input_ids": [4, 13, 11, 12], "labels": [IGNORE_INDEX, IGNORE_INDEX, 11, 12],
             "kl_input_ids": [4, 13, 7, 8, 9], "kl_labels": [IGNORE_INDEX, IGNORE_INDEX, 7, 8, 9],
             DESIRABLE: False, PAIR_INDEX: 1}]
    return PairCollator(pad_id, sides=("", KL_PREFIX), carried=(DESIRABLE,))(rows)


@pytest.mark.parametrize("lora", [False, True])
def test_chunked_kto_equals_autograd_through_full_logits(lora, tiny_model_dir, tokenizer):
    """KTOLoss.training_loss (the partners' no-grad pass, z, the loss made inside lm_head) has the value and the
    gradients of KTO computed by autograd from the full logits; the reference precomputed (full) or the adapters
    disabled (LoRA)."""
    from test_preference import seeded_model

    def model():
        return seeded_model(tiny_model_dir, lora)

    def sequence_logps(m, batch):
        logits = m(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        labels = batch["labels"][:, 1:]
        logp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, labels.clamp(min=0)[..., None])[..., 0]
        return (logp * (labels != IGNORE_INDEX)).sum(-1)

    cfg = PreferenceSection(loss="kto", beta=0.5, desirable_weight=1.2)
    batch = _kto_batch(tokenizer.pad_token_id)
    table = torch.tensor([[-20.0, -25.0], [-9.0, -30.0]])  # (response, partner) per example

    plain = model()
    with torch.no_grad():
        if lora:
            with plain.disable_adapter():
                reference = sequence_logps(plain, batch)
            ref, ref_kl = reference[:2], reference[2:]
        else:
            ref, ref_kl = table[:, 0], table[:, 1]
        z = (sequence_logps(plain, batch)[2:] - ref_kl).mean().clamp(min=0)
    expected = kto_losses(cfg, sequence_logps(plain, batch)[:2], ref, batch[DESIRABLE], z)[0].sum()
    expected.backward()

    chunked = model()
    objective = KTOLoss(chunked, cfg, "adapters" if lora else "precomputed")
    objective.tables = {"train": table}
    got = objective.training_loss(chunked, batch, torch.tensor(1.0))
    got.backward()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(objective._kl, z, rtol=1e-5, atol=1e-6)
    grads = {n: p.grad for n, p in plain.named_parameters() if p.grad is not None}
    assert grads
    for name, p in chunked.named_parameters():
        if name in grads:
            torch.testing.assert_close(p.grad, grads[name], rtol=1e-4, atol=1e-6, msg=name)


def _write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def test_unpaired_examples_get_a_partner_with_another_prompt(tmp_path, tokenizer):
    """Each example's KL sequence is its own prompt followed by the response of the next example whose prompt
    differs (the same prompt twice in a row is skipped), with only that response scored; the answers also occur
    in the prompts (adversarial: the masks must come from the rendering, not from matching text)."""
    records = [{"prompt": "Repeat: apple pear", "completion": "apple pear", "label": True},
               {"prompt": "Repeat: apple pear", "completion": "APPLE PEAR!", "label": False},
               {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say kiwi"}],
                "completion": [{"role": "assistant", "content": "kiwi"}], "label": True}]
    section = DataSection(path=_write(tmp_path / "kto.jsonl", records), format="unpaired", max_seq_len=64,
                          shuffle=False)
    section._unpaired = True
    train, _, reports = build_datasets(section, tokenizer, 0, nullcontext)
    assert len(train) == 3 and reports["train"].examples == 3
    assert train[DESIRABLE] == [True, False, True] and train[PAIR_INDEX] == [0, 1, 2]

    def scored(ids, labels):
        return tokenizer.decode([t for t, label in zip(ids, labels) if label != IGNORE_INDEX])

    def prompt(ids, labels):
        return tokenizer.decode(ids[:next(i for i, label in enumerate(labels) if label != IGNORE_INDEX)])

    rows = [train[i] for i in range(3)]
    # rows 0 and 1 share a prompt: both take row 2's response; row 2 takes row 0's
    for row, partner in zip(rows, (rows[2], rows[2], rows[0])):
        assert scored(row["kl_input_ids"], row["kl_labels"]) == scored(partner["input_ids"], partner["labels"])
        assert prompt(row["kl_input_ids"], row["kl_labels"]) == prompt(row["input_ids"], row["labels"])
    assert scored(rows[1]["input_ids"], rows[1]["labels"]) == "APPLE PEAR!<|im_end|>"
    assert partner_rows([3, 3, 5, 3]) == [2, 2, 3, 2]


def test_preference_pairs_split_into_a_desirable_and_an_undesirable_example(tmp_path, tokenizer):
    """TRL's unpair_preference_dataset: each pair's chosen response desirable, rejected not, chosen first."""
    from datasets import Dataset
    from trl.data_utils import unpair_preference_dataset

    pairs = [{"prompt": "Sort: b a", "chosen": "a b", "rejected": "b a"},
             {"prompt": "Sort: d c", "chosen": "c d", "rejected": "D C!"}]
    section = DataSection(path=_write(tmp_path / "pairs.jsonl", pairs), format="preference", max_seq_len=64,
                          shuffle=False)
    section._unpaired = True
    train, _, _ = build_datasets(section, tokenizer, 0, nullcontext)
    theirs = unpair_preference_dataset(Dataset.from_list(pairs))
    ours = [(tokenizer.decode([t for t, label in zip(r["input_ids"], r["labels"]) if label != IGNORE_INDEX]),
             r[DESIRABLE]) for r in train]
    assert ours == [(c + "<|im_end|>", label) for c, label in zip(theirs["completion"], theirs["label"])]


@pytest.mark.parametrize("records, message", [
    ([{"prompt": "a", "completion": "b", "label": "yes"}], r"kto.jsonl:1: 'label' must be true or false"),
    ([{"prompt": "a", "completion": "b", "label": True}, {"prompt": "c", "completion": "d", "label": True}],
     "needs desirable and undesirable examples .* all 2 are desirable"),
    ([{"prompt": "a", "completion": "b", "label": True}, {"prompt": "a", "completion": "d", "label": False}],
     "all 2 examples share one prompt"),
])
def test_bad_unpaired_data_is_one_line(tmp_path, tokenizer, records, message):
    section = DataSection(path=_write(tmp_path / "kto.jsonl", records), format="unpaired", max_seq_len=64)
    section._unpaired = True
    with pytest.raises(DataError, match=message):
        build_datasets(section, tokenizer, 0, nullcontext)


def test_kto_recipes_are_checked_before_anything_loads():
    kto = REPO / "recipes/tiny/kto.yaml"
    recipe = load_recipe(kto)
    assert recipe.data.unpaired_examples() and recipe.reference_mode() == "precomputed"
    assert load_recipe(kto, ["lora.r=4"]).reference_mode() == "adapters"
    assert load_recipe(kto, ["data.path=data/tiny_dpo.jsonl", "data.format=preference",
                             "data.eval_path=null"]).data.unpaired_examples()
    assert not load_recipe(REPO / "recipes/tiny/dpo.yaml").data.unpaired_examples()
    assert load_recipe(kto, ["data.packing=true"]).data.packing  # padding-free: tests/test_padding_free.py
    cases = [(["data.path=data/tiny_alpaca.jsonl", "data.format=alpaca", "data.eval_path=null"],
              "kto needs data.format: unpaired"),
             (["preference.loss=sigmoid"], "data.format: unpaired holds .* set training.objective: dpo with "
                                           "preference.loss: kto"),
             (["training.objective=sft"], "data.format: unpaired holds"),
             (["preference.reference=none"], "compares the policy with a reference"),
             (["preference.loss=simpo"], "data.format: unpaired holds"),
             (["preference.desirable_weight=0"], "greater than 0"),
             (["data.streaming=true"], "kto pairs each example with another's response for its KL estimate: "
                                       "concat_and_chunk and streaming are not supported with it \\(data.packing is")]
    for overrides, message in cases:
        with pytest.raises(RecipeError, match=message):
            load_recipe(kto, overrides)


def test_the_class_balance_advice_is_trls():
    """TRL warns unless desirable_weight x desirable / (undesirable_weight x undesirable) is within [1, 4/3]
    and gives the same ranges."""
    cfg = PreferenceSection(loss="kto")
    assert balance_note(cfg, 427, 373) is None
    note = balance_note(cfg, 100, 300)
    assert "= 0.33" in note and "desirable_weight in [3.00, 4.00]" in note
    assert "undesirable_weight in [0.25, 0.33]" in note
