"""The warm launcher's server (test-only): `accelerate launch` whose workers are forked from a process that has
already imported what train.py imports, instead of each starting a new interpreter.

Why: a 2-process launch of the tiny model costs 15-25 CPU-s, of which the training is well under 1: the rest
is the launcher and every worker importing torch, transformers, datasets, accelerate and DeepSpeed again. The
suite makes ~200 launches on 2 cores. Forked workers share those imports (copy-on-write) and start in
milliseconds.

What stays real: the launch itself is accelerate's own `launch_command` (tests/warm/client.py hands it the
argv a user types), reading the same accelerate config file, validating it and computing the workers'
environment (FSDP_*, ACCELERATE_*, the DeepSpeed config) with its own code; only torchrun's process start
(`torch.distributed.run.run`) and the single-process `subprocess.Popen` are replaced by forks with the
environment torchrun gives its workers (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT, TORCHELASTIC_*).
The workers then run the unchanged script (runpy, as `__main__`), rendezvous and train over gloo as usual.

What it does not cover, and falls back to the real launcher for: several machines, torchrun restarts
(--max_restarts), and any launch whose environment differs from this server's in a variable that is read
at import time (PYTHONPATH: the CPU ring-attention shim; HF_HOME, ...): see `_IMPORT_TIME_VARIABLES`.
Launches that signal or kill the launcher or its ranks use the real launcher too (tests/conftest.py
`start_launch`). tests/README.md lists which tests run on which.

Protocol (a Unix socket, one connection per launch): the client sends one JSON line {argv, cwd, env} with
its stdin/stdout/stderr attached (SCM_RIGHTS); the server forks a launch process that answers one JSON line,
{"fallback": true} before running anything or {"exit": code} when the launch ended. A client that goes away
(killed on a test's timeout) takes its workers with it."""

from __future__ import annotations

import json
import functools
import os
import select
import signal
import socket
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# Variables read when a module is imported (or a library starts): a launch whose environment differs from the
# server's in one of these runs on the real launcher. Anything else is read when the run reads it.
_IMPORT_TIME_VARIABLES = ("PYTHON", "HF_", "HUGGINGFACE", "TRANSFORMERS_", "DATASETS_", "TOKENIZERS_", "TORCH",
                          "PYTORCH", "DS_", "DEEPSPEED", "ACCELERATE_", "CUDA", "MKL", "KMP", "LD_", "XDG_", "HOME",
                          "MLFLOW", "BITSANDBYTES", "TRITON", "TMPDIR")
# ... except these, set by imports in the tools that launch (lm-eval's): KMP_DUPLICATE_LIB_OK (scikit-learn's) is
# read only where two OpenMP runtimes are loaded, which torch's build here never does; HF_XET_HIGH_PERFORMANCE
# (lm-eval's) only by downloads, and launches here download nothing (HF_HUB_OFFLINE)
_SET_BY_TOOLS = ("KMP_DUPLICATE_LIB_OK", "HF_XET_HIGH_PERFORMANCE")
# ... and these, which a worker applies itself after the fork as its imports would have (`_apply_in_worker`): a
# launch's own datasets cache (the GPU acceptance harness, the data bench), its own PYTHONPATH entries (the CPU ring's
# sitecustomize), torch's log settings (the compile tests' recompile log)
_APPLIED_IN_WORKER = ("HF_DATASETS_CACHE", "PYTHONPATH", "TORCH_LOGS")
# ... and those of a library the server has not imported (mlflow: DeepSpeed is imported without it), which a worker
# reads when it imports the library itself, as a new interpreter would
_LIBRARY_OF = {"MLFLOW": "mlflow"}


_START_ENV: dict = {}  # the server's environment before its imports: what a launch's environment is compared with
_SET_BY_IMPORTS: dict = {}  # what those imports set (a real worker's imports set it too)
_WORKERS_CPU_S = 0.0  # in a launch process: the CPU seconds its workers used (for TEST_CPU_LOG)


