"""`make bench` and `make bench-overhead` run end to end and write their files (no timing assertions:
speed belongs in the benchmark's output, not in pass/fail)."""

import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import REPO
from disttrain.errors import DisttrainError
from disttrain.bench.strategies import main as bench_main
from disttrain.bench.strategies import summarize
from disttrain.bench.overhead import main as overhead_main

pytestmark = pytest.mark.launch


def test_bench_writes_results_for_each_strategy(tmp_path, tiny_model_dir):
    out = tmp_path / "bench"
    bench_main(["--recipe", str(REPO / "recipes/tiny/sft.yaml"), "--strategies", "ddp,zero2", "--steps", "6",
                "--warmup", "2", "--out", str(out), "--timeout", "300", f"model.name_or_path={tiny_model_dir}"])
    results = json.loads((out / "results.json").read_text())
    assert [r["strategy"] for r in results["results"]] == ["ddp", "zero2"]
    for r in results["results"]:
        assert r["steps"] == 4 and r["devices"] == 2
        assert r["tokens_per_s_per_device"] > 0 and 0 < r["mfu"] < 1 and r["peak_mem_gb"] > 0
        assert r["step_time_p50_s"] <= r["step_time_p90_s"]
        assert r["mfu"] == pytest.approx(r["tflops_per_device"] / results["results"][0]["peak_tflops_per_device"])
    assert "| zero2 |" in (out / "results.md").read_text()
    assert (out / "results.png").stat().st_size > 10_000


def test_a_launch_past_its_timeout_is_killed_and_named_in_one_line(tmp_path, tiny_model_dir):
    """A hung launch (CI once waited 20 min on a rank that never exited) stops at --timeout with its reason."""
    out = tmp_path / "bench"
    with pytest.raises(DisttrainError, match=r"^bench: ddp failed \(killed after 0.01s, its time limit\); log: "):
        bench_main(["--recipe", str(REPO / "recipes/tiny/sft.yaml"), "--strategies", "ddp", "--steps", "6",
                    "--warmup", "2", "--out", str(out), "--timeout", "0.01", f"model.name_or_path={tiny_model_dir}"])
    assert (out / "runs" / "ddp" / "launch.log").read_text().endswith("(killed after 0.01s)")


def test_summary_weights_windows_by_their_steps():
    records = [{"step": s, "step_time_s": 0.5, "tokens": 100 * n, "tokens_per_s": 1, "tokens_per_s_per_device": 0.5,
                "tflops_per_device": 2.0, "peak_tflops_per_device": 10.0, "peak_mem_gb": 1.0,
                "data_wait_share": 0.1, "loss": 1.0} for s, n in ((2, 2), (6, 4), (10, 4))]
    row = summarize("ddp", records, warmup=2)
    assert row["steps"] == 2
    assert row["tokens_per_s_per_device"] == pytest.approx(800 / 4.0 / 2)  # 8 steps x 0.5 s, 2 devices
    assert row["mfu"] == pytest.approx(0.2)


def test_bench_overhead_compares_three_runners(tmp_path, tiny_model_dir):
    """One round end to end (three launches); how rounds combine is test_overhead_rounds_combine_by_median."""
    out = tmp_path / "overhead"
    overhead_main(["--recipe", str(REPO / "recipes/tiny/sft.yaml"), "--steps", "8", "--warmup", "4",
                   "--rounds", "1", "--out", str(out), "--timeout", "300", f"model.name_or_path={tiny_model_dir}",
                   "data.packing=true", "--trainer-unpacked"])
    result = json.loads((out / "overhead.json").read_text())
    assert result["trainer_unpacked"] and "Trainer fed padded (unpacked) batches" in (out / "overhead.md").read_text()
    assert set(result["tokens_per_s_per_device"]) == {"disttrain", "raw_ddp", "hf_trainer"}
    assert all(v > 0 for v in result["tokens_per_s_per_device"].values())
    (only,) = result["rounds"]
    assert only["disttrain_over_raw"] == pytest.approx(
        only["tokens_per_s_per_device"]["disttrain"] / only["tokens_per_s_per_device"]["raw_ddp"])
    assert result["disttrain_over_raw"] == pytest.approx(only["disttrain_over_raw"])
    assert "a/b =" in (out / "overhead.md").read_text()


