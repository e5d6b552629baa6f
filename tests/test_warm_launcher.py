"""The warm launcher (tests/warm/) gives its forked workers what `accelerate launch` gives its own: for every
accelerate config the project ships, the same environment (the variables accelerate computes from the config
file, those torchrun sets per rank), argv, working directory and sys.path[0]. So a claim proven on its
workers is proven on what the launcher would have started; tests/README.md lists the launches that stay on
the real launcher (signals, kills, restarts, several machines, import-time variables)."""

import json
import os
import subprocess

import pytest

from conftest import REPO, assert_ok, launch_command, real_launcher

NO_WARM = os.environ.get("DISTTRAIN_WARM") == "0"
pytestmark = [pytest.mark.launch,
              pytest.mark.skipif(NO_WARM, reason="DISTTRAIN_WARM=0: every launch is real, no warm one to compare")]

CONFIGS = sorted(p.stem for p in (REPO / "accelerate_configs").glob("*.yaml"))
# what differs from one launch to the next, or between torchrun's agent and no agent (the warm launcher has
# none: its workers meet at MASTER_PORT themselves, as torchrun's do when restarts are off)
PER_LAUNCH = {"MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_ERROR_FILE",
              "TORCHELASTIC_ENABLE_FILE_TIMER", "TORCHELASTIC_TIMER_FILE", "DISTTRAIN_WARM_CPU_LOG",
              "PYTEST_CURRENT_TEST"}
# set by an import (DeepSpeed's: how torch probes CUDA; inductor's: its cache folder, at its default) in whichever
# process makes it first: a real launcher and its workers make it themselves, warm workers made it before the
# launch. Neither changes anything on these CPUs (no CUDA to probe; the folder is the default either way).
# mlflow's telemetry session id: set by its import where telemetry is on (outside CI: in a test process that
# imported mlflow at collection), unset where it is off (a launch during a test, PYTEST_CURRENT_TEST set)
SET_BY_IMPORTS = {"PYTORCH_NVML_BASED_CUDA_CHECK", "TORCHINDUCTOR_CACHE_DIR", "_MLFLOW_TELEMETRY_SESSION_ID"}


