"""preference.loss: kto -- Kahneman-Tversky optimisation (Ethayarajh et al. 2024) on examples judged one by one,
as TRL's KTOTrainer computes it (tests/test_kto.py runs TRL's own code on the same log-probs):

    z     = max(0, mean of (log pi - log pi_ref)(partner's response | the example's prompt)), no gradient: the KL
            estimate from mismatched examples (data/unpaired.py), over the micro-batches of all ranks at this
            accumulation step (TRL gathers it over the ranks too)
    r     = log pi(y|x) - log pi_ref(y|x), summed over the response's tokens
    loss  = desirable_weight x (1 - sigmoid(beta (r - z)))     a desirable example
            undesirable_weight x (1 - sigmoid(beta (z - r)))   an undesirable one
    logged: rewards/chosen and rewards/rejected (beta r, means over the desirable and the undesirable examples),
            rewards/margin, logps/chosen, logps/rejected, kl (z)

A micro-batch is laid out as the pairs' (data/preference.py's collator): n examples, then their n KL partners. So
the reference is DPO's, unchanged (preference.py): precomputed with the initial weights (a row per example: its
response, its partner), the adapters disabled, or a frozen copy. The partners take one no-grad forward of the
policy, as in TRL; only the examples take the forward with gradients. The loss's chunked gradient is DPO's
(the per-sequence weights d loss / d log-prob, then one chunked pass).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from disttrain.data.collation import LENGTHS_KEY, SECOND_GROUP_AT, SEQUENCE_COUNT, SEQUENCE_INDEX, SQUARES_KEY
from disttrain.data.preference import PAIR_INDEX
from disttrain.data.unpaired import DESIRABLE
from disttrain.objectives.preference import PreferenceLoss, with_margin_and_sets
from disttrain.recipe.schema import PreferenceSection

# per example: reward and log-prob on its class's column, the class counts; per micro-batch: z and a count
STATS = ("rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected")
RECOMMENDED_BALANCE = (1.0, 4 / 3)  # desirable_weight x desirable / (undesirable_weight x undesirable): the paper's


def kto_losses(cfg: PreferenceSection, logps: torch.Tensor, ref_logps: torch.Tensor, desirable: torch.Tensor,
               kl: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, reward beta x r) per example from summed response log-probs, the reference's, and z."""
    ratio = logps - ref_logps
    chosen = 1 - torch.sigmoid(cfg.beta * (ratio - kl))
    rejected = 1 - torch.sigmoid(cfg.beta * (kl - ratio))
    losses = torch.where(desirable, cfg.desirable_weight * chosen, cfg.undesirable_weight * rejected)
    return losses, cfg.beta * ratio.detach()


