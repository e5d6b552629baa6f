"""Resume under the conditions that break it: a mixture with per-source eval and LoRA dropout, the launcher
signalled during a slow save, a killed rank (relaunched, and restarted by torchrun itself), a save killed
mid-write, corrupt checkpoints, another world size. Exact resume per strategy from a mid-run checkpoint is
in test_strategies.py; the uninterrupted runs come from the strategy matrix (tests/strategy_runs.py)."""

import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from conftest import (REPO, assert_ok, base_recipe, free_port, kill_launch, launch, rank_processes, start_launch,
                      write_recipe)
from disttrain.tools.diagnose import diagnose
from disttrain.metrics.log import read_metrics
from strategy_runs import (CHECKPOINT_EVERY, STEPS, assert_same_run, losses, matrix_recipe, small_data,
                           strategy_run)

pytestmark = pytest.mark.launch


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_mixture_resumes_like_an_uninterrupted_run(strategy, tmp_path, tiny_model_dir, runs):
    """Two sources (alpaca, ShareGPT with tool calls) mixed 2:1 and evaluated each on its own: resumed from
    the step-5 checkpoint, the run repeats the uninterrupted one step for step, evaluations included. Under
    DDP with LoRA dropout 0.1: the dropout RNG of every rank resumes too."""
    sources = [{"path": str(small_data(runs)), "format": "alpaca", "name": "alpaca", "weight": 2},
               {"path": str(REPO / "data/tiny_sharegpt.jsonl"), "format": "sharegpt", "name": "tools",
                "weight": 1, "eval_fraction": 0.05}]
    lora = {"dropout": 0.1} if strategy == "ddp" else False
    a, b = (matrix_recipe(tmp_path, tiny_model_dir, {"sources": sources, "max_seq_len": 256}, name, lora=lora,
                          training={"eval_every": 3}) for name in ("a", "b"))
    assert_ok(launch(strategy, a))
    checkpoint = tmp_path / "a" / "checkpoints" / f"step-{CHECKPOINT_EVERY:08d}"
    second = launch(strategy, b, overrides=[f"output.resume={checkpoint}"])
    assert_ok(second)
    assert f"at step {CHECKPOINT_EVERY}/{STEPS}" in second.stdout
    assert_same_run(tmp_path / "a", tmp_path / "b", bool(lora), first_step=CHECKPOINT_EVERY + 1)
    evals = {name: {r["step"]: r["eval_loss/tools"] for r in read_metrics(tmp_path / name) if "eval_loss" in r}
             for name in ("a", "b")}
    assert sorted(evals["a"]) == [3, 6, 9, 10] and sorted(evals["b"]) == [6, 9, 10]
    assert evals["b"] == pytest.approx({s: evals["a"][s] for s in evals["b"]}, rel=1e-6)


def start_make(target: str, recipe_path: Path, log_path: Path, env=None, *make_vars: str) -> subprocess.Popen:
    """`make <target> GPUS=2 RECIPE=...` exactly as a user types it, output in log_path."""
    cmd = ["make", "-s", target, "GPUS=2", f"MASTER_PORT={free_port()}", f"RECIPE={recipe_path}", *make_vars]
    with log_path.open("w") as log:
        return subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


def signal_the_launcher_after(job: subprocess.Popen, metrics: Path, lines: int) -> None:
    """SIGTERM to the `accelerate launch` process only, as SLURM, Kubernetes or a cloud preemption signals
    the launcher: its torchrun agent forwards the signal to the workers and kills them after its timeout."""
    deadline = time.time() + 120
    while time.time() < deadline and not (metrics.exists() and len(metrics.read_text().splitlines()) >= lines):
        time.sleep(0.2)
    launchers = [p for p in psutil.Process(job.pid).children(recursive=True)
                 if "launch" in p.cmdline() and "RANK" not in p.environ()]
    assert len(launchers) == 1, [p.cmdline() for p in launchers]
    launchers[0].send_signal(signal.SIGTERM)


