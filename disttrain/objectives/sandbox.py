"""A Python tool for agentic rollouts (rl.tools: [disttrain.objectives.sandbox:python]): the code the model writes
runs in a subprocess of its own, never in the trainer, with a wall-clock and CPU-time limit, an address-space
limit, a file-size limit, no core dumps, an empty scratch directory as its working directory and home, a bare
environment, Python's isolated mode, and -- where the OS lets an unprivileged process make namespaces (Linux user
namespaces) -- a network namespace with no interface. What it prints (stdout, then stderr) is the tool's result.

A convenience, not a security boundary: the child runs as the trainer's user, can read what that user can read,
and keeps the network where namespaces are not allowed. Run untrusted policies in a container or VM of their own.
Other limits: write your own tool calling run_python(code, seconds=..., memory_mb=...).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile

OUTPUT_CHARS = 2000  # what the model sees of a long output: its end (a traceback's last line is the useful one)


def python(code: str) -> str:
    """Run a Python program and return what it prints.

    Args:
        code: The Python source to run; print the values you want to see.
    """
    return run_python(code)


# The child's first lines, before the model's code: its limits and, where allowed, a network namespace without
# interfaces. Run in the child's own interpreter rather than in a preexec_fn, which runs Python between fork and
# exec and can deadlock a parent with threads (the trainer has many).
_BOOTSTRAP = """
import resource, sys
seconds, memory = int(sys.argv[1]), int(sys.argv[2]) << 20
resource.setrlimit(resource.RLIMIT_CPU, (seconds, seconds))
resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
resource.setrlimit(resource.RLIMIT_FSIZE, (16 << 20, 16 << 20))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
try:
    import ctypes
    ctypes.CDLL(None, use_errno=True).unshare(0x10000000 | 0x40000000)  # CLONE_NEWUSER | CLONE_NEWNET
except Exception:
    pass
code, sys.argv[:] = sys.argv[3], ["-c"]
del resource, seconds, memory, sys
exec(compile(code, "<code>", "exec"), {"__name__": "__main__"})
"""


def run_python(code: str, seconds: float = 5.0, memory_mb: int = 1024) -> str:
    """`code` run by `python -I` under the limits above; its output, or what stopped it."""
    with tempfile.TemporaryDirectory(prefix="disttrain-sandbox-") as scratch:
        environment = {"PATH": "/usr/bin:/bin", "HOME": scratch, "TMPDIR": scratch, "LANG": "C.UTF-8",
                       "PYTHONDONTWRITEBYTECODE": "1", "OMP_NUM_THREADS": "1"}
        child = subprocess.Popen([sys.executable, "-I", "-c", _BOOTSTRAP, str(int(seconds) + 1), str(memory_mb), code],
                                 cwd=scratch, env=environment, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, start_new_session=True)
        try:
            output, _ = child.communicate(timeout=seconds)
        except subprocess.TimeoutExpired:
            _kill(child)
            return f"error: the program ran longer than {seconds:g} s and was stopped"
        text = output.decode("utf-8", errors="replace")
        if len(text) > OUTPUT_CHARS:
            text = "..." + text[-OUTPUT_CHARS:]
        if child.returncode < 0:
            name = signal.Signals(-child.returncode).name
            reason = "memory limit" if name in ("SIGKILL", "SIGSEGV") else \
                "CPU-time limit" if name == "SIGXCPU" else name
            return f"{text}error: the program was stopped ({name}: {reason})".lstrip()
        return text if text else "(no output)"


def _kill(child: subprocess.Popen) -> None:
    """The child and anything it started (its own session)."""
    try:
        os.killpg(child.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    child.communicate()


def isolated_from_network() -> bool:
    """Whether this machine gives the sandbox a namespace without network (what docs/rl.md's claim rests on)."""
    probe = run_python("import socket\ntry:\n    socket.create_connection(('1.1.1.1', 53), timeout=1)\n"
                       "    print('connected')\nexcept OSError as e:\n    print('refused', e.errno)")
    return "connected" not in probe
