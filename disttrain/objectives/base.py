"""The objective seam: what a training batch is, what is minimised, and what must exist before the first
update. The loop calls only the loss object's interface (`training_loss`, `eval_loss`, the metrics window);
train.py calls only this one; a new objective is a new module here and a name in `objective_for`."""

from __future__ import annotations

from typing import Protocol


class Objective(Protocol):
    def collator(self, tokenizer):
        """Rows -> a micro-batch (padding, bookkeeping the loss needs)."""

    def loss(self, model):
        """The loss object the loop calls (its metrics and eval record come with it)."""

    def prepare(self, accelerator, model, loss, train_set, eval_sets: dict, eval_loaders: dict, collator) -> None:
        """Before any update and after accelerator.prepare: whatever the objective needs (a reference)."""
