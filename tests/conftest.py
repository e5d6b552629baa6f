"""Shared fixtures: the tiny model (built once per session, locally), recipe files, and a runner for real
`accelerate launch` jobs on CPU processes."""

from __future__ import annotations

import atexit
import fcntl
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import psutil
import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from disttrain.runtime.launcher import free_port, launch_command  # noqa: E402, F401  (free_port: re-exported for the tests)

# Offline and quiet: the Hub is unreachable here, and tests must never try it.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_MODE", "offline")
# Each pytest process (`make test` runs two, pytest-xdist) tokenises into its own datasets cache: two launches
# preparing the same file at once would otherwise share cache files, and "rank 1 read rank 0's cache" could
# be rank 1 reading another test's cache.
_DATASETS_CACHE = tempfile.mkdtemp(prefix=f"disttrain-tests-{os.environ.get('PYTEST_XDIST_WORKER', 'main')}-")
os.environ["HF_DATASETS_CACHE"] = os.path.join(_DATASETS_CACHE, "datasets")
atexit.register(shutil.rmtree, _DATASETS_CACHE, ignore_errors=True)


def pytest_configure(config):
    """Start this test process's warm launcher (tests/warm/server.py): the suite's `accelerate launch` runs
    fork their workers from imports made once. Not for the unit tests alone (`make test-fast`), not in the
    xdist controller (it runs no test), and not with DISTTRAIN_WARM=0 (every launch on the real launcher)."""
    controller = not os.environ.get("PYTEST_XDIST_WORKER") and (config.getoption("numprocesses", None) or 0) != 0
    if controller or os.environ.get("DISTTRAIN_WARM") == "0" or "not launch" in (config.getoption("markexpr") or ""):
        return
    socket_path = os.path.join(_DATASETS_CACHE, "warm.sock")
    # the server's own output (which launches went to the real launcher, and why), kept after the session
    log = open(os.path.join(tempfile.gettempdir(),
                            f"disttrain-warm-{os.environ.get('PYTEST_XDIST_WORKER', 'main')}.log"), "w")
    server = subprocess.Popen([sys.executable, str(REPO / "tests" / "warm" / "server.py"), socket_path],
                              stdout=log, stderr=subprocess.STDOUT, cwd=REPO)

    def stop() -> None:  # waited for: its CPU and its launches' count as this process's children's
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
    atexit.register(stop)
    os.environ["DISTTRAIN_LAUNCHER"] = str(REPO / "tests" / "warm" / "client.py")
    os.environ["DISTTRAIN_WARM_SOCKET"] = socket_path


class SharedRuns:
    """Runs that several tests read, made once per test session whichever test process asks first.

    `runs.get(key, make)` calls make(folder) under a lock on `key` in a folder that every test process of the
    session sees (pytest-xdist workers share their base temp dir's parent), keeps its (pickled) result and
    gives it to every later caller, in this process or another: a process that asks while the run is being
    made waits for it. So tests are spread over the test processes freely (no groups pin them to one), and a
    run made for one claim serves every claim it can prove. A make that failed fails every test asking again,
    with its error, instead of being launched again."""

    def __init__(self, root: Path):
        self.root = root
        self.root.mkdir(parents=True, exist_ok=True)
        self._memo: dict[str, object] = {}

    def get(self, key: str, make):
        if key in self._memo:
            return self._memo[key]
        done, failed = self.root / f"{key}.result", self.root / f"{key}.failed"
        with open(self.root / f"{key}.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                if failed.exists():
                    pytest.fail(f"shared run {key} failed when another test made it:\n{failed.read_text()}")
                if not done.exists():
                    folder = self.root / key
                    shutil.rmtree(folder, ignore_errors=True)
                    folder.mkdir()
                    try:
                        value = make(folder)
                    except BaseException as exc:
                        failed.write_text(f"{type(exc).__name__}: {exc}"[-6000:])
                        raise
                    done.write_bytes(pickle.dumps(value))
                self._memo[key] = pickle.loads(done.read_bytes())
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)
        return self._memo[key]


