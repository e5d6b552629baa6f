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
model). On a GPU the pass says how much GPU memory it freed, if any (`CYCLES_HELD_GPU_MEMORY`): that much
set-up would have held for less time without the pause; the GPU acceptance run's full fine-tune items fail
when the line appears (scripts/gpu/items/finetune.py).

Measured on a 2-process CPU launch of the tiny model (docs/benchmarks.md, "Start-up"): 1.8 CPU-s less for
DDP, 2.2 for ZeRO-3, about a tenth of the launch. This module imports nothing heavy: train.py calls it
before torch is imported.
"""

from __future__ import annotations

import gc
import sys

CYCLES_HELD_GPU_MEMORY = "start-up: the garbage collector freed"


def pause_collector() -> None:
    gc.disable()


def freeze_imports() -> None:
    """Once the libraries are imported and the process group exists, before the run's own objects: everything
    alive so far (the imported modules' million objects, which live as long as the process) is moved out of the
    collector's sight (gc.freeze), so the pass at the end of set-up and every full collection in training scan
    only what set-up made after it: that pass took 0.43 CPU-s per process of a 2-process CPU launch of the tiny
    model here, 0.18 after (DDP and ZeRO-3 alike). What this leaves uncollected is the few reference cycles the
    imports themselves dropped."""
    gc.freeze()


def resume_collector() -> None:
    """Before the training loop: free whatever cycles set-up left (once), then collect as usual; on a GPU, one
    line if that pass freed 1 MiB or more of GPU memory."""
    import torch  # imported long before: a dictionary lookup

    on_gpu = torch.cuda.is_available() and torch.cuda.is_initialized()
    before = torch.cuda.memory_allocated() if on_gpu else 0
    gc.collect()
    gc.enable()
    freed_mib = (before - torch.cuda.memory_allocated()) / 2**20 if on_gpu else 0.0
    if freed_mib >= 1:
        print(f"{CYCLES_HELD_GPU_MEMORY} {freed_mib:.0f} MiB of GPU memory that set-up had left in reference "
              "cycles (held until now because the collector was paused while the run was set up)",
              file=sys.stderr, flush=True)
