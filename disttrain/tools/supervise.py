"""Run a node's launch as a process tree that a preemption signal reaches whole, and that ends whole.

Cluster engines signal one process: kubelet sends SIGTERM to the container's main process (the cluster entry), SLURM
to the step's processes, a Ray driver to what it started. The entry runs `make train-*`, which runs a shell, which
runs `accelerate launch` (torchrun's agent, which forwards SIGTERM to the workers and SIGKILLs them
SHUTDOWN_TIMEOUT later). Left alone, the signal kills the entry at once (rc 143): in a container that is PID 1
exiting, which takes every worker down mid-checkpoint; outside one the workers are orphaned. make and the shell also
die on SIGTERM without waiting for the launcher.

So the command runs in a process group of its own; SIGTERM / SIGINT are forwarded to that group (make, the shell and
the launcher: the launcher forwards them to its workers, each in a session of its own), and the entry returns only
when every process under it has exited: it is a child subreaper (Linux), so the launcher, orphaned when make exits
first, becomes its child and is waited for. A run that was signalled exits 128 + the signal (143), which every
engine reads as "not finished": the next start resumes from the checkpoint the workers wrote.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import time

FORWARDED = (signal.SIGTERM, signal.SIGINT)
PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h
LEFTOVER_WAIT_S = 30  # after an unsignalled run: how long a process the run left behind may take to exit


def _become_subreaper() -> bool:
    """Orphaned descendants are re-parented to this process instead of init, so it can wait for them."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _children(pid: int) -> list[int]:
    """The live processes whose parent is `pid` (/proc; empty where there is none)."""
    found = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return found
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            found.append(int(entry))
    return found


def _reap_all(deadline: float) -> bool:
    """Wait for every child (the re-parented ones too) until `deadline`; True when none is left."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return True
        if pid == 0:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.2)


def _kill_tree(group: int) -> None:
    """SIGKILL what is left: the command's group and every remaining child's own group (torchrun's workers)."""
    for pid in [group, *_children(os.getpid())]:
        for kill in (os.killpg, os.kill):
            try:
                kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def run(cmd: list[str], cwd, env: dict[str, str], shutdown_s: float) -> int:
    """Run `cmd`, forwarding SIGTERM / SIGINT to it; return its exit status, or 128 + the first signal forwarded.
    After a signal the workers have `shutdown_s` (the launcher's own SIGKILL deadline) plus a margin to exit."""
    subreaper = _become_subreaper()
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, start_new_session=True)
    received: list[int] = []

    def forward(signum, _frame):
        received.append(signum)
        try:
            os.killpg(proc.pid, signum)
        except ProcessLookupError:
            pass

    previous = {s: signal.signal(s, forward) for s in FORWARDED}
    try:
        code = proc.wait()
        if subreaper:  # the launcher and its workers may outlive make (signalled: always): wait for them too
            grace = shutdown_s + 60 if received else LEFTOVER_WAIT_S
            if not _reap_all(time.monotonic() + grace):
                print(f"supervise: processes of the run outlived it by {grace:.0f} s; killing them", flush=True)
                _kill_tree(proc.pid)
                _reap_all(time.monotonic() + 10)
        return 128 + received[0] if received else code
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
