"""Where numbers go: a JSONL file in the output dir (for tests and tools), the trackers accelerate
manages (wandb / tensorboard), and a tqdm bar on the main process."""

from __future__ import annotations

import json
import time
from pathlib import Path

from tqdm.auto import tqdm

METRICS_FILE = "metrics.jsonl"


class MetricsLogger:
    def __init__(self, accelerator, out_dir: str | Path, total_steps: int, initial_step: int = 0):
        self.accelerator = accelerator
        self.path = Path(out_dir) / METRICS_FILE
        if accelerator.is_main_process and self.path.exists():
            # a resumed run repeats the steps after its checkpoint: drop their old lines (no duplicates)
            kept = [line for line in self.path.read_text().splitlines()
                    if line.strip() and json.loads(line)["step"] <= initial_step]
            self.path.write_text("".join(line + "\n" for line in kept))
        self.resumed_from = initial_step or None  # marked on the first loss line after a resume (make diagnose)
        self.bar = tqdm(total=total_steps, initial=initial_step, desc="train", unit="step",
                        disable=not accelerator.is_main_process, dynamic_ncols=True)

    def log(self, record: dict, step: int) -> None:
        """Every rank calls this; only the main process writes."""
        record = {"step": step, "time": round(time.time(), 3), **record}
        if self.resumed_from is not None and "loss" in record:
            record["resumed_from_step"], self.resumed_from = self.resumed_from, None
        if self.accelerator.is_main_process:
            with self.path.open("a") as f:
                f.write(json.dumps(record) + "\n")
            shown = {k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in record.items()
                     if k in ("loss", "lr", "grad_norm", "tokens_per_s", "eval_loss")}
            self.bar.set_postfix(shown, refresh=False)
        trackable = {k: v for k, v in record.items() if isinstance(v, (int, float)) and k != "step"}
        self.accelerator.log(trackable, step=step)

    def advance(self, n: int = 1) -> None:
        self.bar.update(n)

    def close(self) -> None:
        self.bar.close()


def read_metrics(out_dir_or_file: str | Path) -> list[dict]:
    """The records of a run's metrics.jsonl (given its output dir or the file itself)."""
    path = Path(out_dir_or_file)
    if path.is_dir():
        path = path / METRICS_FILE
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
