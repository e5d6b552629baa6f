"""scripts/slurm/train.sbatch runs, for every shipped config, the cluster entry on each node (disttrain/tools/
cluster.py: SLURM's variables -> the node's `make train-*`), so each node launches what the Make target launches by
hand: the same config, processes, machines and mesh flags (HSDP, Ulysses, CP, TP, FSDP2 + TP, EP's size), from the
one definition in the Makefile. Before it took the mesh flags from there, it passed none, and every mesh config
(the shipped 2-node HSDP recipe included) was refused."""

import os
import re
import signal
import subprocess
import time

import pytest

from conftest import REPO

# config -> its make target (the configs a multi-node job runs: every one but the single process)
TARGETS = {config: "train-" + config.replace("_", "-") for config in
           ("ddp", "fsdp", "fsdp_offload", "hsdp", "fsdp_cp", "tp", "fsdp_tp", "fsdp_ep", "zero1", "zero2", "zero3",
            "zero3_offload", "zero3_ulysses")}
FLAGS = re.compile(r"--(config_file|num_processes|num_machines|machine_rank|parallelism_config_\w+)[ =](\S+)")
EP_SIZE = re.compile(r"PARALLELISM_CONFIG_EP_SIZE=(\d+)")  # expert parallelism's size: in the environment


def _arithmetic(line: str) -> str:
    """make -n prints the shell's $(( ... )) unevaluated: evaluate them as the shell would (integers)."""
    return re.sub(r"\$\(\(\s*([\d\s*/+-]+?)\s*\)\)", lambda m: str(int(eval(m.group(1).replace("/", "//")))), line)


def _flags(line: str) -> dict[str, str]:
    return {name: value for name, value in FLAGS.findall(line)}


