"""Test-only: with DISTTRAIN_TEST_SAVE_DELAY_S=N in the environment and this folder on PYTHONPATH, every
train.py process sleeps N seconds at the start of each checkpoint save, as a large model's save takes long.
Used by tests/test_resume.py to show that a preemption checkpoint survives the launcher's shutdown timeout.
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
