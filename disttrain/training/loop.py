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
from itertools import islice

import torch

from disttrain.runtime import guards
from disttrain.data import LENGTHS_KEY
from disttrain.objectives.token_loss import TokenLoss


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


def _window_denominator(window: list[dict], accelerator, objective: TokenLoss,
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


@torch.no_grad()
def evaluate(accelerator, model, loader, objective: TokenLoss, name: str = "eval") -> torch.Tensor:
    """The objective's eval sums over one eval set, all ranks; duplicated padding samples are dropped by
    gather_for_metrics."""
    model.eval()
    totals = None
    for batch in loader:
        per_row = accelerator.gather_for_metrics(objective.eval_rows(model, batch, name)).double().sum(0)
        totals = per_row if totals is None else totals + per_row
    model.train()
    return totals


def evaluate_all(accelerator, model, loaders: dict, objective: TokenLoss) -> dict[str, float]:
    """`eval_loss` over every eval set, and per set of a mixture (`eval_loss/<source>`)."""
    return objective.eval_record({name: evaluate(accelerator, model, loader, objective, name)
                                  for name, loader in loaders.items()})


class _Window:
    """Running sums between two log lines. They stay on the device (no host sync in the step loop) and are
    gathered across ranks only when a line is written."""

    DEVICE_FIELDS = ("loss_sum", "targets", "tokens", "flops", "recompute_flops")
    HOST_FIELDS = ("padded_tokens", "data_wait_s", "peak_mem_gb")
    FIELDS = DEVICE_FIELDS + HOST_FIELDS

    def __init__(self, device, meter=None, peak_flops: float | None = None, data_rank_size: int = 1,
                 share: float = 1.0):
        self.device, self.meter, self.peak_flops = device, meter, peak_flops
        self.data_rank_size = data_rank_size  # consecutive processes that read the same rows (Ulysses: sp)
        self.share = share  # the part of each batch this process accounts for (ParallelPlan.share)
        self.reset()

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
        by_data = {k: f[k].reshape(-1, self.data_rank_size).sum(1) for k in ("loss_sum", "targets")}
        rank_loss = by_data["loss_sum"] / by_data["targets"].clamp(min=1)
        mean_loss = f["loss_sum"].sum() / f["targets"].sum().clamp(min=1)
        elapsed = max(time.perf_counter() - self.started - self.excluded_s, 1e-9)
        devices = per_rank.shape[0]
        record = {
            "loss": float(mean_loss),
            "loss_rank_min": float(rank_loss.min()),
            "loss_rank_max": float(rank_loss.max()),
            "loss_rank_min_rank": int(rank_loss.argmin()) * self.data_rank_size,  # its first process
            "loss_rank_max_rank": int(rank_loss.argmax()) * self.data_rank_size,
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


def train(accelerator, model, optimizer, scheduler, train_loader, eval_loaders, cfg, log, state: TrainState,
          total_steps: int, per_epoch: int, log_every: int, progress=None, checkpointer=None,
          flops_meter=None, peak_flops: float | None = None, distributed=None,
          token_loss: TokenLoss | None = None, sampler=None, data_rank_size: int = 1, share: float = 1.0,
          scorer=None, micro_batch_context=None) -> TrainState:
    """Run optimizer steps from state.step until total_steps (or cfg.stop_at_step, or SIGTERM).

    `log(record, step)` receives every metrics line (on every rank); `progress()` is called once per step;
    `checkpointer` (due(step) / save(state)) writes checkpoints. A log line is always written at a
    checkpoint, so a resumed run's metrics continue without a seam. `flops_meter` and `peak_flops` add
    TFLOPS per device and MFU to the log lines. `distributed` (the recipe section) sets the replica check
    interval and the loss-spread warning threshold. `token_loss` computes each micro-batch's loss (default:
    transformers' plain loss from full logits); `sampler(step)` generates and logs samples at each evaluation.
    `data_rank_size`: consecutive processes sharing rows (ParallelPlan.group), compared as one in the spread;
    `share`: the part of each batch a process counts in the metrics (ParallelPlan.share: 1/tp).
    `scorer` (due(step) / scorer(checkpoint) -> record) scores the checkpoints it is due for with lm-eval.
    `micro_batch_context(batch)` is entered around each micro-batch's forward and backward
    (ParallelPlan.micro_batch_context: context parallelism cuts the batch's sequences there).
    """
    token_loss = token_loss or TokenLoss(model, "plain")
    micro_batch_context = micro_batch_context or (lambda batch: contextlib.nullcontext())
    ga = accelerator.gradient_accumulation_steps
    window = _Window(accelerator.device, flops_meter, peak_flops, data_rank_size, share)
    replicas_every = distributed.check_replicas_every if distributed is not None else None
    warn_loss_spread = guards.LossSpreadWarning(distributed.loss_spread_warning if distributed is not None else None)
    model.train()
    while state.step < total_steps:
        state.epoch = state.step // per_epoch
        train_loader.set_epoch(state.epoch)  # the epoch's permutation, identical on every rank
        consumed = (state.step % per_epoch) * ga  # non-zero only right after a mid-epoch resume
        if consumed and not getattr(train_loader, "resumes_itself", False):  # a stream loaded its own position
            batches = iter(accelerator.skip_first_batches(train_loader, consumed))
        else:
            batches = iter(train_loader)
        for _ in range(state.step % per_epoch, per_epoch):
            step = state.step + 1
            guards.at("loading the next batches", step)
            fetch_started = time.perf_counter()
            micro_batches = list(islice(batches, ga))
            window.data_wait += time.perf_counter() - fetch_started
            if micro_batches and not token_loss.checked:  # the chunked loss equals the model's own, or stop
                guards.at("checking the chunked loss against the model's own loss", step)
                window.timed_apart(lambda: token_loss.check_against_model(accelerator, model, micro_batches[0]))
            guards.at("all_reduce of the step's target-token count", step)
            denominator, flags = _window_denominator(
                micro_batches, accelerator, token_loss,
                (_stop_requested, checkpointer is not None and checkpointer.time_due()))
            guards.at("forward/backward (gradient all-reduce / shard gathers) and optimizer step", step)
            for batch in micro_batches:
                with accelerator.accumulate(model), _activation_storage(cfg, accelerator.device), \
                        micro_batch_context(batch):
                    loss = token_loss.training_loss(model, batch, denominator)
                    accelerator.backward(loss)
                    if accelerator.sync_gradients:
                        grad_norm = _grad_norm(accelerator, model, cfg.max_grad_norm)
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                window.add_micro(loss.detach() * denominator, token_loss.units(batch), batch)
            scheduler.step()
            state.step += 1
            window.steps += 1
            if progress is not None:
                progress()
            last = state.step >= total_steps
            stop = flags.is_set(STOP) or (cfg.stop_at_step is not None and state.step >= cfg.stop_at_step
                                          and not last)
            save = checkpointer is not None and (checkpointer.due(state.step, last) or flags.is_set(TIME_DUE) or stop)
            if state.step % log_every == 0 or last or save:
                guards.at("gathering metrics from all ranks", step)
                summary = window.summarize(accelerator, token_loss.unit_name)
                state.tokens_seen += summary["tokens"]
                log({**summary, **token_loss.window_metrics(accelerator), "lr": scheduler.get_last_lr()[0],
                     "grad_norm": _as_float(grad_norm), "epoch": state.epoch, "tokens_seen": state.tokens_seen},
                    state.step)
                warn_loss_spread(summary, state.step, accelerator.print)
                window.reset()
            # timed apart from the window: tokens/s and MFU count training time only
            if replicas_every and state.step % replicas_every == 0:
                window.timed_apart(lambda: guards.check_replicas(
                    accelerator, model, state.step, checkpointer.last_saved if checkpointer is not None else None))
            evaluation_due = cfg.eval_every and (state.step % cfg.eval_every == 0 or last)
            if eval_loaders and evaluation_due:
                guards.at("evaluation", step)
                evaluated, took = window.timed_apart(lambda: evaluate_all(accelerator, model, eval_loaders, token_loss))
                log({**evaluated, "eval_time_s": took}, state.step)
            if sampler is not None and evaluation_due:
                guards.at("sample generations (every rank, same steps)", step)
                window.timed_apart(lambda: sampler(state.step))
            if save:
                guards.at("saving a checkpoint", step)
                _, took = window.timed_apart(lambda: checkpointer.save(state))
                log({"checkpoint_time_s": took}, state.step)
                if scorer is not None and scorer.due(state.step) and not stop:
                    guards.at("scoring the checkpoint with lm-eval (main process; the other ranks wait)", step,
                              collective=False)
                    scored, took = window.timed_apart(lambda: scorer(checkpointer.last_saved))
                    log({**scored, "lm_eval_time_s": took}, state.step)
            if stop or last:
                return state
    return state
