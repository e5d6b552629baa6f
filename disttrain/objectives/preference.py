"""training.objective: dpo -- preference tuning on the same loop, strategies and checkpoints as SFT.

The losses (per pair, as TRL computes them; tests/test_preference.py compares each with TRL's code on the
same log-probs):
    sigmoid  DPO: -log sigmoid(beta * delta), delta = (chosen - ref chosen) - (rejected - ref rejected) of the
             summed response log-probs; with label_smoothing e: -(1-e) logsig(beta delta) - e logsig(-beta delta)
    hinge    relu(1 - beta * delta)
    ipo      (delta / response tokens - 1 / (2 beta))^2, each side's log-ratio averaged over its tokens
    simpo    reference-free: -logsig(beta (avg chosen - avg rejected) - gamma), average log-probs per token
    orpo     reference-free: NLL of the chosen tokens (average per token) - beta * logsig(log odds ratio)
Rewards (logged): beta x log-ratio (DPO family), beta x average log-prob (SimPO, ORPO).

How the gradient is made without full-vocabulary logits: inside lm_head's forward (as for the SFT chunked
loss, loss.py), the per-token log-probs of every response of the micro-batch are computed chunk by chunk
without gradients, summed per sequence, and the pair losses and their derivatives with respect to each
sequence's log-prob are taken on those few numbers; a second chunked pass then makes the gradients of
sum_t w_seq(t) * log p_t with those weights, which is the gradient of the loss. So chosen and rejected of a
pair must sit in one micro-batch (data/preference.py's collator keeps them together), and lm_head is
projected twice per step (no full logits, no second model forward).

The reference log-probs, per data/preference.py's pair index:
    adapters     LoRA: the same model with the adapters disabled, one no-grad forward per micro-batch
    precomputed  full fine-tuning: one pass over the training pairs with the initial weights before the first
                 step, sharded across ranks like training, saved to <output.dir>/reference_logps.safetensors
                 and read back on resume (never recomputed from trained weights)
    none         SimPO / ORPO
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from disttrain.recipe.schema import PreferenceSection
from disttrain.data import BOOKKEEPING_KEYS, IGNORE_INDEX
from disttrain.data.collation import SEQUENCE_COUNT, SEQUENCE_INDEX
from disttrain.data.preference import PAIR_INDEX
from disttrain.errors import DisttrainError
from disttrain.objectives.token_loss import LossEngine, chunked_loss_sum, chunked_token_losses

REFERENCE_FILE = "reference_logps.safetensors"
STATS = ("rewards/chosen", "rewards/rejected", "rewards/accuracy", "logps/chosen", "logps/rejected")


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, stable at both ends."""
    return torch.where(x > -0.6931471805599453, torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def pair_losses(cfg: PreferenceSection, chosen: torch.Tensor, rejected: torch.Tensor, chosen_tokens: torch.Tensor,
                rejected_tokens: torch.Tensor, ref_chosen: torch.Tensor | None = None,
                ref_rejected: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, chosen reward, rejected reward) per pair from summed response log-probs and token counts."""
    beta, smooth = cfg.beta, cfg.label_smoothing
    if cfg.reference_free():
        avg_chosen, avg_rejected = chosen / chosen_tokens.clamp(min=1), rejected / rejected_tokens.clamp(min=1)
        if cfg.loss == "simpo":
            logits = beta * (avg_chosen - avg_rejected) - cfg.simpo_gamma
            losses = -(1 - smooth) * F.logsigmoid(logits) - smooth * F.logsigmoid(-logits)
        else:  # orpo
            log_odds = (avg_chosen - avg_rejected) - (log1mexp(avg_chosen) - log1mexp(avg_rejected))
            losses = -avg_chosen - beta * F.logsigmoid(log_odds)
        return losses, beta * avg_chosen.detach(), beta * avg_rejected.detach()
    chosen_ratio, rejected_ratio = chosen - ref_chosen, rejected - ref_rejected
    delta = chosen_ratio - rejected_ratio
    if cfg.loss == "sigmoid":
        losses = -(1 - smooth) * F.logsigmoid(beta * delta) - smooth * F.logsigmoid(-beta * delta)
    elif cfg.loss == "hinge":
        losses = torch.relu(1 - beta * delta)
    else:  # ipo: each side's log-ratio averaged over its tokens
        average = chosen_ratio / chosen_tokens.clamp(min=1) - rejected_ratio / rejected_tokens.clamp(min=1)
        losses = (average - 1 / (2 * beta)) ** 2
    return losses, beta * chosen_ratio.detach(), beta * rejected_ratio.detach()


def sequence_sums(per_token: torch.Tensor, batch: dict) -> torch.Tensor:
    """[sequences] sums of per-token values laid out as chunked_token_losses lays them out (position t: the
    target t + 1), whether each sequence is a row (padded; the last position has no target) or sequences share
    rows (padding-free: `SEQUENCE_INDEX` says whose each position is; a sequence's first token is no target, so
    no position predicts across a boundary)."""
    segments = batch.get(SEQUENCE_INDEX)
    if segments is None:
        return per_token[:, :-1].sum(-1)
    count = batch[SEQUENCE_COUNT]
    sums = per_token.new_zeros(count + 1)  # the last: padding's
    return sums.index_add_(0, segments.reshape(-1), per_token.reshape(-1))[:count]


def response_tokens(batch: dict) -> torch.Tensor:
    """Scored tokens per sequence (the targets of its positions)."""
    labels = batch["labels"]
    targets = torch.cat([labels[:, 1:] != IGNORE_INDEX, labels.new_zeros(labels.shape[0], 1, dtype=torch.bool)], 1)
    return sequence_sums(targets.long(), batch)


def pair_model_inputs(batch: dict) -> dict:
    """What the model is given of a pair batch (padded: ids and mask; padding-free: ids and position ids, flash's
    boundaries): not the labels, the pair index or the bookkeeping."""
    return {k: v for k, v in batch.items() if k not in BOOKKEEPING_KEYS and k not in ("labels", PAIR_INDEX)}


class PreferenceLoss:
    """The loop's loss for training.objective: dpo (objectives/base.Loss; see the module docstring). `units` are
    pairs. Its engine is the chunked head (LossEngine) with the pair loss as what lm_head returns in training."""

    unit_name = "pairs"

    def __init__(self, model, cfg: PreferenceSection, reference: str):
        self.engine = LossEngine(model, "chunked", training_head=self._training_head)
        self.head = self.engine.head
        self.cfg, self.reference = cfg, reference
        self.tables: dict[str, torch.Tensor] = {}  # precomputed: per split ("train", eval sets), [pairs, 2]
        self.split = "train"  # whose precomputed table the next micro-batches use
        self._ref: tuple[torch.Tensor, torch.Tensor] | None = None  # this micro-batch's, set before the forward
        self._layout: dict = {}  # this micro-batch's pair index and (padding-free) sequence index, for lm_head
        self._last: torch.Tensor | None = None  # this micro-batch's [pairs, STATS + count], set by the forward
        self._window: torch.Tensor | None = None  # their sums since the last log line

    @property
    def checked(self) -> bool:
        return self.engine.checked

    def check_against_model(self, accelerator, model, batch: dict) -> None:
        """The engine's token loss against the model's own, on the first sequence (chosen) of the first pair."""
        self.engine.check_against_model(accelerator, model, batch)

    @staticmethod
    def layout(batch: dict) -> dict:
        """What lm_head's forward needs besides its labels to sum per sequence: the pair index and, padding-free,
        the sequence index and count."""
        return {k: batch[k] for k in (PAIR_INDEX, SEQUENCE_INDEX, SEQUENCE_COUNT) if k in batch}

    @staticmethod
    def _inputs(batch: dict) -> dict:
        return pair_model_inputs(batch)

    def _chunked(self, model, batch: dict) -> torch.Tensor:
        """[sequences, seq] per-token losses from the chunked head (no gradients outside training)."""
        return self.engine.output(model, batch, self._inputs(batch)).logits

    def units(self, batch: dict) -> torch.Tensor:
        return torch.full((), batch[PAIR_INDEX].numel(), device=batch["input_ids"].device, dtype=torch.long)

    # ---- the loss, inside lm_head's forward ----

    def _losses_from_logps(self, logps: torch.Tensor, tokens: torch.Tensor):
        """(losses, stats [pairs, STATS + 1]) from the per-sequence log-probs of [chosen..., rejected...] and
        their scored tokens."""
        n = logps.shape[0] // 2
        ref = self._ref if self._ref is not None else (None, None)
        losses, reward_c, reward_r = pair_losses(self.cfg, logps[:n], logps[n:], tokens[:n], tokens[n:], *ref)
        stats = torch.stack([reward_c, reward_r, (reward_c > reward_r).float(), logps[:n].detach(),
                             logps[n:].detach(), torch.ones_like(reward_c)], dim=1)  # STATS, then a pair count
        return losses, stats

    def _training_head(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        layout = {**self._layout, "labels": labels}
        logps = -sequence_sums(chunked_token_losses(hidden.detach(), self.head, labels), layout)
        leaf = logps.detach().requires_grad_()
        with torch.enable_grad():
            losses, self._last = self._losses_from_logps(leaf, response_tokens(layout))
            total = losses.sum()
        (grad,) = torch.autograd.grad(total, leaf)
        # d total / d (sequence log-prob) weights each sequence's tokens; log p = -cross-entropy
        if SEQUENCE_INDEX in layout:  # a weight per position: its sequence's (padding's: 0)
            weights = torch.cat([-grad, grad.new_zeros(1)])[layout[SEQUENCE_INDEX]]
            surrogate = chunked_loss_sum(hidden, self.head, labels, position_weights=weights)
        else:
            surrogate = chunked_loss_sum(hidden, self.head, labels, row_weights=-grad)
        return surrogate - surrogate.detach() + total.detach()  # the loss's value, the loss's gradient

    def _sequence_logps(self, model, batch: dict) -> torch.Tensor:
        """Summed response log-probs per sequence, no gradients (per-token losses from the chunked head)."""
        with torch.no_grad():
            return -sequence_sums(self._chunked(model, batch), batch)

    def _reference_logps(self, model, batch: dict) -> tuple[torch.Tensor, torch.Tensor] | None:
        if self.reference == "none":
            return None
        if self.reference == "precomputed":
            if self.split not in self.tables:
                raise DisttrainError(f"preference: no precomputed reference log-probs for {self.split!r}")
            table = self.tables[self.split]
            if table.device != batch["input_ids"].device:  # moved once, not copied every micro-batch
                table = self.tables[self.split] = table.to(batch["input_ids"].device)
            ref = table[batch[PAIR_INDEX]]
            return ref[:, 0], ref[:, 1]
        if self.reference == "adapters":
            from accelerate.utils import extract_model_from_parallel

            peft_model = extract_model_from_parallel(model)
            was_training = model.training
            model.eval()  # the reference has no dropout
            try:
                with peft_model.disable_adapter():
                    logps = self._sequence_logps(model, batch)
            finally:
                model.train(was_training)
            n = logps.shape[0] // 2
            return logps[:n], logps[n:]
        if self.reference == "model":
            with torch.no_grad(), self._autocast():
                logps = -sequence_sums(self._reference_scorer.output(self._reference_model, batch,
                                                                 self._inputs(batch)).logits, batch)
            n = logps.shape[0] // 2
            return logps[:n], logps[n:]
        raise DisttrainError(f"preference.reference: {self.reference} is unknown")

    def attach_reference(self, model, scorer: LossEngine, autocast) -> None:
        """preference.reference: model -- the frozen copy (prepared for the strategy), the engine that makes
        its lm_head return per-token losses, and the accelerator's autocast for its forward."""
        self._reference_model, self._reference_scorer, self._autocast = model, scorer, autocast

    def training_loss(self, model, batch: dict, num_items_in_batch) -> torch.Tensor:
        self._ref = self._reference_logps(model, batch)
        self._layout = self.layout(batch)
        out = self.engine.output(model, batch, self._inputs(batch))
        stats = self._last.double().sum(0)  # stays on the device until a log line
        self._window = stats if self._window is None else self._window + stats
        return self.engine.with_router_loss(out.logits / num_items_in_batch, out, batch)  # MoE: the router loss, as SFT

    def window_metrics(self, accelerator) -> dict:
        """Means over the pairs of all ranks since the last log line (one all-reduce)."""
        record, self._window = pair_means(accelerator, self._window, STATS), None
        return record

    # ---- evaluation ----

    def eval_rows(self, model, batch: dict, split: str = "eval") -> torch.Tensor:
        """Per pair: (loss, 1, reward chosen, reward rejected, correct)."""
        self.split = split
        try:
            self._ref = self._reference_logps(model, batch)
        finally:
            self.split = "train"
        logps = self._sequence_logps(model, batch)
        return pair_eval_rows(*self._losses_from_logps(logps, response_tokens(batch)))

    def eval_record(self, sums: dict[str, torch.Tensor]) -> dict[str, float]:
        return pair_eval_record(sums)


# ---- what every pair objective (DPO's family, reward models) logs ----

def pair_means(accelerator, window: torch.Tensor | None, names: tuple[str, ...]) -> dict[str, float]:
    """Means over the pairs of all ranks of a window of sums [names..., pair count] (one all-reduce), with
    rewards/margin = rewards/chosen - rewards/rejected."""
    local = window if window is not None else torch.zeros(len(names) + 1, dtype=torch.float64)
    total = accelerator.reduce(local.to(accelerator.device), reduction="sum")
    pairs = max(float(total[-1]), 1.0)
    record = {name: float(value) / pairs for name, value in zip(names, total[:-1])}
    record["rewards/margin"] = record["rewards/chosen"] - record["rewards/rejected"]
    return record


def pair_eval_rows(losses: torch.Tensor, stats: torch.Tensor) -> torch.Tensor:
    """Per pair: (loss, 1, reward chosen, reward rejected, correct), from the losses and the stats whose first
    columns are (reward chosen, reward rejected, correct)."""
    return torch.stack([losses, torch.ones_like(losses), stats[:, 0], stats[:, 1], stats[:, 2]], dim=1)


def pair_eval_record(sums: dict[str, torch.Tensor]) -> dict[str, float]:
    """eval_loss and eval_rewards/* over every eval set's summed pair_eval_rows; eval_loss/<set> per set of a
    mixture."""
    total = sum(sums.values())
    pairs = max(float(total[1]), 1.0)
    record = {"eval_loss": float(total[0]) / pairs, "eval_rewards/chosen": float(total[2]) / pairs,
              "eval_rewards/rejected": float(total[3]) / pairs, "eval_rewards/accuracy": float(total[4]) / pairs}
    return with_margin_and_sets(record, sums)


def with_margin_and_sets(record: dict[str, float], sums: dict[str, torch.Tensor]) -> dict[str, float]:
    """An eval record with eval_rewards/margin and, for a mixture, eval_loss/<set> (each set's summed rows:
    loss first, then the count)."""
    record["eval_rewards/margin"] = record["eval_rewards/chosen"] - record["eval_rewards/rejected"]
    record.update({f"eval_loss/{name}": float(s[0]) / max(float(s[1]), 1.0) for name, s in sums.items()
                   if name != "eval"})
    return record


# ---- precomputed reference log-probs ----

@torch.no_grad()
def _score(accelerator, model, objective: PreferenceLoss, loader, pairs: int) -> torch.Tensor:
    """[pairs, 2] log-probs (chosen, rejected) of every pair of a prepared, unshuffled loader: each rank scores
    its shard, the rows are gathered on every rank (duplicates from even batches dropped)."""
    table = torch.full((pairs, 2), float("nan"), dtype=torch.float64)
    for batch in loader:
        logps = objective._sequence_logps(model, batch)
        n = logps.shape[0] // 2
        rows = torch.cat([batch[PAIR_INDEX].double()[:, None], logps[:n, None].double(), logps[n:, None].double()],
                         dim=1)
        rows = accelerator.gather_for_metrics(rows).cpu()
        table[rows[:, 0].long()] = rows[:, 1:]
    if torch.isnan(table).any():
        raise DisttrainError("preference: some pairs got no reference log-probs (the reference pass missed rows)")
    return table.float()


def precompute_reference(accelerator, model, objective: PreferenceLoss, loaders: dict, out_dir: str | Path,
                         fingerprint: dict[str, str]) -> dict[str, torch.Tensor]:
    """Reference log-probs of every pair of every split ({name: (prepared unshuffled loader, pairs)}) with the
    current -- initial -- weights, or the ones this run saved before (a resumed run must not recompute them
    from trained weights). Saved atomically by the main process to <out_dir>/reference_logps.safetensors."""
    from safetensors.torch import save_file

    path = Path(out_dir) / REFERENCE_FILE
    if path.is_file():
        tables = read_reference(path, {name: pairs for name, (_, pairs) in loaders.items()}, fingerprint)
        accelerator.print(f"preference: reference log-probs read from {path} (not recomputed)")
        return tables
    model.eval()
    tables = {name: _score(accelerator, model, objective, loader, pairs) for name, (loader, pairs) in loaders.items()}
    model.train()
    if accelerator.is_main_process:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        save_file(tables, str(tmp), metadata=fingerprint)
        tmp.replace(path)
    accelerator.wait_for_everyone()
    accelerator.print(f"preference: reference log-probs of {sum(t.shape[0] for t in tables.values())} "
                      f"{objective.unit_name} computed "
                      f"with the initial weights -> {path}")
    return tables


def read_reference(path: Path, sizes: dict[str, int], fingerprint: dict[str, str]) -> dict[str, torch.Tensor]:
    """Saved reference log-probs, if they belong to this run's data and model (`fingerprint`: reference_key);
    else one line saying what differs."""
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        saved, tables = f.metadata() or {}, {name: f.get_tensor(name) for name in f.keys()}
    saved_sizes = {name: table.shape[0] for name, table in tables.items()}
    if saved.get("model") != fingerprint["model"]:
        raise DisttrainError(f"{path} holds reference log-probs of another model ({saved.get('model', 'not recorded')}"
                             f"; this run: {fingerprint['model']}): delete it to recompute them with this model, or "
                             "use a new output.dir")
    if saved.get("data") != fingerprint["data"] or saved_sizes != sizes:
        raise DisttrainError(f"{path} holds reference log-probs of other data ({saved_sizes} pairs, fingerprint "
                             f"{saved.get('data')}; this run: {sizes}, {fingerprint['data']}): delete it to "
                             "recompute them, or use a new output.dir")
    return tables


def reference_key(recipe, train_set, eval_sets: dict) -> dict[str, str]:
    """What saved reference log-probs belong to: the prepared splits (their `datasets` fingerprints) and the
    model that scored them (path, revision, dtype, and for a local directory its weight files' sizes and
    times: an SFT checkpoint written over the same path is another model)."""
    spec = recipe.model
    model = f"{spec.name_or_path}@{spec.revision or 'default'} {spec.dtype}"
    local = Path(spec.name_or_path)
    if local.is_dir():
        weights = sorted(local.glob("*.safetensors")) + sorted(local.glob("*.bin"))
        model += " " + ",".join(f"{w.name}:{w.stat().st_size}:{w.stat().st_mtime_ns}" for w in weights)
    return {"data": data_fingerprint(train_set, eval_sets), "model": model}


def reference_loaders(accelerator, train_set, eval_sets: dict, eval_loaders: dict, micro_batch_size: int,
                      collator) -> dict:
    """{split: (prepared unshuffled loader, pairs)} for precompute_reference: the training pairs in order,
    and the eval loaders the run already has."""
    from disttrain.data import make_loader

    train = accelerator.prepare(make_loader(train_set, micro_batch_size, collator, shuffle=False, drop_last=False))
    return {"train": (train, len(train_set)),
            **{name: (loader, len(eval_sets[name])) for name, loader in eval_loaders.items()}}


def data_fingerprint(train_set, eval_sets: dict) -> str:
    """The `datasets` fingerprints of the prepared splits: saved reference log-probs belong to these rows."""
    return ";".join(f"{name}:{ds._fingerprint}" for name, ds in {"train": train_set, **eval_sets}.items())


def live_reference(accelerator, recipe, sharded: bool, local_device):
    """preference.reference: model -- a frozen copy of the initial weights next to the policy, sharded the way
    the policy is (frozen_model). Returns (model, scorer) for attach_reference."""
    scorers = []  # its lm_head returns per-token losses while labels are set on it
    model = frozen_model(accelerator, recipe, recipe.model, sharded, local_device,
                         lambda bare: scorers.append(LossEngine(bare, "chunked")))
    return model, scorers[0]


def frozen_model(accelerator, recipe, spec, sharded: bool, local_device, before_wrapping=None):
    """A frozen model of `spec` (the policy's initial weights, or a distillation teacher) in eval mode, sharded the
    way the policy is: FSDP2 through accelerate's own fsdp2_prepare_model, ZeRO-3 through a DeepSpeed inference
    engine (no optimizer), otherwise whole on the device. `before_wrapping(model)`: called on the loaded model
    before it is sharded (to install a head's forward)."""
    from accelerate.utils import DistributedType

    from disttrain.model.loading import load_model

    spec = spec.model_copy(update={"gradient_checkpointing": False})  # no backward through it
    model = load_model(spec, None, sharded=sharded, local_device=local_device)
    model.requires_grad_(False)
    if before_wrapping is not None:
        before_wrapping(model)
    if accelerator.distributed_type == DistributedType.FSDP:
        from accelerate.utils.fsdp_utils import fsdp2_prepare_model

        model = fsdp2_prepare_model(accelerator, model)
    elif accelerator.distributed_type == DistributedType.DEEPSPEED and \
            accelerator.state.deepspeed_plugin.zero_stage == 3:
        import copy

        import deepspeed

        config = copy.deepcopy(accelerator.state.deepspeed_plugin.deepspeed_config)
        for key in ("optimizer", "scheduler"):
            config.pop(key, None)
        config["zero_optimization"].pop("offload_optimizer", None)
        model, *_ = deepspeed.initialize(model=model, config=config)
    elif accelerator.distributed_type == DistributedType.DEEPSPEED:
        # ZeRO-1/2: DeepSpeed runs the policy in bf16/fp16 weights and accelerate does not autocast under
        # DeepSpeed, so a copy left in its load dtype (fp32) would score in another precision than the policy
        model = model.to(accelerator.device, dtype=_DEEPSPEED_DTYPES.get(recipe.training.mixed_precision))
    else:
        model = model.to(accelerator.device)
    model.eval()
    return model


_DEEPSPEED_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}  # training.mixed_precision -> weights


def prepare_reference(accelerator, recipe, model, objective: PreferenceLoss, train_set, eval_sets: dict,
                      eval_loaders: dict, collator) -> None:
    """The run's reference (recipe.reference_mode()): a frozen copy attached to the objective (`model`), or
    the precomputed log-probs of every pair (`precomputed`, read back on resume); nothing to do for the
    adapters-off reference (LoRA) and the reference-free losses."""
    from disttrain.runtime.backends import has_gpu, shards_weights

    mode = recipe.reference_mode()
    if mode == "model":
        local_device = accelerator.local_process_index if has_gpu() else None
        objective.attach_reference(*live_reference(accelerator, recipe, shards_weights(accelerator), local_device),
                                   accelerator.autocast)
    elif mode == "precomputed":
        loaders = reference_loaders(accelerator, train_set, eval_sets, eval_loaders,
                                    recipe.training.micro_batch_size, collator)
        objective.tables = precompute_reference(accelerator, model, objective, loaders, recipe.output.dir,
                                                reference_key(recipe, train_set, eval_sets))
