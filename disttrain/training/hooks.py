"""What runs between optimizer steps, one protocol for all of it: the metrics line, the replica check,
evaluation, sample generations, the checkpoint and lm-eval on it, the progress bar.

The loop (training/loop.py) only runs steps. After each it hands every hook, in order, a `StepEnd` (the step,
whether it was the last, whether a stop was asked for, whether a checkpoint is due) and calls those whose
`due(end)` says so; a hook returns a record for metrics.jsonl (or None). Work that is not training (all of it
but the metrics line and the progress bar) is timed apart from the throughput window, and, when the hook names
a `time_key`, its seconds are logged under it. Every rank calls every hook at the same steps: several of them
run collectives (evaluation, gathering metrics, a checkpoint). A new periodic job is a class here with `due`
and `__call__`, added to `for_run`'s list.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Protocol

import torch

from disttrain.runtime import guards


@dataclass
class StepEnd:
    """The step that just finished, as every hook sees it (the same on every rank)."""

    state: Any  # loop.TrainState, after the step
    last: bool  # the run's last step
    stop: bool  # SIGTERM or training.stop_at_step: save and leave after this step
    save: bool  # a checkpoint is written at this step (its cadence, its clock, or a stop)
    window: Any  # loop._Window: the running sums since the last metrics line
    saved: Path | None = None  # the checkpoint written at this step, once SaveCheckpoint ran

    @property
    def step(self) -> int:
        return self.state.step


class Hook(Protocol):
    timed: bool  # timed apart from the training throughput
    time_key: str | None  # logged with the seconds it took

    def due(self, end: StepEnd) -> bool: ...

    def __call__(self, end: StepEnd) -> dict | None: ...


class Progress:
    timed, time_key = False, None

    def __init__(self, advance: Callable[[], None]):
        self.advance = advance

    def due(self, end: StepEnd) -> bool:
        return True

    def __call__(self, end: StepEnd) -> None:
        self.advance()


class MetricsLine:
    """Every logging.every_steps, at the last step and at every checkpoint (so a resumed run's metrics continue
    without a seam): the window's sums gathered from all ranks, the loss's own metrics, lr and grad norm."""

    timed, time_key = False, None

    def __init__(self, accelerator, loss, scheduler, every: int, distributed):
        self.accelerator, self.loss, self.scheduler, self.every = accelerator, loss, scheduler, every
        self.warn_loss_spread = guards.LossSpreadWarning(distributed.loss_spread_warning if distributed else None)

    def due(self, end: StepEnd) -> bool:
        return end.step % self.every == 0 or end.last or end.save

    def __call__(self, end: StepEnd) -> dict:
        guards.at("gathering metrics from all ranks", end.step)
        summary = end.window.summarize(self.accelerator, self.loss.unit_name)
        end.state.tokens_seen += summary["tokens"]
        record = {**summary, **self.loss.window_metrics(self.accelerator), "lr": self.scheduler.get_last_lr()[0],
                  "grad_norm": end.window.grad_norm(), "epoch": end.state.epoch,
                  "tokens_seen": end.state.tokens_seen}
        self.warn_loss_spread(summary, end.step, self.accelerator.print)
        end.window.reset()
        return record


class ReplicaCheck:
    """distributed.check_replicas_every: replicated weights compared by checksum across ranks."""

    timed, time_key = True, None

    def __init__(self, accelerator, model, every: int | None, checkpointer=None):
        self.accelerator, self.model, self.every, self.checkpointer = accelerator, model, every, checkpointer

    def due(self, end: StepEnd) -> bool:
        return bool(self.every) and end.step % self.every == 0

    def __call__(self, end: StepEnd) -> None:
        last_saved = self.checkpointer.last_saved if self.checkpointer is not None else None
        guards.check_replicas(self.accelerator, self.model, end.step, last_saved)


class Evaluation:
    """training.eval_every (and the last step): the objective's eval loss on every eval set."""

    timed, time_key = True, "eval_time_s"

    def __init__(self, accelerator, model, loss, loaders: dict, every: int | None):
        self.accelerator, self.model, self.loss, self.loaders, self.every = accelerator, model, loss, loaders, every

    def due(self, end: StepEnd) -> bool:
        return bool(self.loaders) and evaluation_due(self.every, end)

    def __call__(self, end: StepEnd) -> dict:
        guards.at("evaluation", end.step)
        return evaluate_all(self.accelerator, self.model, self.loaders, self.loss)


