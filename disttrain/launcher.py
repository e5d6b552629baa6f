"""Starting `accelerate launch` jobs from our own tools (preflight, bench) exactly as a user would, with
the output kept in a log file next to the run."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_command(config: str | Path, nproc: int, script: str | Path, *args: str,
                   launcher_args: tuple[str, ...] = ()) -> list[str]:
    """`accelerate launch --config_file accelerate_configs/<config>.yaml [launcher_args] <script> <args>`;
    `config` may also be the path of another .yaml."""
    config_file = str(config) if str(config).endswith(".yaml") else str(REPO / "accelerate_configs" / f"{config}.yaml")
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", config_file,
            "--num_processes", str(nproc), "--main_process_port", str(free_port()), *launcher_args,
            str(REPO / script), *args]


def run_logged(cmd: list[str], log_path: Path) -> subprocess.CompletedProcess:
    """Run from the repository root (relative ds_configs paths), one CPU thread per process."""
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"})
    log_path.write_text(proc.stdout + "\n" + proc.stderr)
    return proc