@pytest.fixture(scope="session")
def runs(tmp_path_factory) -> SharedRuns:
    base = tmp_path_factory.getbasetemp()
    return SharedRuns((base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "shared-runs")


@pytest.fixture(scope="session")
def tiny_model_dir(runs) -> Path:
    """The tiny model, built once for every test process: the runs they share then name one model path."""
    from disttrain.tools.tiny import build_model_dir

    return runs.get("tiny-llama", lambda folder: build_model_dir(folder / "tiny-llama"))


# Tests whose wall time is longest (measured with the warm launcher: 20-60 s each), run first among the launches.
LONGEST = ("test_sigterm_to_the_launcher_checkpoints_even_when_the_save_outlasts_torchs_30_s",
           "test_acceptance_dry_run_records_every_item",
           "test_bench_data_measures_ours_floor_memory_and_the_first_step",
           "test_strategies_one_after_another_with_the_defaults",
           "test_make_eval_equals_lm_evals_command_line_on_the_same_model",
           "test_two_nodes_train_like_one")


def pytest_collection_modifyitems(config, items):
    """Longest first: the launches before the unit tests, the longest launches first (the suite's two test
    processes take tests in this order and steal from each other's end), so that what is left at the end is
    seconds-long unit tests and both processes finish together instead of one waiting on a long launch."""
    def weight(item) -> tuple[int, int]:
        launch = item.get_closest_marker("launch") is not None or item.get_closest_marker("heavy") is not None
        return (0 if launch else 1, 0 if item.originalname in LONGEST else 1)
    items.sort(key=weight)


# TEST_CPU_LOG=path: one JSON line per test with the CPU seconds it cost, its launches' processes included (the
# suite is CPU-bound on CI's 2 cores, so CPU-s, not wall time, says where the time goes; a shared run is charged
# to the test that made it). `make test TEST_CPU_LOG=/tmp/cpu.jsonl`, then sort by "cpu_s".
@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    path = os.environ.get("TEST_CPU_LOG")
    if not path:
        yield
        return
    import json
    import resource
    import time

    def cpu() -> float:
        own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime
    warm_log = Path(_DATASETS_CACHE) / "warm-cpu.log"  # the warm launcher's workers are not our children
    os.environ["DISTTRAIN_WARM_CPU_LOG"] = str(warm_log)
    warm_log.write_text("")
    start_cpu, start_wall = cpu(), time.monotonic()
    yield
    warm_cpu = sum(float(line) for line in warm_log.read_text().split())
    row = {"test": item.nodeid, "cpu_s": round(cpu() - start_cpu + warm_cpu, 1),
           "wall_s": round(time.monotonic() - start_wall, 1)}
    with open(path, "a") as log:
        log.write(json.dumps(row) + "\n")


@pytest.fixture(scope="session")
def tiny_moe_dir(runs, tiny_model_dir) -> Path:
    """A tiny Qwen3-MoE (4 experts per block, 2 per token; the published config's router loss off) with the
    tiny tokenizer, built once for every test process."""
    def make(folder: Path) -> Path:
        import torch
        from transformers import AutoTokenizer, Qwen3MoeConfig, Qwen3MoeForCausalLM

        tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
        config = Qwen3MoeConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                                mlp_only_layers=[], decoder_sparse_step=1, output_router_logits=False,
                                router_aux_loss_coef=0.001, tie_word_embeddings=False,
                                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        torch.manual_seed(0)
        Qwen3MoeForCausalLM(config).save_pretrained(folder / "tiny-moe", safe_serialization=True)
        tokenizer.save_pretrained(folder / "tiny-moe")
        return folder / "tiny-moe"
    return runs.get("tiny-moe", make)


@pytest.fixture(scope="session")
def tiny_vlm_dirs(runs) -> dict[str, Path]:
    """The tiny vision-language models (Gemma-3- and LLaVA-shaped, with their processors), built once for every
    test process."""
    from disttrain.tools.tiny import VLM_FAMILIES, build_vlm_dir

    return {family: runs.get(f"tiny-{family}-vl", lambda folder, f=family: build_vlm_dir(folder / f"tiny-{f}-vl", f))
            for family in VLM_FAMILIES}


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
        # greedy samples at the end cost ~3 CPU-s per launch (a forward per token, gathered under ZeRO-3),
        # the model card and plots ~2 s on rank 0: the tests that assert them turn them on
        "logging": {"report_to": ["none"], "every_steps": 1, "samples": 0},
        "output": {"dir": str(out_dir), "report": False},
    }
    for name, values in sections.items():
        if values is None:
            recipe[name] = None
        else:
            recipe.setdefault(name, {}).update(values)
    return recipe


