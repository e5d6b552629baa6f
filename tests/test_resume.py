"""Exact resume for every strategy: stop mid-epoch with grad_accum > 1, resume, and match an uninterrupted
run step for step and weight for weight. Plus killed ranks, killed saves and corrupt checkpoints."""

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest
import torch
import yaml
from safetensors.torch import load_file

from conftest import (REPO, assert_ok, base_recipe, free_port, kill_launch, launch, rank_processes, shared_run,
                      start_launch, write_recipe)
from disttrain.diagnose import diagnose
from disttrain.metrics import read_metrics

pytestmark = pytest.mark.launch

STEPS, STOP = 10, 5
LORA = {"r": 8, "alpha": 16, "dropout": 0.1, "target_modules": ["q_proj", "v_proj"]}  # dropout: RNG must resume too


@pytest.fixture(scope="module")
def small_data(tmp_path_factory) -> Path:
    """35 rows -> 4 steps per epoch with 2 ranks x micro 2 x accum 2 (3 rows dropped): the runs cross epochs,
    and step 5 is one window into the second epoch."""
    path = tmp_path_factory.mktemp("data") / "small.jsonl"
    path.write_text("".join((REPO / "data/tiny_alpaca.jsonl").read_text().splitlines(keepends=True)[:35]))
    return path


def recipe(tmp_path, model_dir, data, name, lora=False, **output):
    sections = dict(data={"path": str(data), "max_seq_len": 48},
                    training={"max_steps": STEPS, "micro_batch_size": 2, "grad_accum": 2, "lr": 2e-3,
                              "lr_scheduler": "cosine", "warmup_steps": 2},
                    output={"checkpoint_every": 3, "keep_last": 2, **output})
    if lora:
        sections["lora"] = LORA
    return write_recipe(tmp_path / f"{name}.yaml", base_recipe(model_dir, tmp_path / name, **sections))


def losses(out):
    return {r["step"]: r["loss"] for r in read_metrics(out) if "loss" in r}


def final_weights(out, lora):
    return load_file(out / "final" / ("adapter_model.safetensors" if lora else "model.safetensors"))


def assert_same_run(a, b, lora):
    la, lb = losses(a), losses(b)
    assert sorted(lb) == list(range(1, STEPS + 1)), "metrics must have one line per step, no gap, no duplicate"
    assert lb == pytest.approx(la, rel=1e-6, abs=1e-7)
    wa, wb = final_weights(a, lora), final_weights(b, lora)
    for key in wa:
        torch.testing.assert_close(wb[key], wa[key], rtol=1e-6, atol=1e-7, msg=key)


@pytest.mark.parametrize("strategy, lora", [("ddp", False), ("fsdp", False), ("zero2", False), ("zero3", False),
                                            ("ddp", True), ("fsdp", True), ("zero2", True), ("zero3", True)])
def test_stop_and_resume_matches_uninterrupted(strategy, lora, tmp_path, tiny_model_dir, small_data):
    r = recipe(tmp_path, tiny_model_dir, small_data, "a", lora)
    assert_ok(launch(strategy, r))
    b = recipe(tmp_path, tiny_model_dir, small_data, "b", lora)
    first = launch(strategy, b, overrides=[f"training.stop_at_step={STOP}"])
    assert_ok(first)
    assert f"stopped at step {STOP}/{STEPS}" in first.stdout
    assert not (tmp_path / "b" / "final").exists()
    second = launch(strategy, b)
    assert_ok(second)
    assert f"resumed from {tmp_path / 'b' / 'checkpoints' / f'step-{STOP:08d}'} at step {STOP}/{STEPS}" in second.stdout
    assert_same_run(tmp_path / "a", tmp_path / "b", lora)
    kept = sorted(p.name for p in (tmp_path / "b" / "checkpoints").iterdir())
    assert kept == ["latest", "step-00000009", "step-00000010"]  # keep_last=2


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_mixture_stops_and_resumes_like_an_uninterrupted_run(strategy, tmp_path, tiny_model_dir, small_data):
    """Two sources (alpaca, ShareGPT with tool calls) mixed 2:1 and evaluated each on its own: stopped
    mid-epoch and resumed, the run repeats the uninterrupted one step for step, evaluations included."""
    sources = [{"path": str(small_data), "format": "alpaca", "name": "alpaca", "weight": 2},
               {"path": str(REPO / "data/tiny_sharegpt.jsonl"), "format": "sharegpt", "name": "tools",
                "weight": 1, "eval_fraction": 0.05}]
    runs = []
    for name in ("a", "b"):
        r = recipe(tmp_path, tiny_model_dir, small_data, name)
        tree = yaml.safe_load(r.read_text())
        tree["data"] = {"sources": sources, "max_seq_len": 256}
        tree["training"]["eval_every"] = 3
        r.write_text(yaml.safe_dump(tree))
        runs.append(r)
    assert_ok(launch(strategy, runs[0]))
    assert_ok(launch(strategy, runs[1], overrides=[f"training.stop_at_step={STOP}"]))
    second = launch(strategy, runs[1])
    assert_ok(second)
    assert f"at step {STOP}/{STEPS}" in second.stdout
    assert_same_run(tmp_path / "a", tmp_path / "b", False)
    evals = {name: {r["step"]: r["eval_loss/tools"] for r in read_metrics(tmp_path / name) if "eval_loss" in r}
             for name in ("a", "b")}
    assert sorted(evals["a"]) == [3, 6, 9, 10] and evals["b"] == pytest.approx(evals["a"], rel=1e-6)


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


