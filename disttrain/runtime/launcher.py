"""Starting `accelerate launch` jobs from our own tools (preflight, bench) exactly as a user would, with
the output kept in a log file next to the run."""

from __future__ import annotations

import os
import random
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def cpu_ring_env() -> dict:
    """For a context-parallel launch on a CPU (preflight, bench-long): tests/cpu_ring on PYTHONPATH, the test-only
    mapping of torch's CPU attention kernel into its ring attention (torch maps only its CUDA kernels)."""
    ring = str(REPO / "tests" / "cpu_ring")
    return {"PYTHONPATH": os.pathsep.join(p for p in (ring, os.environ.get("PYTHONPATH")) if p)}


LOWEST_PORT = 20000  # the free ports handed out lie between this and the kernel's ephemeral range
_DRAW = random.SystemRandom()  # not the seeded module RNG: two test processes that seeded alike would draw alike


def free_port() -> int:
    """A port nothing listens on, below the kernel's ephemeral range. A port from bind(0) lies inside that range,
    where the kernel also picks the local ports of outgoing connections (a gloo mesh opens one per pair of ranks),
    so one of them could take it before the rendezvous binds it (seen once in the test suite: EADDRINUSE)."""
    low = _ephemeral_start()
    for _ in range(64) if low - LOWEST_PORT > 1000 else ():
        port = _DRAW.randrange(LOWEST_PORT, low)
        if _bindable(port):
            return port
    with socket.socket() as s:  # a narrow or unknown range: the kernel's choice
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ephemeral_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default start


def _bindable(port: int) -> bool:
    """Free on every interface, as the rendezvous store binds it."""
    with socket.socket() as s:
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


def launch_command(config: str | Path, nproc: int, script: str | Path, *args: str,
                   launcher_args: tuple[str, ...] = ()) -> list[str]:
    """`accelerate launch --config_file accelerate_configs/<config>.yaml [launcher_args] <script> <args>`;
    `config` may also be the path of another .yaml. DISTTRAIN_LAUNCHER, if set, names a script that takes
    `accelerate launch`'s arguments in its place: the test suite's warm launcher (tests/warm/)."""
    config_file = str(config) if str(config).endswith(".yaml") else str(REPO / "accelerate_configs" / f"{config}.yaml")
    launcher = ([os.environ["DISTTRAIN_LAUNCHER"]] if os.environ.get("DISTTRAIN_LAUNCHER")
                else ["-m", "accelerate.commands.launch"])
    return [sys.executable, *launcher, "--config_file", config_file,
            "--num_processes", str(nproc), "--main_process_port", str(free_port()), *launcher_args,
            str(REPO / script), *args]


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL a launch and every process under it. torchrun starts its workers in sessions of their own, so
    killing the launcher's process group alone would leave them running (and holding its output pipes)."""
    import psutil

    try:
        below = psutil.Process(proc.pid).children(recursive=True)  # before the parent dies and they move
    except psutil.Error:
        below = []
    for p in below:
        try:
            p.kill()
        except psutil.Error:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        proc.kill()
    proc.wait()


def run_logged(cmd: list[str], log_path: Path, timeout_s: float | None = None,
               env: dict | None = None) -> subprocess.CompletedProcess:
    """Run from the repository root (relative ds_configs paths), one CPU thread per process, `env` added to
    the environment. After `timeout_s` the launcher and every process it started are killed (returncode -9,
    the output kept)."""
    # With a timeout the launch gets its own process group, so that killing it kills the workers too (without
    # one it stays in ours: Ctrl-C reaches every process as usual).
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=timeout_s is not None,
                            env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", **(env or {})})
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        kill_tree(proc)
        stdout, stderr = proc.communicate()
        stderr += f"\n(killed after {timeout_s:g}s)"
    except BaseException:  # Ctrl-C while waiting: the own process group would not get it
        if timeout_s is not None:
            kill_tree(proc)
        raise
    log_path.write_text(stdout + "\n" + stderr)
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def why_failed(proc: subprocess.CompletedProcess) -> str:
    """"exit N", or what run_logged appended when it killed the launch at its timeout."""
    killed = re.search(r"\(killed after [\d.]+s\)$", proc.stderr or "")
    return f"{killed.group(0)[1:-1]}, its time limit" if killed else f"exit {proc.returncode}"