def preload() -> None:
    """What train.py imports, imported once here (and nothing run: no thread pool may exist before a fork)."""
    sys.path[0] = str(REPO)  # (not tests/warm) as for train.py
    import accelerate.commands.launch  # noqa: F401
    import torch.distributed.run  # noqa: F401
    from disttrain.runtime import backends
    import train  # noqa: F401  (its module level: the collector pause and guards)
    import datasets  # noqa: F401
    import peft  # noqa: F401
    import transformers
    from transformers.models.llama import modeling_llama  # noqa: F401
    from transformers.models.qwen3_moe import modeling_qwen3_moe  # noqa: F401

    for name in ("disttrain.recipe.schema", "disttrain.data", "disttrain.data.feed",
                 "disttrain.evaluation.during_training", "disttrain.metrics.log", "disttrain.metrics.throughput",
                 "disttrain.metrics.trackers", "disttrain.model.loading", "disttrain.objectives",
                 "disttrain.recipe.compat", "disttrain.report.run_files", "disttrain.parallel.plan",
                 "disttrain.training.checkpoint", "disttrain.training.handover", "disttrain.training.loop",
                 "disttrain.training.optim", "disttrain.training.samples",
                 # what the objectives import when a recipe asks: TRL's fused head (training.loss_impl: trl) and
                 # chat-template tools (rl.tools), the objectives' own modules
                 "disttrain.objectives.dpo", "disttrain.objectives.grpo", "disttrain.objectives.distill",
                 "disttrain.objectives.agent", "trl.trainer.utils", "trl.chat_template_utils"):
        __import__(name)
    transformers.AutoTokenizer, transformers.AutoModelForCausalLM  # noqa: B018  (resolve the lazy modules)
    # what each process would otherwise build again after the fork (found by profiling the workers of matrix
    # runs; ~0.09 CPU-s a process timed alone): transformers' checkpoint conversion table, built at the first
    # from_pretrained and kept in a module global (about a thousand regular expressions compiled); and
    # accelerate's torchao check, which FSDP2's prepare asks per parameter, each time parsing the package metadata
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping

    get_checkpoint_conversion_mapping("llama")
    import accelerate.utils.imports as accelerate_imports
    import accelerate.utils.modeling as accelerate_modeling

    accelerate_modeling.is_torchao_available = functools.cache(accelerate_imports.is_torchao_available)
    backends._import_deepspeed_without_mlflow([])  # as a DeepSpeed launch imports it
    # modules the workers imported after the fork (sampled over the same runs): datasets' load_dataset patches
    # scipy.io for streaming, ZeRO's optimizer check imports Muon, lm-eval's task index for evaluation.tasks
    for name in ("scipy.io", "deepspeed.runtime.zero.muon.muon_optimizer", "lm_eval.tasks"):
        __import__(name)
    backends.cpu_info_once()  # as a DeepSpeed launch does, and asked once here: no worker starts py-cpuinfo's
    if "cpuinfo" in sys.modules:  # processes (DeepSpeed installed)
        sys.modules["cpuinfo"].get_cpu_info()


def serve(path: str) -> None:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)  # clients wait in the queue while the imports below run
    parent = os.getppid()
    global _START_ENV, _SET_BY_IMPORTS
    _START_ENV = dict(os.environ)
    preload()
    _SET_BY_IMPORTS = {k: v for k, v in os.environ.items() if _START_ENV.get(k) != v}
    import gc

    gc.collect()
    gc.freeze()  # the imported objects stay out of the children's collections (and their pages shared)
    gc.enable()
    # Ended by the test process (SIGTERM, then it waits): every launch process reaped by then, so their CPU
    # (their workers' included) is counted in the test process's children, as a real launcher's would be.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    while True:
        ready, _, _ = select.select([listener], [], [], 1.0)
        _reap()
        if os.getppid() != parent:  # the test process is gone
            return
        if not ready:
            continue
        conn, _ = listener.accept()
        sys.stdout.flush(), sys.stderr.flush()
        if os.fork() == 0:
            listener.close()
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            try:
                code = _serve_launch(conn)
            except BaseException:  # noqa: BLE001  (anything: the client must hear an answer)
                import traceback

                traceback.print_exc()
                code = 1
            if code is not None:
                _answer(conn, {"exit": code, "workers_cpu_s": round(_WORKERS_CPU_S, 2)})
            os._exit(0)
        conn.close()