def test_overhead_rounds_combine_by_median():
    from disttrain.bench.overhead import RUNNERS, round_order, round_record, summarise

    assert [round_order(i)[0] for i in range(4)] == ["disttrain", "raw_ddp", "hf_trainer", "disttrain"]
    assert all(sorted(round_order(i)) == sorted(RUNNERS) for i in range(3))
    rounds = [round_record({"disttrain": a, "raw_ddp": b, "hf_trainer": c})
              for a, b, c in ((100, 100, 50), (80, 100, 60), (90, 100, 40))]
    summary = summarise(rounds)
    assert summary["tokens_per_s_per_device"] == {"disttrain": 90, "raw_ddp": 100, "hf_trainer": 50}
    assert summary["disttrain_over_raw"] == pytest.approx(0.9)  # median of 1.0, 0.8, 0.9
    # the median of the per-round ratios 2.0, 1.33, 2.25 -- not the ratio of the medians (90 / 50 = 1.8)
    assert summary["disttrain_over_trainer"] == pytest.approx(2.0)
    assert summary["a_c"] == pytest.approx([2.0, 80 / 60, 2.25])


def test_gpu_figures_script_dry_runs_on_cpu(tmp_path):
    """The prepared GPU run (scripts/bench/gpu_figures.py) works end to end on the tiny shape, so the first
    session with a GPU spends its device minutes measuring, not debugging."""
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts/bench/gpu_figures.py"), "--shape", "tiny", "--seq", "64", "--steps", "4",
         "--warmup", "1", "--micro-batch", "2", "--precision", "no", "--configs", "fsdp,single_ckpt",
         "--out", str(out), "--work", str(tmp_path / "work")],
        cwd=REPO, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((out / "gpu_figures.json").read_text())
    assert [r["config"] for r in result["rows"]] == ["fsdp", "single_ckpt"]
    for row in result["rows"]:
        assert "error" not in row and row["steps"] == 3 and 0 < row["mfu"] < 1, row
    assert "hfu" in result["rows"][1] and result["rows"][1]["hfu"] > result["rows"][1]["mfu"]  # recompute counted
    assert "hfu" not in result["rows"][0]
    assert "| fsdp | no | no |" in (out / "gpu_figures.md").read_text()
    assert (out / "launches.log").read_text().count("=====") == 2


def test_bench_memory_measures_plain_chunked_and_floor(tmp_path):
    """`make bench-memory` end to end under DDP (2 processes: each engine's self-check on a wrapped model) with a
    small vocabulary: one launch per engine (plain, chunked, TRL's fused head) and the floor, one row; the engines
    trained the same steps to the same losses."""
    from disttrain.bench.memory import main as memory_main

    out = tmp_path / "memory"
    memory_main(["--strategies", "ddp", "--nproc", "2", "--vocab", "8192", "--seq", "128", "--steps", "3",
                 "--warmup", "1", "--out", str(out)])
    (row,) = json.loads((out / "results.json").read_text())["rows"]
    runs = ("plain", "chunked", "trl", "floor")
    assert all(row[f"{run}_peak_gb"] > 0 and row[f"{run}_step_s"] > 0 for run in runs)
    assert row["plain_loss_gb"] == pytest.approx(row["plain_peak_gb"] - row["floor_peak_gb"])
    assert row["chunked_loss_rel_diff"] < 1e-4 and row["trl_loss_rel_diff"] < 1e-4  # fp32: the same training
    table = (out / "results.md").read_text()
    assert "| ddp | trl |" in table and "| ddp | chunked |" in table


