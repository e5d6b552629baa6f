"""The GRPO-family losses (disttrain/objectives/policy_loss.py) against TRL 1.16's own GRPOTrainer._compute_loss,
run on the same per-token log-probs, old and reference log-probs, advantages and masks: the loss of each
micro-batch, and the gradient of an optimizer step of several micro-batches as the loop normalises it (the summed
losses over the summed units) against TRL's losses summed over the window, to 1e-6."""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from disttrain.objectives.policy_loss import UNITS, policy_loss, units
from disttrain.recipe.schema import RLSection

trl_grpo = pytest.importorskip("trl.trainer.grpo_trainer")

LOSSES = ("grpo", "dr_grpo", "dapo", "bnpo", "cispo")
MAX_COMPLETION = 7


class _OneProcess:
    num_processes = 1
    sync_gradients = True

    @staticmethod
    def reduce(x, reduction="sum"):
        return x

    @staticmethod
    def gather(x):
        return x

    gather_for_metrics = gather


def _trl_trainer(cfg: RLSection, accumulation: int):
    """What TRL's _compute_loss reads of its trainer, set from the recipe's rl section."""
    epsilon_high = cfg.epsilon_high if cfg.epsilon_high is not None else cfg.epsilon
    stub = SimpleNamespace(
        top_entropy_quantile=1.0, off_policy_mask_threshold=None, importance_sampling_level=cfg.importance_sampling,
        beta=cfg.beta, loss_type=cfg.loss, epsilon_low=cfg.epsilon, epsilon_high=epsilon_high, use_vllm=False,
        vllm_importance_sampling_correction=False, model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=accumulation, max_completion_length=MAX_COMPLETION,
        accelerator=_OneProcess(), _entropy_bonus_enabled=bool(cfg.entropy_coef), entropy_coef=cfg.entropy_coef,
        use_adaptive_entropy=False, aux_loss_enabled=False,
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        args=SimpleNamespace(use_bias_correction_kl=False, delta=None, steps_per_generation=accumulation))
    return stub


def _trl_loss(cfg: RLSection, logps: torch.Tensor, batch: dict, accumulation: int, items: torch.Tensor,
              entropies: torch.Tensor | None = None):
    stub = _trl_trainer(cfg, accumulation)
    entropies = torch.zeros_like(logps) if entropies is None else entropies
    stub._get_per_token_logps_and_entropies = lambda *a, **k: (logps, entropies, None)
    inputs = {"prompt_ids": torch.zeros(logps.shape[0], 0, dtype=torch.long),
              "prompt_mask": torch.zeros(logps.shape[0], 0, dtype=torch.long),
              "completion_ids": torch.zeros_like(batch["mask"], dtype=torch.long),
              "completion_mask": batch["mask"].long(), "advantages": batch["advantages"],
              "num_items_in_batch": items}
    if batch.get("old") is not None:
        inputs["old_per_token_logps"] = batch["old"]
    if cfg.beta:
        inputs["ref_per_token_logps"] = batch["ref"]
    return trl_grpo.GRPOTrainer._compute_loss(stub, None, inputs)


def _micro_batch(generator, completions=4, tokens=MAX_COMPLETION, old=False, ref=False) -> dict:
    mask = torch.ones(completions, tokens)
    for row in range(completions):  # completions of different lengths; one row fully masked (truncated, masked)
        mask[row, tokens - row:] = 0
    mask[-1] = 0
    logps = -torch.rand(completions, tokens, generator=generator, dtype=torch.float64) * 3
    batch = {"logps": logps, "mask": mask.double(),
             "advantages": torch.randn(completions, generator=generator, dtype=torch.float64)}
    if old:  # the old policy: near the current one, some ratios beyond every clip
        batch["old"] = logps + torch.randn(completions, tokens, generator=generator, dtype=torch.float64) * 0.4
    if ref:
        batch["ref"] = logps + torch.randn(completions, tokens, generator=generator, dtype=torch.float64) * 0.3
    return batch


CASES = [dict(loss=loss) for loss in LOSSES] + [
    dict(loss="dapo", epsilon_high=0.28, beta=0.04),
    dict(loss="grpo", importance_sampling="sequence", epsilon=3e-4, epsilon_high=4e-4),  # GSPO
    dict(loss="cispo", epsilon_high=1.5, beta=0.1),
    dict(loss="bnpo", beta=0.02, importance_sampling="sequence"),
    dict(loss="dr_grpo", epsilon=0.1, epsilon_high=0.3)]
ENTROPY_CASES = [dict(loss=loss, entropy_coef=0.05) for loss in ("dapo", "grpo", "bnpo")] + [
    dict(loss="cispo", entropy_coef=0.2, beta=0.1, epsilon_high=1.5)]


