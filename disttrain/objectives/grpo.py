"""Online RL (training.objective: grpo): before each batch of prompts is trained on, the current policy samples
rl.num_generations completions of every prompt (rollout.py), the reward functions score them (rewards.py), the
advantages are taken within each prompt's group, and the policy-gradient loss of policy_loss.py is minimised on
them -- rl.num_iterations optimizer steps per batch of completions. The loop does not change: the objective's
step source (Rollouts) makes each step's micro-batches, and its loss (GRPOLoss) is called like SFT's.

How the gradient is made without full-vocabulary logits, as for DPO (preference.py): inside lm_head's forward
the per-token log-probs of the completion tokens are computed chunk by chunk without gradients (with each
token's entropy, for the metrics), the loss and its derivative with respect to each token's log-prob are taken
on those numbers, and a second chunked pass makes the gradient of sum_t w_t log p_t with those weights. Log-probs
are taken at the sampling temperature (the logits divided by it), as TRL takes them.

The reference of the KL term (rl.beta > 0): LoRA -> the same model with its adapters disabled; full fine-tuning
-> a frozen copy of the initial weights sharded like the policy (preference.live_reference).
"""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import replace
from types import SimpleNamespace

import torch

from disttrain.data.prompts import PROMPT_INDEX, PromptCollator
from disttrain.errors import DisttrainError
from disttrain.objectives import rollout
from disttrain.objectives.policy_loss import STATS, UNITS, entropy_bonus, policy_loss, units
from disttrain.objectives.rewards import Rewards, advantages, reward_names, weighted_sum
from disttrain.objectives.rollout import ADVANTAGES_KEY, MASK_KEY, OLD_KEY, REF_KEY, ROLLOUT_KEYS
from disttrain.objectives.token_loss import LossEngine, chunked_loss_sum, chunked_token_losses
from disttrain.runtime.backends import generating

SAMPLES_LOGGED = 2  # completions of a step's first prompt kept for the metrics line (with their rewards)


class GRPO:
    def __init__(self, recipe):
        self.recipe, self.rl = recipe, recipe.rl
        self.rewards = Rewards(recipe.rl)  # imported now: a wrong module:function stops before the model loads
        self.tokenizer = self.accelerator = None

    def model_kwargs(self, tokenizer) -> dict:
        """The causal LM as it is."""
        return {}

    def collator(self, tokenizer) -> PromptCollator:
        self.tokenizer = tokenizer
        return PromptCollator()

    def loss(self, model) -> GRPOLoss:
        return GRPOLoss(model, self.rl, self.recipe.rl_reference())

    def prepare(self, accelerator, model, loss, train_set, eval_sets, eval_loaders, collator) -> None:
        """The frozen reference when the KL term needs one and no adapters can be switched off."""
        self.accelerator = accelerator
        if loss.reference == "model":
            from disttrain.objectives.preference import live_reference
            from disttrain.runtime.backends import has_gpu, shards_weights

            local_device = accelerator.local_process_index if has_gpu() else None
            reference, scorer = live_reference(accelerator, self.recipe, shards_weights(accelerator), local_device)
            scorer.head._disttrain_transform = replace(scorer.family.transform, temperature=self.rl.temperature)
            loss.attach_reference(reference, scorer, accelerator.autocast)

    def steps(self, feed) -> Rollouts:
        """Each step's micro-batches rolled out from the feed's prompt batches."""
        return Rollouts(feed, self)


