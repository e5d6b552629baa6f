"""The training loop: one optimizer step = `grad_accum` micro-batches on every rank.

Loss normalisation. The gradient of one optimizer step is the gradient of
    sum(token losses over all micro-batches on all ranks) / (target tokens over all of them),
not the mean of per-micro-batch means, which over-weights short sequences (the 2024 gradient-accumulation
bug). The loop therefore looks at the whole accumulation window first, all-reduces its target-token
count, and hands the model `num_items_in_batch` so that, after accelerate divides by grad_accum and DDP /
FSDP / ZeRO average over ranks, the result is exactly that token-weighted mean.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import asdict, dataclass
from typing import Any, Iterator, NamedTuple, Protocol

import torch

from disttrain.runtime import guards
from disttrain.data import LENGTHS_KEY
from disttrain.objectives.base import Loss
from disttrain.training.hooks import Hook, StepEnd


@dataclass
class TrainState:
    step: int = 0          # optimizer steps done
    epoch: int = 0
    tokens_seen: int = 0   # non-padding input tokens, all ranks

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for key, value in state.items():
            setattr(self, key, value)


_stop_requested = False
STOP, TIME_DUE = 0, 1  # the flags every rank raises into the step's all-reduce


def request_stop(*_signal_args) -> None:
    """SIGTERM handler: finish the current step, checkpoint, exit (the flag reaches all ranks in one step)."""
    global _stop_requested
    _stop_requested = True


def _window_denominator(window: list[dict], accelerator, objective: Loss,
                        flags: tuple[bool, ...]) -> tuple[torch.Tensor, "_FlagsOnHost"]:
    """All-reduce of (target tokens -- or pairs -- in this window, then this rank's flags): one small collective
    per step. A flag is set for all ranks when any rank sets it (SIGTERM reached one rank, one rank's clock says a
    checkpoint is due), so every rank takes the same branch. The denominator stays on the device; the flags are
    read through _FlagsOnHost at the end of the step."""
    targets = sum(objective.units(b) for b in window).to(accelerator.device, torch.float32)
    raised = [torch.full((), float(flag), device=targets.device) for flag in flags]  # fills, not host-to-device copies
    total = accelerator.reduce(torch.stack([targets, *raised]), reduction="sum")
    # scale so that accelerate's /grad_accum and the strategy's mean over ranks are undone
    denominator = total[0].clamp(min=1.0) / (accelerator.num_processes * accelerator.gradient_accumulation_steps)
    return denominator, _FlagsOnHost(total[1:])


class _FlagsOnHost:
    """Device flags brought to the host without waiting for the kernels queued after them. `bool(t)` on a GPU
    tensor waits for everything queued so far (the whole step, once its backward is queued); this copy waits
    only for the collective that produced the flags, so reading them at the end of a step leaves the next step's
    kernels queued behind the running ones. On a CPU the values are read directly."""

    def __init__(self, flags: torch.Tensor):
        self._done = None
        self._values = flags
        if flags.device.type == "cuda":
            self._values = torch.empty(flags.shape, dtype=flags.dtype, pin_memory=True)
            self._values.copy_(flags, non_blocking=True)
            self._done = torch.cuda.Event()
            self._done.record(torch.cuda.current_stream(flags.device))

    def is_set(self, index: int) -> bool:
        if self._done is not None:
            self._done.synchronize()
        return bool(self._values[index] > 0)


def _activation_storage(cfg, device: torch.device):
    """training.offload_activations: tensors saved for the backward pass wait in host memory (pinned on GPUs,
    so the copies are asynchronous); otherwise they stay where they were made."""
    if cfg.offload_activations:
        return torch.autograd.graph.save_on_cpu(pin_memory=device.type == "cuda")
    return contextlib.nullcontext()


def _grad_norm(accelerator, model, max_norm: float | None):
    # With max_norm=inf nothing is clipped but the (sharding-aware) total norm is still returned.
    norm = accelerator.clip_grad_norm_(model.parameters(), max_norm or math.inf)
    if norm is None and hasattr(model, "get_global_grad_norm"):  # DeepSpeed clips inside its engine
        norm = model.get_global_grad_norm()
    return norm


def _as_float(value) -> float:
    return float(value) if value is not None else float("nan")


class _Window:
    """Running sums between two log lines. They stay on the device (no host sync in the step loop) and are
    gathered across ranks only when a line is written."""

    DEVICE_FIELDS = ("loss_sum", "targets", "tokens", "flops", "recompute_flops")
    HOST_FIELDS = ("padded_tokens", "data_wait_s", "peak_mem_gb")
    FIELDS = DEVICE_FIELDS + HOST_FIELDS

    def __init__(self, device, meter=None, peak_flops: float | None = None, data_of: list[int] | None = None,
                 share: float = 1.0):
        self.device, self.meter, self.peak_flops = device, meter, peak_flops
        self.data_of = data_of  # each process's data rank (ParallelPlan.data_rank_of); None: each its own
        self.share = share  # the part of each batch this process accounts for (ParallelPlan.share)
        self.last_grad_norm = None  # the total norm of the latest optimizer step (set by the loop)
        self.reset()

    def grad_norm(self) -> float:
        return _as_float(self.last_grad_norm)

    def reset(self):
        self.sums = torch.zeros(len(self.DEVICE_FIELDS), device=self.device, dtype=torch.float64)
        self.steps = 0
        self.padded_tokens = 0
        self.data_wait = 0.0
        self.excluded_s = 0.0  # evaluation, checkpoints, replica checks: not training time
        self.started = time.perf_counter()

    def timed_apart(self, work):
        """Run `work()` outside the training time of this window; returns (its result, its seconds)."""
        started = time.perf_counter()
        result = work()
        took = time.perf_counter() - started
        self.excluded_s += took
        return result, took

    def add_micro(self, loss_sum: torch.Tensor, units: torch.Tensor, batch: dict):
        # device tensors only: a Python number copied to a GPU would synchronise the stream every micro-batch
        zero = loss_sum.new_zeros(())
        flops = self.meter.batch_flops(batch) if self.meter else zero
        recompute = self.meter.recompute_flops(batch) if self.meter else zero
        values = [loss_sum, units, batch[LENGTHS_KEY].sum(), flops, recompute]  # DEVICE_FIELDS
        self.sums += torch.stack([v.to(self.device, torch.float64) for v in values]) * self.share
        self.padded_tokens += batch["input_ids"].numel() * self.share  # known on the host

    def summarize(self, accelerator, unit_name: str = "target_tokens") -> dict:
        from disttrain.metrics.throughput import peak_memory_gb

        host = torch.tensor([self.padded_tokens, self.data_wait, peak_memory_gb(self.device)], dtype=torch.float64)
        local = torch.cat([self.sums, host.to(self.device)])
        per_rank = accelerator.gather(local.unsqueeze(0)).reshape(-1, len(self.FIELDS))  # one collective
        f = {name: per_rank[:, i] for i, name in enumerate(self.FIELDS)}
        # the spread compares data ranks: slices of the same sequences (Ulysses) differ by position, not data
        data_of = torch.tensor(self.data_of if self.data_of is not None else range(per_rank.shape[0]),
                               device=per_rank.device)
        by_data = {k: f[k].new_zeros(int(data_of.max()) + 1).index_add_(0, data_of, f[k])
                   for k in ("loss_sum", "targets")}
        first_process = {int(d): p for p, d in reversed(list(enumerate(data_of.tolist())))}
        rank_loss = by_data["loss_sum"] / by_data["targets"].clamp(min=1)
        mean_loss = f["loss_sum"].sum() / f["targets"].sum().clamp(min=1)
        elapsed = max(time.perf_counter() - self.started - self.excluded_s, 1e-9)
        devices = per_rank.shape[0]
        record = {
            "loss": float(mean_loss),
            "loss_rank_min": float(rank_loss.min()),
            "loss_rank_max": float(rank_loss.max()),
            "loss_rank_min_rank": first_process[int(rank_loss.argmin())],  # its first process
            "loss_rank_max_rank": first_process[int(rank_loss.argmax())],
            "loss_rank_spread": float((rank_loss.max() - rank_loss.min()) / mean_loss.abs().clamp(min=1e-12)),
            "step_time_s": elapsed / max(self.steps, 1),
            "tokens_per_s": float(f["tokens"].sum()) / elapsed,
            "tokens_per_s_per_device": float(f["tokens"].sum()) / elapsed / devices,
            "padded_tokens_per_s_per_device": float(f["padded_tokens"].sum()) / elapsed / devices,
            "data_wait_share": float(f["data_wait_s"].max()) / elapsed,
            "peak_mem_gb": float(f["peak_mem_gb"].max()),
            unit_name: int(f["targets"].sum()),
            "tokens": int(f["tokens"].sum()),
        }
        if self.meter is not None:
            tflops = float(f["flops"].sum()) / elapsed / devices / 1e12
            record["tflops_per_device"] = tflops
            if self.peak_flops:
                record["mfu"] = tflops * 1e12 / self.peak_flops
                if record["mfu"] > 1.0:  # impossible: the peak (or the FLOP count) is wrong, not the run
                    record["mfu_suspect"] = True
                record["peak_tflops_per_device"] = self.peak_flops / 1e12
                if self.meter.recompute:  # hardware FLOPs utilisation: the recomputed forward included
                    record["hfu"] = float(f["flops"].sum() + f["recompute_flops"].sum()) / elapsed / devices \
                        / self.peak_flops
        return record


class StepSource(Protocol):
    """Where each optimizer step's micro-batches come from: a data feed (data/feed.py), or an objective that makes
    them itself (from the feed's rows and the current model, e.g. completions it generates before each step)."""

    total_steps: int
    per_epoch: int
    rank_state: Any  # () -> this rank's resume state (JSON) saved in every checkpoint, or None: nothing to save

    def restore(self, rank_state: dict) -> None:
        """On resume: the state rank_state() saved."""

    def windows(self, run: Run, state: TrainState) -> Iterator[list[dict]]:
        """The micro-batches of each optimizer step from state.step on (grad_accum of them per step); it keeps
        state.epoch and, on resume, starts where the step says the data stood."""


class Trainable(NamedTuple):
    """The model with its optimizer and schedule, as accelerator.prepare returned them (the feed prepares them
    with its loader: data/feed.py)."""

    model: Any
    optimizer: Any
    scheduler: Any


@dataclass
class Run:
    """What the loop trains, handed over whole: the prepared model, optimizer and schedule, the loss, where the
    batches come from, the recipe, the parallel plan (what each process counts, what a micro-batch runs inside),
    the checkpointer (its cadence and clock decide when a step saves) and the FLOP meter with the device's peak."""

    accelerator: Any
    trainable: Trainable
    loss: Loss
    steps: StepSource
    recipe: Any
    plan: Any = None  # parallel/plan.ParallelPlan; None: one process, nothing cut
    checkpointer: Any = None  # training/checkpoint.Checkpointer; None: nothing saved
    throughput: tuple = (None, None)  # (metrics.flops.FlopsMeter, peak FLOP/s per device): MFU in the metrics

    @property
    def model(self):
        return self.trainable.model

    @property
    def scheduler(self):
        return self.trainable.scheduler


def train(run: Run, state: TrainState, hooks: list[Hook], log) -> TrainState:
    """Run optimizer steps from state.step until the step source's total (or training.stop_at_step, or SIGTERM).

    After each step every hook (training/hooks.py: progress, metrics line, replica check, evaluation, samples,
    checkpoint, lm-eval) is asked, in order, whether it is due; what it returns goes to `log(record, step)`.
    Whether the step saves is decided here, before the hooks run (the metrics line is forced at a checkpoint):
    the checkpointer's step cadence, its clock (agreed across ranks in the step's all-reduce) or a stop."""
    accelerator, model = run.accelerator, run.model
    cfg, token_loss, checkpointer = run.recipe.training, run.loss, run.checkpointer
    data_of, share = (run.plan.data_rank_of(accelerator.num_processes), run.plan.share) if run.plan is not None \
        else (None, 1.0)
    micro_batch_context = run.plan.micro_batch_context(accelerator, model) if run.plan is not None else \
        (lambda batch: contextlib.nullcontext())
    window = _Window(accelerator.device, *run.throughput, data_of, share)
    # a pipeline's schedule runs the window whole (parallel/pipeline.py)
    run_window = (run.plan.window_runner(run) if run.plan is not None else None) or \
        _one_at_a_time(run, micro_batch_context)
    total_steps = run.steps.total_steps
    model.train()
    windows = run.steps.windows(run, state)
    while state.step < total_steps:
        step = state.step + 1
        guards.at("loading the next batches", step)
        fetch_started = time.perf_counter()
        micro_batches = next(windows)
        window.data_wait += time.perf_counter() - fetch_started
        if micro_batches and not token_loss.checked:  # the chunked loss equals the model's own, or stop
            guards.at("checking the chunked loss against the model's own loss", step)
            window.timed_apart(lambda: token_loss.check_against_model(accelerator, model, micro_batches[0]))
        guards.at("all_reduce of the step's target-token count", step)
        denominator, flags = _window_denominator(
            micro_batches, accelerator, token_loss,
            (_stop_requested, checkpointer is not None and checkpointer.time_due()))
        guards.at("forward/backward (gradient all-reduce / shard gathers) and optimizer step", step)
        for batch, loss_sum in zip(micro_batches, run_window(micro_batches, denominator, window)):
            window.add_micro(loss_sum, token_loss.units(batch), batch)
        run.scheduler.step()
        state.step += 1
        window.steps += 1
        last = state.step >= total_steps
        stop = flags.is_set(STOP) or (cfg.stop_at_step is not None and state.step >= cfg.stop_at_step and not last)
        save = checkpointer is not None and (checkpointer.due(state.step, last) or flags.is_set(TIME_DUE) or stop)
        _after_step(hooks, StepEnd(state, last, stop, save, window), log)
        if stop or last:
            return state
    return state


def _one_at_a_time(run: Run, micro_batch_context):
    """The window's runner of every mesh but a pipeline: each micro-batch forward and backward inside accelerate's
    accumulation, the last one clipping and stepping; it returns each micro-batch's summed loss."""
    accelerator, model, optimizer = run.accelerator, run.model, run.trainable.optimizer
    cfg, token_loss = run.recipe.training, run.loss

    def run_window(micro_batches: list[dict], denominator, window: _Window) -> list[torch.Tensor]:
        sums = []
        for batch in micro_batches:
            with accelerator.accumulate(model), _activation_storage(cfg, accelerator.device), \
                    micro_batch_context(batch):
                loss = token_loss.training_loss(model, batch, denominator)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    window.last_grad_norm = _grad_norm(accelerator, model, cfg.max_grad_norm)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            sums.append(loss.detach() * denominator)
        return sums
    return run_window


def _after_step(hooks: list[Hook], end: StepEnd, log) -> None:
    for hook in hooks:
        if not hook.due(end):
            continue
        if hook.timed:  # timed apart from the window: tokens/s and MFU count training time only
            record, took = end.window.timed_apart(lambda: hook(end))
            record = {**(record or {}), hook.time_key: took} if hook.time_key else record
        else:
            record = hook(end)
        if record:
            log(record, end.step)
