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

from disttrain.data.collation import flattens_packed_rows
from disttrain.data.prompts import PROMPT_INDEX, PromptCollator
from disttrain.errors import DisttrainError
from disttrain.objectives import agent, rollout, sampling, vllm_engine
from disttrain.objectives.policy_loss import UNITS, clip_units, entropy_bonus, policy_loss, units
from disttrain.objectives.rewards import (Rewards, advantages, baselined, nanstd, reward_names, step_statistics,
                                          weighted_sum)
from disttrain.objectives.rl_metrics import RolloutWindow
from disttrain.objectives.rollout import (ADVANTAGES_KEY, ENGINE_KEY, MASK_KEY, OLD_KEY, PACKED_AT, REF_KEY,
                                          ROLLOUT_KEYS, SAMPLED_KEY, to_packed, to_padded)
from disttrain.objectives.token_loss import LossEngine, chunked_loss_sum, chunked_token_losses
from disttrain.objectives.tools import Toolbox
from disttrain.objectives.vllm_engine import engine_weights
from disttrain.runtime.backends import bare_model
from disttrain.runtime.rollout_weights import RolloutWeights


class GRPO:
    def __init__(self, recipe):
        self.recipe, self.rl = recipe, recipe.rl
        # imported now: a wrong module:function, a tool transformers cannot describe stop before the model loads
        self.toolbox = Toolbox(recipe.rl) if recipe.rl.agentic() else None
        self.rewards = Rewards(recipe.rl, self.toolbox.reward_name if self.toolbox else None)
        if not self.rewards.items:
            raise DisttrainError(f"rl.environment: {recipe.rl.environment} has no get_reward() and rl.rewards is "
                                 "empty: give at least one reward")
        if recipe.rl.engine == "vllm":  # the server answers, vLLM is here: known before the model loads
            vllm_engine.check(recipe.rl)
        self.tokenizer = self.accelerator = None

    @property
    def layout(self) -> dict:
        """The training rows' layout (rollout.training_rows): padding-free with data.packing; one row for
        flash-attention, whose kernel reads restarting position ids as sequences only at batch size 1."""
        packing = self.recipe.data.packing
        return {"padding_free": packing,
                "one_row": packing and flattens_packed_rows(self.recipe.model.attn_implementation)}

    def model_kwargs(self, tokenizer) -> dict:
        """The causal LM as it is; with tools, its chat template checked for them first."""
        if self.toolbox is not None:
            agent.check_template(tokenizer, self.recipe.model.tokenizer_name_or_path or self.recipe.model.name_or_path)
        return {}

    def collator(self, tokenizer) -> PromptCollator:
        self.tokenizer = tokenizer
        return PromptCollator()

    def loss(self, model) -> GRPOLoss:
        return GRPOLoss(model, self.rl, self.recipe.rl_reference(), self.rewards.names)

    def prepare(self, accelerator, model, loss, train_set, eval_sets, eval_loaders, collator) -> None:
        """The frozen reference when the KL term needs one and no adapters can be switched off; dropout off
        (rl.disable_dropout); reward models told where the run's weights live."""
        self.accelerator = accelerator
        self.rewards.prepare(accelerator)
        if self.rl.disable_dropout:
            self.without_dropout(model)
        if loss.reference == "model":
            from disttrain.objectives.preference import live_reference
            from disttrain.runtime.backends import has_gpu, shards_weights

            local_device = accelerator.local_process_index if has_gpu() else None
            reference, scorer = live_reference(accelerator, self.recipe, shards_weights(accelerator), local_device)
            scorer.head._disttrain_transform = replace(scorer.family.transform, temperature=self.rl.temperature)
            loss.attach_reference(reference, scorer, accelerator.autocast)

    @staticmethod
    def without_dropout(model) -> None:
        """Every dropout of the policy off, as TRL's disable_dropout_in_model (LoRA's is an nn.Dropout too)."""
        for module in model.modules():
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.0

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
        self.weights: RolloutWeights | None = None  # how the policy is held while it samples (made at the first)
        self.window: RolloutWindow | None = None
        self.engine = vllm_engine.VLLMEngine(self.rl) if self.rl.engine == "vllm" else None
        self._throwaway: list[int] | None = None  # a prompt for a rank's throwaway generate rows
        self.engine_logps: dict = {}  # rl.engine: vllm -- {(micro-batch, prompt): the server's log-probs}
        self.trajectories: dict = {}  # rl.tools: {(micro-batch, prompt): its completions' agent.Trajectory}
        train_set = getattr(feed, "train_set", None)
        if train_set is not None and len(train_set):
            first = json.loads(train_set[0]["record"])
            columns = set(first) - {"prompt"} | ({"environments"} if objective.toolbox else set())
            objective.rewards.check_columns(columns, objective.recipe.data.path or "data.sources")
            if objective.toolbox is not None and not isinstance(first["prompt"], list):
                raise DisttrainError(f"rl.tools: {objective.recipe.data.path or 'data.sources'} has plain-text "
                                     "prompts; tool calls need chat prompts (a list of messages ending with the "
                                     "user's turn) for the chat template to list the tools in")

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
                micro_batches = self._rollout(run, prompt_batches, batch, state)
            self.pending = (batch, micro_batches)
            for _ in range(first, self.iterations):
                yield micro_batches
            prompts_state.step += 1

    def _rollout(self, run, prompt_batches: list[dict], batch: int, state) -> list[dict]:
        """Sample, score and lay out one step's prompt batches (every rank: the same number of generate calls)."""
        accelerator, model, loss = run.accelerator, run.model, run.loss
        tokenizer, rl, group = self.objective.tokenizer, self.rl, self.rl.num_generations
        self.window = loss.window  # where the reward functions' log_metric values go
        self.weights = self.weights or RolloutWeights(accelerator, rl)
        progress = SimpleNamespace(global_step=state.step, epoch=state.epoch, max_steps=self.total_steps)
        if self.weights.collective:  # the clock starts when every rank is here: waiting for one still writing the
            accelerator.wait_for_everyone()  # last step's log line is not sampling (the gathers would wait anyway)
        clock = [time.perf_counter(), 0.0, 0.0]  # (start of the current phase, sampling seconds, scoring seconds)
        groups = [(m, k, 0) for m, p in enumerate(prompt_batches) for k in range(len(p["prompt_ids"]))]
        if self.objective.toolbox is not None:
            self.objective.toolbox.rewind()
        done = self._sample(run, prompt_batches, batch, groups, state.step)
        sampled = [[done[m, k] for k in range(len(p["prompt_ids"]))] for m, p in enumerate(prompt_batches)]
        _lap(clock, 1)
        scored = [self._score(m, p, c, batch, progress) for m, (p, c) in enumerate(zip(prompt_batches, sampled))]
        _lap(clock, 2)
        resampled = self._resample_flat_groups(run, prompt_batches, batch, progress, sampled, scored, clock)
        all_rows = []
        for m, (prompts, completions) in enumerate(zip(prompt_batches, sampled)):
            flat = [c for g in completions for c in g]
            prompt_of = [ids for ids in prompts["prompt_ids"] for _ in range(group)]
            logps = [lp for k in range(len(completions)) for lp in self.engine_logps[m, k]] if self.engine else None
            played = policy = None
            if self.objective.toolbox:  # rl.tools: each trajectory's own prompt (its environment's reset adds to it)
                played = [t for k in range(len(completions)) for t in self.trajectories[m, k]]
                prompt_of, policy = [t.prompt_ids for t in played], [t.policy for t in played]
            all_rows.append((flat, rollout.training_rows(prompt_of, flat, tokenizer.pad_token_id,
                                                         rl.mask_truncated_completions, accelerator.device, logps,
                                                         policy, **self.objective.layout), played))
        statistics = self._step_statistics(run, scored, [rows for _, rows, _ in all_rows])
        micro_batches = []
        for (flat, rows, played), (table, _, _) in zip(all_rows, scored):
            rows[ADVANTAGES_KEY], rewards = advantages(table, self.objective.rewards.weights, group, rl.advantage,
                                                       rl.reward_scale, statistics)
            rows[ADVANTAGES_KEY] = rows[ADVANTAGES_KEY].to(accelerator.device)
            loss.before_training(model, rows, self.iterations > 1 or self.engine is not None)
            loss.window.add_rollout(table, rewards, flat, group, played)
            micro_batches.append(rows)
        loss.window.add_times(clock[1], clock[2], resampled)
        loss.window.keep_samples(tokenizer, prompt_batches[0], sampled[0], scored[0][1], scored[0][2])
        return micro_batches

    def _step_statistics(self, run, scored: list, rows: list[dict]):
        """rl.scale_rewards=batch: the statistics of the step's completions on every data rank (rewards.py)."""
        rl, group = self.rl, self.rl.num_generations
        if rl.reward_scale != "batch":
            return None
        summed = torch.cat([s[1] for s in scored])
        values = summed if rl.advantage == "grpo" else baselined(summed, group, rl.advantage)
        tokens = torch.cat([r[MASK_KEY].sum(-1).cpu() for r in rows])
        both = _on_data_ranks(run.accelerator, torch.stack([values, tokens], dim=1), run.plan).view(-1, 2)
        return step_statistics(rl.advantage, "batch", both[:, 0], both[:, 1])

    def _sample(self, run, prompt_batches: list[dict], batch: int, groups: list[tuple[int, int, int]],
                step: int) -> dict:
        """{(micro-batch, prompt): its num_generations completions} for `groups` -- (micro-batch, prompt in it,
        attempt) -- sampled in one rollout. Attempt a of a prompt draws its completions a x num_generations on."""
        group, seed = self.rl.num_generations, run.recipe.training.seed
        prompts, seeds = [], []
        for m, k, attempt in groups:
            row = int(prompt_batches[m][PROMPT_INDEX][k])
            prompts += [prompt_batches[m]["prompt_ids"][k]] * group
            seeds += [sampling.completion_seed(seed, batch, row, attempt * group + g) for g in range(group)]
        if self.engine is not None:
            return self._sample_on_server(run, prompts[::group], seeds[::group], groups, step)
        self._throwaway = prompt_batches[0]["prompt_ids"][0]  # nothing to (re)do here while others do: a throwaway
        if self.objective.toolbox is not None:
            return self._play(run, prompt_batches, groups, seeds)
        with self._policy(run) as generate:
            flat = generate(prompts, seeds, None)
        return {(m, k): flat[i * group:(i + 1) * group] for i, (m, k, _) in enumerate(groups)}

    @contextlib.contextmanager
    def _policy(self, run):
        """generate(prompts, seeds, max_new_tokens) -> [(ids, truncated)] from the current policy, in eval mode
        under the run's autocast, held as RolloutWeights decides. Where generate() is synced the ranks agree on
        its calls (a resampling round or a turn of tool calls has more rows on some ranks, none on others: there
        a throwaway row keeps the rank in step); `generate.synced` and `generate.eos` (where turns end) tell the
        caller."""
        accelerator, rl, tokenizer = run.accelerator, self.rl, self.objective.tokenizer
        with contextlib.ExitStack() as stack:
            module, synced = stack.enter_context(self.weights.model(run.model, self._decode_shape()))
            stack.enter_context(accelerator.autocast())
            eos = rollout.eos_ids(tokenizer, module)

            def generate(prompts: list[list[int]], seeds: list[int], max_new_tokens: int | None) -> list:
                calls = rollout.generate_calls(rl, len(prompts)) if prompts else 0
                if synced:
                    calls = int(accelerator.reduce(torch.tensor([float(calls)], device=accelerator.device), "max"))
                rows = len(prompts)
                if not calls:
                    return []
                if not prompts:
                    prompts, seeds = [self._throwaway], [0]
                flat = rollout.sample(module, rl, prompts, seeds, eos, tokenizer.pad_token_id, accelerator.device,
                                      synced, calls, max_new_tokens)
                return flat[:rows]

            generate.synced, generate.eos = synced, eos
            yield generate

    def _play(self, run, prompt_batches: list[dict], groups: list[tuple[int, int, int]], seeds: list[int]) -> dict:
        """rl.tools: each completion played as a trajectory of turns and tool calls (agent.py); {(micro-batch,
        prompt): its completions} as _sample, the trajectories kept in self.trajectories."""
        accelerator, group, toolbox = run.accelerator, self.rl.num_generations, self.objective.toolbox
        played = []
        environments = iter(toolbox.instances(len(groups) * group))
        for i, (m, k, _) in enumerate(groups):
            record = json.loads(prompt_batches[m]["record"][k])
            row = int(prompt_batches[m][PROMPT_INDEX][k])
            prompt = None
            for g in range(group):
                environment = next(environments)
                if environment is not None or prompt is None:  # without reset() text, one rendering per prompt
                    prompt = self._agent_prompt(record, environment, row)
                played.append(agent.Trajectory(prompt, seeds[i * group + g], toolbox.callables(environment),
                                               environment))
        with self._policy(run) as generate:
            def more(rows: int) -> bool:
                if not generate.synced:
                    return rows > 0
                return float(accelerator.reduce(torch.tensor([float(rows)], device=accelerator.device), "max")) > 0

            agent.roll_out(played, generate, more, self.objective.tokenizer, toolbox, self.rl, generate.eos)
        done = {}
        for i, (m, k, _) in enumerate(groups):
            self.trajectories[m, k] = played[i * group:(i + 1) * group]
            done[m, k] = [t.completion for t in self.trajectories[m, k]]
        return done

    def _agent_prompt(self, record: dict, environment, row: int) -> list[int]:
        """A trajectory's prompt: the record's messages (its environment's reset() text appended to the user's
        last turn) rendered with the tools listed, as TRL renders it."""
        messages = [dict(m) for m in record["prompt"]]
        if environment is not None:
            try:
                observation = environment.reset(**record)
            except Exception as exc:
                raise DisttrainError(f"rl.environment: reset() raised {type(exc).__name__}: {str(exc)[:200]} on "
                                     f"training row {row}") from None
            if observation is not None:
                messages[-1]["content"] = (messages[-1].get("content") or "") + str(observation)
        tokenizer, limit = self.objective.tokenizer, self.objective.recipe.data.max_seq_len
        try:
            ids = list(tokenizer.apply_chat_template(messages, tools=self.objective.toolbox.schemas, tokenize=True,
                                                     add_generation_prompt=True, return_dict=False))
        except Exception as exc:
            raise DisttrainError(f"training row {row}: the chat template refused the prompt with its tools: "
                                 f"{str(exc).strip()[:200]}") from None
        if len(ids) > limit:
            raise DisttrainError(f"training row {row}: the prompt has {len(ids)} tokens with its tools listed, over "
                                 f"data.max_seq_len={limit}: raise data.max_seq_len")
        return ids

    def _sample_on_server(self, run, prompts: list[list[int]], seeds: list[int], groups: list, step: int) -> dict:
        """rl.engine: vllm -- the weights pushed when an optimizer step changed them (every rank joins the gather),
        then each prompt's completions from the server, its log-probs kept for the correction."""
        if self.engine.pushed_at != step:
            with self.weights.model(run.model, (1, 1), whole=True) as (module, _):
                self.engine.push(run.accelerator, module, step)
        eos = rollout.eos_ids(self.objective.tokenizer, bare_model(run.accelerator, run.model))
        done = {}
        for (m, k, _), sampled in zip(groups, self.engine.sample(prompts, seeds, eos) if prompts else []):
            done[m, k] = [(ids, truncated) for ids, truncated, _ in sampled]
            self.engine_logps[m, k] = [logps for _, _, logps in sampled]
        return done

    def _resample_flat_groups(self, run, prompt_batches, batch, progress, sampled, scored, clock) -> int:
        """DAPO's dynamic sampling (rl.dynamic_sampling rounds at most): a group whose rewards are all equal
        (no signal) is sampled again with fresh seeds, round after round while any rank has one. Each group's
        fate depends on its own completions only, so every strategy still equals one process. Returns the
        groups resampled at least once."""
        redone, group = set(), self.rl.num_generations
        for attempt in range(1, self.rl.dynamic_sampling + 1):
            flat = [(m, k) for m, (_, summed, _) in enumerate(scored) for k in range(len(summed) // group)
                    if _zero_std(summed[k * group:(k + 1) * group])]
            if run.accelerator.num_processes > 1:
                count = torch.tensor([float(len(flat))], device=run.accelerator.device)
                if float(run.accelerator.reduce(count, reduction="sum")) == 0:
                    break
            elif not flat:
                break
            done = self._sample(run, prompt_batches, batch, [(m, k, attempt) for m, k in flat],
                                progress.global_step)
            for (m, k), completions in done.items():
                sampled[m][k] = completions
            redone |= set(flat)
            _lap(clock, 1)
            for m in sorted({m for m, _ in flat}):
                scored[m] = self._score(m, prompt_batches[m], sampled[m], batch, progress)
            _lap(clock, 2)
        return len(redone)

    def _decode_shape(self) -> tuple[int, int]:
        """(rows per generate call, tokens per row) at most: what a rollout's KV cache may hold. The same on every
        rank (the recipe's bounds, not this rank's prompts), so the ranks decide alike how to hold the model."""
        recipe = self.objective.recipe
        rows = recipe.training.micro_batch_size * recipe.training.grad_accum * self.rl.num_generations
        return min(rows, self.rl.rows_per_generate or rows), recipe.data.max_seq_len + self.rl.max_completion_length

    def _score(self, m: int, prompts: dict, completions: list[list[tuple]], batch: int,
               progress) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """([completions, functions] rewards, their weighted sums, the functions' log_extra columns) of prompt
        micro-batch `m`. With tools a completion is its messages (the assistant's turns and the tools' replies, as
        TRL passes them) and the functions are given each completion's environment instance (`environments`)."""
        tokenizer, group, window = self.objective.tokenizer, self.rl.num_generations, self.window
        records = [json.loads(r) for r in prompts["record"]]
        texts = [tokenizer.decode(ids, skip_special_tokens=True) for g in completions for ids, _ in g]
        chat = [isinstance(r["prompt"], list) for r in records]
        flat_records = [r for r in records for _ in range(group)]
        columns = {k: [r.get(k) for r in flat_records] for k in records[0] if k != "prompt"}
        rows = [int(i) for i in prompts[PROMPT_INDEX] for _ in range(group)]
        answers = [[{"role": "assistant", "content": t}] if chat[i // group] else t for i, t in enumerate(texts)]
        if self.objective.toolbox is not None:
            played = [t for k in range(len(completions)) for t in self.trajectories[m, k]]
            answers = [t.messages or [{"role": "assistant", "content": ""}] for t in played]
            if self.objective.toolbox.environment is not None:
                columns["environments"] = [t.environment for t in played]
        extra: dict[str, list] = {}
        table = self.objective.rewards.score(
            prompts=[r["prompt"] for r in flat_records],
            completions=answers,
            completion_ids=[ids for g in completions for ids, _ in g], columns=columns,
            where=lambda i: f"completion {i % group} of training row {rows[i]} (prompt batch {batch})",
            extras={"trainer_state": progress, "log_metric": window.log_metric,
                    "log_extra": lambda column, values: extra.setdefault(column, []).extend(values)})
        return table, weighted_sum(table, self.objective.rewards.weights), extra


def _lap(clock: list, slot: int) -> None:
    """Adds the seconds since the phase began to clock[slot] and starts the next phase."""
    now = time.perf_counter()
    clock[slot] += now - clock[0]
    clock[0] = now


def _zero_std(rewards: torch.Tensor) -> bool:
    """A group with no signal: its scored rewards all equal (TRL's isclose(nanstd, 0))."""
    return bool(torch.isclose(nanstd(rewards.double()), torch.zeros((), dtype=torch.float64)))


def _on_data_ranks(accelerator, values: torch.Tensor, plan) -> torch.Tensor:
    """`values` of every data rank, concatenated (processes sharing a batch counted once)."""
    gathered = accelerator.gather(values.to(accelerator.device)).cpu()
    group = plan.group if plan is not None else 1
    return gathered.view(accelerator.num_processes, -1)[::group].reshape(-1)


class GRPOLoss:
    """The loop's loss for training.objective: grpo (objectives/base.Loss). `units`: rl.loss's (policy_loss.UNITS).
    Its engine is the chunked head with the policy loss as what lm_head returns in training."""

    def __init__(self, model, rl, reference: str, names: list[str] | None = None):
        self.engine = LossEngine(model, "chunked", training_head=self._training_head)
        self.head, self.rl, self.reference = self.engine.head, rl, reference
        self.unit_name = UNITS[rl.loss]
        self.sampling = replace(self.engine.family.transform, temperature=rl.temperature)
        self.head._disttrain_transform = self.sampling
        self.window = RolloutWindow(names or reward_names(rl), clip_units(rl), agentic=rl.agentic())
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
        if PACKED_AT in batch:  # padding-free: no mask, sequences apart by their position ids
            return {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"]}
        return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}

    def training_loss(self, model, batch: dict, num_items_in_batch) -> torch.Tensor:
        self._batch, self._num_items = batch, num_items_in_batch
        try:
            out = self.engine.output(model, batch, self._inputs(batch))
        finally:
            self._batch = None
        return self.engine.with_router_loss(out.logits / num_items_in_batch, out, batch)  # MoE: the router loss, as SFT

    def _training_head(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        batch = self._batch
        at = batch.get(PACKED_AT)  # padding-free rows: the loss reads the padded layout (rollout.to_padded)
        entropies = torch.zeros(labels.shape, dtype=torch.float32, device=hidden.device)
        logps = to_padded(-chunked_token_losses(hidden.detach(), self.head, labels, entropies=entropies), at)
        entropies = to_padded(entropies, at)
        leaf = logps.detach().requires_grad_()
        with torch.enable_grad():
            total, stats = policy_loss(self.rl, leaf, batch[MASK_KEY], batch[ADVANTAGES_KEY], batch.get(OLD_KEY),
                                       batch.get(REF_KEY), self.rl.max_completion_length, batch.get(ENGINE_KEY))
        (grad,) = torch.autograd.grad(total, leaf)
        mask = batch[MASK_KEY]
        self.window.add_policy(stats, (entropies * mask).sum())
        bonus, entropy_weights = None, None
        if self.rl.entropy_coef:  # a mean of its own: scaled by the units the loop divides the head's output by
            bonus = entropy_bonus(self.rl, entropies, mask) * self._num_items
            entropy_weights = -self.rl.entropy_coef * self._num_items * mask / mask.sum().clamp(min=1.0)
        if entropy_weights is not None:
            entropy_weights = to_packed(entropy_weights, at, labels.shape)
        surrogate = chunked_loss_sum(hidden, self.head, labels, position_weights=to_packed(-grad, at, labels.shape),
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
            return to_padded(-(engine or self.engine).output(model, batch, self._inputs(batch)).logits,
                             batch.get(PACKED_AT))
        finally:
            model.train(was_training)

    def attach_reference(self, model, scorer: LossEngine, autocast) -> None:
        self._reference = (model, scorer, autocast)

    def before_training(self, model, batch: dict, old_policy: bool) -> None:
        """What a batch needs before its first update: the old policy's log-probs (rl.num_iterations > 1), the
        reference's (rl.beta > 0)."""
        if old_policy:
            batch[OLD_KEY] = self.token_logps(model, batch)
        sampled = batch.pop(SAMPLED_KEY, None)  # rl.engine: vllm -- the server's log-probs, to correct by
        if sampled is not None and self.rl.vllm.importance_sampling != "off":
            batch[ENGINE_KEY] = engine_weights(batch[OLD_KEY], sampled, batch[MASK_KEY], self.rl.vllm)
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
