"""The causal-LM loss without full-vocabulary logits (training.loss_impl: chunked, the default).

For today's vocabularies the logits are the largest activation: 4 x 4096 tokens x 152k (Qwen2.5) is 2.5 G
values, 5 GB in bf16, 10 GB more upcast to fp32 for the loss, and as much again for their gradient. Here the
output projection (lm_head) computes, inside its own forward call, the loss of each target token from the
final hidden states, a chunk of tokens at a time, in fp32:
- only positions with a target are projected (prompt tokens of SFT data never reach the vocabulary);
- a chunk's logits exist only while its loss and its gradients (softmax - one-hot, times the hidden
  states and the weight) are computed, in the forward pass; the backward only scales those gradients, so
  nothing is recomputed. The weight's gradient is made in fp32 during the forward (full fine-tuning only:
  a frozen LoRA base needs none);
- nothing changes for the strategies: the projection runs inside lm_head's forward, where FSDP2 has
  gathered the root module's weights and ZeRO-3 the lm_head's (and gathers them again for the backward), so
  the weight is whole whatever shards it.
The loss and its gradients equal transformers' own (plain) loss: tests/test_loss_impl.py compares them to
1e-5 in fp32, full and LoRA, packed and unpacked. training.loss_impl: plain keeps transformers' path.
"""

from __future__ import annotations

import torch

from disttrain.data import BOOKKEEPING_KEYS, IGNORE_INDEX, LENGTHS_KEY, count_targets

CHUNK_LOGITS = 2**24  # logits per chunk: 16 M values = 64 MB in fp32, whatever the vocabulary