def kl_estimate(policy: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """z: the mean log-ratio of the partners over every rank's micro-batch (one all-reduce), at least 0."""
    total = torch.stack([(policy - reference).double().sum(), torch.tensor(float(policy.numel()),
                                                                          dtype=torch.float64, device=policy.device)])
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(total)
    return (total[0] / total[1].clamp(min=1)).clamp(min=0).to(policy.dtype)


def halves(batch: dict) -> tuple[dict, dict]:
    """(examples, partners): the batch's first n and last n sequences, each trimmed to its longest (padding-free:
    each in its rows, or its part of the one row); the per-example columns (PAIR_INDEX, desirable) in both."""
    n = batch[PAIR_INDEX].numel()
    if SEQUENCE_INDEX in batch:
        return _packed_half(batch, n, True), _packed_half(batch, n, False)
    parts = []
    for part in (slice(0, n), slice(n, 2 * n)):
        half = {k: v[part] if v.dim() and v.shape[0] == 2 * n else v for k, v in batch.items()}
        width = int(half["attention_mask"].sum(-1).max())
        parts.append({k: v[:, :width] if v.dim() == 2 and v.shape[1] > width else v for k, v in half.items()})
    return parts[0], parts[1]


def _packed_half(batch: dict, n: int, first: bool) -> dict:
    """The examples' (`first`) or the partners' part of a padding-free batch packed in two groups
    (data/collation.pack_sequences): their rows, or their tokens of the one flattened row with their boundaries;
    sequences numbered from 0 again, padding n."""
    at, flat = batch[SECOND_GROUP_AT], "cu_seq_lens_q" in batch
    part = slice(0, at) if first else slice(at, None)
    sequences = slice(0, n) if first else slice(n, None)
    half = {}
    for key, value in batch.items():
        if key in ("cu_seq_lens_q", "cu_seq_lens_k"):
            half[key] = value[:n + 1] if first else value[n:] - value[n]
        elif key in (LENGTHS_KEY, SQUARES_KEY):  # per row, flattened: per sequence
            half[key] = value[sequences if flat else part]
        elif isinstance(value, torch.Tensor) and value.dim() == 2:
            half[key] = value[:, part] if flat else value[part]
        elif key != SECOND_GROUP_AT:  # the per-example columns; flash's longest (a bound for either half)
            half[key] = value
    index = half[SEQUENCE_INDEX]
    half[SEQUENCE_INDEX] = index.clamp(max=n) if first else index - n  # padding (2n): n
    half[SEQUENCE_COUNT] = n
    return half


def balance_note(cfg: PreferenceSection, desirable: int, undesirable: int) -> str | None:
    """TRL's advice when the weighted classes are out of the paper's balance (1 to 4/3), else None."""
    low, high = RECOMMENDED_BALANCE
    ratio = cfg.desirable_weight * desirable / (cfg.undesirable_weight * undesirable)
    if low <= ratio <= high:
        return None
    balanced_desirable = undesirable * cfg.undesirable_weight / desirable  # the desirable_weight for a ratio of 1
    balanced_undesirable = desirable * cfg.desirable_weight / undesirable
    d = (balanced_desirable * low, balanced_desirable * high)
    u = (balanced_undesirable / high, balanced_undesirable / low)
    return (f"KTO: {desirable} desirable and {undesirable} undesirable examples give desirable_weight x desirable / "
            f"(undesirable_weight x undesirable) = {ratio:.2f}; the KTO paper recommends {low:g} to {high:.2f}: set "
            f"preference.desirable_weight in [{d[0]:.2f}, {d[1]:.2f}] or preference.undesirable_weight in "
            f"[{u[0]:.2f}, {u[1]:.2f}]")


class KTOLoss(PreferenceLoss):
    """The loop's loss for preference.loss: kto (see the module docstring). `units` are examples."""

    unit_name = "examples"

    def __init__(self, model, cfg: PreferenceSection, reference: str):
        super().__init__(model, cfg, reference)
        self._kl: torch.Tensor | None = None  # this micro-batch's z and classes, set before the forward
        self._desirable: torch.Tensor | None = None

    def _losses_from_logps(self, logps: torch.Tensor, tokens: torch.Tensor | None):
        """(losses, stats [examples, 6]) from the examples' summed log-probs (z, classes, reference set before;
        KTO does not average per token: `tokens` unused)."""
        losses, rewards = kto_losses(self.cfg, logps, self._ref[0], self._desirable, self._kl)
        good = self._desirable.to(rewards.dtype)
        bad = 1 - good
        stats = torch.stack([rewards * good, rewards * bad, logps.detach() * good, logps.detach() * bad, good, bad],
                            dim=1)
        return losses, stats

    def _prepare(self, model, batch: dict, partner_logps) -> tuple[dict, dict]:
        """The reference's log-probs, the classes and z, before a forward over the examples."""
        examples, partners = halves(batch)
        self._ref = self._reference_logps(model, batch)  # (examples', partners')
        self._desirable = batch[DESIRABLE].to(torch.bool)
        logps = partner_logps if partner_logps is not None else self._sequence_logps(model, partners)
        self._kl = kl_estimate(logps, self._ref[1])
        return examples, partners

    def training_loss(self, model, batch: dict, num_items_in_batch) -> torch.Tensor:
        examples, _ = self._prepare(model, batch, None)
        self._layout = self.layout(examples)
        out = self.engine.output(model, examples, self._inputs(examples))
        z = self._kl.double().to(self._last.device)
        stats = torch.cat([self._last.double().sum(0), torch.stack([z, torch.ones_like(z)])])  # STATS, classes, z, 1
        self._window = stats if self._window is None else self._window + stats
        return self.engine.with_router_loss(out.logits / num_items_in_batch, out, examples)

    def window_metrics(self, accelerator) -> dict:
        """Means over the examples of each class of all ranks since the last log line, and z (one all-reduce)."""
        local = self._window if self._window is not None else torch.zeros(len(STATS) + 4, dtype=torch.float64)
        self._window = None
        total = accelerator.reduce(local.to(accelerator.device), reduction="sum").tolist()
        good, bad = max(total[4], 1.0), max(total[5], 1.0)
        record = {"rewards/chosen": total[0] / good, "rewards/rejected": total[1] / bad,
                  "logps/chosen": total[2] / good, "logps/rejected": total[3] / bad,
                  "kl": total[6] / max(total[7], 1.0)}
        record["rewards/margin"] = record["rewards/chosen"] - record["rewards/rejected"]
        return record

    def eval_rows(self, model, batch: dict, split: str = "eval") -> torch.Tensor:
        """Per example: (loss, 1, reward if desirable, desirable, reward if undesirable, undesirable, z)."""
        logps = self._sequence_logps(model, batch)
        n = logps.shape[0] // 2
        self.split = split
        try:
            self._prepare(model, batch, logps[n:])
        finally:
            self.split = "train"
        losses, stats = self._losses_from_logps(logps[:n], None)
        return torch.stack([losses, torch.ones_like(losses), stats[:, 0], stats[:, 4], stats[:, 1], stats[:, 5],
                            self._kl.expand_as(losses)], dim=1)

    def eval_record(self, sums: dict[str, torch.Tensor]) -> dict[str, float]:
        total = sum(sums.values())
        examples = max(float(total[1]), 1.0)
        good, bad = max(float(total[3]), 1.0), max(float(total[5]), 1.0)
        record = {"eval_loss": float(total[0]) / examples, "eval_rewards/chosen": float(total[2]) / good,
                  "eval_rewards/rejected": float(total[4]) / bad, "eval_kl": float(total[6]) / examples}
        return with_margin_and_sets(record, sums)