def test_bench_data_measures_ours_floor_memory_and_the_first_step(tmp_path):
    """`make bench-data` end to end on small sizes: every format against its floor, memory at two sizes, and
    the 2-process launch whose data_report says that only rank 0 tokenised."""
    from disttrain.bench.data import main as data_main

    out = tmp_path / "data"
    data_main(["--alpaca", "400", "--chat", "100", "--text", "0", "--max-seq-len", "256", "--out", str(out)])
    results = json.loads((out / "results.json").read_text())
    assert set(results["formats"]) == {"alpaca", "chat"}
    for r in results["formats"].values():
        assert r["ours"]["records"] == r["floor"]["records"] and r["ratio"] > 0
    small, full = results["memory"]["validate"]
    assert (small["records"], full["records"]) == (100, 400) and full["peak_anon_gb"] > 0
    assert [r["tokenised_here"] for r in results["launch"]["preparation_per_rank"]] == [True, False]
    assert results["launch"]["seconds_to_first_step"] > 0
    assert "| alpaca | 400 |" in (out / "results.md").read_text()


def test_bench_long_measures_activations_per_rank_with_and_without_ulysses(tmp_path):
    """`make bench-long` end to end on a short sequence: ZeRO-3 (sp 1) and ZeRO-3 + Ulysses (sp 2) on 2
    processes, each against its floor; one row per size, the ratios taken against sp 1."""
    from disttrain.bench.long import main as long_main

    out = tmp_path / "long"
    long_main(["--seq", "1024", "--floor-seq", "64", "--hidden", "128", "--layers", "2", "--heads", "4",
               "--steps", "3", "--warmup", "1", "--out", str(out)])
    rows = json.loads((out / "results.json").read_text())["rows"]
    assert [(r["mesh"], r["size"], r["config"]) for r in rows] == [("sp", 1, "zero3"), ("sp", 2, "zero3_ulysses")]
    for r in rows:
        assert r["long_peak_gb"] > 0 and r["floor_peak_gb"] > 0 and r["step_s"] > 0
        assert r["activations_gb"] == pytest.approx(r["long_peak_gb"] - r["floor_peak_gb"])
    assert rows[0]["activations_vs_size1"] == 1.0
    assert rows[1]["activations_vs_size1"] == pytest.approx(rows[1]["activations_gb"] / rows[0]["activations_gb"])
    assert "| sp | 2 | zero3_ulysses |" in (out / "results.md").read_text()


def test_bench_long_launches_each_mesh_with_its_config_and_sizes():
    """The context-parallel rows (measured once by hand, docs/benchmarks.md: a launch pair each) get FSDP2's
    configs, the cp flags, and on a CPU the test-only ring kernel; a size that does not divide is one line."""
    from disttrain.bench.long import launch_args
    from disttrain.runtime.launcher import REPO as ROOT

    assert launch_args("cp", 1, 2) == ("fsdp", [], {})
    config, flags, env = launch_args("cp", 2, 4)
    assert (config, flags) == ("fsdp_cp", ["--parallelism_config_cp_size", "2", "--parallelism_config_dp_shard_size",
                                           "2"])
    assert torch.cuda.is_available() or env["PYTHONPATH"].split(os.pathsep)[0] == str(ROOT / "tests" / "cpu_ring")
    assert (ROOT / "tests" / "cpu_ring" / "sitecustomize.py").is_file()
    assert launch_args("sp", 2, 2)[:2] == ("zero3_ulysses", ["--parallelism_config_sp_size", "2",
                                                             "--parallelism_config_dp_shard_size", "1"])
    # tensor parallelism: alone when it takes every process, under FSDP2 (fsdp_tp.yaml) otherwise
    assert launch_args("tp", 1, 2) == ("fsdp", [], {})
    assert launch_args("tp", 2, 2) == ("tp", ["--parallelism_config_tp_size", "2"], {})
    assert launch_args("tp", 2, 4) == ("fsdp_tp", ["--parallelism_config_tp_size", "2",
                                                   "--parallelism_config_dp_shard_size", "2"], {})
    with pytest.raises(DisttrainError, match="--cp 3 must divide --nproc 4"):
        launch_args("cp", 3, 4)
