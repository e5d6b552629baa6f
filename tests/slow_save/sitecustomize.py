"""Test-only: with DISTTRAIN_TEST_SAVE_DELAY_S=N in the environment and this folder on PYTHONPATH, every
train.py process sleeps N seconds at the start of each checkpoint save, as a large model's save takes long.
Used by tests/test_resume.py to show that a preemption checkpoint survives the launcher's shutdown timeout.
With DISTTRAIN_TEST_SCORE_DELAY_S=N the main process sleeps N seconds in each scoring during training, as a
large model's lm-eval run takes long (tests/test_evaluation.py: the other ranks outlast distributed.timeout_s).
Python imports sitecustomize in every process at start-up; all other processes are left untouched."""

import os
import sys

_delay = float(os.environ.get("DISTTRAIN_TEST_SAVE_DELAY_S") or 0)
if _delay and sys.argv and sys.argv[0].endswith("train.py"):
    import time

    import accelerate

    _save_state = accelerate.Accelerator.save_state

    def _slow_save_state(self, *args, **kwargs):
        print(f"test: checkpoint save delayed by {_delay:g} s", flush=True)
        time.sleep(_delay)
        return _save_state(self, *args, **kwargs)

    accelerate.Accelerator.save_state = _slow_save_state

_score_delay = float(os.environ.get("DISTTRAIN_TEST_SCORE_DELAY_S") or 0)
if _score_delay and sys.argv and sys.argv[0].endswith("train.py"):
    import time

    from disttrain.evaluation import during_training

    _score = during_training.CheckpointScorer._score

    def _slow_score(self, checkpoint):
        print(f"test: scoring delayed by {_score_delay:g} s", flush=True)
        time.sleep(_score_delay)
        return _score(self, checkpoint)

    during_training.CheckpointScorer._score = _slow_score