def _chunk_tokens(vocab: int) -> int:
    return max(1, CHUNK_LOGITS // vocab)


def _logits(hidden: torch.Tensor, weight: torch.Tensor, bias, compute_dtype) -> torch.Tensor:
    """One chunk's logits in fp32, from a matmul in the dtype the plain lm_head would use under autocast."""
    logits = hidden.to(compute_dtype) @ weight.to(compute_dtype).t()
    if bias is not None:
        logits = logits + bias.to(compute_dtype)
    return logits.float()


def _shifted_targets(labels: torch.Tensor) -> torch.Tensor:
    """Position t is trained to predict labels[:, t + 1]; the last position predicts nothing."""
    return torch.cat([labels[:, 1:], labels.new_full((labels.shape[0], 1), IGNORE_INDEX)], dim=1).reshape(-1)


def _compute_dtype(hidden: torch.Tensor, head: torch.nn.Linear) -> torch.dtype:
    device = hidden.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else head.weight.dtype


class _ChunkedCrossEntropySum(torch.autograd.Function):
    """Sum of the cross-entropies of `hidden @ weight.T (+ bias)` against `targets`, chunk by chunk. The
    gradients are computed in the same pass, while each chunk's logits exist (softmax - one-hot, times the
    chunk's hidden states / the weight), so the backward only scales them by the incoming gradient: no
    logits are kept and none are recomputed. The output is a sum, so that scale is one number."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, compute_dtype, token_weights=None):
        want_hidden, want_weight, want_bias = ctx.needs_input_grad[:3]
        total = torch.zeros((), device=hidden.device, dtype=torch.float32)
        grad_hidden = torch.empty_like(hidden) if want_hidden else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if want_weight else None
        grad_bias = torch.zeros_like(bias, dtype=torch.float32) if want_bias else None
        step = _chunk_tokens(weight.shape[0])
        for start in range(0, hidden.shape[0], step):
            chunk = slice(start, start + step)
            logits = _logits(hidden[chunk], weight, bias, compute_dtype)
            lse = torch.logsumexp(logits, dim=-1)
            rows = torch.arange(logits.shape[0], device=logits.device)
            losses = lse - logits[rows, targets[chunk]]
            total += (losses * token_weights[chunk]).sum() if token_weights is not None else losses.sum()
            if not (want_hidden or want_weight or want_bias):
                continue
            grad_logits = logits.sub_(lse[:, None]).exp_()  # softmax, in place of the logits
            grad_logits[rows, targets[chunk]] -= 1.0
            if token_weights is not None:
                grad_logits.mul_(token_weights[chunk, None])
            if want_hidden:
                grad_hidden[chunk] = (grad_logits.to(compute_dtype) @ weight.to(compute_dtype)).to(hidden.dtype)
            if want_weight:
                grad_weight += grad_logits.t().to(compute_dtype).matmul(hidden[chunk].to(compute_dtype)).float()
            if want_bias:
                grad_bias += grad_logits.sum(0)
        ctx.save_for_backward(grad_hidden, grad_weight.to(weight.dtype) if want_weight else None,
                              grad_bias.to(bias.dtype) if want_bias else None)
        return total

    @staticmethod
    def backward(ctx, grad_total):
        grads = tuple(g * grad_total.to(g.dtype) if g is not None else None for g in ctx.saved_tensors)
        return (*grads, None, None, None)


def chunked_loss_sum(hidden: torch.Tensor, head: torch.nn.Linear, labels: torch.Tensor,
                     row_weights: torch.Tensor | None = None) -> torch.Tensor:
    """Sum over target tokens of the cross-entropy of predicting labels[:, t + 1] at position t, from the
    final hidden states, without full-vocabulary logits (0-dim, fp32, differentiable). `row_weights`: each
    row's tokens weighted by its value (a sequence-level objective's gradient, see preference.py)."""
    targets = _shifted_targets(labels)
    positions = (targets != IGNORE_INDEX).nonzero().squeeze(1)
    compute_dtype = _compute_dtype(hidden, head)
    token_weights = None
    if row_weights is not None:
        token_weights = row_weights.float().repeat_interleave(labels.shape[1]).index_select(0, positions)
    with torch.autocast(hidden.device.type, enabled=False):  # the Function picks its matmul dtype itself
        return _ChunkedCrossEntropySum.apply(hidden.reshape(-1, hidden.shape[-1]).index_select(0, positions),
                                             head.weight, head.bias, targets.index_select(0, positions),
                                             compute_dtype, token_weights)


@torch.no_grad()
def chunked_token_losses(hidden: torch.Tensor, head: torch.nn.Linear, labels: torch.Tensor) -> torch.Tensor:
    """[batch, seq] fp32 losses of predicting labels[:, t + 1] at position t (0 where there is no target), for
    evaluation: chunk by chunk, no gradients."""
    targets = _shifted_targets(labels)
    positions = (targets != IGNORE_INDEX).nonzero().squeeze(1)
    hidden = hidden.reshape(-1, hidden.shape[-1]).index_select(0, positions)
    wanted = targets.index_select(0, positions)
    losses = torch.zeros(targets.shape[0], device=hidden.device, dtype=torch.float32)
    step, dtype = _chunk_tokens(head.weight.shape[0]), _compute_dtype(hidden, head)
    for start in range(0, hidden.shape[0], step):
        logits = _logits(hidden[start:start + step], head.weight, head.bias, dtype)
        rows = torch.arange(logits.shape[0], device=logits.device)
        losses[positions[start:start + step]] = torch.logsumexp(logits, -1) - logits[rows, wanted[start:start + step]]
    return losses.view(labels.shape)


def output_projection(model) -> torch.nn.Module:
    """lm_head of a causal LM (through a peft wrapper)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    head = base.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear):
        raise TypeError(f"training.loss_impl=chunked needs a plain torch.nn.Linear output projection, found "
                        f"{type(head).__module__}.{type(head).__name__} (LoRA on lm_head?); remove lm_head from "
                        "lora.target_modules or use training.loss_impl=plain")
    return head


