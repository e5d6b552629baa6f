"""The objective seam: what a training batch is, what is minimised, what must exist before the first update,
and where each step's batches come from. The loop calls only the loss object's interface (`training_loss`,
`eval_loss`, the metrics window) and the step source's `windows`; train.py calls only this one; a new objective
is a new module here and a name in `objective_for`. An objective whose steps make their own batches (online RL:
generate completions with the current policy, score them, train on them) returns its own step source from
`steps(feed)`, built over the feed's rows; the loop does not change (tests/test_step_source.py proves the seam
with an objective that generates before every step)."""

from __future__ import annotations

from typing import Protocol

import torch


class Loss(Protocol):
    """What the loop calls on an objective's loss (SFT's TokenLoss, DPO's PreferenceLoss): each holds a
    token-loss engine (token_loss.LossEngine: chunked, plain or TRL's fused head) rather than inheriting one."""

    unit_name: str  # what the step's loss is averaged over (target tokens, pairs): the loop's normalisation
    checked: bool  # the start-up self-check has run

    def check_against_model(self, accelerator, model, batch: dict) -> None:
        """Once, on the first micro-batch: the engine's loss equals the model's own, or one line and stop."""

    def units(self, batch: dict) -> torch.Tensor:
        """How many of unit_name the micro-batch holds."""

    def training_loss(self, model, batch: dict, num_items_in_batch) -> torch.Tensor:
        """The micro-batch's summed loss / num_items_in_batch (the window's units on all ranks)."""

    def window_metrics(self, accelerator) -> dict:
        """The objective's own metrics for a log line (collective where non-empty)."""

    def eval_rows(self, model, batch: dict, split: str = "eval") -> torch.Tensor:
        """[dataset rows, k] sums for evaluation of eval set `split`."""

    def eval_record(self, sums: dict) -> dict[str, float]:
        """The eval metrics from each eval set's summed eval_rows."""


class Objective(Protocol):
    def model_kwargs(self, tokenizer) -> dict:
        """How model loading builds the model for it (model/loading.load_model's head; {}: the causal LM)."""

    def collator(self, tokenizer):
        """Rows -> a micro-batch (padding, bookkeeping the loss needs)."""

    def loss(self, model):
        """The loss object the loop calls (its metrics and eval record come with it)."""

    def prepare(self, accelerator, model, loss, train_set, eval_sets: dict, eval_loaders: dict, collator) -> None:
        """Before any update and after accelerator.prepare: whatever the objective needs (a reference)."""

    def steps(self, feed):
        """The loop's step source (training/loop.StepSource): the feed itself, or one built over it."""