def _launch_dump(cmd: list[str], folder) -> dict:
    folder.mkdir()
    proc = subprocess.run([*cmd, str(folder)], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert_ok(proc)
    return {p.stem: json.loads(p.read_text()) for p in sorted(folder.glob("rank*.json"))}


@pytest.mark.parametrize("config", CONFIGS)
def test_warm_workers_get_what_accelerate_launch_gives_its_workers(tmp_path, config):
    nproc = 1 if config == "single_gpu" else 2
    warm_cmd = launch_command(config, nproc, "tests/scripts/dump_env.py")
    assert warm_cmd[1] == os.environ.get("DISTTRAIN_LAUNCHER"), "the suite runs without its warm launcher"
    warm = _launch_dump(warm_cmd, tmp_path / "warm")
    real = _launch_dump(real_launcher(launch_command(config, nproc, "tests/scripts/dump_env.py")), tmp_path / "real")
    assert sorted(warm) == sorted(real) == [f"rank{r}" for r in range(nproc)]
    for rank in real:
        w, r = warm[rank], real[rank]
        differing = ({k for k in set(w["env"]) | set(r["env"]) if w["env"].get(k) != r["env"].get(k)}
                     - PER_LAUNCH - SET_BY_IMPORTS)
        assert not differing, {k: (w["env"].get(k), r["env"].get(k)) for k in sorted(differing)}
        assert (w["cwd"], w["path0"], w["main"]) == (r["cwd"], r["path0"], r["main"])
        assert (w["argv"][1:], r["argv"][1:]) == ([str(tmp_path / "warm")], [str(tmp_path / "real")])


def test_a_launch_with_an_import_time_variable_of_its_own_runs_on_the_real_launcher(tmp_path):
    """HF_HOME is read when huggingface_hub is imported, which the server did with its own: such a launch is
    handed back and the client becomes `accelerate launch` (its torchrun agent's store is the proof: warm
    workers have none)."""
    def agent_store(env: dict) -> str:
        folder = tmp_path / str(len(list(tmp_path.iterdir())))
        folder.mkdir()
        proc = subprocess.run([*launch_command("ddp", 2, "tests/scripts/dump_env.py"), str(folder)], cwd=REPO,
                              capture_output=True, text=True, timeout=300, env={**os.environ, **env})
        assert_ok(proc)
        return json.loads((folder / "rank1.json").read_text())["env"]["TORCHELASTIC_USE_AGENT_STORE"]
    assert agent_store({"OMP_NUM_THREADS": "1"}) == "False"  # warm
    assert agent_store({"HF_HOME": str(tmp_path / "hf")}) == "True"  # real
    shadowing = tmp_path / "target"  # a PYTHONPATH entry holding a module the server imported (train.py's)
    shadowing.mkdir()
    (shadowing / "train.py").write_text("")
    assert agent_store({"PYTHONPATH": str(shadowing)}) == "True"  # real


def test_import_time_variables_a_worker_applies_itself_do_what_a_new_interpreter_does(tmp_path):
    """A launch with its own datasets cache (the GPU acceptance harness, the data bench), its own PYTHONPATH entry
    holding a sitecustomize (the CPU ring kernel) and its own TORCH_LOGS (the compile tests) stays warm: its worker
    applies them after the fork, and gets what `accelerate launch`'s worker gets from them at start-up."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import os, sys\nos.environ['SITECUSTOMIZED'] = sys.argv[0]\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_DATASETS_CACHE": str(tmp_path / "cache"),
           "PYTHONPATH": os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p),
           "TORCH_LOGS": "recompiles"}
    facts = {}
    for name, cmd in (("warm", launch_command("ddp", 1, "tests/scripts/dump_env.py")),
                      ("real", real_launcher(launch_command("ddp", 1, "tests/scripts/dump_env.py")))):
        folder = tmp_path / name
        folder.mkdir()
        proc = subprocess.run([*cmd, str(folder), "--imports"], cwd=REPO, capture_output=True, text=True,
                              timeout=300, env=env)
        assert_ok(proc)
        facts[name] = json.loads((folder / "rank0.json").read_text())
    assert facts["warm"]["env"]["TORCHELASTIC_USE_AGENT_STORE"] == "False"  # served warm
    assert facts["warm"]["imports"] == facts["real"]["imports"]
    assert facts["real"]["imports"] == {
        "datasets_cache": str(tmp_path / "cache"), "downloads": str(tmp_path / "cache" / "downloads"),
        "path1": str(site), "sitecustomized": facts["real"]["argv"][0], "recompiles_logged": True}
    assert facts["real"]["argv"][0].endswith("dump_env.py")  # the sitecustomize saw the script's argv


def test_free_ports_lie_below_the_kernels_ephemeral_range_where_outgoing_connections_take_theirs(monkeypatch):
    """A launch's rendezvous port is drawn below the ephemeral range (gloo's connections take their local ports
    inside it: one once took a test launch's port first), free when drawn, not from the seeded module RNG (two
    test processes seeded alike would draw alike); with no room below the range, the kernel's choice."""
    import random
    import socket

    from disttrain.runtime import launcher

    start = launcher._ephemeral_start()
    random.seed(7)
    first = [launcher.free_port() for _ in range(8)]
    random.seed(7)
    assert [launcher.free_port() for _ in range(8)] != first
    if start - launcher.LOWEST_PORT > 1000:
        assert all(launcher.LOWEST_PORT <= port < start for port in first)
    for port in first:
        with socket.socket() as s:
            s.bind(("", port))  # free
    monkeypatch.setattr(launcher, "_ephemeral_start", lambda: launcher.LOWEST_PORT + 10)
    assert launcher.free_port() >= start  # bind(0): inside the real range
