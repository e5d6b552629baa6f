"""Knowledge distillation (training.objective: distill): a student trained to match a frozen teacher's next-token
distributions at every completion token -- generalised knowledge distillation (GKD, Agarwal et al. 2024) as TRL's
GKDTrainer computes it.

Each optimizer step trains on one of three kinds of completions, decided per step from the run's seed (the same
on every rank, so every strategy equals one process and a resumed run decides as the uninterrupted one did):
the student's own samples of the step's prompts (on-policy, a distill.lmbda share of the steps), the teacher's
samples (distill.seq_kd, the other steps), or the dataset's answers. Samples are drawn as online RL draws them
(rollout.py, sampling.py: one batched generate() per rank, each completion from its own seed), the prompt of a
chat/alpaca row being its tokens before its first answer token.

The loss is TRL's generalized_jsd_loss summed over the completion tokens and divided by their number over the
whole optimizer step (the loop's token normalisation): beta 0 -> KL(teacher || student), 1 -> KL(student ||
teacher), between -> beta KL(teacher || m) + (1 - beta) KL(student || m), m the beta-mixture.
tests/test_distill.py compares loss and gradients with TRL's function.

Why hand-written: TRL's loss takes both models' full [tokens, vocab] logits (10 GB in fp32 for 4 x 4096 tokens of
Qwen's vocabulary, twice). Here neither model's logits are ever whole: the teacher's forward stops at its final
hidden states (its lm_head returns them unprojected), and inside the student's lm_head forward each chunk of
completion tokens is projected through both heads, its divergence and its gradient with respect to the student's
logits taken in closed form while the chunk exists (as token_loss.py does for the cross-entropy), so the backward
only scales the saved gradients. The teacher's head weight is gathered whole for that (FSDP2: its DTensor's
full_tensor(); ZeRO-3: GatheredParameters), one matrix, never the whole teacher.

Two vocabularies of different widths (Qwen2.5-7B's embedding is padded to 152,064 rows, 0.5B's to 151,936) are
compared over their common first columns when those hold every token of the tokenizer; teachers with another
tokenizer are refused before any weight loads (check_teacher).
"""

from __future__ import annotations

import contextlib
import hashlib
import math
from dataclasses import replace

import torch

from disttrain.data import IGNORE_INDEX, LENGTHS_KEY, SQUARES_KEY, count_targets
from disttrain.data.collation import Collator, shifted as shift
from disttrain.data.prompts import PROMPT_INDEX, PromptCollator
from disttrain.errors import DisttrainError
from disttrain.objectives import rollout, sampling
from disttrain.objectives.token_loss import (CHUNK_LOGITS, FamilyTransform, LossEngine, LogitTransform, _compute_dtype,
                                             _logits, _per_row_sums, _whole, output_projection,
                                             save_head_grads, scaled_head_grads)
from disttrain.runtime.rollout_weights import RolloutWeights

SOURCE_KEY = "distill_source"  # [rows]: where each row's completion came from (SOURCES' index)
SOURCES = ("data", "student", "teacher")
STATS = ("divergence", "student_logps", "teacher_logps", "tokens", "on_policy_tokens")


# ---- the divergence, one chunk of tokens at a time ----

def chunk_divergence(student: torch.Tensor, teacher: torch.Tensor, beta: float, want_grad: bool):
    """(per-token generalised JSD [tokens], d sum / d student logits [tokens, vocab] or None, student log-probs,
    teacher log-probs) of fp32 logits already divided by the temperature. The gradient in closed form: beta 0 ->
    p_s - p_t; 1 -> p_s (log p_s - log p_t - D); else p_s (g - sum p_s g), g = (1 - beta)(log p_s - log m).
    `student` is overwritten."""
    log_s = torch.log_softmax(student, dim=-1)
    del student
    log_t = torch.log_softmax(teacher, dim=-1)
    grad = None
    if beta == 0:
        p_t = log_t.exp()
        per_token = (p_t * (log_t - log_s)).sum(-1)
        if want_grad:
            grad = log_s.exp().sub_(p_t)
    elif beta == 1:
        p_s = log_s.exp()
        ratio = log_s - log_t
        per_token = (p_s * ratio).sum(-1)
        if want_grad:
            grad = ratio.sub_(per_token[:, None]).mul_(p_s)
    else:
        log_m = torch.logaddexp(log_s + math.log1p(-beta), log_t + math.log(beta))
        p_s = log_s.exp()
        per_token = beta * (log_t.exp() * (log_t - log_m)).sum(-1) + (1 - beta) * (p_s * (log_s - log_m)).sum(-1)
        if want_grad:
            g = log_m.neg_().add_(log_s).mul_(1 - beta)  # (1 - beta)(log p_s - log m), in log_m's memory
            grad = g.sub_((p_s * g).sum(-1, keepdim=True)).mul_(p_s)
    return per_token, grad, log_s, log_t


