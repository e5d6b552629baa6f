"""The policy-gradient losses of training.objective: grpo, on per-token log-probs, as TRL 1.16's
GRPOTrainer._compute_loss computes them (tests/test_policy_loss.py runs TRL's own method on the same inputs):

    ratio     exp(log p - log p_old) per token, or per completion: exp(mean of its tokens' log-ratios) (GSPO,
              rl.importance_sampling: sequence); log p_old is log p detached when each batch is trained on once
    clipped   -min(ratio * A, clip(ratio, 1 - epsilon, 1 + epsilon_high) * A); cispo: -min(ratio, epsilon_high)
              (detached) * A * log p
    engine    times the importance-sampling weight of a vLLM engine's samples (rl.engine: vllm)
    KL        beta * (exp(ref - log p) - (ref - log p) - 1) added per token (the k3 estimator)
    entropy   minus entropy_coef x the micro-batch's mean entropy at the completion tokens (entropy_bonus: a
              per-micro-batch mean, as TRL's; the loop averages it over the micro-batches and ranks)

How the token losses are aggregated is the loss's own, and it fixes what the loop normalises by (its `units`):
the loop divides the summed loss of every micro-batch on every rank by the units summed the same way, so the
gradient equals TRL's sum of per-micro-batch losses (each divided by the accumulation steps, averaged over
ranks) when micro-batches hold the same number of completions:
    grpo      sum over completions of (token losses' mean over the completion)     units: completions
    dr_grpo   sum of token losses / max_completion_length                         units: completions
    bnpo      the micro-batch's mean token loss                                     units: micro-batches
    dapo      sum of token losses                                                   units: completion tokens
    cispo     sum of token losses                                                   units: completion tokens
"""

from __future__ import annotations

import torch

UNITS = {"grpo": "completions", "dr_grpo": "completions", "bnpo": "micro_batches", "dapo": "completion_tokens",
         "cispo": "completion_tokens"}
# what each micro-batch adds to the window's statistics (sums; the log line divides them)
STATS = ("tokens", "completions", "kl", "clip/low", "clip/high", "clip/region")


def units(loss: str, mask: torch.Tensor) -> torch.Tensor:
    """What the micro-batch counts for the loop's normalisation (UNITS)."""
    kind = UNITS[loss]
    if kind == "completion_tokens":
        return mask.sum().long()
    if kind == "completions":
        return torch.full((), mask.shape[0], dtype=torch.long, device=mask.device)
    return torch.ones((), dtype=torch.long, device=mask.device)


def policy_loss(cfg, logps: torch.Tensor, mask: torch.Tensor, advantages: torch.Tensor,
                old_logps: torch.Tensor | None = None, ref_logps: torch.Tensor | None = None,
                max_completion_length: int | None = None,
                engine_weights: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(the micro-batch's loss summed as its units count, STATS sums) from [completions, tokens] log-probs and
    mask (1 on the tokens trained on) and one advantage per completion. `cfg`: the recipe's rl section;
    `engine_weights`: the importance-sampling correction of a vLLM engine's samples (vllm_engine.engine_weights),
    applied to the policy term before the KL is added, as TRL applies it."""
    mask = mask.to(logps.dtype)
    advantages = advantages.to(logps.dtype).unsqueeze(1)
    old_logps = logps.detach() if old_logps is None else old_logps
    epsilon_high = cfg.epsilon_high if cfg.epsilon_high is not None else cfg.epsilon
    log_ratio = logps - old_logps
    if cfg.importance_sampling == "sequence":
        log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    ratio = torch.exp(log_ratio)
    if cfg.loss == "cispo":
        per_token = -torch.clamp(ratio, max=epsilon_high).detach() * advantages * logps
    else:
        clipped = torch.clamp(ratio, 1 - cfg.epsilon, 1 + epsilon_high)
        per_token = -torch.min(ratio * advantages, clipped * advantages)
    if engine_weights is not None:
        per_token = per_token * engine_weights
    kl = None
    if cfg.beta != 0.0:
        delta = ref_logps - logps
        kl = torch.exp(delta) - delta - 1
        per_token = per_token + cfg.beta * kl
    masked = per_token * mask
    if cfg.loss == "grpo":
        total = (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).sum()
    elif cfg.loss == "dr_grpo":
        total = masked.sum() / max_completion_length
    elif cfg.loss == "bnpo":
        total = masked.sum() / mask.sum().clamp(min=1.0)
    else:  # dapo, cispo
        total = masked.sum()
    return total, _stats(cfg, ratio.detach(), advantages, mask, kl, epsilon_high)


def entropy_bonus(cfg, entropies: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """-entropy_coef x the micro-batch's mean entropy over the tokens trained on (0-dim; not normalised by the
    loop's units: it is a mean already, averaged over micro-batches and ranks as the accumulation averages)."""
    mask = mask.to(entropies.dtype)
    return -cfg.entropy_coef * (entropies * mask).sum() / mask.sum().clamp(min=1.0)


def clip_units(cfg) -> str:
    """What the clip shares are shares of, as TRL logs them: tokens, or completions when each completion has one
    ratio (GSPO: rl.importance_sampling: sequence); STATS holds both counts."""
    return "completions" if cfg.importance_sampling == "sequence" else "tokens"


def _stats(cfg, ratio, advantages, mask, kl, epsilon_high) -> torch.Tensor:
    """STATS sums of one micro-batch: the clip shares as TRL logs them (clip/* of cispo: the capped share), counted
    per token, or per completion under sequence-level ratios (clip_units)."""
    def token_sum(x):
        return (x.to(mask.dtype).expand_as(mask) * mask).sum()

    def clip_sum(x):
        return x.to(mask.dtype).sum() if clip_units(cfg) == "completions" else token_sum(x)

    if cfg.loss == "cispo":
        capped = (ratio > epsilon_high) & (advantages > 0)
        low, high, region = torch.zeros_like(capped), capped, capped
    else:
        low = (ratio < 1 - cfg.epsilon) & (advantages < 0)
        high = (ratio > 1 + epsilon_high) & (advantages > 0)
        region = low | high
    values = [mask.sum(), torch.tensor(float(mask.shape[0]), device=mask.device),
              token_sum(kl.detach()) if kl is not None else mask.new_zeros(()),
              clip_sum(low), clip_sum(high), clip_sum(region)]
    return torch.stack([v.to(torch.float64) for v in values])
