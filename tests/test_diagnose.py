"""`make diagnose`: every failure class is recognised, from logs of runs really broken here on CPU where that
is possible, and from verbatim library error texts for GPU-only failures (tests/fixtures/logs)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, assert_ok, base_recipe, launch, write_recipe
from disttrain.tools.diagnose import diagnose, main

FIXTURES = Path(__file__).parent / "fixtures" / "logs"


def classes(*paths) -> list[str]:
    return [f.id for f in diagnose([Path(p) for p in paths])]


def write_log(tmp_path: Path, proc: subprocess.CompletedProcess, name: str = "run.log") -> Path:
    path = tmp_path / name
    path.write_text(proc.stdout + "\n" + proc.stderr)
    return path


# ----------------------------------------------------------------------------- GPU-only texts
@pytest.mark.parametrize("fixture, expected", [
    ("nccl_watchdog_timeout.log", "collective_timeout"),
    ("cuda_oom_rank0_only.log", "oom_one_rank"),
    ("cuda_oom_all_ranks.log", "cuda_oom"),
    ("duplicate_gpu.log", "duplicate_gpu"),
    ("device_mismatch.log", "device_mismatch"),
    ("disk_full.log", "disk_full"),
    ("zero3_export_accelerate.log", "zero3_gather_missing"),
    ("nccl_mismatch", "nccl_version_mismatch"),
    ("exit_abort_gloo.log", "native_abort"),  # a real CPU log: a rank aborted at exit after finishing
    # a real CPU log: SIGKILLed rank, torchrun restart on the shared store, connect refused
    ("elastic_shared_store.log", "elastic_shared_store"),
])
def test_gpu_failure_texts_are_named(fixture, expected):
    assert classes(FIXTURES / fixture)[0] == expected


def test_details_name_the_rank_and_the_operation():
    nccl = diagnose([FIXTURES / "nccl_watchdog_timeout.log"])[0]
    assert nccl.details["op"] == "ALLREDUCE" and nccl.details["ms"] == "1800087"
    oom = diagnose([FIXTURES / "cuda_oom_rank0_only.log"])[0]
    assert oom.details["ranks"] == ["0"] and "rank(s) 0 only" in oom.title
    dup = diagnose([FIXTURES / "duplicate_gpu.log"])[0]
    assert (dup.details["rank_a"], dup.details["rank_b"]) == ("1", "0")
    mismatch = diagnose([FIXTURES / "nccl_mismatch"])
    assert mismatch[0].id == "nccl_version_mismatch"


def test_unknown_log_exits_1_and_missing_path_exits_2(tmp_path, capsys):
    clean = tmp_path / "fine.log"
    clean.write_text("train: 100%|██████████| 6/6\nfinal model: out/final\n")
    assert main([str(clean)]) == 1
    assert "no known failure pattern" in capsys.readouterr().out
    assert main([str(tmp_path / "nope.log")]) == 2
    assert main([str(FIXTURES / "disk_full.log"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report[0]["id"] == "disk_full" and report[0]["docs"].endswith("#disk-full")


def test_every_class_has_a_troubleshooting_section():
    from disttrain.tools.diagnose import RULES

    doc = (REPO / "docs" / "troubleshooting.md").read_text()
    for rule in RULES + [type("R", (), {"id": "oom_one_rank"}), type("R", (), {"id": "rank_failed"})]:
        assert f'<a id="{rule.id.replace("_", "-")}"></a>' in doc, rule.id


# ----------------------------------------------------------------------------- runs broken on CPU
@pytest.mark.launch
def test_port_taken_on_the_master_node(tmp_path, tiny_model_dir):
    recipe = write_recipe(tmp_path / "r.yaml", base_recipe(tiny_model_dir, tmp_path / "out"))
    with socket.socket() as holder:
        holder.bind(("0.0.0.0", 0))
        holder.listen()
        port = holder.getsockname()[1]
        # the launcher itself (multi-node rank 0) refuses the taken port
        proc = launch("ddp", recipe, nproc=2, extra_args=["--num_machines", "2", "--machine_rank", "0",
                                                          "--main_process_ip", "127.0.0.1", "--main_process_port",
                                                          str(port)], timeout=120)
        assert proc.returncode != 0
        found = diagnose([write_log(tmp_path, proc)])
        assert found[0].id == "port_in_use" and found[0].details["port"] == str(port)
        # our pre-launch check (Makefile) names the owner: this test process
        check = subprocess.run([sys.executable, "-m", "disttrain.runtime.ports", "--port", str(port), "--nodes", "2"],
                               cwd=REPO, capture_output=True, text=True)
        assert check.returncode == 2
        assert f"port {port} is already in use, held by pid " in check.stderr and "MASTER_PORT=" in check.stderr
        single = subprocess.run([sys.executable, "-m", "disttrain.runtime.ports", "--port", str(port)], cwd=REPO,
                                capture_output=True, text=True)
        assert single.returncode == 0 and "warning:" in single.stderr  # one node: accelerate moves on
        make = subprocess.run(["make", "train-ddp", "NODES=2", "NODE_RANK=0", "GPUS=1", f"MASTER_PORT={port}",
                               f"RECIPE={recipe}"], cwd=REPO, capture_output=True, text=True, timeout=300)
        assert make.returncode != 0 and f"rendezvous port {port} is already in use" in make.stderr
        assert "run: strategy" not in make.stdout and not (tmp_path / "out").exists()  # nothing was launched
    free = subprocess.run([sys.executable, "-m", "disttrain.runtime.ports", "--port", str(port), "--nodes", "2"],
                          cwd=REPO, capture_output=True, text=True)
    assert free.returncode == 0 and free.stderr == ""


@pytest.mark.launch
def test_missing_accelerate_config_and_bad_recipe(tmp_path, tiny_model_dir):
    recipe = write_recipe(tmp_path / "r.yaml", base_recipe(tiny_model_dir, tmp_path / "out"))
    proc = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                           "accelerate_configs/zero4.yaml", "train.py", "--recipe", str(recipe)],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    found = diagnose([write_log(tmp_path, proc, "cfg.log")])
    assert found[0].id == "missing_accelerate_config" and found[0].details["file"] == "accelerate_configs/zero4.yaml"

    # no --config_file and no default config (empty HF_HOME): accelerate warns and uses defaults; the bad
    # recipe value then stops train.py with one line
    bad = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "1", "train.py",
                          "--recipe", str(recipe), "training.lr=fast"], cwd=REPO, capture_output=True, text=True,
                         timeout=120, env={**os.environ, "HF_HOME": str(tmp_path / "hf_home")})
    assert bad.returncode != 0
    found = diagnose([write_log(tmp_path, bad, "recipe.log")])
    assert found[0].id == "user_error" and "training.lr" in found[0].details["message"]
    assert "missing_accelerate_config" in [f.id for f in found]


@pytest.mark.launch
def test_zero3_without_16bit_gather_fails_before_training(tmp_path, tiny_model_dir):
    ds = json.loads((REPO / "ds_configs" / "zero3.json").read_text())
    ds["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = False
    (tmp_path / "zero3_nogather.json").write_text(json.dumps(ds))
    config = (REPO / "accelerate_configs" / "zero3.yaml").read_text().replace(
        "ds_configs/zero3.json", str(tmp_path / "zero3_nogather.json"))
    config_path = tmp_path / "zero3_nogather.yaml"
    config_path.write_text(config)
    recipe = write_recipe(tmp_path / "r.yaml", base_recipe(tiny_model_dir, tmp_path / "out"))
    proc = launch(config_path, recipe, timeout=300)
    assert proc.returncode != 0
    assert "stage3_gather_16bit_weights_on_model_save unset or false cannot export" in proc.stderr
    assert not (tmp_path / "out" / "metrics.jsonl").exists(), "it trained before failing"
    assert classes(write_log(tmp_path, proc))[0] == "zero3_gather_missing"


@pytest.mark.launch
def test_loss_jump_after_a_resume_on_other_data(tmp_path, tiny_model_dir):
    out = tmp_path / "out"
    recipe = write_recipe(tmp_path / "r.yaml", base_recipe(
        tiny_model_dir, out, training={"max_steps": 40, "lr": 1e-2}, output={"checkpoint_every": 30}))
    # one process: what is diagnosed is the metrics of a resume on other data, whatever the strategy
    assert_ok(launch("single_gpu", recipe, nproc=1, overrides=["training.stop_at_step=30"]))
    assert classes(out) == []  # a clean run has nothing to report
    # the "resumed" run reads other data (random characters) and asks for another learning rate
    rng = __import__("random").Random(0)
    noise = tmp_path / "noise.jsonl"
    noise.write_text("".join(json.dumps({"text": "".join(rng.choice("qxzjvkw#@%&!?") for _ in range(200))}) + "\n"
                             for _ in range(400)))
    resumed = launch("single_gpu", recipe, nproc=1,
                     overrides=[f"data.path={noise}", "data.format=text", "training.lr=0.1"])
    assert_ok(resumed)
    log = write_log(tmp_path, resumed)
    assert "warning: resuming with a changed recipe: data.format: 'alpaca' -> 'text'; data.path:" in resumed.stdout
    assert "training.lr: 0.01 -> 0.1" in resumed.stdout
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["resumed_from_step"] for r in records if "resumed_from_step" in r] == [30]
    found = diagnose([out])
    assert found[0].id == "loss_jump_after_resume" and found[0].details["step"] == 30, \
        [(r["step"], r.get("loss")) for r in records]
    assert "recipe_changed_on_resume" in classes(log)