def _chunk_tokens(vocab: int) -> int:
    # a chunk holds ~6 [tokens, vocab] fp32 tensors at once (both models' logits, log-probs, the gradient), the
    # cross-entropy's ~2: a sixth of its tokens keeps the two losses' peaks alike (`make bench-distill`)
    return max(1, CHUNK_LOGITS // 6 // vocab)


class _ChunkedDivergenceSum(torch.autograd.Function):
    """Sum over tokens of the divergence between the student's (`hidden @ weight.T`) and the teacher's
    (`teacher_hidden @ teacher_weight.T`) distributions over the first `vocab` columns; gradients for the
    student's hidden states and head made in the same pass (token_loss._ChunkedCrossEntropySum's scheme).
    `stats` (a [2] fp32 tensor) gets the sums of the student's and teacher's log-probs of `targets` and nothing
    else; `per_token` ([tokens] fp32, optional) each token's divergence."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, teacher_hidden, teacher_weight, teacher_bias, targets, compute_dtype,
                transforms, beta, vocab, stats, per_token):
        want_hidden, want_weight, want_bias = ctx.needs_input_grad[:3]
        student_transform, teacher_transform = transforms
        total = torch.zeros((), device=hidden.device, dtype=torch.float32)
        grad_hidden = torch.empty_like(hidden) if want_hidden else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if want_weight else None
        grad_bias = torch.zeros_like(bias, dtype=torch.float32) if want_bias else None
        cast, teacher_cast = weight[:vocab].to(compute_dtype), teacher_weight[:vocab].to(compute_dtype)
        bias_v = bias[:vocab] if bias is not None else None
        teacher_bias_v = teacher_bias[:vocab] if teacher_bias is not None else None
        step = _chunk_tokens(vocab)
        want = want_hidden or want_weight or want_bias
        for start in range(0, hidden.shape[0], step):
            chunk = slice(start, start + step)
            student = _logits(hidden[chunk], cast, bias_v, compute_dtype, student_transform)
            slope = student_transform.derivative(student) if want else 1.0
            teacher = _logits(teacher_hidden[chunk], teacher_cast, teacher_bias_v, compute_dtype, teacher_transform)
            values, grad, log_s, log_t = chunk_divergence(student, teacher, beta, want)
            del teacher
            rows = torch.arange(values.shape[0], device=values.device)
            stats[0] += log_s[rows, targets[chunk]].sum()
            stats[1] += log_t[rows, targets[chunk]].sum()
            del log_s, log_t
            total += values.sum()
            if per_token is not None:
                per_token[chunk] = values
            if grad is None:
                continue
            if not isinstance(slope, float) or slope != 1.0:
                grad.mul_(slope)  # through the temperature, scale and softcap to lm_head's raw output
            if want_hidden:
                grad_hidden[chunk] = (grad.to(compute_dtype) @ cast).to(hidden.dtype)
            if want_weight:
                grad_weight[:vocab] += grad.t().to(compute_dtype).matmul(hidden[chunk].to(compute_dtype)).float()
            if want_bias:
                grad_bias[:vocab] += grad.sum(0)
        save_head_grads(ctx, hidden, weight, bias, grad_hidden, grad_weight, grad_bias)
        return total

    @staticmethod
    def backward(ctx, grad_total):
        return (*scaled_head_grads(ctx, grad_total), *(None,) * 10)


def divergence_sum(hidden: torch.Tensor, head: torch.nn.Linear, teacher_hidden: torch.Tensor, teacher_head: tuple,
                   labels: torch.Tensor, beta: float, transforms: tuple[LogitTransform, LogitTransform], vocab: int,
                   stats: torch.Tensor, per_position: torch.Tensor | None = None) -> torch.Tensor:
    """Sum over the target tokens (position t predicting labels[:, t + 1]) of the generalised JSD between the
    student (its final hidden states and lm_head) and the teacher (its final hidden states [rows, seq, hidden] and
    its head's (weight, bias), whole) -- 0-dim fp32, differentiable in the student's. `per_position` ([rows, seq]
    fp32): filled with each position's divergence (0 where no target)."""
    targets = shift(labels).reshape(-1)
    positions = (targets != IGNORE_INDEX).nonzero().squeeze(1)
    per_token = None
    if per_position is not None:
        per_token = torch.zeros(positions.shape[0], device=hidden.device, dtype=torch.float32)
    student_rows = hidden.reshape(-1, hidden.shape[-1]).index_select(0, positions)
    teacher_rows = teacher_hidden.reshape(-1, teacher_hidden.shape[-1]).index_select(0, positions)
    compute_dtype = _compute_dtype(hidden, head)
    with torch.autocast(hidden.device.type, enabled=False):
        total = _ChunkedDivergenceSum.apply(student_rows, _whole(head.weight), _whole(head.bias), teacher_rows,
                                            teacher_head[0], teacher_head[1], targets.index_select(0, positions),
                                            compute_dtype, transforms, beta, vocab, stats, per_token)
    if per_position is not None:
        per_position.view(-1)[positions] = per_token
    return total


# ---- the teacher ----

def _load_error(teacher: str, exc: Exception) -> DisttrainError:
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return DisttrainError(f"distill.teacher: {teacher} cannot be loaded ({first}): give a local directory or Hub id "
                          "of a causal LM")


def check_teacher(recipe, tokenizer) -> int:
    """Before any weight loads: the teacher's tokenizer and config read, the tokenizers equal (else one line naming
    both), and the vocabulary width both models' logits are compared over returned."""
    from transformers import AutoConfig, AutoTokenizer

    from disttrain.model.family import configs_of

    d, spec = recipe.distill, recipe.model
    try:
        theirs = AutoTokenizer.from_pretrained(d.teacher, revision=d.teacher_revision,
                                               trust_remote_code=spec.trust_remote_code)
        teacher_config = AutoConfig.from_pretrained(d.teacher, revision=d.teacher_revision,
                                                    trust_remote_code=spec.trust_remote_code)
        student_config = AutoConfig.from_pretrained(spec.name_or_path, revision=spec.revision,
                                                    trust_remote_code=spec.trust_remote_code)
    except (OSError, ValueError, KeyError) as exc:
        raise _load_error(d.teacher, exc) from None
    student_name = spec.tokenizer_name_or_path or spec.name_or_path
    if theirs.get_vocab() != tokenizer.get_vocab():
        raise DisttrainError(f"distill.teacher: {d.teacher}'s tokenizer ({len(theirs)} tokens) is not the student's "
                             f"({student_name}, {len(tokenizer)} tokens): distillation compares the two models' "
                             "distributions token by token, so they must share one tokenizer")
    widths = [next((c.vocab_size for c in configs_of(config) if getattr(c, "vocab_size", None)), None)
              for config in (student_config, teacher_config)]
    if None in widths:
        which = "the student" if widths[0] is None else d.teacher
        raise DisttrainError(f"distill.teacher: the vocabulary size of {which} is not in its config (vocab_size): a "
                             "causal LM is needed")
    common = min(widths)
    if common < len(tokenizer):
        raise DisttrainError(f"distill.teacher: {d.teacher} has {widths[1]} logits per token and the student "
                             f"{widths[0]}, fewer than the tokenizer's {len(tokenizer)} tokens")
    return common


class Teacher:
    """The frozen teacher, loaded and sharded like DPO's live reference (preference.live_reference), whose forward
    stops at its final hidden states: its lm_head returns them unprojected while `hidden_states` runs."""

    def __init__(self, accelerator, recipe):
        from disttrain.objectives.preference import frozen_model
        from disttrain.runtime.backends import has_gpu, shards_weights

        d, spec = recipe.distill, recipe.model
        self._temperature = d.loss_temperature
        teacher_spec = spec.model_copy(update={
            "name_or_path": d.teacher, "revision": d.teacher_revision, "dtype": d.teacher_dtype or spec.dtype,
            "tokenizer_name_or_path": None, "quantization": None, "router_aux_loss_coef": None,
            "router_balance": "micro_batch", "freeze": None})
        local_device = accelerator.local_process_index if has_gpu() else None
        self.accelerator = accelerator
        self.transform = LogitTransform()
        self._hidden: torch.Tensor | None = None
        self._capturing = False
        try:
            self.model = frozen_model(accelerator, recipe, teacher_spec, shards_weights(accelerator), local_device,
                                      self._install)
        except OSError as exc:
            raise _load_error(d.teacher, exc) from None

    def _install(self, model) -> None:
        """Before sharding: the head made to return the final hidden states (and the family's own transform
        neutralised while it runs: the divergence applies it, with distill.loss_temperature)."""
        self.head = output_projection(model)
        self.family = FamilyTransform(model)
        self.transform = replace(self.family.transform, temperature=self._temperature)

        plain_forward = self.head.forward

        def forward(hidden):  # the instance's forward (the state dict does not change)
            if not self._capturing:  # sampling (distill.seq_kd): the logits
                return plain_forward(hidden)
            self._hidden = hidden.detach()
            return hidden

        self.head.forward = torch.compiler.disable(forward)

    @torch.no_grad()
    def hidden_states(self, batch: dict) -> torch.Tensor:
        """[rows, seq, hidden] the teacher's final hidden states of the batch (eval mode, the run's autocast)."""
        self._capturing = True
        try:
            with self.accelerator.autocast(), self.family.neutralised():
                self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False)
        finally:
            self._capturing = False
        hidden, self._hidden = self._hidden, None
        return hidden

    @contextlib.contextmanager
    def head_weights(self):
        """The teacher head's (weight, bias), whole for the moment (a collective under FSDP2 and ZeRO-3: every rank
        asks at the same point of the student's forward)."""
        weight, bias = self.head.weight, self.head.bias
        if hasattr(weight, "ds_id"):  # ZeRO-3: partitioned to shape (0,)
            import deepspeed

            params = [p for p in (weight, bias) if p is not None]
            with deepspeed.zero.GatheredParameters(params):
                yield weight, bias
            return
        yield _whole(weight), _whole(bias) if bias is not None else None


# ---- the objective ----

class Distill:
    def __init__(self, recipe):
        self.recipe, self.cfg = recipe, recipe.distill
        self.prompts = all(s.format == "prompt" for s in recipe.data.all_sources())
        self.sampling = self.cfg.sampling()
        self.tokenizer = self.teacher = None
        self.vocab = None

    def model_kwargs(self, tokenizer) -> dict:
        """The causal LM as it is; the teacher's tokenizer and vocabulary checked first (before any weight loads)."""
        self.vocab = check_teacher(self.recipe, tokenizer)
        return {}

    def collator(self, tokenizer):
        self.tokenizer = tokenizer
        return PromptCollator() if self.prompts else Collator(tokenizer.pad_token_id)

    def loss(self, model) -> DistillLoss:
        return DistillLoss(model, self.cfg)

    def prepare(self, accelerator, model, loss, train_set, eval_sets, eval_loaders, collator) -> None:
        """The frozen teacher, sharded like the student."""
        from disttrain.runtime import guards

        guards.at("loading the teacher (distillation)")
        self.teacher = Teacher(accelerator, self.recipe)
        loss.attach_teacher(self.teacher, self.vocab)

    def source(self, step: int) -> str:
        """Where step `step`'s completions come from: the student with probability lmbda (drawn from the seed and
        the step), else the teacher (seq_kd) or the data."""
        draw = sampling.completion_seed(self.recipe.training.seed, step, -1, -1) / 2.0 ** 63
        if draw < self.cfg.lmbda:
            return "student"
        return "teacher" if self.cfg.seq_kd else "data"

    def steps(self, feed) -> DistillSteps:
        return DistillSteps(feed, self)


def _prompt_seed(tokens: list[int]) -> int:
    """A chat/alpaca row's number for its completion's seed: a hash of its prompt's tokens (its row in the data
    is not in the batch, and the tokens are the same wherever the row is read)."""
    digest = hashlib.blake2b(torch.tensor(tokens, dtype=torch.int64).numpy().tobytes(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class DistillSteps:
    """The step source of training.objective: distill (training/loop.StepSource): the feed's micro-batches, or
    rows of their prompts with completions sampled by the student or the teacher (Distill.source). The samples
    follow from the step and the rows, so the feed's own resume state is the whole of it."""

    def __init__(self, feed, objective: Distill):
        self.feed, self.objective = feed, objective
        self.total_steps, self.per_epoch = feed.total_steps, feed.per_epoch
        self.samplers: dict[str, RolloutWeights] = {}

    @property
    def rank_state(self):
        return self.feed.rank_state

    def restore(self, rank_state) -> None:
        self.feed.restore(rank_state)

    def windows(self, run, state):
        for window in self.feed.windows(run, state):
            source = self.objective.source(state.step)
            if source == "data":
                yield [_marked(batch, 0) for batch in window]
            else:
                yield self._sampled(run, window, source, state.step)

    def _prompts(self, batch: dict, step: int) -> tuple[list[list[int]], list[int]]:
        """(prompt ids, seeds) of a micro-batch's rows."""
        seed = self.objective.recipe.training.seed
        if "prompt_ids" in batch:
            rows = [int(i) for i in batch[PROMPT_INDEX]]
            return batch["prompt_ids"], [sampling.completion_seed(seed, step, row, 0) for row in rows]
        prompts = []
        for ids, labels in zip(batch["input_ids"].tolist(), batch["labels"].tolist()):
            first = next((t for t, label in enumerate(labels) if label != IGNORE_INDEX), len(labels))
            prompts.append(ids[:max(first, 1)])
        return prompts, [sampling.completion_seed(seed, step, _prompt_seed(p), 0) for p in prompts]

    def _sampled(self, run, window: list[dict], source: str, step: int) -> list[dict]:
        """The window's prompts with completions sampled in one generate() call per rank (every rank the same
        number of calls), laid out as training rows."""
        objective, accelerator = self.objective, run.accelerator
        laid = [self._prompts(batch, step) for batch in window]
        prompts = [p for ps, _ in laid for p in ps]
        seeds = [s for _, ss in laid for s in ss]
        model = run.model if source == "student" else objective.teacher.model
        weights = self.samplers.setdefault(source, RolloutWeights(accelerator, objective.sampling))
        tokenizer, cfg = objective.tokenizer, objective.sampling
        recipe = objective.recipe
        rows = recipe.training.micro_batch_size * recipe.training.grad_accum
        shape = (min(rows, cfg.rows_per_generate or rows), recipe.data.max_seq_len + cfg.max_completion_length)
        with contextlib.ExitStack() as stack:
            module, synced = stack.enter_context(weights.model(model, shape))
            stack.enter_context(accelerator.autocast())
            eos = rollout.eos_ids(tokenizer, module)
            calls = rollout.generate_calls(cfg, len(prompts))
            if synced:
                calls = int(accelerator.reduce(torch.tensor([float(calls)], device=accelerator.device), "max"))
            flat = rollout.sample(module, cfg, prompts, seeds, eos, tokenizer.pad_token_id, accelerator.device,
                                  synced, calls)
        batches, start = [], 0
        for batch_prompts, _ in laid:
            done = flat[start:start + len(batch_prompts)]
            start += len(batch_prompts)
            rows_of = rollout.training_rows(batch_prompts, done, tokenizer.pad_token_id, False, accelerator.device)
            batches.append(_marked({k: rows_of[k] for k in ("input_ids", "attention_mask", "labels", LENGTHS_KEY,
                                                              SQUARES_KEY)}, SOURCES.index(source)))
        return batches


def _marked(batch: dict, source: int) -> dict:
    rows = batch["input_ids"].shape[0]
    return {**batch, SOURCE_KEY: torch.full((rows,), source, dtype=torch.long, device=batch["input_ids"].device)}


# ---- the loss ----

class DistillLoss:
    """The loop's loss for training.objective: distill (objectives/base.Loss): `units` are the completion tokens;
    its engine is the chunked head with the divergence as what lm_head returns (training and evaluation)."""

    unit_name = "target_tokens"

    def __init__(self, model, cfg):
        self.engine = LossEngine(model, "chunked", training_head=self._training_head, eval_head=self._eval_head)
        self.head, self.cfg = self.engine.head, cfg
        self.transform = replace(self.engine.family.transform, temperature=cfg.loss_temperature)
        self.teacher: Teacher | None = None
        self.vocab = 0
        self._teacher_hidden: torch.Tensor | None = None
        self._last_ce: torch.Tensor | None = None
        self._window: torch.Tensor | None = None  # STATS sums since the last log line

    def attach_teacher(self, teacher: Teacher, vocab: int) -> None:
        self.teacher, self.vocab = teacher, vocab

    @property
    def checked(self) -> bool:
        return self.engine.checked

    def check_against_model(self, accelerator, model, batch: dict) -> None:
        """The student's chunked cross-entropy against its own loss (the head's projection is the one the
        divergence uses)."""
        saved = self.engine.eval_head
        self.engine.eval_head = None  # the plain per-token losses for the check
        try:
            self.engine.check_against_model(accelerator, model, {k: v for k, v in batch.items() if k != SOURCE_KEY})
        finally:
            self.engine.eval_head = saved

    def units(self, batch: dict) -> torch.Tensor:
        return count_targets(batch)

    @staticmethod
    def _inputs(batch: dict) -> dict:
        return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}

    def _divergence(self, hidden, labels, stats, per_position=None) -> torch.Tensor:
        with self.teacher.head_weights() as teacher_head:
            return divergence_sum(hidden, self.head, self._teacher_hidden, teacher_head, labels, self.cfg.beta,
                                  (self.transform, self.teacher.transform), self.vocab, stats, per_position)

    def _training_head(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        stats = torch.zeros(2, dtype=torch.float32, device=hidden.device)
        total = self._divergence(hidden, labels, stats)
        self._last = torch.stack([total.detach(), stats[0], stats[1]])
        return total

    def _eval_head(self, hidden: torch.Tensor, labels: torch.Tensor, shifted: bool) -> torch.Tensor:
        """[rows, seq] each position's divergence; the student's cross-entropy kept for eval_rows."""
        from disttrain.objectives.token_loss import chunked_token_losses

        self._last_ce = chunked_token_losses(hidden, self.head, labels)
        per_position = torch.zeros(labels.shape, dtype=torch.float32, device=hidden.device)
        self._divergence(hidden, labels, torch.zeros(2, dtype=torch.float32, device=hidden.device), per_position)
        return per_position

    def training_loss(self, model, batch: dict, num_items_in_batch) -> torch.Tensor:
        self._teacher_hidden = self.teacher.hidden_states(batch)
        try:
            out = self.engine.output(model, batch, self._inputs(batch))
        finally:
            self._teacher_hidden = None
        tokens = count_targets(batch).float()
        on_policy = tokens if int(batch[SOURCE_KEY][0]) == 1 else torch.zeros_like(tokens)
        stats = torch.cat([self._last.double(), torch.stack([tokens, on_policy]).double()])
        self._window = stats if self._window is None else self._window + stats
        return self.engine.with_router_loss(out.logits / num_items_in_batch, out, batch)

    def window_metrics(self, accelerator) -> dict:
        """Per completion token over every rank since the last log line (one all-reduce): the divergence, the
        student's and the teacher's log-probs of the tokens trained on, the on-policy share of those tokens."""
        local = self._window if self._window is not None else torch.zeros(len(STATS), dtype=torch.float64)
        total = accelerator.reduce(local.to(accelerator.device), reduction="sum")
        self._window = None
        tokens = max(float(total[3]), 1.0)
        return {"distill/divergence": float(total[0]) / tokens, "distill/student_logps": float(total[1]) / tokens,
                "distill/teacher_logps": float(total[2]) / tokens, "distill/on_policy": float(total[4]) / tokens}

    # ---- evaluation: the dataset's answers ----

    @torch.no_grad()
    def eval_rows(self, model, batch: dict, split: str = "eval") -> torch.Tensor:
        """Per dataset row: (divergence sum, answer tokens, the student's cross-entropy sum)."""
        self._teacher_hidden = self.teacher.hidden_states(batch)
        try:
            per_position = self.engine.output(model, batch, self._inputs(batch)).logits
        finally:
            self._teacher_hidden = None
        targets = batch["labels"][:, 1:]
        sums = _per_row_sums(per_position[:, :-1], targets, batch)
        return torch.cat([sums, self._last_ce[:, :-1].sum(-1, keepdim=True)], dim=1)

    def eval_record(self, sums: dict[str, torch.Tensor]) -> dict[str, float]:
        """eval_loss: the divergence per answer token over every eval set (eval_loss/<set> per set of a mixture);
        eval_nll: the student's cross-entropy of the answers."""
        total = sum(sums.values())
        tokens = max(float(total[1]), 1.0)
        record = {"eval_loss": float(total[0]) / tokens, "eval_nll": float(total[2]) / tokens}
        record.update({f"eval_loss/{name}": float(s[0]) / max(float(s[1]), 1.0) for name, s in sums.items()
                       if name != "eval"})
        return record
