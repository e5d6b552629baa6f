"""The recipe's `evaluation:` section: lm-eval tasks scored on the checkpoints training writes, every
evaluation.every_steps, with the numbers in metrics.jsonl and the trackers (lm_eval/<task>/<metric>).

The main process rebuilds the model from the checkpoint just written (model/from_checkpoint.py, the same reading
`make eval RUN=<checkpoint>` uses, so the two give the same numbers) on its own device and scores it; the other
ranks wait at a barrier, then receive the numbers. Reading the checkpoint instead of the live model works alike
for every strategy (FSDP and ZeRO-3 hold only shards) and leaves the training state untouched; the RNG states
lm-eval seeds are put back, so a run with evaluation trains exactly as one without. The cost: one more copy of the
model on the main process's device while it is scored (keep the task list cheap, `limit` small)."""

from __future__ import annotations

import random
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

from disttrain.evaluation import harness


class CheckpointScorer:
    def __init__(self, accelerator, section):
        self.accelerator, self.section = accelerator, section
        self.manager = harness.task_manager(section.include, section.tasks)
        harness.check_tasks(self.manager, section.tasks)  # a bad task name stops the run before any step

    def due(self, step: int) -> bool:
        return step % self.section.every_steps == 0

    def __call__(self, checkpoint: Path) -> dict[str, float]:
        """Collective: every rank calls it; all get the main process's numbers."""
        from accelerate.utils import broadcast_object_list

        scored = [self._score(checkpoint) if self.accelerator.is_main_process else None]
        broadcast_object_list(scored, from_process=0)
        return scored[0]

    def _score(self, checkpoint: Path) -> dict[str, float]:
        from disttrain.model import from_checkpoint
        from disttrain.model.export import without_zero3_init

        section = self.section
        with _rng_put_back(), without_zero3_init(self.accelerator):
            model, tokenizer, _ = from_checkpoint.load(checkpoint, self.accelerator.device)
            chat = section.chat_template == "yes" or (section.chat_template == "auto" and
                                                      bool(getattr(tokenizer, "chat_template", None)))
            results = harness.evaluate_loaded(model, tokenizer, section.tasks, self.manager, chat, section.limit,
                                              section.batch_size)
            del model
        return metric_record(harness.metrics(results))


def metric_record(metrics: dict[str, dict[str, float]]) -> dict[str, float]:
    """{"lm_eval/<task>/<metric>": value}: tracker-friendly names (a filter other than `none` appended)."""
    record = {}
    for task, values in metrics.items():
        for name, value in values.items():
            metric, _, filt = name.partition(",")
            if "_stderr" not in metric:
                record[f"lm_eval/{task}/{metric if filt in ('', 'none') else f'{metric}_{filt}'}"] = value
    return record


@contextmanager
def _rng_put_back():
    """lm-eval seeds python's, numpy's and torch's generators; training continues with the states it had."""
    states = random.getstate(), np.random.get_state(), torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    try:
        yield
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.set_rng_state(states[2])
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


def scorer_for(accelerator, recipe) -> CheckpointScorer | None:
    section = recipe.evaluation
    return CheckpointScorer(accelerator, section) if section.tasks and section.every_steps else None