def test_sigterm_to_the_launcher_checkpoints_even_when_the_save_outlasts_torchs_30_s(tmp_path, tiny_model_dir, runs):
    """`make train-ddp`, the launcher signalled while the checkpoint save takes 35 s (tests/slow_save): the
    workers finish the step, checkpoint and exit before the launcher's shutdown timeout (SHUTDOWN_TIMEOUT),
    and the same command resumes from that checkpoint. Control: with a shutdown timeout shorter than the
    save, the launcher kills the workers inside it and no checkpoint is complete."""
    slow = {"PYTHONPATH": str(REPO / "tests" / "slow_save")}
    made = {}
    for name, delay, make_vars in (("control", 8, ["SHUTDOWN_TIMEOUT=3"]), ("run", 35, [])):
        r = matrix_recipe(tmp_path, tiny_model_dir, small_data(runs), name, training={"max_steps": 400},
                          output={"checkpoint_every": None})
        job = start_make("train-ddp", r, tmp_path / f"{name}.log",
                         {**slow, "DISTTRAIN_TEST_SAVE_DELAY_S": str(delay)}, *make_vars)
        try:
            started = time.time()
            signal_the_launcher_after(job, tmp_path / name / "metrics.jsonl", lines=5)
            job.wait(timeout=180)
            made[name] = (r, (tmp_path / f"{name}.log").read_text(), time.time() - started)
        finally:
            kill_launch(job)
    r, out, elapsed = made["control"]
    assert "checkpoint save delayed" in out, out[-3000:]
    assert not [p for p in (tmp_path / "control" / "checkpoints").iterdir() if p.name.startswith("step-")], out[-3000:]
    r, out, elapsed = made["run"]
    stopped = [line for line in out.splitlines() if line.startswith("stopped at step")]
    assert stopped and elapsed > 35, out[-3000:]
    step = int(stopped[0].split()[3].split("/")[0])
    assert 5 <= step < 400 and (tmp_path / "run" / "checkpoints" / f"step-{step:08d}" / "manifest.json").is_file()
    resumed = launch("ddp", r, overrides=[f"training.stop_at_step={step + 2}"])
    assert_ok(resumed)
    assert f"step-{step:08d} at step {step}/400" in resumed.stdout