class Rollouts:
    """The step source of training.objective: grpo (training/loop.StepSource): for each of the feed's prompt
    batches, completions sampled, scored and made into training rows, trained on rl.num_iterations times. With
    more than one iteration the completions being trained on are this rank's resume state (saved in every
    checkpoint): a run stopped between two iterations resumes on the same completions."""

    def __init__(self, feed, objective: GRPO):
        self.feed, self.objective, self.rl = feed, objective, objective.rl
        self.iterations = self.rl.num_iterations
        self.total_steps = feed.total_steps * self.iterations
        self.per_epoch = feed.per_epoch * self.iterations
        self.pending: tuple[int, list[dict]] | None = None  # (prompt batch, its micro-batches) being trained on
        train_set = getattr(feed, "train_set", None)
        if train_set is not None and len(train_set):
            columns = set(json.loads(train_set[0]["record"])) - {"prompt"}
            objective.rewards.check_columns(columns, objective.recipe.data.path or "data.sources")

    @property
    def rank_state(self):
        return self._state_dict if self.iterations > 1 else self.feed.rank_state

    def _state_dict(self) -> dict:
        batch, micro_batches = self.pending
        return {"prompt_batch": batch, "micro_batches": [
            {k: {"values": v.tolist(), "dtype": str(v.dtype).removeprefix("torch.")} for k, v in b.items()}
            for b in micro_batches]}

    def restore(self, rank_state: dict) -> None:
        if self.iterations == 1:
            self.feed.restore(rank_state)
            return
        self.pending = (rank_state["prompt_batch"], [
            {k: torch.tensor(v["values"], dtype=getattr(torch, v["dtype"])) for k, v in b.items()}
            for b in rank_state["micro_batches"]])

    def windows(self, run, state):
        prompts_state = SimpleNamespace(step=state.step // self.iterations, epoch=state.epoch)
        for prompt_batches in self.feed.windows(run, prompts_state):
            state.epoch = prompts_state.epoch
            batch, first = prompts_state.step, state.step % self.iterations
            if first and self.pending is not None and self.pending[0] == batch:  # resumed between iterations
                micro_batches = [{k: v.to(run.accelerator.device) for k, v in b.items()} for b in self.pending[1]]
            elif first:
                raise DisttrainError(f"resuming at step {state.step} (iteration {first + 1} of rl.num_iterations="
                                     f"{self.iterations}) needs the completions saved with the checkpoint, which "
                                     "it does not hold: resume from another checkpoint")
            else:
                micro_batches = self._rollout(run, prompt_batches, batch)
            self.pending = (batch, micro_batches)
            for _ in range(first, self.iterations):
                yield micro_batches
            prompts_state.step += 1

    def _rollout(self, run, prompt_batches: list[dict], batch: int) -> list[dict]:
        """Sample, score and lay out one step's prompt batches (every rank: the same number of generate calls)."""
        accelerator, model, loss = run.accelerator, run.model, run.loss
        tokenizer, rl = self.objective.tokenizer, self.rl
        started = time.perf_counter()
        sampled = []
        with contextlib.ExitStack() as stack:  # the bare model in eval mode, under the run's autocast
            module = stack.enter_context(generating(accelerator, model))
            stack.enter_context(accelerator.autocast())
            eos = rollout.eos_ids(tokenizer, module)
            synced = accelerator.num_processes > 1
            for prompts in prompt_batches:
                seeds = [rollout.completion_seed(run.recipe.training.seed, batch, int(i))
                         for i in prompts[PROMPT_INDEX]]
                sampled.append([rollout.sample(module, rl, ids, seed, eos, tokenizer.pad_token_id, accelerator.device,
                                               synced) for ids, seed in zip(prompts["prompt_ids"], seeds)])
        generated = time.perf_counter()
        scored = [self._score(prompts, completions, batch) for prompts, completions in zip(prompt_batches, sampled)]
        summed = torch.cat([s[1] for s in scored])
        batch_std = _batch_std(accelerator, summed, run.plan) if rl.scale_rewards == "batch" else None
        micro_batches = []
        for prompts, completions, (table, _) in zip(prompt_batches, sampled, scored):
            flat = [c for group in completions for c in group]
            prompt_of = [ids for ids in prompts["prompt_ids"] for _ in range(rl.num_generations)]
            rows = rollout.training_rows(prompt_of, flat, tokenizer.pad_token_id, rl.mask_truncated_completions,
                                         accelerator.device)
            rows[ADVANTAGES_KEY], rewards = advantages(table, self.objective.rewards.weights, rl.num_generations,
                                                       rl.scale_rewards, batch_std)
            rows[ADVANTAGES_KEY] = rows[ADVANTAGES_KEY].to(accelerator.device)
            loss.before_training(model, rows, self.iterations > 1)
            loss.window.add_rollout(table, rewards, flat, rl.num_generations)
            micro_batches.append(rows)
        loss.window.add_times(generated - started, time.perf_counter() - generated)
        loss.window.keep_samples(tokenizer, prompt_batches[0], sampled[0], scored[0][1])
        return micro_batches

    def _score(self, prompts: dict, completions: list[list[tuple]], batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """([completions, functions] rewards, their weighted sums) of one prompt micro-batch."""
        tokenizer, group = self.objective.tokenizer, self.rl.num_generations
        records = [json.loads(r) for r in prompts["record"]]
        texts = [tokenizer.decode(ids, skip_special_tokens=True) for g in completions for ids, _ in g]
        chat = [isinstance(r["prompt"], list) for r in records]
        flat_records = [r for r in records for _ in range(group)]
        columns = {k: [r.get(k) for r in flat_records] for k in records[0] if k != "prompt"}
        rows = [int(i) for i in prompts[PROMPT_INDEX] for _ in range(group)]
        table = self.objective.rewards.score(
            prompts=[r["prompt"] for r in flat_records],
            completions=[[{"role": "assistant", "content": t}] if chat[i // group] else t for i, t in enumerate(texts)],
            completion_ids=[ids for g in completions for ids, _ in g], columns=columns,
            where=lambda i: f"completion {i % group} of training row {rows[i]} (prompt batch {batch})")
        return table, weighted_sum(table, self.objective.rewards.weights)


def _batch_std(accelerator, summed: torch.Tensor, plan) -> torch.Tensor:
    """The std of the step's summed rewards on every data rank (processes sharing a batch counted once)."""
    from disttrain.objectives.rewards import nanstd

    gathered = accelerator.gather(summed.to(accelerator.device)).cpu()
    group = plan.group if plan is not None else 1
    per_process = gathered.view(accelerator.num_processes, -1)[::group]
    return nanstd(per_process.reshape(-1))


class GRPOLoss:
    """The loop's loss for training.objective: grpo (objectives/base.Loss). `units`: rl.loss's (policy_loss.UNITS).
    Its engine is the chunked head with the policy loss as what lm_head returns in training."""

    def __init__(self, model, rl, reference: str):
        self.engine = LossEngine(model, "chunked", training_head=self._training_head)
        self.head, self.rl, self.reference = self.engine.head, rl, reference
        self.unit_name = UNITS[rl.loss]
        self.sampling = replace(self.engine.family.transform, temperature=rl.temperature)
        self.head._disttrain_transform = self.sampling
        self.window = RolloutWindow(reward_names(rl))
        self._batch: dict | None = None
        self._num_items = 1.0  # the loop's denominator of the micro-batch being trained on
        self._reference = None

    @property
    def checked(self) -> bool:
        return self.engine.checked

    def check_against_model(self, accelerator, model, batch: dict) -> None:
        """The engine's token loss against the model's own (at temperature 1, the model's own logits)."""
        self.head._disttrain_transform = self.engine.family.transform
        try:
            self.engine.check_against_model(accelerator, model, {k: v for k, v in batch.items()
                                                                 if k not in ROLLOUT_KEYS})
        finally:
            self.head._disttrain_transform = self.sampling

    def units(self, batch: dict) -> torch.Tensor:
        return units(self.rl.loss, batch[MASK_KEY])

    @staticmethod
    def _inputs(batch: dict) -> dict:
        return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}

    def training_loss(self, model, batch: dict, num_items_in_batch) -> torch.Tensor:
        self._batch, self._num_items = batch, num_items_in_batch
        try:
            out = self.engine.output(model, batch, self._inputs(batch))
        finally:
            self._batch = None
        return self.engine.with_router_loss(out.logits / num_items_in_batch, out)  # MoE: the router loss, as SFT

    def _training_head(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        batch = self._batch
        entropies = torch.zeros(labels.shape, dtype=torch.float32, device=hidden.device)
        logps = -chunked_token_losses(hidden.detach(), self.head, labels, entropies=entropies)
        leaf = logps.detach().requires_grad_()
        with torch.enable_grad():
            total, stats = policy_loss(self.rl, leaf, batch[MASK_KEY], batch[ADVANTAGES_KEY], batch.get(OLD_KEY),
                                       batch.get(REF_KEY), self.rl.max_completion_length)
        (grad,) = torch.autograd.grad(total, leaf)
        mask = batch[MASK_KEY]
        self.window.add_policy(stats, (entropies * mask).sum())
        bonus, entropy_weights = None, None
        if self.rl.entropy_coef:  # a mean of its own: scaled by the units the loop divides the head's output by
            bonus = entropy_bonus(self.rl, entropies, mask) * self._num_items
            entropy_weights = -self.rl.entropy_coef * self._num_items * mask / mask.sum().clamp(min=1.0)
        surrogate = chunked_loss_sum(hidden, self.head, labels, position_weights=-grad,
                                     entropy_weights=entropy_weights)
        value = total.detach() + (bonus.detach() if bonus is not None else 0.0)
        return surrogate - surrogate.detach() + value  # the loss's value, the loss's gradient

    # ---- log-probs without gradients: the old policy's, the reference's ----

    @torch.no_grad()
    def token_logps(self, model, batch: dict, engine: LossEngine | None = None) -> torch.Tensor:
        """[rows, seq] log-probs at the positions predicting the labels (0 elsewhere), at the sampling
        temperature, in eval mode."""
        was_training = model.training
        model.eval()
        try:
            return -(engine or self.engine).output(model, batch, self._inputs(batch)).logits
        finally:
            model.train(was_training)

    def attach_reference(self, model, scorer: LossEngine, autocast) -> None:
        self._reference = (model, scorer, autocast)

    def before_training(self, model, batch: dict, old_policy: bool) -> None:
        """What a batch needs before its first update: the old policy's log-probs (rl.num_iterations > 1), the
        reference's (rl.beta > 0)."""
        if old_policy:
            batch[OLD_KEY] = self.token_logps(model, batch)
        if self.reference == "adapters":
            from accelerate.utils import extract_model_from_parallel

            with extract_model_from_parallel(model).disable_adapter():
                batch[REF_KEY] = self.token_logps(model, batch)
        elif self.reference == "model":
            reference, scorer, autocast = self._reference
            with autocast():
                batch[REF_KEY] = self.token_logps(reference, batch, scorer)

    def window_metrics(self, accelerator) -> dict:
        return self.window.metrics(accelerator)

    def eval_rows(self, model, batch: dict, split: str = "eval") -> torch.Tensor:
        raise DisttrainError("training.objective: grpo has no held-out evaluation")

    def eval_record(self, sums: dict) -> dict[str, float]:
        return {}


ROLLOUT_SUMS = ("completions", "reward", "reward_sq", "length", "truncated", "groups", "groups_zero_std")


class RolloutWindow:
    """What the rollouts and the policy loss add up between two log lines; one all-reduce of the sums and one of
    the maxima (lengths, times) when a line is written."""

    def __init__(self, names: list[str]):
        self.names, self.functions = names, len(names)
        self.reset()

    def reset(self) -> None:
        self.sums = torch.zeros(len(ROLLOUT_SUMS) + 3 * self.functions, dtype=torch.float64)  # host: the rollouts'
        self.policy: torch.Tensor | None = None  # the loss's STATS + entropy sum, left on the device until a line
        # the longest completion, minus the shortest, and this rank's rollout and scoring seconds (the slowest
        # rank's are reported)
        self.maxima = torch.tensor([float("-inf"), float("-inf"), 0.0, 0.0], dtype=torch.float64)
        self.steps = 0
        self.samples: list[dict] = []

    def add_rollout(self, table: torch.Tensor, summed: torch.Tensor, completions: list[tuple], group: int) -> None:
        lengths = torch.tensor([len(ids) for ids, _ in completions], dtype=torch.float64)
        grouped = summed.double().view(-1, group)
        zero_std = (grouped.std(dim=1, unbiased=False).nan_to_num(0.0) == 0).sum()
        values = [len(completions), summed.double().nansum(), (summed.double() ** 2).nansum(), lengths.sum(),
                  sum(t for _, t in completions), grouped.shape[0], zero_std]
        scored = ~torch.isnan(table)
        per_function = torch.cat([table.double().nan_to_num(0.0).sum(0), (table.double().nan_to_num(0.0) ** 2).sum(0),
                                  scored.sum(0).double()])
        self.sums += torch.cat([torch.tensor(values, dtype=torch.float64), per_function])
        self.maxima[:2] = torch.maximum(self.maxima[:2], torch.stack([lengths.max(), -lengths.min()]))

    def add_times(self, rollout_s: float, score_s: float) -> None:
        self.maxima[2:] += torch.tensor([rollout_s, score_s], dtype=torch.float64)
        self.steps += 1

    def add_policy(self, stats: torch.Tensor, entropy_sum: torch.Tensor) -> None:
        """Every micro-batch: summed on its device (a copy to the host would wait for the step's kernels)."""
        values = torch.cat([stats.detach(), entropy_sum.detach().double().reshape(1)])
        self.policy = values if self.policy is None else self.policy + values

    def keep_samples(self, tokenizer, prompts: dict, completions: list[list[tuple]], summed: torch.Tensor) -> None:
        prompt = tokenizer.decode(prompts["prompt_ids"][0])
        self.samples = [{"prompt": prompt, "completion": tokenizer.decode(ids), "reward": float(summed[i])}
                        for i, (ids, _) in enumerate(completions[0][:SAMPLES_LOGGED])]

    def metrics(self, accelerator) -> dict:
        """Means over every rank's completions (and tokens) since the last log line."""
        device = accelerator.device
        policy = self.policy if self.policy is not None else torch.zeros(len(STATS) + 1, dtype=torch.float64)
        sums = accelerator.reduce(torch.cat([self.sums.to(device), policy.to(device)]), reduction="sum").cpu()
        maxima = accelerator.reduce(self.maxima.to(device), reduction="max").cpu() if accelerator.num_processes > 1 \
            else self.maxima
        f = self.functions
        base = len(ROLLOUT_SUMS)
        policy = sums[base + 3 * f:]
        tokens = max(float(policy[0]), 1.0)
        record = {"entropy": float(policy[-1]) / tokens, "kl": float(policy[2]) / tokens,
                  "clip_ratio/low_mean": float(policy[3]) / tokens, "clip_ratio/high_mean": float(policy[4]) / tokens,
                  "clip_ratio/region_mean": float(policy[5]) / tokens}
        if float(sums[0]) > 0:  # completions sampled in this window (rl.num_iterations > 1: not at every step)
            record.update(self._rollout_metrics(sums, maxima))
        if accelerator.is_main_process and self.samples:
            record["completions"] = self.samples
        self.reset()
        return record

    def _rollout_metrics(self, sums: torch.Tensor, maxima: torch.Tensor) -> dict:
        f, base = self.functions, len(ROLLOUT_SUMS)
        n = float(sums[0])
        mean = float(sums[1]) / n
        record = {"reward": mean, "reward_std": max(float(sums[2]) / n - mean * mean, 0.0) ** 0.5,
                  "completions/mean_length": float(sums[3]) / n, "completions/max_length": float(maxima[0]),
                  "completions/min_length": -float(maxima[1]), "completions/clipped_ratio": float(sums[4]) / n,
                  "frac_reward_zero_std": float(sums[6]) / max(float(sums[5]), 1.0),
                  "rollout_s": float(maxima[2]) / max(self.steps, 1), "reward_s": float(maxima[3]) / max(self.steps, 1)}
        for j in range(f):  # each function over the completions it scored
            count = max(float(sums[base + 2 * f + j]), 1.0)
            mean_j = float(sums[base + j]) / count
            record[f"rewards/{self.names[j]}/mean"] = mean_j
            variance = float(sums[base + f + j]) / count - mean_j * mean_j
            record[f"rewards/{self.names[j]}/std"] = max(variance, 0.0) ** 0.5
        if self.steps:  # completion tokens of all ranks over the slowest rank's sampling time
            record["rollout_tokens_per_s"] = float(sums[3]) / max(float(maxima[2]), 1e-9)
        return record
