"""What every acceptance item uses: the run's settings (GPU vs CPU dry run), the shared context, one
subprocess per launch with its log and deadline, the items' base recipe, and the checks of losses and exports.
Only modules the bare GPU image has are imported at the top (stdlib, disttrain.launcher/metrics); torch,
transformers and yaml are imported where used, after acceptance.py has installed the kit's wheels."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from disttrain.runtime.launcher import kill_tree, launch_command  # noqa: E402
from disttrain.metrics.log import read_metrics  # noqa: E402

PASS, FAIL, SKIP, INFO = "PASS", "FAIL", "SKIP", "INFO"
LORA = {"r": 8, "alpha": 16, "dropout": 0.0, "target_modules": "all-linear"}
MAX_LOG_TAIL = 4000


@dataclass
class Settings:
    """What differs between the GPU run and the CPU dry run."""

    device: str  # cuda / cpu (for packing_isolation.py)
    dtype: str  # bfloat16 / float32 (packing_isolation.py)
    precision: str  # the recipes' training.mixed_precision: bf16 / no
    shape: str  # gpu_figures.SHAPES key of the model built for the items
    seq: int
    steps: int  # N of the full fine-tune items; the stop is at N // 2
    micro_batch: int
    loss_rtol: float  # resumed vs uninterrupted per-step losses
    eval_rtol: float  # packed vs unpacked eval loss at init

    @classmethod
    def for_run(cls, dry_run: bool) -> Settings:
        if dry_run:
            return cls("cpu", "float32", "no", "tiny", seq=64, steps=4, micro_batch=2, loss_rtol=1e-5, eval_rtol=1e-4)
        return cls("cuda", "bfloat16", "bf16", "accept", seq=512, steps=8, micro_batch=4, loss_rtol=1e-3,
                   eval_rtol=1e-2)


class Fail(Exception):
    """The item's claim does not hold; `log` is the file whose tail explains it."""

    def __init__(self, detail: str, log: Path | None = None):
        super().__init__(detail)
        self.detail, self.log = detail, log


class Skip(Exception):
    pass


@dataclass
class Ctx:
    """The run's shared state; each item gets its own copy (`for_item`) with its name, dir, deadline and
    figures. The lock and the import cache stay shared between copies (items may run in threads)."""

    s: Settings
    work: Path
    launches_log: Path
    model_dir: Path | None = None
    corpus: Path | None = None
    params: int = 0
    item: str = ""
    item_dir: Path = Path()
    timeout: float = math.inf
    deadline: float = math.inf
    figures: dict = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    _importable: dict = field(default_factory=dict)

    def for_item(self, name: str, timeout: float) -> Ctx:
        return replace(self, item=name, item_dir=self.work / name, timeout=timeout,
                       deadline=time.monotonic() + timeout, figures={})

    def remaining(self) -> float:
        """The item's time left for its next subprocess (killed when it is up); a FAIL when none is left."""
        left = self.deadline - time.monotonic()
        if left <= 0.1:
            raise Fail(f"timed out: the item's {self.timeout:g} s were spent")
        return left

    def importable(self, module: str) -> tuple[bool, str]:
        """Imports `module` in a fresh interpreter (a broken CUDA extension fails there, not here)."""
        if module not in self._importable:
            proc = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, text=True,
                                  timeout=180)
            last = (proc.stderr.strip().splitlines() or [""])[-1]
            self._importable[module] = (proc.returncode == 0, last)
        return self._importable[module]


def run_cmd(ctx: Ctx, label: str, cmd: list[str], env: dict | None = None) -> tuple[subprocess.CompletedProcess, Path]:
    """One subprocess of the current item, from the repository root, stdout and stderr into
    <item_dir>/<label>.log (then appended to launches.log). When the item's time is up, the subprocess and
    every process under it are SIGKILLed (launcher.kill_tree). Each item gets its
    own `datasets` cache: items running side by side never write the same cache file."""
    ctx.item_dir.mkdir(parents=True, exist_ok=True)
    log = ctx.item_dir / f"{label}.log"
    env = {"HF_DATASETS_CACHE": str(ctx.item_dir / "hf_datasets"), **(env or {})}
    timeout = ctx.remaining()
    started = time.monotonic()
    with log.open("w") as sink:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", **env})
    timed_out = False
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        kill_tree(proc)
    except BaseException:
        kill_tree(proc)
        raise
    seconds = round(time.monotonic() - started, 1)
    ctx.figures.setdefault("launch_s", {})[label] = seconds  # start-up cost, to size later runs
    output = log.read_text(errors="replace") + (f"\n(killed after {timeout:.3g} s)\n" if timed_out else "")
    log.write_text(output)
    with ctx.lock, ctx.launches_log.open("a") as f:
        f.write(f"\n===== {ctx.item} / {label} (exit {proc.returncode}, {seconds:g} s): "
                f"{' '.join(f'{k}={v}' for k, v in env.items())} {' '.join(cmd)}\n{output}")
    if timed_out:
        raise Fail(f"{label}: timed out (killed with every process under it: the item's {ctx.timeout:g} s "
                   "were spent)", log)
    return subprocess.CompletedProcess(cmd, proc.returncode, output, ""), log