def test_the_default_recipe_killed_mid_run_resumes_from_a_checkpoint_it_wrote_by_default(tmp_path):
    """`make train` as a newcomer types it (the default recipe, nothing about checkpoints on the command line),
    SIGKILLed as soon as its first checkpoint is complete, as an OOM kill or a lost node ends a run (no handler
    runs, nothing is flushed): the same command again resumes from that checkpoint and finishes the run."""
    out = tmp_path / "run"
    command = ["make", "-s", "train", f"ARGS=output.dir={out}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with (tmp_path / "killed.log").open("w") as log:
        job = subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.time() + 300
        while time.time() < deadline and job.poll() is None and not (out / "checkpoints").is_dir():
            time.sleep(0.05)
        while time.time() < deadline and job.poll() is None and not any(
                p.name.startswith("step-") for p in (out / "checkpoints").iterdir()):
            time.sleep(0.05)
    finally:
        kill_launch(job)
    killed_log = (tmp_path / "killed.log").read_text()
    saved = sorted(p.name for p in (out / "checkpoints").iterdir() if p.name.startswith("step-"))
    assert saved and not (out / "final").exists(), killed_log[-3000:]  # killed mid-run, after a checkpoint
    again = subprocess.run(command, cwd=REPO, capture_output=True, text=True, env=env, timeout=600)
    assert_ok(again)
    resumed = [line for line in again.stdout.splitlines() if line.startswith("resumed from")]
    assert resumed and f"checkpoints/{saved[-1]} at step {int(saved[-1][5:])}/" in resumed[0], again.stdout[-3000:]
    steps = [r["step"] for r in read_metrics(out) if "loss" in r]
    assert (out / "final" / "model.safetensors").is_file() and steps[-1] == int(resumed[0].split("/")[-1])


def test_the_time_cadence_alone_writes_checkpoints_mid_run(tmp_path, tiny_model_dir):
    """output.checkpoint_minutes with no step cadence: checkpoints appear mid-run, each one complete."""
    r = write_recipe(tmp_path / "r.yaml", base_recipe(
        tiny_model_dir, tmp_path / "run", training={"max_steps": 30},
        output={"checkpoint_every": None, "checkpoint_minutes": 0.0005, "checkpoint_at_end": False, "keep_last": 30,
                "save_final_model": False}))
    done = launch("single_gpu", r, nproc=1)
    assert_ok(done)
    saved = [int(p.name[5:]) for p in (tmp_path / "run" / "checkpoints").iterdir() if p.name.startswith("step-")]
    assert len(saved) >= 2 and min(saved) < 30, saved  # a save per ~30 ms of training, the end not asked for
    assert all((tmp_path / "run" / "checkpoints" / f"step-{s:08d}" / "manifest.json").is_file() for s in saved)


LONG_STEPS = 60  # long enough that a rank killed after the first checkpoint (step 10) dies mid-run


def long_recipe(folder, model_dir, data, name):
    return matrix_recipe(folder, model_dir, data, name, training={"max_steps": LONG_STEPS},
                         output={"checkpoint_every": 10})


@pytest.fixture
def long_uninterrupted(runs, tiny_model_dir) -> Path:
    """The uninterrupted DDP run that the killed-rank and elastic-restart runs must end like (launched once)."""
    def make(folder):
        assert_ok(launch("ddp", long_recipe(folder, tiny_model_dir, small_data(runs), "a")))
        return folder / "a"
    return runs.get("ddp-long", make)


def kill_rank_1_after_the_first_checkpoint(launcher, out_dir: Path) -> None:
    """SIGKILL rank 1 of a running launch as soon as its first complete checkpoint exists."""
    ckpts = out_dir / "checkpoints"
    deadline = time.time() + 120
    while time.time() < deadline and not (ckpts.is_dir() and any(p.name.startswith("step-") for p in ckpts.iterdir())):
        time.sleep(0.05)
    ranks = rank_processes(launcher)
    assert 1 in ranks, "no training process found"
    ranks[1].kill()


def test_killed_rank_then_relaunch_ends_with_the_same_weights(tmp_path, tiny_model_dir, runs, long_uninterrupted):
    """SIGKILL one rank mid-run: the job fails; the same command again resumes from the newest complete
    checkpoint and ends exactly where an uninterrupted run ends."""
    b = long_recipe(tmp_path, tiny_model_dir, small_data(runs), "b")
    log_path = tmp_path / "killed.log"
    proc = start_launch("ddp", b, log_path)
    try:
        kill_rank_1_after_the_first_checkpoint(proc, tmp_path / "b")
        assert proc.wait(timeout=120) != 0
    finally:
        kill_launch(proc)
    assert not (tmp_path / "b" / "final").exists()
    # make diagnose names the SIGKILL as the cause and the survivor's lost connection as its consequence
    found = [f.id for f in diagnose([log_path])]
    assert found[0] == "host_oom_or_killed", (found, log_path.read_text()[-3000:])
    second = launch("ddp", b)
    assert_ok(second)
    assert "resumed from" in second.stdout
    assert_same_run(long_uninterrupted, tmp_path / "b", False, steps=LONG_STEPS)


def test_elastic_restart_after_a_killed_rank_resumes_and_ends_like_an_uninterrupted_run(tmp_path, tiny_model_dir,
                                                                                        runs, long_uninterrupted):
    """`make train-ddp MAX_RESTARTS=1`: SIGKILL one rank after the first checkpoint; torchrun restarts both
    workers by itself, they resume from the newest complete checkpoint, and the job ends with exit 0 and the
    uninterrupted run's losses and weights."""
    b = long_recipe(tmp_path, tiny_model_dir, small_data(runs), "b")
    log_path = tmp_path / "elastic.log"
    job = start_make("train-ddp", b, log_path, None, "MAX_RESTARTS=1")
    try:
        kill_rank_1_after_the_first_checkpoint(job, tmp_path / "b")  # the launcher, not the test, brings it back
        assert job.wait(timeout=300) == 0, log_path.read_text()[-4000:]
    finally:
        kill_launch(job)
    out = log_path.read_text()
    # torchrun names the first worker it finds failed: the killed rank (-9), or rank 0 leaving on the lost peer
    # with its one line (guards.CollectiveFailure's exit code 3) when it gets there first
    assert re.search(r"failed \(exitcode: (-9|3)\)", out) and "resumed from" in out, out[-4000:]
    assert "shared rendezvous store" not in out  # MAX_RESTARTS set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
    # metrics continue across the restart without gap or duplicate, to the uninterrupted run's end
    assert_same_run(long_uninterrupted, tmp_path / "b", False, steps=LONG_STEPS)


def test_kill_during_a_checkpoint_write_resumes_from_the_previous_one(tmp_path, tiny_model_dir, runs):
    """SIGKILL every process the moment the step-10 checkpoint starts being written (as a node failure would):
    the half-written save is never used, the relaunch resumes from step 5 and ends like the uninterrupted run
    (the matrix's DDP run: same recipe)."""
    uninterrupted = strategy_run(runs, tiny_model_dir, "ddp", False)
    b = matrix_recipe(tmp_path, tiny_model_dir, small_data(runs), "b")
    # every save waits 3 s after its .tmp dir exists (tests/slow_save), so the kill lands inside it even on a
    # loaded machine (a save of this tiny model takes milliseconds: a busy-wait could miss it)
    proc = start_launch("ddp", b, env={"PYTHONPATH": str(REPO / "tests" / "slow_save"),
                                       "DISTTRAIN_TEST_SAVE_DELAY_S": "3"})
    tmp = tmp_path / "b" / "checkpoints" / f".tmp-step-{STEPS:08d}"
    try:
        deadline = time.time() + 180
        while time.time() < deadline and not tmp.exists() and proc.poll() is None:
            time.sleep(0.05)
    finally:
        kill_launch(proc)
    assert tmp.is_dir() and not (tmp / "manifest.json").exists(), "the kill did not land inside the save"
    assert (tmp_path / "b" / "checkpoints" / "latest").read_text() == f"step-{CHECKPOINT_EVERY:08d}"
    second = launch("ddp", b)
    assert_ok(second)
    assert f"step-{CHECKPOINT_EVERY:08d} at step {CHECKPOINT_EVERY}/" in second.stdout
    assert not list((tmp_path / "b" / "checkpoints").glob(".tmp-*")), "the half-written save was not cleaned up"
    assert_same_run(uninterrupted.out, tmp_path / "b", lora=False)


def test_interrupted_save_and_corrupt_checkpoints_are_never_loaded(tmp_path, tiny_model_dir, runs):
    """On a copy of the matrix's finished DDP run, continued to step 12."""
    finished = strategy_run(runs, tiny_model_dir, "ddp", False).out
    shutil.copytree(finished, tmp_path / "run")
    r = matrix_recipe(tmp_path, tiny_model_dir, small_data(runs), "run", training={"max_steps": 12})
    root = tmp_path / "run" / "checkpoints"
    assert (root / "latest").read_text() == f"step-{STEPS:08d}"
    # a save killed mid-way leaves a .tmp dir: resume ignores it and continues from the last complete one
    partial = root / f".tmp-step-{STEPS + 1:08d}"
    shutil.copytree(root / f"step-{STEPS:08d}", partial)
    (partial / "manifest.json").unlink()
    proc = launch("ddp", r, overrides=[f"training.stop_at_step={STEPS + 1}"])
    assert_ok(proc)
    assert f"resumed from {root / f'step-{STEPS:08d}'} at step {STEPS}/12" in proc.stdout
    # a truncated shard in the newest checkpoint is named in one line, and nothing starts
    newest = root / (root / "latest").read_text()
    assert newest.name == f"step-{STEPS + 1:08d}"
    victim = newest / "model.safetensors"
    victim.write_bytes(victim.read_bytes()[:100])
    proc = launch("ddp", r, timeout=120)
    assert proc.returncode != 0
    assert f"error: checkpoint {newest} is corrupt: model.safetensors has 100 bytes" in proc.stderr
    # an explicit path is honoured, and a missing one is an error
    proc = launch("ddp", r, overrides=[f"output.resume={tmp_path / 'nope'}"], timeout=120)
    assert proc.returncode != 0 and "output.resume=" in proc.stderr and "no such checkpoint directory" in proc.stderr


def test_world_size_change(tmp_path, tiny_model_dir, runs):
    """FSDP2 (DCP) reshards the matrix's 2-process step-5 checkpoint to 1 process when the global batch is kept
    (1 x 2 x 2 = 2 x 1 x 2 rows) and continues like the uninterrupted run; a changed global batch is refused;
    DeepSpeed explains why it cannot, naming zero_to_fp32.py."""
    data = small_data(runs)
    fsdp = strategy_run(runs, tiny_model_dir, "fsdp", False).out
    checkpoint = fsdp / "checkpoints" / f"step-{CHECKPOINT_EVERY:08d}"
    one = matrix_recipe(tmp_path, tiny_model_dir, data, "one", processes=1)
    proc = launch("fsdp", one, nproc=1, overrides=[f"output.resume={checkpoint}"])
    assert_ok(proc)
    assert "processes=1" in proc.stdout and f"at step {CHECKPOINT_EVERY}/{STEPS}" in proc.stdout
    la, lb = losses(fsdp), losses(tmp_path / "one")
    assert sorted(lb) == list(range(CHECKPOINT_EVERY + 1, STEPS + 1))
    assert lb == pytest.approx({s: la[s] for s in lb}, rel=1e-5)
    bad = launch("fsdp", one, nproc=1, overrides=[f"output.resume={checkpoint}", "training.grad_accum=1",
                                                  "output.dir=" + str(tmp_path / "bad")], timeout=120)
    assert bad.returncode != 0
    assert "set training.grad_accum so that processes x micro_batch_size x grad_accum = 4" in bad.stderr

    zero2 = strategy_run(runs, tiny_model_dir, "zero2", False).out / "checkpoints" / f"step-{CHECKPOINT_EVERY:08d}"
    proc = launch("zero2", one, nproc=1, overrides=[f"output.resume={zero2}", "output.dir=" + str(tmp_path / "z")],
                  timeout=120)
    assert proc.returncode != 0
    assert "written by 2 processes, this run has 1: DeepSpeed ZeRO shards are per rank" in proc.stderr
    script = zero2 / "zero_to_fp32.py"  # where DeepSpeed writes it
    assert script.is_file() and f"python {script} " in proc.stderr
