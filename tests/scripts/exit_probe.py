"""Runs a distributed entry point as __main__ (`exit_probe.py train.py ARGS`, `exit_probe.py -m MODULE ARGS`)
and reports, when it calls os._exit, whether the default process group it created is still alive (tests only).
It must be: freed earlier, by whatever held its last reference, its gloo destructor can hang a finished rank
(disttrain/runtime/guards.py, hold_until_exit)."""

import gc
import os
import runpy
import sys
import weakref
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch.distributed as dist  # noqa: E402

created = []
_init, _exit = dist.init_process_group, os._exit


def init_process_group(*args, **kwargs):
    _init(*args, **kwargs)
    created.append(weakref.ref(dist.distributed_c10d._get_default_group()))


def exit_then_report(code):
    gc.collect()  # cycles too: the collector may run at any allocation between main() and os._exit
    alive = bool(created) and all(ref() is not None for ref in created)
    sys.stdout.flush()
    os.write(1, f"rank {os.environ['RANK']}: process group alive at exit: {alive}\n".encode())  # one write per rank
    _exit(code)


dist.init_process_group, os._exit = init_process_group, exit_then_report
if sys.argv[1] == "-m":
    module, sys.argv = sys.argv[2], sys.argv[2:]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
else:
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