def error_line(proc: subprocess.CompletedProcess) -> str:
    """The line that says why a launch failed: disttrain's `error:` line, else the last exception line."""
    lines = [ln.strip() for ln in proc.stdout.splitlines() if ln.strip()]
    for pattern in ("error: ", "Error:", "Error", "error"):
        found = [ln for ln in lines if pattern in ln and not ln.startswith(("W", "[W"))]
        if found:
            return found[-1][:400]
    return lines[-1][:400] if lines else "(no output)"


def recipe(ctx: Ctx, run_dir: Path, **sections) -> dict:
    """The items' base recipe (packed text of max_seq_len, logging every step), sections merged in."""
    s = ctx.s
    tree = {
        "model": {"name_or_path": str(ctx.model_dir), "dtype": "float32", "attn_implementation": "sdpa"},
        "data": {"path": str(ctx.corpus), "format": "text", "max_seq_len": s.seq, "packing": True},
        "training": {"max_steps": s.steps, "micro_batch_size": s.micro_batch, "grad_accum": 2, "lr": 1e-4,
                     "lr_scheduler": "cosine", "warmup_steps": 1, "mixed_precision": s.precision, "seed": 7},
        "logging": {"report_to": ["none"], "every_steps": 1},
        "output": {"dir": str(run_dir)},
    }
    for name, values in sections.items():
        tree.setdefault(name, {}).update(values)
    return tree


def require_gpus(nproc: int, config: str) -> None:
    """SKIP an item whose launch needs more GPUs than this machine has."""
    import torch

    if nproc > 1 and torch.cuda.device_count() < nproc:
        raise Skip(f"needs {nproc} GPUs ({config}); this machine has {torch.cuda.device_count()}")


def train(ctx: Ctx, label: str, config: str, tree: dict, overrides: tuple[str, ...] = (),
          env: dict | None = None, nproc: int = 1) -> tuple[subprocess.CompletedProcess, Path]:
    """`accelerate launch --config_file accelerate_configs/<config>.yaml --num_processes <nproc> train.py`
    with the recipe `tree` (written next to the run); Fail with the error line when it does not exit 0."""
    import yaml

    ctx.item_dir.mkdir(parents=True, exist_ok=True)
    path = ctx.item_dir / f"{label}.yaml"
    path.write_text(yaml.safe_dump(tree, sort_keys=False))
    cmd = launch_command(config, nproc, "train.py", "--recipe", str(path), *overrides)
    proc, log = run_cmd(ctx, label, cmd, env)
    if proc.returncode != 0:
        raise Fail(f"{label} ({config}) exit {proc.returncode}: {error_line(proc)}", log)
    return proc, log


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run_dir) if "loss" in r}


def require_finite_losses(run_dir: Path, steps: int, log: Path, first: int = 1) -> dict[int, float]:
    found = losses(run_dir)
    if sorted(found) != list(range(first, steps + 1)):
        raise Fail(f"{run_dir.name}: logged steps {sorted(found)}, expected {first}..{steps}", log)
    bad = {k: v for k, v in found.items() if not math.isfinite(v)}
    if bad:
        raise Fail(f"{run_dir.name}: non-finite loss at steps {sorted(bad)}", log)
    return found


def max_rel_diff(a: dict[int, float], b: dict[int, float]) -> float:
    """Over the steps b logged."""
    return max(abs(a[k] - b[k]) / max(abs(a[k]), 1e-12) for k in b)


def check_full_export(ctx: Ctx, final: Path, log: Path) -> None:
    """final/ is a standard HF dir: from_pretrained loads it, with every weight finite."""
    import torch
    from transformers import AutoModelForCausalLM

    if not (final / "config.json").is_file():
        raise Fail(f"no exported model at {final}", log)
    with ctx.lock:  # from_pretrained patches torch's init functions while it builds: one at a time
        model = AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32)
    params = sum(p.numel() for p in model.parameters())
    if params != ctx.params:
        raise Fail(f"{final} has {params:,} parameters, the model trained has {ctx.params:,}", log)
    if not all(torch.isfinite(p).all() for p in model.parameters()):
        raise Fail(f"{final} holds non-finite weights", log)


def check_adapter_export(final: Path, log: Path) -> list[str]:
    """final/ holds a LoRA adapter (config + finite safetensors weights); returns its tensors' names."""
    import torch
    from safetensors.torch import load_file

    weights = final / "adapter_model.safetensors"
    if not ((final / "adapter_config.json").is_file() and weights.is_file()):
        raise Fail(f"no adapter exported at {final}", log)
    tensors = load_file(weights)
    if not tensors or not all(torch.isfinite(t).all() for t in tensors.values()):
        raise Fail(f"{weights}: empty or non-finite adapter weights", log)
    return sorted(tensors)

