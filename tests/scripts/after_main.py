"""train.py's main(), then whether the prepared DDP model is still alive once main() returned (tests only). It
must be: freed there, it would take the last reference to the gloo process group, whose destructor can hang a
finished rank (disttrain/runtime/guards.py, hold_until_exit)."""

import gc
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import train  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

train.main(sys.argv[1:])
alive = any(isinstance(o, DistributedDataParallel) for o in gc.get_objects())
sys.stdout.flush()
line = f"rank {os.environ['RANK']}: DistributedDataParallel alive after main: {alive}\n"
os.write(1, line.encode())  # in one write: the ranks share the pipe
os._exit(0)