@pytest.mark.parametrize("config", list(TARGETS))
def test_the_sbatch_line_is_the_make_targets_line(config):
    """Each node's command (the cluster entry's, from SLURM's variables) is the make target with that node's rank,
    and what make runs for it is what `make train-<config> NODES=2 NODE_RANK=1 ...` runs by hand: the same config,
    processes, machines, mesh flags and expert-parallel size."""
    env = {**os.environ, "SLURM_NNODES": "2", "MASTER_ADDR": "10.0.0.1", "GPUS_PER_NODE": "4", "STRATEGY": config,
           "DRY_RUN": "1", "RECIPE": "recipes/qwen2.5-32b/full_sft_hsdp.yaml"}
    rendered = subprocess.run(["bash", "scripts/slurm/train.sbatch"], cwd=REPO, env=env, capture_output=True,
                              text=True, timeout=60)
    assert rendered.returncode == 0, rendered.stderr
    nodes = rendered.stdout.strip().splitlines()
    assert len(nodes) == 2 and all("RECIPE=recipes/qwen2.5-32b/full_sft_hsdp.yaml" in line for line in nodes)
    assert [f"NODE_RANK={r}" in line.split() for r, line in enumerate(nodes)] == [True, True]
    assert nodes[1].split()[:5] == ["make", "-s", "-o", "tiny", TARGETS[config]]
    ours = subprocess.run(["make", "-n", *nodes[1].split()[2:]], cwd=REPO, capture_output=True, text=True, timeout=60)
    make = subprocess.run(["make", "-n", TARGETS[config], "NODES=2", "GPUS=4", "NODE_RANK=1", "MASTER_ADDR=10.0.0.1"],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    lines = [next(line for line in out.stdout.splitlines() if "launch --config_file" in line) for out in (ours, make)]
    assert _flags(_arithmetic(lines[0])) == _flags(_arithmetic(lines[1]))
    if config in ("hsdp", "fsdp_cp", "tp", "fsdp_tp", "fsdp_ep", "zero3_ulysses"):
        assert any(name.startswith("parallelism_config_") for name in _flags(lines[0]))
    assert EP_SIZE.findall(ours.stdout) == EP_SIZE.findall(make.stdout) == (["4"] if config == "fsdp_ep" else [])
    assert "TORCH_ELASTIC_SHUTDOWN_TIMEOUT=270" in ours.stdout  # below the job's --signal lead time


def test_the_log_dir_slurm_writes_to_ships_with_the_repository():
    """SLURM opens #SBATCH --output before the script runs, so logs/ must exist at submission."""
    text = (REPO / "scripts/slurm/train.sbatch").read_text()
    assert "#SBATCH --output=logs/" in text
    tracked = subprocess.run(["git", "ls-files", "logs"], cwd=REPO, capture_output=True, text=True).stdout
    assert "logs/.gitkeep" in tracked


def _in_the_step(process) -> bool:
    """A process of the fake job's step (tests/fake_slurm/srun marks them as SLURM's cgroup holds them)."""
    import psutil

    try:
        return "FAKE_SLURM_STEP" in process.environ()
    except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
        return False


@pytest.mark.launch
def test_the_shipped_hsdp_recipes_slurm_job_trains_on_two_loopback_nodes_and_survives_the_time_limit_signal(tmp_path):
    """`STRATEGY=hsdp RECIPE=recipes/qwen2.5-32b/full_sft_hsdp.yaml sbatch --nodes=2 scripts/slurm/train.sbatch`,
    run as SLURM runs it on 2 "nodes" of this machine (tests/fake_slurm: srun starts one task per node with its
    SLURM_PROCID, scontrol names the nodes): the recipe shrunk as `make preflight` shrinks it, 2 nodes x 2 CPU
    processes, HSDP replicating across the nodes and sharding within each. Mid-run, SIGTERM reaches every process
    of the step, as `#SBATCH --signal=TERM@300` sends it before the time limit: the job ends with a complete
    checkpoint and no process left, though a task that exits non-zero has srun kill the step 1 s later (the entry
    exits only after its workers); the same sbatch again resumes, trains to the end and exports."""
    import psutil

    from conftest import free_port
    from disttrain.metrics.log import read_metrics
    from disttrain.recipe.schema import load_recipe
    from disttrain.tools.preflight import build_shrunk_model, cpu_overrides

    shipped = "recipes/qwen2.5-32b/full_sft_hsdp.yaml"
    model_dir, _ = build_shrunk_model(load_recipe(REPO / shipped), tmp_path / "model")
    overrides, _ = cpu_overrides(load_recipe(REPO / shipped), model_dir, tmp_path / "run", steps=4)
    env = {**os.environ, "PATH": f"{REPO / 'tests' / 'fake_slurm'}:{os.environ['PATH']}", "OMP_NUM_THREADS": "1",
           "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "node[0-1]", "GPUS_PER_NODE": "2", "STRATEGY": "hsdp",
           "RECIPE": shipped, "MASTER_PORT": str(free_port()), "RDZV_TIMEOUT": "120", "FAKE_SLURM_LOGS": str(tmp_path),
           "ARGS": " ".join(overrides + ["logging.samples=0", "output.report=false", "output.checkpoint_every=2"])}
    env.pop("MASTER_ADDR", None)  # from scontrol, as on a cluster
    # the step-2 save sleeps 3 s; a task exiting non-zero has the step killed 1 s later (--kill-on-bad-exit's KillWait)
    slow = {"PYTHONPATH": str(REPO / "tests" / "slow_save"), "DISTTRAIN_TEST_SAVE_DELAY_S": "3",
            "FAKE_SLURM_KILL_WAIT": "1"}
    job = subprocess.Popen(["bash", "scripts/slurm/train.sbatch"], cwd=REPO, env={**env, **slow},
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    logs = [tmp_path / f"task-{rank}.log" for rank in (0, 1)]
    try:
        deadline = time.time() + 300
        while time.time() < deadline and not any(p.exists() and "save delayed" in p.read_text() for p in logs):
            time.sleep(0.1)
        step = [p for p in psutil.process_iter() if _in_the_step(p)]
        for process in step:  # slurmstepd signals every process of the step
            try:
                process.send_signal(signal.SIGTERM)
            except psutil.NoSuchProcess:
                pass
        out, _ = job.communicate(timeout=120)
    finally:
        job.kill()
    texts = [p.read_text() for p in logs]
    stopped = [line for line in texts[0].splitlines() if line.startswith("stopped at step")]
    assert stopped and len(step) >= 8, out[-2000:] + "\n".join(t[-3000:] for t in texts)
    at = int(stopped[0].split()[3].split("/")[0])
    assert (tmp_path / "run" / "checkpoints" / f"step-{at:08d}" / "manifest.json").is_file()
    assert [p for p in step if p.is_running() and p.status() != psutil.STATUS_ZOMBIE] == []
    again = subprocess.run(["bash", "scripts/slurm/train.sbatch"], cwd=REPO, env=env, capture_output=True, text=True,
                           timeout=600)
    texts = [p.read_text() for p in logs]
    assert again.returncode == 0, again.stderr[-2000:] + "\n".join(t[-3000:] for t in texts)
    assert "mesh=dp_replicate=2,dp_shard=2" in texts[0] and "processes=4" in texts[0], texts[0][-3000:]
    assert f"step-{at:08d} at step {at}/4" in texts[0]
    steps = [r["step"] for r in read_metrics(tmp_path / "run") if "loss" in r]
    assert steps == [1, 2, 3, 4] and (tmp_path / "run" / "final" / "model.safetensors").is_file()