@torch.no_grad()
def evaluate(accelerator, model, loader, objective, name: str = "eval") -> torch.Tensor:
    """The objective's eval sums over one eval set, all ranks; duplicated padding samples are dropped by
    gather_for_metrics."""
    model.eval()
    totals = None
    for batch in loader:
        per_row = accelerator.gather_for_metrics(objective.eval_rows(model, batch, name)).double().sum(0)
        totals = per_row if totals is None else totals + per_row
    model.train()
    return totals


def evaluate_all(accelerator, model, loaders: dict, objective) -> dict[str, float]:
    """`eval_loss` over every eval set, and per set of a mixture (`eval_loss/<source>`)."""
    return objective.eval_record({name: evaluate(accelerator, model, loader, objective, name)
                                  for name, loader in loaders.items()})


def evaluation_due(every: int | None, end: StepEnd) -> bool:
    return bool(every) and (end.step % every == 0 or end.last)


class Samples:
    """logging.samples: greedy generations at each evaluation (logged by the sampler itself)."""

    timed, time_key = True, None

    def __init__(self, sampler, every: int | None):
        self.sampler, self.every = sampler, every

    def due(self, end: StepEnd) -> bool:
        return evaluation_due(self.every, end)

    def __call__(self, end: StepEnd) -> None:
        guards.at("sample generations (every rank, same steps)", end.step)
        self.sampler(end.step)


class SaveCheckpoint:
    """The checkpoint the step's end asked for (training/checkpoint.Checkpointer decides the cadence)."""

    timed, time_key = True, "checkpoint_time_s"

    def __init__(self, checkpointer):
        self.checkpointer = checkpointer

    def due(self, end: StepEnd) -> bool:
        return end.save

    def __call__(self, end: StepEnd) -> dict:
        guards.at("saving a checkpoint", end.step)
        end.saved = self.checkpointer.save(end.state)
        return {}


class Scoring:
    """evaluation.tasks: lm-eval on the checkpoint just written, when it is one of those due (not at a stop:
    the run is leaving, the next launch scores it)."""

    timed, time_key = True, "lm_eval_time_s"

    def __init__(self, scorer):
        self.scorer = scorer

    def due(self, end: StepEnd) -> bool:
        return end.saved is not None and not end.stop and self.scorer.due(end.step)

    def __call__(self, end: StepEnd) -> dict:
        guards.at("scoring the checkpoint with lm-eval (main process; the other ranks wait)", end.step,
                  collective=False)
        return self.scorer(end.saved)


@dataclass
class Periodic:
    """What train.py hands over for the hooks beyond the run itself, each optional."""

    advance: Callable[[], None] | None = None  # the progress bar
    eval_loaders: dict | None = None
    sampler: Any = None
    scorer: Any = None


def for_run(run, periodic: Periodic) -> list[Hook]:
    """The standard hooks of a training run (`run`: loop.Run), in the order they run after a step."""
    accelerator, recipe = run.accelerator, run.recipe
    hooks: list[Hook] = [] if periodic.advance is None else [Progress(periodic.advance)]
    hooks.append(MetricsLine(accelerator, run.loss, run.scheduler, recipe.logging.every_steps, recipe.distributed))
    hooks.append(ReplicaCheck(accelerator, run.model, recipe.distributed.check_replicas_every, run.checkpointer))
    evaluated = run.plan.eval_model(run) if run.plan is not None else run.model
    hooks.append(Evaluation(accelerator, evaluated, run.loss, periodic.eval_loaders or {}, recipe.training.eval_every))
    if periodic.sampler is not None:
        hooks.append(Samples(periodic.sampler, recipe.training.eval_every))
    if run.checkpointer is not None:
        hooks.append(SaveCheckpoint(run.checkpointer))
    if periodic.scorer is not None:
        hooks.append(Scoring(periodic.scorer))
    return hooks