@pytest.mark.parametrize("old", [False, True], ids=["on-policy", "old-policy"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_each_loss_equals_trls_per_micro_batch_and_over_an_accumulation_window(case, old):
    cfg = RLSection(**case)
    generator = torch.Generator().manual_seed(7)
    window = [_micro_batch(generator, old=old, ref=bool(cfg.beta)) for _ in range(3)]
    accumulation = len(window)
    tokens = sum(b["mask"].sum() for b in window)  # TRL's num_items_in_batch: the window's tokens

    theirs, ours, our_units = [], [], []
    leaves_theirs = [b["logps"].clone().requires_grad_() for b in window]
    leaves_ours = [b["logps"].clone().requires_grad_() for b in window]
    for batch, leaf_t, leaf_o in zip(window, leaves_theirs, leaves_ours):
        theirs.append(_trl_loss(cfg, leaf_t, batch, accumulation, tokens))
        total, stats = policy_loss(cfg, leaf_o, batch["mask"], batch["advantages"], batch.get("old"),
                                   batch.get("ref"), MAX_COMPLETION)
        ours.append(total)
        our_units.append(units(cfg.loss, batch["mask"]))
        assert stats.shape == (6,) and float(stats[0]) == float(batch["mask"].sum())

    # the loop: sum of micro-batch losses / the window's units; TRL: the sum of its (already scaled) losses
    our_step = sum(ours) / sum(our_units)
    their_step = sum(theirs)
    torch.testing.assert_close(our_step, their_step, rtol=1e-6, atol=1e-9)
    our_step.backward()
    their_step.backward()
    for mine, trl in zip(leaves_ours, leaves_theirs):
        torch.testing.assert_close(mine.grad, trl.grad, rtol=1e-6, atol=1e-10)
    for total, unit, trl in zip(ours, our_units, theirs):  # and each micro-batch's loss is TRL's
        scale = sum(our_units) if UNITS[cfg.loss] == "completion_tokens" else unit * accumulation
        torch.testing.assert_close(total / scale, trl, rtol=1e-6, atol=1e-9)


def test_the_clip_statistics_count_what_trl_logs():
    cfg = RLSection(loss="dapo", epsilon=0.1, epsilon_high=0.15)
    batch = _micro_batch(torch.Generator().manual_seed(3), old=True)
    total, stats = policy_loss(cfg, batch["logps"], batch["mask"], batch["advantages"], batch["old"])
    stub = _trl_trainer(cfg, 1)
    stub._get_per_token_logps_and_entropies = lambda *a, **k: (batch["logps"], torch.zeros_like(batch["logps"]), None)
    inputs = {"prompt_ids": torch.zeros(4, 0, dtype=torch.long), "prompt_mask": torch.zeros(4, 0, dtype=torch.long),
              "completion_ids": torch.zeros(4, MAX_COMPLETION, dtype=torch.long),
              "completion_mask": batch["mask"].long(), "advantages": batch["advantages"],
              "old_per_token_logps": batch["old"], "num_items_in_batch": batch["mask"].sum()}
    trl_grpo.GRPOTrainer._compute_loss(stub, None, inputs)
    logged = stub._metrics["train"]
    tokens = float(stats[0])
    assert float(stats[3]) / tokens == pytest.approx(logged["clip_ratio/low_mean"][0], rel=1e-6)
    assert float(stats[4]) / tokens == pytest.approx(logged["clip_ratio/high_mean"][0], rel=1e-6)
    assert float(stats[5]) / tokens == pytest.approx(logged["clip_ratio/region_mean"][0], rel=1e-6)
    assert 0 < float(stats[5]) < tokens  # the case clips some tokens, not all


@pytest.mark.parametrize("case", ENTROPY_CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_the_entropy_bonus_equals_trls_over_an_accumulation_window(case):
    """TRL subtracts entropy_coef x each micro-batch's mean entropy, divided by the accumulation steps; the loop adds
    entropy_bonus per micro-batch beside the normalised policy loss and averages micro-batches the same way."""
    from disttrain.objectives.policy_loss import entropy_bonus

    cfg = RLSection(**case)
    generator = torch.Generator().manual_seed(5)
    window = [_micro_batch(generator, old=True, ref=bool(cfg.beta)) for _ in range(3)]
    for batch in window:
        batch["entropies"] = torch.rand(batch["logps"].shape, generator=generator, dtype=torch.float64) * 4
    tokens = sum(b["mask"].sum() for b in window)
    leaves = {side: [(b["logps"].clone().requires_grad_(), b["entropies"].clone().requires_grad_()) for b in window]
              for side in ("ours", "theirs")}
    theirs = sum(_trl_loss(cfg, lp, b, len(window), tokens, ent) for b, (lp, ent) in zip(window, leaves["theirs"]))
    totals, unit_sum, bonuses = [], 0, []
    for b, (lp, ent) in zip(window, leaves["ours"]):
        total, _ = policy_loss(cfg, lp, b["mask"], b["advantages"], b["old"], b.get("ref"), MAX_COMPLETION)
        totals.append(total)
        unit_sum = unit_sum + units(cfg.loss, b["mask"])
        bonuses.append(entropy_bonus(cfg, ent, b["mask"]))
    ours = sum(totals) / unit_sum + sum(bonuses) / len(window)
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-9)
    ours.backward()
    theirs.backward()
    for (lp_o, ent_o), (lp_t, ent_t) in zip(leaves["ours"], leaves["theirs"]):
        torch.testing.assert_close(lp_o.grad, lp_t.grad, rtol=1e-6, atol=1e-10)
        torch.testing.assert_close(ent_o.grad, ent_t.grad, rtol=1e-6, atol=1e-10)
