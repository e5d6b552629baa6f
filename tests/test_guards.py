"""Runtime guards of train.py, each triggered by really breaking a 2-process run: a stopped rank (collective
timeout), a rank whose weights drift (replica check), ranks seeded differently (initial-weights check), and
a low loss-spread threshold. The logs are then diagnosed like a user would."""

from __future__ import annotations

import json
import re
import signal
import time

import pytest

from conftest import (assert_ok, base_recipe, kill_launch, launch, launch_script, rank_processes, start_launch,
                      write_recipe)
from disttrain.tools.diagnose import diagnose
from strategy_runs import strategy_run


@pytest.mark.launch
def test_a_stopped_rank_times_out_naming_rank_step_and_phase(tmp_path, tiny_model_dir):
    """SIGSTOP rank 1 mid-training: rank 0 waits in its next collective, warns at 80 % of the timeout and then
    fails with one line naming itself, the step and what it was doing."""
    out = tmp_path / "out"
    recipe = write_recipe(tmp_path / "r.yaml", base_recipe(
        tiny_model_dir, out, training={"max_steps": 100000}, distributed={"timeout_s": 8},
        output={"save_final_model": False, "checkpoint_at_end": False}))
    log_path = tmp_path / "run.log"
    proc = start_launch("ddp", recipe, log_path)
    stopped = None
    try:
        deadline = time.time() + 180
        while time.time() < deadline and not ((out / "metrics.jsonl").exists() and
                                              len((out / "metrics.jsonl").read_text().splitlines()) >= 3):
            assert proc.poll() is None, log_path.read_text()[-3000:]
            time.sleep(0.1)
        stopped = rank_processes(proc).get(1)
        assert stopped is not None, "rank 1 not found"
        stopped.send_signal(signal.SIGSTOP)
        deadline = time.time() + 120
        while time.time() < deadline and "a collective timed out" not in log_path.read_text():
            time.sleep(0.2)
        # SIGKILL, not SIGCONT: a continued rank 1 finds its own receive past its deadline and reports a timeout
        # too (seen once in CI), which would make it look like a waiting rank instead of the stuck one
        stopped.kill()
        assert proc.wait(timeout=120) != 0
    finally:
        if stopped is not None and stopped.is_running():
            stopped.send_signal(signal.SIGCONT)
        kill_launch(proc)
    text = log_path.read_text()
    assert "error: rank 0 of 2: a collective timed out after 8s in '" in text, text[-4000:]
    assert "warning: rank 0: no progress for" in text  # the stall warning came before the timeout
    line = next(candidate for candidate in text.splitlines() if "a collective timed out" in candidate)
    step = int(line.split("' at step ")[1].split(":")[0])
    assert step >= 3
    found = diagnose([log_path])
    timeout = next(f for f in found if f.id == "collective_timeout")
    assert timeout.details["ranks_waiting"] == [0] and timeout.details["suspect_ranks"] == [1]


@pytest.mark.launch
def test_diverging_replicas_stop_the_run_at_the_next_check(tmp_path, tiny_model_dir):
    out = tmp_path / "out"
    recipe = write_recipe(tmp_path / "r.yaml", base_recipe(
        tiny_model_dir, out, training={"max_steps": 8}, distributed={"check_replicas_every": 4},
        output={"checkpoint_every": 2}))
    proc = launch("ddp", recipe, script="tests/scripts/faulty_train.py", env={"DISTTRAIN_TEST_FAULT": "diverge"})
    assert proc.returncode != 0
    assert "error: step 4: the weights on ranks [1] differ from rank 0's" in proc.stderr
    from transformers import AutoModelForCausalLM

    first = next(name for name, _ in AutoModelForCausalLM.from_pretrained(tiny_model_dir).named_parameters())
    assert f"first differing parameter: {first}; random generator in rank 0's state on ranks []" in proc.stderr
    # checked before the step-4 checkpoint is written: the newest one named is step 2's
    assert "newest checkpoint of this run (rank 0's weights): " in proc.stderr and "step-00000002" in proc.stderr
    assert not (out / "checkpoints" / "step-00000004").exists()
    assert not (out / "final").exists()
    (tmp_path / "run.log").write_text(proc.stdout + proc.stderr)
    found = diagnose([tmp_path / "run.log"])
    assert found[0].id == "replica_mismatch" and found[0].details["ranks"] == "1"


