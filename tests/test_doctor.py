"""`make doctor`: a real gloo bandwidth sweep on 2 CPU processes (and across 2 loopback 'nodes'), and each
check's FAIL path triggered for real where possible."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from collections import namedtuple

import pytest

from conftest import REPO, free_port
from disttrain.tools import doctor

TINY_RECIPE = str(REPO / "recipes" / "tiny" / "sft.yaml")


def run_doctor(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "disttrain.tools.doctor", "--json", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)


def by_name(report: dict) -> dict:
    return {c["name"]: c for c in report["checks"]}


@pytest.mark.launch
def test_doctor_on_cpu_measures_gloo_bandwidth_as_nccl_tests_define_it(tiny_model_dir):
    proc = run_doctor("--nproc", "2", "--max-bytes", str(1 << 20), "--output-dir", str(tiny_model_dir.parent))
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert report["ok"] is True
    checks = by_name(report)
    for name in ("torch", "accelerate", "transformers", "peft", "disk", "/dev/shm", "open files",
                 "all_reduce bandwidth", "all_gather bandwidth", "interconnect", "versions across ranks"):
        assert name in checks, name
    assert checks["interconnect"]["detail"].startswith("CPU processes over TCP (gloo)")
    bench = report["bandwidth"]
    assert bench["backend"] == "gloo" and bench["world_size"] == 2 and bench["nodes"] == 1
    sizes = sorted({r["bytes"] for r in bench["results"]})
    assert sizes == [1024, 4096, 16384, 65536, 262144, 1048576]
    for r in bench["results"]:
        factor = 2 * (2 - 1) / 2 if r["op"] == "all_reduce" else (2 - 1) / 2
        assert r["algbw_gbps"] == pytest.approx(r["bytes"] / (r["time_us"] * 1e-6) / 1e9, rel=1e-6)
        assert r["busbw_gbps"] == pytest.approx(r["algbw_gbps"] * factor, rel=1e-9)
        assert r["iters"] >= 3 and r["time_us"] > 0
    assert len(bench["versions"]) == 2 and {v["rank"] for v in bench["versions"]} == {0, 1}


@pytest.mark.launch
def test_doctor_across_two_loopback_nodes_gathers_every_ranks_versions():
    port = free_port()
    common = ["--nodes", "2", "--nproc", "1", "--master-addr", "127.0.0.1", "--master-port", str(port),
              "--max-bytes", "65536", "--timeout-s", "120"]
    node1 = subprocess.Popen([sys.executable, "-m", "disttrain.tools.doctor", "--json", "--node-rank", "1", *common],
                             cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    node0 = run_doctor("--node-rank", "0", *common)
    out1, err1 = node1.communicate(timeout=300)
    assert node0.returncode in (0, 1), node0.stderr[-3000:]
    report0, report1 = json.loads(node0.stdout), json.loads(out1)
    assert report0["bandwidth"]["world_size"] == 2 and report0["bandwidth"]["nodes"] == 2
    assert by_name(report0)["versions across ranks"]["status"] == "PASS"
    assert by_name(report0)["master address"]["status"] == "WARN"  # loopback is only fine on one machine
    assert by_name(report1)["master reachable"]["status"] == "PASS"
    assert report1["bandwidth"] is None and by_name(report1)["collective test"]["status"] == "PASS"


def test_unreachable_master_and_taken_port_fail():
    port = free_port()
    unreachable = doctor.wait_reachable("127.0.0.1", port, timeout_s=1)
    assert unreachable.status == "FAIL" and f"127.0.0.1:{port}" in unreachable.detail
    with socket.socket() as holder:
        holder.bind(("0.0.0.0", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        checks = {c.name: c for c in doctor.check_network(2, 0, "10.0.0.1", taken)}
        assert checks["master port"].status == "FAIL" and f"port {taken} is already in use" in checks["master port"].fix
        assert doctor.wait_reachable("127.0.0.1", taken, timeout_s=1).status == "PASS"


def test_missing_network_interface_fails(monkeypatch):
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "ib-does-not-exist0")
    monkeypatch.setenv("NCCL_P2P_DISABLE", "1")
    checks = {c.name: c for c in doctor.check_network(1, 0, "127.0.0.1", 29500)}
    assert checks["NCCL_SOCKET_IFNAME"].status == "FAIL"
    assert checks["NCCL_P2P_DISABLE"].status == "WARN"
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "lo")
    assert {c.name: c for c in doctor.check_network(1, 0, "127.0.0.1", 29500)}["NCCL_SOCKET_IFNAME"].status == "PASS"


def test_too_little_disk_for_the_recipes_checkpoints_fails_with_exit_1(monkeypatch, capsys):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(doctor.shutil, "disk_usage", lambda path: usage(100 << 30, 99 << 30, 1 << 30))
    code = doctor.main(["--recipe", str(REPO / "recipes/llama-3.1-8b/full_sft_fsdp.yaml"), "--no-bandwidth", "--json"])
    report = json.loads(capsys.readouterr().out)
    disk = by_name(report)["disk"]
    assert code == 1 and report["ok"] is False and disk["status"] == "FAIL"
    # 8.03B parameters x 12 bytes (fp32 weights + Adam) per checkpoint, keep_last + 1 of them, + fp32 export
    assert "need ~299.2 GiB (89.7 GiB per checkpoint + 29.9 GiB export, keep_last=2)" in disk["detail"]


def test_versions_that_differ_between_ranks_fail():
    same = {"host": "a", "torch": "2.8.0", "cuda": "12.8", "nccl": "2.27.3", "driver": "570.1", "python": "3.11"}
    assert doctor.compare_versions([same, {**same, "host": "b"}]).status == "PASS"
    check = doctor.compare_versions([same, {**same, "host": "b", "nccl": "2.21.5"}])
    assert check.status == "FAIL" and "nccl: 2.21.5, 2.27.3" in check.detail


@pytest.mark.parametrize("backend, nodes, busbw, label", [
    ("nccl", 1, 350.0, "NVLink"), ("nccl", 1, 20.0, "PCIe"), ("nccl", 1, 1.0, "slow"),
    ("nccl", 2, 45.0, "InfiniBand"), ("nccl", 2, 5.0, "Ethernet"), ("nccl", 2, 0.5, "slow"),
    ("gloo", 1, 1.0, "gloo"),
])
def test_interconnect_classes(backend, nodes, busbw, label):
    assert label in doctor.classify(backend, nodes, busbw)[0]


def test_accelerate_default_config_is_flagged(monkeypatch, tmp_path):
    import accelerate.commands.config as accelerate_config

    default = tmp_path / "default_config.yaml"
    default.write_text("distributed_type: MULTI_GPU\n")
    monkeypatch.setattr(accelerate_config, "default_config_file", str(default))
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp16")
    checks = {c.name: c for c in doctor.check_accelerate_defaults()}
    assert checks["accelerate default config"].status == "WARN"
    assert "ACCELERATE_MIXED_PRECISION" in checks["accelerate environment"].detail


@pytest.mark.parametrize("cuda, gpus, expect_gpu, status, needle", [
    (None, 8, False, "FAIL", "torch 2.13.0+cpu is a CPU build but this machine has 8 NVIDIA GPU(s) (nvidia-smi)"),
    (None, 0, True, "FAIL", "is a CPU build but GPU=1 asks for a CUDA build"),
    (None, 0, False, "PASS", "torch 2.13.0+cpu, a CPU build (no NVIDIA GPU here)"),
    ("12.8", 0, False, "PASS", "a CUDA 12.8 build (no NVIDIA GPU here: it runs on the CPU; the smaller CPU build: "
                               "make setup TORCH_INDEX=https://download.pytorch.org/whl/cpu)"),
    ("12.8", 8, True, "PASS", "a CUDA 12.8 build, 8 NVIDIA GPU(s)"),
])
def test_a_cpu_torch_on_a_gpu_machine_is_named_in_one_line(monkeypatch, cuda, gpus, expect_gpu, status, needle):
    """The trap: `make train` installed the CPU build, the user moved to the GPU machine and trained on its CPU."""
    import torch

    monkeypatch.setattr(torch, "__version__", "2.13.0+cpu")
    monkeypatch.setattr(torch.version, "cuda", cuda)
    check = doctor.check_torch_build(gpus, expect_gpu)
    assert check.status == status and needle in check.detail
    assert ("make setup GPU=1 TORCH_INDEX=https://download.pytorch.org/whl/cu128" in check.fix) == (status == "FAIL")


def test_setup_stops_on_a_cpu_torch_where_a_gpu_is_wanted(capsys):
    assert doctor.main(["--torch-build", "--expect-gpu"]) == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith("setup: torch ") and "Fix: make setup GPU=1" in err