def test_sigterm_to_the_launcher_checkpoints_even_when_the_save_outlasts_torchs_30_s(tmp_path, tiny_model_dir,
                                                                                     small_data):
    """`make train-ddp`, the launcher signalled while the checkpoint save takes 35 s (tests/slow_save): the
    workers finish the step, checkpoint and exit before the launcher's shutdown timeout (SHUTDOWN_TIMEOUT),
    and the same command resumes from that checkpoint. Control: with a shutdown timeout shorter than the
    save, the launcher kills the workers inside it and no checkpoint is complete."""
    slow = {"PYTHONPATH": str(REPO / "tests" / "slow_save")}
    runs = {}
    for name, delay, make_vars in (("control", 8, ["SHUTDOWN_TIMEOUT=3"]), ("run", 35, [])):
        r = recipe(tmp_path, tiny_model_dir, small_data, name)
        r.write_text(r.read_text().replace(f"max_steps: {STEPS}", "max_steps: 400")
                     .replace("checkpoint_every: 3", "checkpoint_every: null"))
        job = start_make("train-ddp", r, tmp_path / f"{name}.log",
                         {**slow, "DISTTRAIN_TEST_SAVE_DELAY_S": str(delay)}, *make_vars)
        try:
            started = time.time()
            signal_the_launcher_after(job, tmp_path / name / "metrics.jsonl", lines=5)
            job.wait(timeout=180)
            runs[name] = (r, (tmp_path / f"{name}.log").read_text(), time.time() - started)
        finally:
            kill_launch(job)
    r, out, elapsed = runs["control"]
    assert "checkpoint save delayed" in out, out[-3000:]
    assert not [p for p in (tmp_path / "control" / "checkpoints").iterdir() if p.name.startswith("step-")], out[-3000:]
    r, out, elapsed = runs["run"]
    stopped = [line for line in out.splitlines() if line.startswith("stopped at step")]
    assert stopped and elapsed > 35, out[-3000:]
    step = int(stopped[0].split()[3].split("/")[0])
    assert 5 <= step < 400 and (tmp_path / "run" / "checkpoints" / f"step-{step:08d}" / "manifest.json").is_file()
    resumed = launch("ddp", r, overrides=["training.max_steps=400", f"training.stop_at_step={step + 2}"])
    assert_ok(resumed)
    assert f"step-{step:08d} at step {step}/400" in resumed.stdout


LONG_STEPS = 60  # long enough that a rank killed after the first checkpoint (step 10) dies mid-run


def long_recipe(tmp_path, model_dir, data, name):
    path = recipe(tmp_path, model_dir, data, name)
    path.write_text(path.read_text().replace(f"max_steps: {STEPS}", f"max_steps: {LONG_STEPS}")
                    .replace("checkpoint_every: 3", "checkpoint_every: 10"))
    return path