@pytest.mark.launch
def test_differently_seeded_ranks_are_reported_and_loss_spread_warns(tmp_path, tiny_model_dir):
    """Seeding with seed + rank before the (random) LoRA init builds different weights per rank: warned before
    wrapping. DDP then broadcasts rank 0's weights, so the periodic checks pass and the run finishes. A loss
    spread threshold below the real spread between ranks triggers the loss-spread warning."""
    out = tmp_path / "out"
    recipe = write_recipe(tmp_path / "r.yaml", base_recipe(
        tiny_model_dir, out, training={"max_steps": 4}, lora={"r": 4, "alpha": 8, "dropout": 0.0},
        distributed={"check_replicas_every": 1, "loss_spread_warning": 1e-4}))
    proc = launch("ddp", recipe, script="tests/scripts/faulty_train.py", env={"DISTTRAIN_TEST_FAULT": "seed_per_rank"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "warning: ranks [1] built different initial weights than rank 0" in proc.stdout
    assert "warning: step 1: loss differs across ranks by" in proc.stdout
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(r["loss_rank_spread"] > 1e-4 for r in records if "loss" in r)
    (tmp_path / "run.log").write_text(proc.stdout + proc.stderr)
    assert "loss_spread" in [f.id for f in diagnose([tmp_path / "run.log"])]


@pytest.mark.launch
def test_correctly_seeded_lora_ranks_agree(runs, tiny_model_dir):
    """The control: train.py itself seeds every rank identically before the model and LoRA init, and the
    replicas stay equal. The strategy matrix's DDP LoRA run compares them at start and after every step."""
    run = strategy_run(runs, tiny_model_dir, "ddp", True)  # made with assert_ok: no ReplicaMismatch stopped it
    assert "check_replicas_every: 1" in (run.out / "recipe.yaml").read_text()
    assert "built different initial weights" not in run.stdout


@pytest.mark.launch
@pytest.mark.parametrize("entry", ["train.py-ddp", "train.py-fsdp", "train.py-zero3", "bench-raw", "bench-trainer",
                                   "commbench"])
def test_every_entry_point_keeps_its_process_group_until_it_exits(entry, tmp_path, tiny_model_dir):
    """Freed before os._exit (by the DDP model as main() returned, or by destroy_process_group), the last
    reference to a gloo process group runs its destructor, which joins gloo's thread with the GIL held: a
    finished rank hung forever (train.py: once in the suite's ~200 launches, 4 of 68 on a loaded machine; the
    bench's raw DDP loop: CI's bench-overhead test, killed after 20 min). Each entry point holds what owns it
    (guards.hold_until_exit) until its os._exit. (FSDP2 and DeepSpeed keep the group referenced themselves: their
    cases pin that, and fail if a later change frees it.)"""
    recipe = write_recipe(tmp_path / "r.yaml", base_recipe(tiny_model_dir, tmp_path / "out", training={"max_steps": 2},
                                                           output={"save_final_model": False,
                                                                   "checkpoint_at_end": False}))
    name, _, config = entry.partition("-")
    peer = ["--recipe", str(recipe), "--steps", "2", "--warmup", "1", "--result", str(tmp_path / "peer.json")]
    args = {"train.py": ["train.py", "--recipe", str(recipe)],
            "bench": ["scripts/bench/peers.py", config, *peer],
            "commbench": ["-m", "disttrain.tools.commbench", "--out", str(tmp_path / "comm.json"),
                          "--max-bytes", "1024"]
            }[name]
    proc = launch_script(config if name == "train.py" else "ddp", "tests/scripts/exit_probe.py", args)
    assert_ok(proc)
    alive = re.findall(r"rank (\d): process group alive at exit: (\w+)", proc.stdout)
    assert sorted(alive) == [("0", "True"), ("1", "True")], proc.stdout[-2000:]


def test_only_distributed_errors_are_explained_as_collective_failures():
    import torch

    from disttrain.runtime import guards

    guards.at("all_reduce of the step's target-token count", 12)
    gloo = RuntimeError("[third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 2000ms for recv "
                        "operation to complete")
    assert "a collective timed out" in guards.describe_collective_error(gloo)
    assert "'all_reduce of the step's target-token count' at step 12" in guards.describe_collective_error(gloo)
    nccl = torch.distributed.DistBackendError("NCCL error: remote process exited or there was a network error")
    assert "lost the connection to another rank" in guards.describe_collective_error(nccl)
    mesh = RuntimeError("Gloo connectFullMesh failed with [third_party/gloo/gloo/transport/tcp/pair.cc:152] timed out "
                        "connecting: SO_ERROR: Connection refused, remote=[127.0.0.1]:8617")  # seen after a restart
    assert "could not connect to another rank" in guards.describe_collective_error(mesh)
    assert "after torchrun restarted" not in guards.describe_collective_error(mesh)
    assert guards.describe_collective_error(OSError("Read timed out. (read timeout=10)")) is None  # a Hub download
    assert guards.describe_collective_error(ValueError("timeout")) is None
    with pytest.raises(guards.CollectiveFailure, match=r"\(cause: RuntimeError: \[third_party/gloo"):
        with guards.collective_failures_explained():
            raise gloo
    with pytest.raises(KeyError):
        with guards.collective_failures_explained():
            raise KeyError("unrelated errors pass through")


def test_torchrun_restarts_on_the_shared_store_are_warned_and_their_connect_failure_named(monkeypatch, capsys):
    from disttrain.runtime import guards

    mesh = RuntimeError("Gloo connectFullMesh failed with [third_party/gloo/gloo/transport/tcp/pair.cc:152] timed out "
                        "connecting: SO_ERROR: Connection refused, remote=[127.0.0.1]:8617")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "1")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")  # what torchrun sets unless the share is disabled
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    monkeypatch.setenv("RANK", "0")
    guards.warn_elastic_shared_store()
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in capsys.readouterr().err
    assert "after torchrun restarted" not in guards.describe_collective_error(mesh)  # first attempt: a plain failure
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert "after torchrun restarted the workers (restart 1)" in guards.describe_collective_error(mesh)
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")  # TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
    guards.warn_elastic_shared_store()
    assert capsys.readouterr().err == ""
    assert "after torchrun restarted" not in guards.describe_collective_error(mesh)


def test_loss_spread_warning_names_ranks_and_repeats_rarely():
    from disttrain.runtime.guards import LossSpreadWarning

    said = []
    warn = LossSpreadWarning(0.5, quiet_steps=100)
    record = {"loss_rank_spread": 0.8, "loss_rank_max": 7.2, "loss_rank_max_rank": 3, "loss_rank_min": 3.1,
              "loss_rank_min_rank": 0}
    warn({**record, "loss_rank_spread": 0.4}, 10, said.append)
    warn(record, 20, said.append)
    warn(record, 60, said.append)
    warn(record, 130, said.append)
    assert len(said) == 2 and "step 20" in said[0] and "rank 3: 7.2, rank 0: 3.1" in said[0]


def test_recipe_changes_ignore_what_may_change_on_resume():
    from disttrain.report.run_files import recipe_changes

    saved = {"training": {"lr": 0.01, "stop_at_step": 30}, "output": {"dir": "a"}, "data": {"path": "x"}}
    current = {"training": {"lr": 0.1, "stop_at_step": None}, "output": {"dir": "b"}, "data": {"path": "x"}}
    assert recipe_changes(saved, current) == ["training.lr: 0.01 -> 0.1"]


def test_checksum_sees_a_tiny_change_and_skips_meta_weights():
    import torch

    from disttrain.runtime.guards import parameter_checksum, replicated_parameters

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    before = parameter_checksum(model.parameters(), torch.device("cpu"))
    assert torch.equal(before, parameter_checksum(model.parameters(), torch.device("cpu")))
    with torch.no_grad():
        model[1].weight[0, 0] += 1e-6
    assert not torch.equal(before, parameter_checksum(model.parameters(), torch.device("cpu")))
    assert len(replicated_parameters(model)) == 4
    with torch.device("meta"):
        assert replicated_parameters(torch.nn.Linear(4, 4)) == []