def _reap() -> None:
    """Launch processes that have ended (without this they would stay zombies, their CPU never counted)."""
    try:
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass
    except ChildProcessError:
        pass


def _answer(conn: socket.socket, message: dict) -> None:
    try:
        conn.sendall((json.dumps(message) + "\n").encode())
    except OSError:
        pass


def _receive(conn: socket.socket) -> tuple[dict, list[int]]:
    data, fds = b"", []
    while not data.endswith(b"\n"):
        chunk, new_fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
        if not chunk:
            raise ConnectionError("the client went away before its request was complete")
        data, fds = data + chunk, fds + list(new_fds)
    return json.loads(data), fds


def why_not_warm(argv: list[str], env: dict) -> str | None:
    """Only one machine, no restarts, and no import-time variable that differs from this server's."""
    for flag, ok in (("--num_machines", "1"), ("--max_restarts", "0")):
        if flag in argv and argv[argv.index(flag) + 1] != ok:
            return f"{flag} {argv[argv.index(flag) + 1]}"
    for arg in argv:
        if arg.startswith(("--machine_rank", "--main_process_ip", "--rdzv", "--deepspeed_hostfile", "--monitor")):
            return arg
    # a launch from a process that made the same imports has what they set (torch's, DeepSpeed's): not a difference
    imported = {**_START_ENV, **_SET_BY_IMPORTS}
    shadowed = _shadowed_by_pythonpath(env)
    if shadowed:  # a new interpreter would import these from the launch's own PYTHONPATH
        return f"PYTHONPATH holds modules the server imported: {shadowed[:5]}"
    not_imported = tuple(prefix for prefix, module in _LIBRARY_OF.items() if module not in sys.modules)
    differing = sorted(k for k in set(env) | set(_START_ENV) if env.get(k) not in (_START_ENV.get(k), imported.get(k))
                       and k.startswith(_IMPORT_TIME_VARIABLES) and k not in _SET_BY_TOOLS + _APPLIED_IN_WORKER
                       and not (not_imported and k.startswith(not_imported)))
    return f"environment differs in {differing}" if differing else None


def _serve_launch(conn: socket.socket) -> int | None:
    """The launch's exit code, or None when it was handed back to the client (the real launcher)."""
    request, fds = _receive(conn)
    argv, env = request["argv"], request["env"]
    reason = why_not_warm(argv, env)
    if reason:
        print(f"warm launcher: real launcher for {argv[-3:]}: {reason}", file=sys.stderr, flush=True)
        _answer(conn, {"fallback": reason})
        return None
    for target, fd in zip((0, 1, 2), fds):
        os.dup2(fd, target)
        os.close(fd)
    os.setsid()
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(env)  # (not what the server's imports set: a real worker has it only once it imports)
    import accelerate.commands.launch as accelerate_launch
    import torch.distributed.run as distrib_run

    launch = _Launch(conn, env)
    distrib_run.run = launch.torchrun  # what accelerate calls for every multi-process launch
    accelerate_launch._run_subprocess = launch.single  # ... and for a single process (simple_launcher)
    sys.argv = ["accelerate-launch", *argv]
    parser = accelerate_launch.launch_command_parser()
    try:
        accelerate_launch.launch_command(parser.parse_args(argv))
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except Exception as exc:  # noqa: BLE001  (as `accelerate launch` would: the traceback, exit 1)
        import traceback

        traceback.print_exception(exc)
        return 1
    finally:
        sys.stdout.flush(), sys.stderr.flush()
    return 0