@shared_run(scope="module")
def long_uninterrupted(tmp_path_factory, tiny_model_dir, small_data) -> Path:
    """The uninterrupted DDP run that the killed-rank and elastic-restart runs must end like (launched once)."""
    tmp = tmp_path_factory.mktemp("long")
    assert_ok(launch("ddp", long_recipe(tmp, tiny_model_dir, small_data, "a")))
    return tmp / "a"


def kill_rank_1_after_the_first_checkpoint(launcher, out_dir: Path) -> None:
    """SIGKILL rank 1 of a running launch as soon as its first complete checkpoint exists."""
    ckpts = out_dir / "checkpoints"
    deadline = time.time() + 120
    while time.time() < deadline and not (ckpts.is_dir() and any(p.name.startswith("step-") for p in ckpts.iterdir())):
        time.sleep(0.05)
    ranks = rank_processes(launcher)
    assert 1 in ranks, "no training process found"
    ranks[1].kill()


def test_killed_rank_then_relaunch_ends_with_the_same_weights(tmp_path, tiny_model_dir, small_data,
                                                             long_uninterrupted):
    """SIGKILL one rank mid-run: the job fails; the same command again resumes from the newest complete
    checkpoint and ends exactly where an uninterrupted run ends."""
    b = long_recipe(tmp_path, tiny_model_dir, small_data, "b")
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
    assert losses(tmp_path / "b") == pytest.approx(losses(long_uninterrupted), rel=1e-6, abs=1e-7)
    wa, wb = final_weights(long_uninterrupted, False), final_weights(tmp_path / "b", False)
    for key in wa:
        torch.testing.assert_close(wb[key], wa[key], rtol=1e-6, atol=1e-7, msg=key)


def test_elastic_restart_after_a_killed_rank_resumes_and_ends_like_an_uninterrupted_run(tmp_path, tiny_model_dir,
                                                                                        small_data,
                                                                                        long_uninterrupted):
    """`make train-ddp MAX_RESTARTS=1`: SIGKILL one rank after the first checkpoint; torchrun restarts both
    workers by itself, they resume from the newest complete checkpoint, and the job ends with exit 0 and the
    uninterrupted run's losses and weights."""
    b = long_recipe(tmp_path, tiny_model_dir, small_data, "b")
    log_path = tmp_path / "elastic.log"
    job = start_make("train-ddp", b, log_path, None, "MAX_RESTARTS=1")
    try:
        kill_rank_1_after_the_first_checkpoint(job, tmp_path / "b")  # the launcher, not the test, brings it back
        assert job.wait(timeout=300) == 0, log_path.read_text()[-4000:]
    finally:
        kill_launch(job)
    out = log_path.read_text()
    assert "failed (exitcode: -9)" in out and "resumed from" in out, out[-4000:]
    assert "shared rendezvous store" not in out  # MAX_RESTARTS set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
    la, lb = losses(long_uninterrupted), losses(tmp_path / "b")
    assert sorted(lb) == list(range(1, LONG_STEPS + 1)), "metrics continue across the restart without gap or duplicate"
    assert lb == pytest.approx(la, rel=1e-6, abs=1e-7)
    wa, wb = final_weights(long_uninterrupted, False), final_weights(tmp_path / "b", False)
    for key in wa:
        torch.testing.assert_close(wb[key], wa[key], rtol=1e-6, atol=1e-7, msg=key)


def test_kill_during_a_checkpoint_write_resumes_from_the_previous_one(tmp_path, tiny_model_dir, small_data):
    """SIGKILL every process the moment the step-6 checkpoint starts being written (as a node failure would):
    the half-written save is never used, the relaunch resumes from step 3 and ends like an uninterrupted run."""
    a = recipe(tmp_path, tiny_model_dir, small_data, "a")
    b = recipe(tmp_path, tiny_model_dir, small_data, "b")
    assert_ok(launch("ddp", a))
    # every save waits 3 s after its .tmp dir exists (tests/slow_save), so the kill lands inside it even on a
    # loaded machine (a save of this tiny model takes milliseconds: a busy-wait could miss it)
    proc = start_launch("ddp", b, env={"PYTHONPATH": str(REPO / "tests" / "slow_save"),
                                       "DISTTRAIN_TEST_SAVE_DELAY_S": "3"})
    tmp = tmp_path / "b" / "checkpoints" / ".tmp-step-00000006"
    try:
        deadline = time.time() + 180
        while time.time() < deadline and not tmp.exists() and proc.poll() is None:
            time.sleep(0.05)
    finally:
        kill_launch(proc)
    assert tmp.is_dir() and not (tmp / "manifest.json").exists(), "the kill did not land inside the save"
    assert (tmp_path / "b" / "checkpoints" / "latest").read_text() == "step-00000003"
    second = launch("ddp", b)
    assert_ok(second)
    assert "resumed from" in second.stdout and "step-00000003 at step 3/" in second.stdout
    assert not list((tmp_path / "b" / "checkpoints").glob(".tmp-*")), "the half-written save was not cleaned up"
    assert_same_run(tmp_path / "a", tmp_path / "b", lora=False)


