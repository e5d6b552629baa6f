"""What every process of every launch pays before its first step, made cheaper without changing what runs.

A launch's first seconds are imports (torch, transformers, datasets, accelerate, DeepSpeed): about a million
Python objects, created again by each process of each launch and relaunch. One cost in them is not the
libraries' work: the cyclic garbage collector, which runs again and again while those objects are created
and finds almost nothing to free. train.py pauses it from its first import until the run is set up
(`pause_collector`), then frees what set-up left in one pass and lets it run as usual (`resume_collector`).
(The other such cost, mlflow imported by `import deepspeed`, is cut where DeepSpeed is imported:
runtime/backends.py, `_import_deepspeed_without_mlflow`.)

Pausing the collector keeps no memory longer: at the end of set-up the one pass frees a few thousand small
objects and no tensor (checked on CPU under DDP, FSDP2 and ZeRO-3, full, LoRA and DPO, a 104M-parameter
model; not checked on a GPU, where loading goes through the same Python code).

Measured on a 2-process CPU launch of the tiny model (docs/benchmarks.md, "Start-up"): 1.8 CPU-s less for
DDP, 2.2 for ZeRO-3, about a tenth of the launch. This module imports nothing heavy: train.py calls it
before torch is imported.
"""

from __future__ import annotations

import gc


def pause_collector() -> None:
    gc.disable()


def resume_collector() -> None:
    """Before the training loop: free whatever cycles set-up left (once), then collect as usual."""
    gc.collect()
    gc.enable()