class TokenLoss:
    """How the loop gets a micro-batch's loss. `chunked`: lm_head's forward returns per-token losses while
    targets are set on it (install() before accelerator.prepare); `plain`: transformers' own loss from the
    full logits."""

    def __init__(self, model, impl: str = "chunked"):
        self.impl = impl
        self.head = None
        if impl == "chunked":
            config = getattr(model.get_base_model() if hasattr(model, "get_base_model") else model, "config", None)
            if getattr(config, "final_logit_softcapping", None) or getattr(config, "logit_scale", 1.0) not in (None, 1.0):
                raise ValueError("this model rescales its logits after lm_head (softcapping / logit_scale), which "
                                 "the chunked loss does not apply: set training.loss_impl=plain")
            self.head = output_projection(model)
            self.head._disttrain_labels = None
            plain_forward = self.head.forward

            def forward(hidden):  # the instance's forward: not a parameter, so state dicts do not change
                labels = self.head._disttrain_labels
                if labels is None:
                    return plain_forward(hidden)
                if torch.is_grad_enabled():  # training: the loss sum (with its gradients)
                    return self._training_head(hidden, labels)
                return chunked_token_losses(hidden, self.head, labels)  # evaluation: per-token losses

            self.head.forward = forward

    unit_name = "target_tokens"  # what the loss is averaged over (the loop's normalisation)

    def _training_head(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """What lm_head returns in training: the micro-batch's summed loss, differentiable."""
        return chunked_loss_sum(hidden, self.head, labels)

    def units(self, batch: dict) -> torch.Tensor:
        """How many items the micro-batch's loss sums over (target tokens; pairs for preference tuning)."""
        return count_targets(batch)

    def window_metrics(self, accelerator) -> dict:
        """Objective-specific metrics for a log line (collective where non-empty; SFT has none)."""
        return {}

    def eval_rows(self, model, batch: dict, split: str = "eval") -> torch.Tensor:
        """[dataset rows, k] sums for evaluation of eval set `split`: (loss sum, target tokens) per row."""
        return _per_row_sums(self.token_losses(model, batch), batch["labels"][:, 1:], batch)

    def eval_record(self, sums: dict[str, torch.Tensor]) -> dict[str, float]:
        """`eval_loss` (token-weighted over every eval set) and `eval_loss/<source>` for each source's set of a
        mixture (a single source's set is just "eval"), from each set's summed eval_rows."""
        loss = sum(float(s[0]) for s in sums.values()) / max(sum(float(s[1]) for s in sums.values()), 1.0)
        record = {"eval_loss": loss}
        record.update({f"eval_loss/{name}": float(s[0]) / max(float(s[1]), 1.0) for name, s in sums.items()
                       if name != "eval"})
        return record

    @staticmethod
    def _inputs(batch: dict) -> dict:
        return {k: v for k, v in batch.items() if k not in BOOKKEEPING_KEYS and k != "labels"}

    def _chunked(self, model, batch: dict) -> torch.Tensor:
        self.head._disttrain_labels = batch["labels"]
        try:
            return model(**self._inputs(batch), use_cache=False).logits  # losses, see forward above
        finally:
            self.head._disttrain_labels = None

    def training_loss(self, model, batch: dict, num_items_in_batch) -> torch.Tensor:
        """sum of the micro-batch's token losses / num_items_in_batch (the loop's token normalisation)."""
        if self.impl == "plain":
            inputs = {k: v for k, v in batch.items() if k not in BOOKKEEPING_KEYS}
            return model(**inputs, num_items_in_batch=num_items_in_batch, use_cache=False).loss
        return self._chunked(model, batch) / num_items_in_batch  # the summed loss of the micro-batch

    @torch.no_grad()
    def token_losses(self, model, batch: dict) -> torch.Tensor:
        """[batch, seq - 1] fp32 per-token losses (0 where there is no target), for evaluation."""
        if self.impl == "plain":
            logits = model(**self._inputs(batch), use_cache=False).logits.float()
            return torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), batch["labels"][:, 1:],
                                                     ignore_index=IGNORE_INDEX, reduction="none")
        return self._chunked(model, batch)[:, :-1]


def _per_row_sums(per_token: torch.Tensor, labels: torch.Tensor, batch: dict) -> torch.Tensor:
    """(loss sum, target count) per dataset row, whether the rows came padded side by side or flattened into
    one row (flash-attention packing): gather_for_metrics drops duplicated rows by counting dataset rows."""
    targets = (labels != IGNORE_INDEX).to(per_token.dtype)
    if per_token.shape[0] == batch[LENGTHS_KEY].shape[0]:
        return torch.stack([per_token.sum(-1), targets.sum(-1)], dim=-1)
    lengths = batch[LENGTHS_KEY]
    row_of_label = torch.repeat_interleave(torch.arange(len(lengths), device=lengths.device), lengths)[1:]
    sums = per_token.new_zeros(len(lengths), 2)
    return sums.index_add_(0, row_of_label, torch.stack([per_token[0], targets[0]], dim=-1))
