"""train.py with one deliberate fault, to prove that the runtime guards catch it (tests only).

DISTTRAIN_TEST_FAULT=
  diverge        rank 1 nudges its weights after every optimizer step: DDP replicas drift apart silently
  seed_per_rank  every rank seeds with seed + rank before building the model (a classic bug): different
                 LoRA initialisations on different ranks
  self_check     the chunked loss is off by 1: the start-up self-check stops every rank with one line after
                 the process group exists (an error raised deep inside a distributed run)
"""

import os
import runpy
import sys
from pathlib import Path

FAULT = os.environ["DISTTRAIN_TEST_FAULT"]
RANK = int(os.environ.get("RANK", "0"))

if FAULT not in ("diverge", "seed_per_rank", "self_check"):
    raise SystemExit(f"unknown DISTTRAIN_TEST_FAULT={FAULT}")
if FAULT == "diverge" and RANK == 1:
    import torch

    adamw_step = torch.optim.AdamW.step

    def step_then_nudge(self, *args, **kwargs):
        out = adamw_step(self, *args, **kwargs)
        with torch.no_grad():
            self.param_groups[0]["params"][0].add_(1e-3)
        return out

    torch.optim.AdamW.step = step_then_nudge
elif FAULT == "self_check":
    from disttrain.objectives.token_loss import LossEngine

    mean_loss = LossEngine.mean_loss
    LossEngine.mean_loss = lambda self, *a, **k: mean_loss(self, *a, **k) + 1.0
elif FAULT == "seed_per_rank":
    import accelerate.utils

    set_seed = accelerate.utils.set_seed
    accelerate.utils.set_seed = lambda seed, *a, **k: set_seed(seed + RANK, *a, **k)

train_py = Path(__file__).resolve().parents[2] / "train.py"
sys.path.insert(0, str(train_py.parent))
sys.argv = [str(train_py), *sys.argv[1:]]
runpy.run_path(str(train_py), run_name="__main__")
