"""The recipe's `evaluation:` section: lm-eval tasks scored on the checkpoints training writes, every
evaluation.every_steps, with the numbers in metrics.jsonl and the trackers (lm_eval/<task>/<metric>).

The main process rebuilds the model from the checkpoint just written (model/from_checkpoint.py, the same reading
`make eval RUN=<checkpoint>` uses, so the two give the same numbers) on its own device and scores it; the other
ranks poll the process group's store for the numbers (no collective: evaluation.wait_s bounds the wait). Reading
the checkpoint instead of the live model works alike for every strategy (FSDP and ZeRO-3 hold only shards) and
leaves the training state untouched; the RNG states
lm-eval seeds are put back, so a run with evaluation trains exactly as one without. The cost: one more copy of the
model on the main process's device while it is scored (keep the task list cheap, `limit` small)."""

from __future__ import annotations

import json
import os
import random
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

from disttrain.errors import DisttrainError
from disttrain.evaluation import harness


class CheckpointScorer:
    def __init__(self, accelerator, section):
        self.accelerator, self.section = accelerator, section
        self.manager = harness.task_manager(section.include, section.tasks)
        harness.check_tasks(self.manager, section.tasks)  # a bad task name stops the run before any step

    def due(self, step: int) -> bool:
        return step % self.section.every_steps == 0

    def __call__(self, checkpoint: Path) -> dict[str, float]:
        """Every rank calls it; all get the main process's numbers. The others wait outside any collective: they
        poll the process group's key-value store (torch's default store, which the launch's rendezvous created)
        for up to evaluation.wait_s, so a scoring longer than distributed.timeout_s (a large model, a full task)
        does not time out a collective, and a scoring that fails on the main process fails them in one line."""
        if self.accelerator.num_processes == 1:
            return self._score(checkpoint)
        from datetime import timedelta

        from torch.distributed import distributed_c10d

        store = distributed_c10d._get_default_store()
        # per torchrun attempt: a restart that kept the rendezvous store must not read an earlier attempt's reply
        key = f"disttrain/scored/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{checkpoint.name}"
        if self.accelerator.is_main_process:
            try:
                scored = self._score(checkpoint)
            except BaseException as exc:
                store.set(key, json.dumps({"error": f"{type(exc).__name__}: {str(exc).strip()[:300]}"}))
                raise
            store.set(key, json.dumps({"scored": scored}))
            return scored
        try:
            store.wait([key], timedelta(seconds=self.section.wait_s))
        except Exception as exc:  # torch's DistStoreError: the wait timed out, or the store's host went away
            if "timeout" in str(exc).lower() or "timed out" in str(exc).lower():
                raise DisttrainError(f"scoring {checkpoint} on the main process took longer than evaluation.wait_s="
                                     f"{self.section.wait_s}; raise it, or set evaluation.limit lower") from None
            raise DisttrainError(f"lost the main process while it scored {checkpoint} ({type(exc).__name__}); its "
                                 "own output names the cause") from None
        reply = json.loads(store.get(key))
        if "error" in reply:
            raise DisttrainError(f"scoring {checkpoint} failed on the main process ({reply['error']}); its own "
                                 "output has the details")
        return reply["scored"]

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
    if not (section.tasks and section.every_steps):
        return None
    if section.limit is None:
        accelerator.print("warning: evaluation.limit is unset: every example of each task is scored on the main "
                          "process at each scoring, with the model rebuilt there (host memory: the model in "
                          "model.dtype plus one more copy of its weights while the checkpoint is read; "
                          "docs/evaluation.md#during-training); set evaluation.limit to keep it cheap")
    return CheckpointScorer(accelerator, section)
