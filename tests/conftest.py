"""Shared fixtures: the tiny model (built once per session, locally), recipe files, and a runner for real
`accelerate launch` jobs on CPU processes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from disttrain.launcher import free_port, launch_command  # noqa: E402, F401  (free_port: re-exported for the tests)

# Offline and quiet: the Hub is unreachable here, and tests must never try it.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_MODE", "offline")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    from disttrain.tiny import build_model_dir

    return build_model_dir(tmp_path_factory.mktemp("tiny") / "tiny-llama")


@pytest.fixture(scope="session")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def base_recipe(model_dir: Path, out_dir: Path, **sections) -> dict:
    """A small, fast recipe; `sections` are merged into the named sections."""
    recipe = {
        "model": {"name_or_path": str(model_dir), "dtype": "float32"},
        "data": {"path": str(REPO / "data/tiny_alpaca.jsonl"), "format": "alpaca", "max_seq_len": 64},
        "training": {"max_steps": 6, "micro_batch_size": 4, "grad_accum": 2, "lr": 3e-3,
                     "mixed_precision": "no", "lr_scheduler": "constant", "seed": 7},
        "logging": {"report_to": ["none"], "every_steps": 1},
        "output": {"dir": str(out_dir)},
    }
    for name, values in sections.items():
        if values is None:
            recipe[name] = None
        else:
            recipe.setdefault(name, {}).update(values)
    return recipe


def write_recipe(path: Path, recipe: dict) -> Path:
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


def launch(config, recipe_path: Path, nproc: int = 2, overrides=(), script: str = "train.py",
           extra_args=(), timeout: int = 600, env=None) -> subprocess.CompletedProcess:
    """`accelerate launch --config_file accelerate_configs/<config>.yaml` exactly as a user types it
    (`config` may also be the path of another .yaml; `extra_args` go to the launcher)."""
    cmd = launch_command(config, nproc, script, "--recipe", str(recipe_path), *overrides,
                         launcher_args=tuple(extra_args))
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout, env=full_env)


def start_launch(config, recipe_path: Path, log_path: Path | None = None, nproc: int = 2,
                 env: dict | None = None) -> subprocess.Popen:
    """`launch` in the background, to signal or kill its ranks; output goes to log_path (or is discarded)."""
    cmd = launch_command(config, nproc, "train.py", "--recipe", str(recipe_path))
    out = log_path.open("w") if log_path else subprocess.DEVNULL
    try:
        return subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
    finally:
        if log_path:
            out.close()


def rank_processes(launcher: subprocess.Popen) -> dict[int, psutil.Process]:
    """The training processes of a launch, by their RANK."""
    ranks = {}
    for child in psutil.Process(launcher.pid).children(recursive=True):
        try:
            if "RANK" in child.environ() and "train.py" in " ".join(child.cmdline()):
                ranks[int(child.environ()["RANK"])] = child
        except psutil.Error:
            continue
    return ranks


def kill_launch(launcher: subprocess.Popen) -> None:
    """SIGKILL the launcher and everything it started (a node failure; also test clean-up)."""
    if launcher.poll() is None:
        for process in psutil.Process(launcher.pid).children(recursive=True):
            process.kill()
        launcher.kill()
    launcher.wait(timeout=60)


def assert_ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, f"exit {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-6000:]}"
