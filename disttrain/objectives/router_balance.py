"""The MoE router's load-balancing loss over every rank's micro-batch together (model.router_balance: global).

transformers adds the Switch-Transformer loss `E * sum_e f_e * P_e` per forward: f_e the share of the (token,
top-k) assignments that went to expert e, P_e the mean router probability of e, both over the tokens of this
rank's micro-batch. With few rows per rank the shares are noisy and a rank is pushed to balance its own handful
of tokens (Qwen's "global-batch load balancing" paper: specialisation suffers); and it is a different loss from
the one one process computes on the same rows. Here the assignment counts and the token count are all-reduced
(detached: f has no gradient in the Switch loss either), the probabilities stay local, each rank's term scaled
so that the mean the strategy takes over ranks is exactly the loss one process computes on all ranks' rows of
this micro-batch (any split: padding, sequence shards, ranks that share a batch count their tokens alike in
both sums). One small all-reduce per micro-batch.

Hand-written because transformers computes the loss inside each family's forward, per rank; the terms follow its
`load_balancing_loss_func` (Mixtral, Qwen2/3-MoE), and the start-up self-check (LossEngine.check_against_model)
compares this computation on one process's rows with the model's own aux_loss, so a family whose router works
otherwise (router logits not given, a sigmoid router) stops in one line instead of training on another loss.
"""

from __future__ import annotations

import torch


def switch_terms(router_logits: tuple[torch.Tensor, ...], experts: int, top_k: int,
                 attention_mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(assignments per expert [E], router probability summed per expert [E], rows), summed over the layers and
    the unmasked tokens, as transformers sums them before it normalises."""
    device = router_logits[0].device
    counts = torch.zeros(experts, dtype=torch.float32, device=device)
    probs = torch.zeros(experts, dtype=torch.float32, device=device)
    rows = torch.zeros((), dtype=torch.float32, device=device)
    mask = None if attention_mask is None else attention_mask.reshape(-1).to(device, torch.float32)
    for logits in router_logits:
        weights = torch.softmax(logits.float(), dim=-1)
        chosen = torch.topk(weights, top_k, dim=-1).indices.reshape(-1)
        token = torch.ones(weights.shape[0], device=device) if mask is None else mask
        counts = counts.scatter_add(0, chosen, token.repeat_interleave(top_k))
        probs = probs + (weights * token.unsqueeze(-1)).sum(0)
        rows = rows + token.sum()
    return counts.detach(), probs, rows.detach()


class GlobalRouterBalance:
    """The load-balancing loss of every rank's micro-batch together, as this rank's share (module docstring)."""

    def __init__(self, routing: tuple[int, int]):
        self.experts, self.top_k = routing

    def loss(self, out, attention_mask: torch.Tensor | None, across_ranks: bool = True) -> torch.Tensor | None:
        """This rank's term; None where the forward returned no router logits. `across_ranks`: False computes
        the loss of this rank's rows alone (what the self-check compares with the model's own)."""
        router_logits = getattr(out, "router_logits", None)
        if not router_logits:
            return None
        counts, probs, rows = switch_terms(tuple(router_logits), self.experts, self.top_k, attention_mask)
        ranks = 1
        if across_ranks and torch.distributed.is_available() and torch.distributed.is_initialized():
            ranks = torch.distributed.get_world_size()
            summed = torch.cat([counts, rows.reshape(1)])
            torch.distributed.all_reduce(summed)  # every rank runs the same micro-batches: one call each
            counts, rows = summed[:-1], summed[-1]
        rows = rows.clamp(min=1.0)
        # mean over ranks of (E * sum f * probs_r * ranks / rows) = E * sum f * (sum_r probs_r) / rows
        return self.experts * torch.sum(counts / rows * probs * ranks / rows)
