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
1e-5 in fp32, full and LoRA, packed and unpacked. What a family adds is applied too (FamilyTransform: logit
scaling and softcapping, with the model's own copy neutralised while the head runs; the MoE load-balancing
loss from the forward's router logits), tests/test_loss_families.py; and every run checks, on its first
micro-batch, that the chunked loss equals the model's own (LossEngine.check_against_model), else stops in
one line. training.loss_impl: plain keeps transformers' path; trl runs TRL's fused LM head instead (fused_head.py),
kept for comparison on the project's bars (docs/benchmarks.md, "Loss engines").
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch

from disttrain.data import BOOKKEEPING_KEYS, IGNORE_INDEX, LENGTHS_KEY, SHIFT_LABELS_KEY, count_targets
from disttrain.data.collation import IMAGES_COUNT_KEY
from disttrain.data.vision import row_images
from disttrain.data.collation import shifted as shift
from disttrain.model.family import Family, configs_of
from disttrain.objectives import fused_head
from disttrain.objectives.router_balance import GlobalRouterBalance

CHUNK_LOGITS = 2**24  # logits per chunk: 16 M values = 64 MB in fp32, whatever the vocabulary


@dataclass(frozen=True)
class LogitTransform:
    """What a family does to lm_head's output before the loss: logits * scale (Granite divides by its
    `logits_scaling`, Cohere multiplies by `logit_scale`, Falcon-H1 by `lm_head_multiplier`), then
    softcap * tanh(logits / softcap) (Gemma 2/3's `final_logit_softcapping`). Applied in fp32 per chunk."""

    scale: float = 1.0
    softcap: float | None = None
    temperature: float = 1.0  # online RL: log-probs at the sampling temperature, the model's logits / T (as TRL)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """The transformed logits (in place)."""
        if self.scale != 1.0:
            logits.mul_(self.scale)
        if self.softcap:
            logits.div_(self.softcap).tanh_().mul_(self.softcap)
        if self.temperature != 1.0:
            logits.div_(self.temperature)
        return logits

    def derivative(self, transformed: torch.Tensor) -> torch.Tensor | float:
        """d transformed / d raw logits, from the transformed logits."""
        if not self.softcap:
            return self.scale / self.temperature
        capped = transformed * self.temperature
        return (1.0 - (capped / self.softcap) ** 2) * self.scale / self.temperature

    @property
    def identity(self) -> bool:
        return self.scale == 1.0 and not self.softcap and self.temperature == 1.0


# Where families' forwards read their logit transform, how it scales the logits, and its neutral value:
#   config: the model's config and its text config (multimodal wrappers); module: the CausalLM; inner: its .model
_SCALES = (("config", "logits_scaling", lambda v: 1.0 / v, 1.0),   # Granite(MoE): logits / logits_scaling
           ("module", "logit_scale", lambda v: v, 1.0),            # Cohere, Cohere2: logits * logit_scale
           ("inner", "lm_head_multiplier", lambda v: v, 1.0))      # Falcon-H1: logits * model.lm_head_multiplier
_SOFTCAP = "final_logit_softcapping"                               # Gemma 2/3/3n, on the (text) config


class FamilyTransform:
    """A model's logit transform, applied by the chunked loss per chunk. While the chunked head runs, the
    model's own copy is set to its neutral value (`neutralised`): the forward would otherwise apply it to
    the losses the head returns (Granite divided the loss and its gradients by 16)."""

    def __init__(self, base):
        configs = configs_of(base.config) if getattr(base, "config", None) is not None else []
        places = {"config": configs, "module": [base], "inner": [getattr(base, "model", None)]}
        self.holders: list[tuple[object, str, object]] = []
        scale = 1.0
        for where, name, to_scale, neutral in _SCALES:
            for obj in places[where]:
                value = getattr(obj, name, None) if obj is not None else None
                if isinstance(value, (int, float)) and not isinstance(value, bool) and value not in (0, neutral):
                    scale *= to_scale(float(value))
                    self.holders.append((obj, name, neutral))
                    break
        softcap = None
        for obj in configs:
            if getattr(obj, _SOFTCAP, None):
                softcap = float(getattr(obj, _SOFTCAP))
                self.holders.append((obj, _SOFTCAP, None))
        self.transform = LogitTransform(scale, softcap)

    @contextmanager
    def neutralised(self):
        saved = [(obj, name, getattr(obj, name)) for obj, name, _ in self.holders]
        try:
            for obj, name, neutral in self.holders:
                setattr(obj, name, neutral)
            yield
        finally:
            for obj, name, value in saved:
                setattr(obj, name, value)


def _chunk_tokens(vocab: int) -> int:
    return max(1, CHUNK_LOGITS // vocab)


def _logits(hidden: torch.Tensor, weight: torch.Tensor, bias, compute_dtype,
            transform: LogitTransform | None = None) -> torch.Tensor:
    """One chunk's logits in fp32, from a matmul in the dtype the plain lm_head would use under autocast,
    transformed as the model does it."""
    logits = hidden.to(compute_dtype) @ weight.to(compute_dtype).t()
    if bias is not None:
        logits = logits + bias.to(compute_dtype)
    logits = logits.float()
    return transform.apply(logits) if transform is not None else logits


def _whole(param):
    """The head's weight (or bias) whole: under tensor parallelism it is a DTensor sharded over the vocabulary,
    gathered here for the chunks (differentiable: each rank's shard gets its slice of the full gradient, which
    every rank computes alike from the same batch). Otherwise the tensor itself."""
    from torch.distributed.tensor import DTensor

    return param.full_tensor() if isinstance(param, DTensor) else param


def _targets(labels: torch.Tensor, shifted: bool) -> torch.Tensor:
    """Position t is trained to predict labels[:, t + 1]; the last position predicts nothing. `shifted`: the
    labels are already position t's targets (`shift_labels`, shifted before the sequence was split)."""
    return (labels if shifted else shift(labels)).reshape(-1)


def _compute_dtype(hidden: torch.Tensor, head: torch.nn.Linear) -> torch.dtype:
    device = hidden.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else head.weight.dtype


class _ChunkedCrossEntropySum(torch.autograd.Function):
    """Sum of the cross-entropies of `hidden @ weight.T (+ bias)` against `targets`, chunk by chunk. The
    gradients are computed in the same pass, while each chunk's logits exist (softmax - one-hot, times the
    chunk's hidden states / the weight), so the backward only scales them by the incoming gradient: no
    logits are kept and none are recomputed. The output is a sum, so that scale is one number."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, compute_dtype, token_weights=None, transform=None,
                entropy_weights=None):
        want_hidden, want_weight, want_bias = ctx.needs_input_grad[:3]
        total = torch.zeros((), device=hidden.device, dtype=torch.float32)
        grad_hidden = torch.empty_like(hidden) if want_hidden else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if want_weight else None
        grad_bias = torch.zeros_like(bias, dtype=torch.float32) if want_bias else None
        step = _chunk_tokens(weight.shape[0])
        cast = weight.to(compute_dtype)  # once per forward, not per chunk (fp32 weights under autocast)
        for start in range(0, hidden.shape[0], step):
            chunk = slice(start, start + step)
            logits = _logits(hidden[chunk], cast, bias, compute_dtype, transform)
            lse = torch.logsumexp(logits, dim=-1)
            rows = torch.arange(logits.shape[0], device=logits.device)
            losses = lse - logits[rows, targets[chunk]]
            total += (losses * token_weights[chunk]).sum() if token_weights is not None else losses.sum()
            entropy_grad = None
            if entropy_weights is not None:  # + sum_t e_t H_t; dH/dz = -p (log p + H)
                log_probs = logits - lse[:, None]
                probs = log_probs.exp()
                entropy = -(probs * log_probs).sum(-1)
                total += (entropy * entropy_weights[chunk]).sum()
                entropy_grad = probs.mul_(log_probs.add_(entropy[:, None])).mul_(-entropy_weights[chunk, None])
                del log_probs
            if not (want_hidden or want_weight or want_bias):
                continue
            slope = transform.derivative(logits) if transform is not None else 1.0  # before the in-place softmax
            grad_logits = logits.sub_(lse[:, None]).exp_()  # softmax, in place of the logits
            grad_logits[rows, targets[chunk]] -= 1.0
            if token_weights is not None:
                grad_logits.mul_(token_weights[chunk, None])
            if entropy_grad is not None:
                grad_logits.add_(entropy_grad)
            if not isinstance(slope, float) or slope != 1.0:
                grad_logits.mul_(slope)  # through the scale / softcap back to lm_head's raw output
            if want_hidden:
                grad_hidden[chunk] = (grad_logits.to(compute_dtype) @ cast).to(hidden.dtype)
            if want_weight:
                grad_weight += grad_logits.t().to(compute_dtype).matmul(hidden[chunk].to(compute_dtype)).float()
            if want_bias:
                grad_bias += grad_logits.sum(0)
        save_head_grads(ctx, hidden, weight, bias, grad_hidden, grad_weight, grad_bias)
        return total

    @staticmethod
    def backward(ctx, grad_total):
        return (*scaled_head_grads(ctx, grad_total), None, None, None, None, None)


def save_head_grads(ctx, hidden, weight, bias, grad_hidden, grad_weight, grad_bias) -> None:
    """Saves the gradients a chunked head Function made in its forward (None: not wanted). The weight's is a sum
    over every target token, not yet scaled by 1/tokens (nor by a loss scale): kept in fp32 where the parameter is
    fp16 (frequent tokens would overflow its range)."""
    ctx.dtypes = (hidden.dtype, weight.dtype, bias.dtype if bias is not None else None)
    ctx.save_for_backward(grad_hidden, _stored(grad_weight, weight.dtype) if grad_weight is not None else None,
                          _stored(grad_bias, bias.dtype) if grad_bias is not None else None)


def scaled_head_grads(ctx, grad_total: torch.Tensor) -> tuple:
    """(hidden, weight, bias) gradients saved by save_head_grads, times the incoming gradient of the sum."""
    return tuple(_scaled(g, grad_total, dtype) if g is not None else None
                 for g, dtype in zip(ctx.saved_tensors, ctx.dtypes))


def _stored(grad: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return grad if dtype == torch.float16 else grad.to(dtype)


SCALE_ROWS = 4096  # rows scaled at a time in fp32 (a bounded temporary, whatever the vocabulary)


def _scaled(grad: torch.Tensor, factor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """grad x factor as a `dtype` tensor, multiplied in fp32: the factor (1/tokens, the loss scale) rounded to
    bf16 would bias every gradient by up to 0.2 %. In place, a block of rows at a time."""
    factor = factor.float()
    if grad.dtype == torch.float32:
        return grad.mul_(factor).to(dtype)
    for rows in grad.split(SCALE_ROWS):
        rows.copy_(rows.float().mul_(factor))
    return grad


def chunked_loss_sum(hidden: torch.Tensor, head: torch.nn.Linear, labels: torch.Tensor,
                     row_weights: torch.Tensor | None = None, shifted: bool = False,
                     position_weights: torch.Tensor | None = None,
                     entropy_weights: torch.Tensor | None = None) -> torch.Tensor:
    """Sum over target tokens of the cross-entropy of predicting labels[:, t + 1] at position t (labels[:, t]
    when `shifted`), from the final hidden states, without full-vocabulary logits (0-dim, fp32,
    differentiable). `row_weights`: each row's tokens weighted by its value (a sequence-level objective's
    gradient, see preference.py); `position_weights`: [batch, seq] a weight per predicting position, as
    chunked_token_losses lays its losses out (a token-level objective's gradient, see grpo.py); `entropy_weights`:
    [batch, seq] likewise, adding sum_t e_t x the entropy of the distribution predicted at t (an entropy bonus)."""
    targets = _targets(labels, shifted)
    positions = (targets != IGNORE_INDEX).nonzero().squeeze(1)
    compute_dtype = _compute_dtype(hidden, head)
    token_weights = None
    if row_weights is not None:
        token_weights = row_weights.float().repeat_interleave(labels.shape[1]).index_select(0, positions)
    if position_weights is not None:
        token_weights = position_weights.float().reshape(-1).index_select(0, positions)
    if entropy_weights is not None:
        entropy_weights = entropy_weights.float().reshape(-1).index_select(0, positions)
    with torch.autocast(hidden.device.type, enabled=False):  # the Function picks its matmul dtype itself
        return _ChunkedCrossEntropySum.apply(hidden.reshape(-1, hidden.shape[-1]).index_select(0, positions),
                                             _whole(head.weight), _whole(head.bias),
                                             targets.index_select(0, positions),
                                             compute_dtype, token_weights, _transform_of(head), entropy_weights)


def _transform_of(head) -> LogitTransform | None:
    """The logit transform TokenLoss found for this head's model (None: none)."""
    transform = getattr(head, "_disttrain_transform", None)
    return None if transform is None or transform.identity else transform


@torch.no_grad()
def chunked_token_losses(hidden: torch.Tensor, head: torch.nn.Linear, labels: torch.Tensor,
                         shifted: bool = False, entropies: torch.Tensor | None = None) -> torch.Tensor:
    """[batch, seq] fp32 losses of predicting labels[:, t + 1] at position t (labels[:, t] when `shifted`; 0
    where there is no target), for evaluation: chunk by chunk, no gradients. `entropies` ([batch, seq] fp32):
    filled with the predicted distribution's entropy at the same positions."""
    targets = _targets(labels, shifted)
    positions = (targets != IGNORE_INDEX).nonzero().squeeze(1)
    hidden = hidden.reshape(-1, hidden.shape[-1]).index_select(0, positions)
    wanted = targets.index_select(0, positions)
    losses = torch.zeros(targets.shape[0], device=hidden.device, dtype=torch.float32)
    step, dtype, transform = _chunk_tokens(head.weight.shape[0]), _compute_dtype(hidden, head), _transform_of(head)
    weight, bias = _whole(head.weight), _whole(head.bias)
    for start in range(0, hidden.shape[0], step):
        at = positions[start:start + step]
        logits = _logits(hidden[start:start + step], weight, bias, dtype, transform)
        rows = torch.arange(logits.shape[0], device=logits.device)
        lse = torch.logsumexp(logits, -1)
        losses[at] = lse - logits[rows, wanted[start:start + step]]
        if entropies is not None:  # H = lse - sum p z
            entropies.view(-1)[at] = lse - (torch.softmax(logits, -1) * logits).sum(-1)
    return losses.view(labels.shape)


def output_projection(model) -> torch.nn.Module:
    """lm_head of a causal LM (through a peft wrapper)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    head = base.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear):
        from disttrain.errors import DisttrainError

        raise DisttrainError(f"training.loss_impl=chunked needs a plain torch.nn.Linear output projection, found "
                             f"{type(head).__module__}.{type(head).__name__} (LoRA on lm_head?); remove lm_head from "
                             "lora.target_modules or use training.loss_impl=plain")
    return head


class LossEngine:
    """How a token loss is computed, as a component the objectives hold (SFT's TokenLoss, DPO's PreferenceLoss,
    any later one): `chunked` (lm_head's forward, while targets are set on it, returns what the objective's
    `training_head(hidden, labels)` makes of them in training and per-token losses in evaluation; installed
    before accelerator.prepare), `plain` (transformers' loss from the full logits) or `trl` (TRL's fused LM
    head, fused_head.py). It applies what the model family adds (logit transforms; the MoE router loss) and runs
    the start-up self-check against the model's own loss."""

    def __init__(self, model, impl: str = "chunked", training_head=None, router_balance: str = "micro_batch",
                 eval_head=None):
        self.impl = impl
        self.eval_head = eval_head  # chunked: what lm_head returns without gradients (None: per-token losses)
        self.head = None
        self.checked = impl == "plain"
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        config = getattr(base, "config", None)
        # what the model adds to the token loss: the MoE load-balancing loss (transformers' own, from the
        # router logits the forward returns, with its attention-mask handling), weighted by its coefficient;
        # model.router_balance=global: over every rank's micro-batch together (router_balance.py)
        family = Family.of(config) if config is not None else None
        self.router_aux_coef = family.router_aux_coef if family is not None else 0.0
        self.balance = None
        if router_balance == "global" and self.router_aux_coef:
            self.balance = GlobalRouterBalance(family.routing)
        self.family = FamilyTransform(base)
        if impl == "trl":
            fused_head.install(model)  # TRL applies the family's transforms and router loss itself
        if impl == "chunked":
            self._install_chunked_head(model, training_head or self._loss_sum)

    def _install_chunked_head(self, model, training_head) -> None:
        self.head = output_projection(model)
        self.head._disttrain_labels = None
        self.head._disttrain_shifted = False  # True: the labels set are position t's targets already
        self.head._disttrain_transform = self.family.transform
        plain_forward = self.head.forward

        def forward(hidden):  # the instance's forward: not a parameter, so state dicts do not change
            labels = self.head._disttrain_labels
            if labels is None:
                return plain_forward(hidden)
            if torch.is_grad_enabled():  # training: what the objective makes of the targets (with gradients)
                return training_head(hidden, labels)
            if self.eval_head is not None:  # evaluation: the objective's own per-position values
                return self.eval_head(hidden, labels, self.head._disttrain_shifted)
            return chunked_token_losses(hidden, self.head, labels, self.head._disttrain_shifted)  # evaluation

        # never compiled: regional compilation (accelerate) compiles lm_head whole, and Dynamo then
        # recompiles it for every new sequence length (the labels' shape, the targets' count) until its
        # recompile limit; the chunked Function gains nothing from a graph anyway
        self.head.forward = torch.compiler.disable(forward)

    def _loss_sum(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The default training head: the micro-batch's summed token loss, differentiable."""
        return chunked_loss_sum(hidden, self.head, labels, shifted=self.head._disttrain_shifted)

    def output(self, model, batch: dict, inputs: dict):
        """The model's forward with the batch's targets set on the chunked head: `.logits` holds what the head
        returned (training: the objective's loss; evaluation: per-token losses)."""
        shifted = SHIFT_LABELS_KEY in batch
        self.head._disttrain_labels = batch[SHIFT_LABELS_KEY] if shifted else batch["labels"]
        self.head._disttrain_shifted = shifted
        try:
            with self.family.neutralised():  # the head applies the family's transform itself
                return model(**inputs, use_cache=False)
        finally:
            self.head._disttrain_labels, self.head._disttrain_shifted = None, False

    def with_router_loss(self, loss: torch.Tensor, out, batch: dict, across_ranks: bool = True) -> torch.Tensor:
        """loss + router_aux_loss_coef x the forward's load-balancing loss (MoE with output_router_logits), per
        micro-batch, as transformers (and TRL's DPO trainer) add it; or, under model.router_balance=global, this
        rank's share of the loss of every rank's micro-batch (`across_ranks` False: of this rank's rows alone)."""
        if not self.router_aux_coef:
            return loss
        if self.balance is not None:
            aux = self.balance.loss(out, batch.get("attention_mask"), across_ranks)
        else:
            aux = getattr(out, "aux_loss", None)
        return loss + self.router_aux_coef * aux.to(loss.device) if aux is not None else loss

    def token_loss_sum(self, model, batch: dict, num_items_in_batch) -> torch.Tensor:
        """sum of the micro-batch's token losses / num_items_in_batch, plus what the model adds to it."""
        if self.impl == "plain":
            inputs = {k: v for k, v in batch.items() if k not in BOOKKEEPING_KEYS}
            return model(**inputs, num_items_in_batch=num_items_in_batch, use_cache=False).loss
        if self.impl == "trl":
            return fused_head.loss(model, _token_inputs(batch), batch, num_items_in_batch)
        out = self.output(model, batch, _token_inputs(batch))
        return self.with_router_loss(out.logits / num_items_in_batch, out, batch)  # the micro-batch's summed loss

    @torch.no_grad()
    def check_against_model(self, accelerator, model, batch: dict) -> None:
        """Once, on the run's first micro-batch (every rank, with its own): the engine's loss of a slice of it
        must equal the model's own loss on it -- transformers' forward with labels, which applies whatever the
        family does (logit transforms, added losses) -- else stop with one line, so that a family nobody has
        tried cannot train on a wrong loss. In eval mode (no dropout), on at most SELF_CHECK_TOKENS tokens of
        one sequence (the model's full logits for them only)."""
        if self.checked:
            return
        self.checked = True
        part = _one_sequence(batch, SELF_CHECK_TOKENS)
        was_training = model.training
        model.eval()
        try:
            with torch.compiler.set_stance("force_eager"):  # compiled regions (training.compile) must not
                targets = count_targets(part)                # compile again for this one-off slice
                ours = self.mean_loss(model, part, targets)
                inputs = {k: v for k, v in part.items() if k not in BOOKKEEPING_KEYS}
                theirs = model(**inputs, use_cache=False).loss.float()
        finally:
            model.train(was_training)
        weights = self.head.weight if self.head is not None else next(model.parameters())  # the model is wrapped
        low_precision = torch.is_autocast_enabled(ours.device.type) or weights.element_size() < 4
        tolerance = 1e-2 if low_precision else 1e-4
        wrong = bool(targets > 0) and not torch.isclose(ours, theirs, rtol=tolerance, atol=tolerance)
        flag = accelerator.reduce(torch.tensor(float(wrong), device=ours.device), reduction="sum")
        if float(flag) > 0:
            from disttrain.errors import DisttrainError

            seen = (f"the {self.impl} loss is {float(ours):.5f} where this model's own loss is {float(theirs):.5f}"
                    if wrong else f"another rank found the {self.impl} loss different from this model's own loss")
            if self.balance is not None:  # the router's loss is computed here, not by the model
                raise DisttrainError(
                    f"model.router_balance=global: on the first micro-batch {seen}: this family's router loss is "
                    "not the Switch-style loss of Mixtral / Qwen-MoE that router_balance.py computes; set "
                    "model.router_balance=micro_batch")
            raise DisttrainError(
                f"training.loss_impl={self.impl}: on the first micro-batch {seen}: the model transforms its logits "
                f"or adds a loss that the {self.impl} path does not apply; set training.loss_impl=plain "
                "(transformers' loss from full logits)")

    def mean_loss(self, model, part: dict, targets: torch.Tensor) -> torch.Tensor:
        """This engine's loss of a micro-batch, averaged over its target tokens, with what the model adds."""
        if self.impl == "trl":
            return fused_head.loss(model, _token_inputs(part), part).float()
        out = self.output(model, part, _token_inputs(part))
        return self.with_router_loss(out.logits.sum() / targets.clamp(min=1), out, part, across_ranks=False)

    @torch.no_grad()
    def token_losses(self, model, batch: dict, inputs: dict | None = None) -> torch.Tensor:
        """[batch, seq - 1] fp32 per-token losses (0 where there is no target), for evaluation; [batch, seq]
        when the batch carries `shift_labels` (one per position). `inputs`: what the model is given (default:
        the batch without its targets and bookkeeping)."""
        shifted = SHIFT_LABELS_KEY in batch
        inputs = _token_inputs(batch) if inputs is None else inputs
        if self.impl == "plain":
            logits = model(**inputs, use_cache=False).logits.float()
            if not shifted:
                logits, targets = logits[:, :-1], batch["labels"][:, 1:]
            else:
                targets = batch[SHIFT_LABELS_KEY]
            return torch.nn.functional.cross_entropy(logits.transpose(1, 2), targets, ignore_index=IGNORE_INDEX,
                                                     reduction="none")
        if self.impl == "trl":
            return fused_head.token_losses(model, inputs, batch)
        per_token = self.output(model, batch, inputs).logits
        return per_token if shifted else per_token[:, :-1]


def _token_inputs(batch: dict) -> dict:
    dropped = (*BOOKKEEPING_KEYS, "labels", SHIFT_LABELS_KEY)  # the targets go to the head, not the model
    return {k: v for k, v in batch.items() if k not in dropped}


class TokenLoss:
    """Supervised fine-tuning's loss, as the loop calls it (objectives/base.Loss): the token-normalised
    cross-entropy of the targets, computed by its engine (LossEngine: chunked by default)."""

    unit_name = "target_tokens"  # what the loss is averaged over (the loop's normalisation)

    def __init__(self, model, impl: str = "chunked", router_balance: str = "micro_batch"):
        self.engine = LossEngine(model, impl, router_balance=router_balance)

    @property
    def checked(self) -> bool:
        return self.engine.checked

    @property
    def router_aux_coef(self) -> float:
        return self.engine.router_aux_coef

    def check_against_model(self, accelerator, model, batch: dict) -> None:
        self.engine.check_against_model(accelerator, model, batch)

    def waive_check(self) -> None:
        """For a caller whose model cannot run the check (a pipeline stage holds no whole model): the start-up
        self-check is skipped; its loss is the chunked head's own function, proven on its own."""
        self.engine.checked = True

    def units(self, batch: dict) -> torch.Tensor:
        """How many items the micro-batch's loss sums over (target tokens)."""
        return count_targets(batch)

    def training_loss(self, model, batch: dict, num_items_in_batch) -> torch.Tensor:
        """sum of the micro-batch's token losses / num_items_in_batch (the loop's token normalisation), plus
        what the model adds to it (MoE: router_aux_loss_coef x its load-balancing loss, as transformers adds)."""
        return self.engine.token_loss_sum(model, batch, num_items_in_batch)

    def window_metrics(self, accelerator) -> dict:
        """Objective-specific metrics for a log line (collective where non-empty; SFT has none)."""
        return {}

    def token_losses(self, model, batch: dict) -> torch.Tensor:
        return self.engine.token_losses(model, batch)

    def eval_rows(self, model, batch: dict, split: str = "eval") -> torch.Tensor:
        """[dataset rows, k] sums for evaluation of eval set `split`: (loss sum, target tokens) per row."""
        targets = batch[SHIFT_LABELS_KEY] if SHIFT_LABELS_KEY in batch else batch["labels"][:, 1:]
        return _per_row_sums(self.token_losses(model, batch), targets, batch)

    def eval_record(self, sums: dict[str, torch.Tensor]) -> dict[str, float]:
        """`eval_loss` (token-weighted over every eval set) and `eval_loss/<source>` for each source's set of a
        mixture (a single source's set is just "eval"), from each set's summed eval_rows."""
        loss = sum(float(s[0]) for s in sums.values()) / max(sum(float(s[1]) for s in sums.values()), 1.0)
        record = {"eval_loss": loss}
        record.update({f"eval_loss/{name}": float(s[0]) / max(float(s[1]), 1.0) for name, s in sums.items()
                       if name != "eval"})
        return record


SELF_CHECK_TOKENS = 256  # tokens of the self-check's slice: full logits of these only


def _one_sequence(batch: dict, max_tokens: int) -> dict:
    """The first sequence of a micro-batch, at most `max_tokens` long, as a batch of one (a flattened
    micro-batch's first example, without its boundaries)."""
    if "cu_seq_lens_q" in batch:
        end = min(int(batch["cu_seq_lens_q"][1]), max_tokens)
        keys = ("input_ids", "labels", "position_ids") + ((SHIFT_LABELS_KEY,) if SHIFT_LABELS_KEY in batch else ())
        return {k: batch[k][:, :end] for k in keys} | {LENGTHS_KEY: batch[LENGTHS_KEY].new_tensor([end])}
    row = 0
    with_images = torch.nonzero(batch[IMAGES_COUNT_KEY]).flatten() if IMAGES_COUNT_KEY in batch else []
    if len(with_images):  # a row with images, whole (its image tokens all or none): every rank's forward runs the
        row = int(with_images[0])  # image path (a text-only micro-batch's is the blank image's row: data/vision.py)
        max_tokens = int(batch[LENGTHS_KEY][row])
    end = min(int(batch[LENGTHS_KEY][row]), max_tokens)
    part = {k: v[row:row + 1, :end] for k, v in batch.items() if isinstance(v, torch.Tensor) and v.dim() == 2}
    return row_images(batch, part | {LENGTHS_KEY: batch[LENGTHS_KEY][row:row + 1].clamp(max=end)}, row)


def _per_row_sums(per_token: torch.Tensor, labels: torch.Tensor, batch: dict) -> torch.Tensor:
    """(loss sum, target count) per dataset row, whether the rows came padded side by side or flattened into
    one row (flash-attention packing): gather_for_metrics drops duplicated rows by counting dataset rows."""
    targets = (labels != IGNORE_INDEX).to(per_token.dtype)
    if per_token.shape[0] == batch[LENGTHS_KEY].shape[0]:
        return torch.stack([per_token.sum(-1), targets.sum(-1)], dim=-1)
    lengths = batch[LENGTHS_KEY]
    rows = torch.repeat_interleave(torch.arange(len(lengths), device=lengths.device), lengths)
    # position t's target is the next token of the same sequence (a boundary has none), so its row is t's
    row_of_label = rows[-per_token.shape[1]:]
    sums = per_token.new_zeros(len(lengths), 2)
    return sums.index_add_(0, row_of_label, torch.stack([per_token[0], targets[0]], dim=-1))