def test_interrupted_save_and_corrupt_checkpoints_are_never_loaded(tmp_path, tiny_model_dir, small_data):
    r = recipe(tmp_path, tiny_model_dir, small_data, "run")
    assert_ok(launch("ddp", r, overrides=["training.stop_at_step=6"]))
    root = tmp_path / "run" / "checkpoints"
    assert (root / "latest").read_text() == "step-00000006"
    # a save killed mid-way leaves a .tmp dir: resume ignores it and continues from the last complete one
    partial = root / ".tmp-step-00000007"
    shutil.copytree(root / "step-00000006", partial)
    (partial / "manifest.json").unlink()
    proc = launch("ddp", r, overrides=["training.stop_at_step=7"])
    assert_ok(proc)
    assert "resumed from" in proc.stdout and "step-00000006 at step 6" in proc.stdout
    # a truncated shard in the newest checkpoint is named in one line, and nothing starts
    newest = root / (root / "latest").read_text()
    victim = newest / "model.safetensors"
    victim.write_bytes(victim.read_bytes()[:100])
    proc = launch("ddp", r, timeout=120)
    assert proc.returncode != 0
    assert f"error: checkpoint {newest} is corrupt: model.safetensors has 100 bytes" in proc.stderr
    # an explicit path is honoured, and a missing one is an error
    proc = launch("ddp", r, overrides=[f"output.resume={tmp_path / 'nope'}"], timeout=120)
    assert proc.returncode != 0 and "output.resume=" in proc.stderr and "no such checkpoint directory" in proc.stderr


def test_world_size_change(tmp_path, tiny_model_dir, small_data):
    """FSDP2 (DCP) reshards to another process count when the global batch is kept; DeepSpeed explains."""
    a = recipe(tmp_path, tiny_model_dir, small_data, "a")
    r = recipe(tmp_path, tiny_model_dir, small_data, "run")
    for path in (a, r):
        text = path.read_text().replace("micro_batch_size: 2", "micro_batch_size: 1").replace("grad_accum: 2", "grad_accum: 3")
        path.write_text(text)
    assert_ok(launch("fsdp", a))
    assert_ok(launch("fsdp", r, overrides=["training.stop_at_step=4"]))
    # 3 processes x 1 x 2 = the same global batch of 6 rows as 2 x 1 x 3
    assert_ok(launch("fsdp", r, nproc=3, overrides=["training.grad_accum=2"]))
    la, lb = losses(tmp_path / "a"), losses(tmp_path / "run")
    assert lb == pytest.approx(la, rel=1e-5)
    bad = launch("fsdp", r, nproc=3, overrides=["training.max_steps=12"], timeout=120)
    assert bad.returncode != 0 and "set training.grad_accum so that processes x micro_batch_size x grad_accum = 6" in bad.stderr

    z = recipe(tmp_path, tiny_model_dir, small_data, "z")
    assert_ok(launch("zero2", z, overrides=["training.stop_at_step=3"]))
    proc = launch("zero2", z, nproc=1, overrides=["training.grad_accum=4"], timeout=120)
    assert proc.returncode != 0
    assert "written by 2 processes, this run has 1: DeepSpeed ZeRO shards are per rank" in proc.stderr
    script = tmp_path / "z" / "checkpoints" / "step-00000003" / "zero_to_fp32.py"  # where DeepSpeed writes it
    assert script.is_file() and f"python {script} " in proc.stderr
