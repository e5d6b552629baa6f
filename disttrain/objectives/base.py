"""The objective seam: what a training batch is, what is minimised, what must exist before the first update,
and where each step's batches come from. The loop calls only the loss object's interface (`training_loss`,
`eval_loss`, the metrics window) and the step source's `windows`; train.py calls only this one; a new objective
is a new module here and a name in `objective_for`. An objective whose steps make their own batches (online RL:
generate completions with the current policy, score them, train on them) returns its own step source from
`steps(feed)`, built over the feed's rows; the loop does not change (tests/test_step_source.py proves the seam
with an objective that generates before every step)."""

from __future__ import annotations

from typing import Protocol


class Objective(Protocol):
    def collator(self, tokenizer):
        """Rows -> a micro-batch (padding, bookkeeping the loss needs)."""

    def loss(self, model):
        """The loss object the loop calls (its metrics and eval record come with it)."""

    def prepare(self, accelerator, model, loss, train_set, eval_sets: dict, eval_loaders: dict, collator) -> None:
        """Before any update and after accelerator.prepare: whatever the objective needs (a reference)."""

    def steps(self, feed):
        """The loop's step source (training/loop.StepSource): the feed itself, or one built over it."""