def held_out(folder: Path, rows: int = 16) -> Path:
    """The first `rows` of data/tiny_alpaca_eval.jsonl (100 rows), written under the file's own name (the eval set's
    name in the logged keys): a launch's evaluations cost a forward per micro-batch of held-out rows, and what an
    evaluation proves holds on 16 of them as on 100."""
    path = folder / "tiny_alpaca_eval.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((REPO / "data/tiny_alpaca_eval.jsonl").read_text().splitlines(True)[:rows]))
    return path


def write_recipe(path: Path, recipe: dict) -> Path:
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


def launch(config, recipe_path: Path, nproc: int = 2, overrides=(), script: str = "train.py",
           extra_args=(), timeout: int = 600, env=None) -> subprocess.CompletedProcess:
    """`accelerate launch --config_file accelerate_configs/<config>.yaml` exactly as a user types it
    (`config` may also be the path of another .yaml; `extra_args` go to the launcher)."""
    return launch_script(config, script, ["--recipe", str(recipe_path), *overrides], nproc, extra_args, timeout, env)


def launch_script(config, script: str, args, nproc: int = 2, extra_args=(), timeout: int = 600,
                  env=None) -> subprocess.CompletedProcess:
    """`accelerate launch --config_file accelerate_configs/<config>.yaml SCRIPT ARGS`; its ranks are killed
    with it after `timeout`."""
    cmd = launch_command(config, nproc, script, *args, launcher_args=tuple(extra_args))
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=full_env)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_launch(proc)  # its ranks too: a hung launch must not hold the cores for the rest of the suite
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def real_launcher(cmd: list[str]) -> list[str]:
    """The command with `accelerate launch` itself in place of the warm launcher: for launches whose launcher
    or ranks a test signals or kills (the warm launcher's workers are not the launcher's children)."""
    warm = os.environ.get("DISTTRAIN_LAUNCHER")
    return [cmd[0], "-m", "accelerate.commands.launch", *cmd[2:]] if warm and cmd[1] == warm else cmd


def start_launch(config, recipe_path: Path, log_path: Path | None = None, nproc: int = 2,
                 env: dict | None = None) -> subprocess.Popen:
    """`launch` in the background, to signal or kill its ranks; output goes to log_path (or is discarded)."""
    cmd = real_launcher(launch_command(config, nproc, "train.py", "--recipe", str(recipe_path)))
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
    assert proc.returncode == 0, (f"exit {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}"
                                  f"\n--- stderr\n{proc.stderr[-6000:]}{native_crash(proc.stderr)}")


def native_crash(stderr: str) -> str:
    """A rank's crash in native code (faulthandler's "Fatal Python error: Segmentation fault" and the Python stack
    of every thread), which the stderr tail loses behind the extension-module list that follows it."""
    start = stderr.find("Fatal Python error")
    if start < 0:
        return ""
    stacks = stderr[start:].split("\nExtension modules:")[0]
    return f"\n--- a rank's native crash (faulthandler)\n{stacks[:6000]}"