class _Launch:
    """One launch's workers: started by fork, watched like torchrun watches them (one fails: the others are
    stopped), and killed if the client goes away."""

    def __init__(self, conn: socket.socket, request_env: dict):
        self.conn = conn
        self.request_env = request_env

    def _launcher_env(self) -> dict:
        """This launch process's environment as torchrun would pass it on: mlflow's import (through DeepSpeed's
        launch path, here in the launch process) writes a telemetry session id into os.environ, which a real
        worker has only once it imports mlflow itself."""
        return {k: v for k, v in os.environ.items() if not k.startswith("_MLFLOW_") or k in self.request_env}

    def torchrun(self, args) -> None:
        nnodes = str(args.nnodes)
        if nnodes not in ("1", "1:1") or int(args.max_restarts) != 0:
            raise RuntimeError(f"the warm launcher serves one machine without restarts, got nnodes={nnodes}")
        nproc = int(args.nproc_per_node)
        master_addr = os.environ.get("MASTER_ADDR", args.master_addr or "127.0.0.1")
        master_port = str(args.master_port)
        run_id = f"warm-{os.getpid()}"
        envs = []
        for rank in range(nproc):
            envs.append({**self._launcher_env(), "LOCAL_RANK": str(rank), "RANK": str(rank), "GROUP_RANK": "0",
                         "ROLE_RANK": str(rank), "ROLE_NAME": "default", "LOCAL_WORLD_SIZE": str(nproc),
                         "WORLD_SIZE": str(nproc), "GROUP_WORLD_SIZE": "1", "ROLE_WORLD_SIZE": str(nproc),
                         "MASTER_ADDR": master_addr, "MASTER_PORT": master_port,
                         "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
                         "TORCHELASTIC_RUN_ID": run_id, "TORCHELASTIC_USE_AGENT_STORE": "False",
                         "TORCHELASTIC_SIGNALS_TO_HANDLE": getattr(args, "signals_to_handle",
                                                                   "SIGTERM,SIGINT,SIGHUP,SIGQUIT"),
                         "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
                         "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})
        script_args = list(args.training_script_args)
        codes = self._run([(args.training_script, script_args, env) for env in envs])
        failed = {rank: code for rank, code in enumerate(codes) if code != 0}
        if failed:
            from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

            raise ChildFailedError(name=args.training_script, failures={
                rank: ProcessFailure(local_rank=rank, pid=0, exitcode=code, error_file="")
                for rank, code in failed.items()})

    def single(self, cmd, current_env, quiet) -> None:
        """accelerate's single-process launch: `[python, script, *args]` run with `current_env`."""
        if cmd[0] != sys.executable or cmd[1] == "-m":
            raise RuntimeError(f"the warm launcher runs `python script ...`, not {cmd[:3]}")
        code = self._run([(cmd[1], list(cmd[2:]), dict(current_env))])[0]
        if code != 0:
            import subprocess

            raise subprocess.CalledProcessError(returncode=code, cmd=cmd)

    def _run(self, workers: list[tuple[str, list[str], dict]]) -> list[int]:
        sys.stdout.flush(), sys.stderr.flush()
        pids = []
        for script, script_args, env in workers:
            pid = os.fork()
            if pid == 0:
                self.conn.close()
                _run_worker(script, script_args, env)
            pids.append(pid)
        codes: dict[int, int] = {}
        stopping_since = None
        while len(codes) < len(pids):
            pid, status, usage = os.wait4(-1, os.WNOHANG)
            if pid in pids:
                global _WORKERS_CPU_S
                _WORKERS_CPU_S += usage.ru_utime + usage.ru_stime
                codes[pid] = os.waitstatus_to_exitcode(status)
                if codes[pid] != 0 and stopping_since is None:  # torchrun: one failed, stop the others
                    stopping_since = time.monotonic()
                    _signal(pids, codes, signal.SIGTERM)
                continue
            if stopping_since is not None and time.monotonic() - stopping_since > 30:
                _signal(pids, codes, signal.SIGKILL)
            readable, _, _ = select.select([self.conn], [], [], 0.05)
            if readable and not self.conn.recv(1, socket.MSG_PEEK):  # the client is gone: so are its workers
                _signal(pids, codes, signal.SIGKILL)
                for p in pids:
                    if p not in codes:
                        os.waitpid(p, 0)
                os._exit(1)
        return [codes[p] for p in pids]


def _signal(pids, codes, sig) -> None:
    for p in pids:
        if p not in codes:
            try:
                os.kill(p, sig)
            except ProcessLookupError:
                pass


def _new_pythonpath(env: dict) -> list[str]:
    """The launch's PYTHONPATH entries the server's own does not have."""
    known = set(_START_ENV.get("PYTHONPATH", "").split(os.pathsep))
    return [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p not in known]


def _shadowed_by_pythonpath(env: dict) -> list[str]:
    """Modules the server imported that the launch's new PYTHONPATH entries hold too (a target dir of other
    versions): a warm worker would keep the server's, so such a launch is not served warm."""
    names = []
    for folder in _new_pythonpath(env):
        if os.path.isdir(folder):
            for entry in sorted(os.listdir(folder)):
                name = entry[:-3] if entry.endswith(".py") else entry
                if name in sys.modules and name != "sitecustomize":
                    names.append(name)
    return names


def _apply_in_worker(env: dict) -> None:
    """What the import-time variables of _APPLIED_IN_WORKER would have done in a new interpreter, where they differ
    from the server's: datasets' cache paths (datasets/config.py derives them at import), the new PYTHONPATH
    entries on sys.path after the script's folder, each one's sitecustomize.py run (python runs it at start-up),
    and torch's logging set from TORCH_LOGS (as torch's import does)."""
    cache = env.get("HF_DATASETS_CACHE")
    if cache and cache != _START_ENV.get("HF_DATASETS_CACHE"):
        import datasets.config as config

        config.HF_DATASETS_CACHE = Path(cache)
        config.DOWNLOADED_DATASETS_PATH = Path(env.get("HF_DATASETS_DOWNLOADED_DATASETS_PATH")
                                               or os.path.join(cache, config.DOWNLOADED_DATASETS_DIR))
        config.EXTRACTED_DATASETS_PATH = Path(env.get("HF_DATASETS_EXTRACTED_DATASETS_PATH")
                                              or os.path.join(config.DOWNLOADED_DATASETS_PATH,
                                                              config.EXTRACTED_DATASETS_DIR))
    added = _new_pythonpath(env)
    sys.path[1:1] = added
    for folder in added:
        site = Path(folder) / "sitecustomize.py"
        if site.is_file():  # imported as python imports it (runpy would set sys.argv[0] to its path meanwhile)
            import importlib.util

            spec = importlib.util.spec_from_file_location("sitecustomize", site)
            module = sys.modules["sitecustomize"] = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
    if env.get("TORCH_LOGS") != _START_ENV.get("TORCH_LOGS"):
        import torch._logging

        torch._logging._init_logs()


def _run_worker(script: str, script_args: list[str], env: dict) -> None:
    """In the forked worker: the environment torchrun would give it, then the script as `python -u` runs it."""
    import runpy

    code = 0
    try:
        for sig in (signal.SIGTERM, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.environ.clear()
        os.environ.update(env)
        sys.stdout.reconfigure(line_buffering=True)
        sys.argv = [script, *script_args]  # (set before a sitecustomize runs, as python sets them)
        sys.path[0] = os.path.dirname(os.path.abspath(script))
        _apply_in_worker(env)
        import torch

        torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if not isinstance(exc.code, (int, type(None))):
            print(exc.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush(), sys.stderr.flush()
        os._exit(code)


if __name__ == "__main__":
    serve(sys.argv[1])
