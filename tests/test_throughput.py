import json

import pytest
import torch

from disttrain.data import Collator, count_targets
from disttrain.metrics.flops import ModelShape
from disttrain.metrics.throughput import FlopsMeter, measured_peak, mfu_band, table_peak


@pytest.mark.parametrize("name, tflops", [
    ("NVIDIA H100 80GB HBM3", 989), ("NVIDIA H100 PCIe", 756), ("NVIDIA H100 NVL", 835), ("NVIDIA H200", 989),
    ("NVIDIA A100-SXM4-80GB", 312), ("NVIDIA A100-PCIE-40GB", 312), ("NVIDIA A100 80GB PCIe", 312),
    ("NVIDIA L40S", 362), ("NVIDIA L40", 181), ("NVIDIA L4", 121), ("NVIDIA A10", 125),
    ("NVIDIA GeForce RTX 4090", 165), ("NVIDIA GeForce RTX 3090", 71), ("NVIDIA RTX A6000", 155),
    ("Tesla V100-SXM2-32GB", 125), ("AMD Instinct MI300X", 1307), ("NVIDIA B200", 2250),
])
def test_device_names_map_to_dense_peaks(name, tflops):
    assert table_peak(name) == tflops * 1e12


@pytest.mark.parametrize("name", ["NVIDIA A10G", "Some Future GPU", "NVIDIA RTX 6000 Ada Generation"])
def test_names_match_whole_tokens(name):
    # "A10G" contains "A10" (and "L40" contains "L4"): a different part, so measured, not a wrong datasheet
    assert table_peak(name) is None


def test_unknown_devices_get_a_measured_peak():
    import time

    start = time.perf_counter()
    assert measured_peak(torch.device("cpu"), torch.float32) > 1e8
    assert measured_peak(torch.device("cpu"), torch.float16) > 0  # slow on CPUs: the size budget keeps it short
    assert time.perf_counter() - start < 5


def test_measuring_the_peak_leaves_the_random_stream_alone():
    """It runs after each process seeded its stream, on whichever ranks find no kept peak: drawing from the global
    generator left a tensor-parallel group's ranks different dropout masks (the replica guard stopped the run)."""
    torch.manual_seed(3)
    before = torch.get_rng_state()
    measured_peak(torch.device("cpu"), torch.float32, sizes=(8,), repeats=1)
    assert torch.equal(torch.get_rng_state(), before)


def test_measured_peak_is_the_best_size(monkeypatch):
    """Max over sizes of the best repeat, warm-up excluded: small matmuls and first calls understate a peak."""
    import disttrain.metrics.throughput as throughput

    clock = iter([0.0, 1.0,  # n=2: warm-up, 1 s (ignored)
                  0.0, 0.5, 0.0, 0.25,  # n=2: 0.5 s, 0.25 s -> 16 / 0.25 = 64 FLOP/s
                  0.0, 1.0, 0.0, 2.0, 0.0, 1.0])  # n=4: 2 s, 1 s -> 128 / 1 = 128 FLOP/s
    monkeypatch.setattr(throughput.time, "perf_counter", lambda: next(clock))
    assert measured_peak(torch.device("cpu"), torch.float32, sizes=(2, 4), repeats=2, budget_s=100) == 128


def test_batch_flops_by_hand():
    shape = ModelShape(params=1000, matmul_params=800, layers=2, heads=4, head_dim=8, hidden=32, vocab=50)
    batch = Collator(0)([{"input_ids": [1, 2, 3], "labels": [1, 2, 3]}, {"input_ids": [4, 5], "labels": [4, 5]}])
    full = FlopsMeter(shape, None).batch_flops(batch)
    assert float(full) == 6 * 800 * 5 + 12 * 2 * 4 * 8 * (9 + 4)
    lora = FlopsMeter(shape, trainable_params=10).batch_flops(batch)
    assert float(lora) == (4 * 800 + 6 * 10) * 5 + 12 * 2 * 4 * 8 * (9 + 4)


def test_recompute_counts_in_hfu_only():
    shape = ModelShape(params=1000, matmul_params=800, layers=2, heads=4, head_dim=8, hidden=32, vocab=50)
    batch = Collator(0)([{"input_ids": [1, 2, 3], "labels": [1, 2, 3]}])
    meter = FlopsMeter(shape, None, recompute=True)
    assert float(meter.batch_flops(batch)) == 6 * 800 * 3 + 12 * 2 * 4 * 8 * 9  # MFU: unchanged
    assert float(meter.recompute_flops(batch)) == 2 * 800 * 3 + 4 * 2 * 4 * 8 * 9  # one more forward
    assert float(FlopsMeter(shape, None).recompute_flops(batch)) == 0


def test_mfu_bands():
    assert [mfu_band(x) for x in (0.05, 0.2, 0.4, 0.5, 0.6)] == ["problem", "normal", "good", "excellent",
                                                                 "near the limit"]


class _OneProcess:
    def gather(self, tensor):
        return tensor


@pytest.mark.parametrize("peak, suspect", [(1.0, True), (1e30, False)])
def test_mfu_over_100_percent_is_flagged(peak, suspect):
    """MFU above 1 is a wrong peak (or FLOP count), not a fast run: the log line says so."""
    from disttrain.training.loop import _Window

    shape = ModelShape(params=1000, matmul_params=800, layers=2, heads=4, head_dim=8, hidden=32, vocab=50)
    window = _Window(torch.device("cpu"), FlopsMeter(shape, None), peak_flops=peak)
    batch = Collator(0)([{"input_ids": [1, 2, 3], "labels": [1, 2, 3]}])
    window.add_micro(torch.tensor(1.5), count_targets(batch), batch)
    window.steps = 1
    record = window.summarize(_OneProcess())
    assert (record["mfu"] > 1.0) is suspect
    assert record.get("mfu_suspect", False) is suspect


def test_time_spent_apart_from_training_is_not_in_throughput():
    """Evaluation and checkpoint time (timed_apart) is left out of step time, tokens/s and MFU."""
    import time

    from disttrain.training.loop import _Window

    window = _Window(torch.device("cpu"))
    batch = Collator(0)([{"input_ids": [1, 2, 3], "labels": [1, 2, 3]}])
    window.add_micro(torch.tensor(1.5), count_targets(batch), batch)
    window.steps = 1
    result, took = window.timed_apart(lambda: time.sleep(0.3) or "saved")
    record = window.summarize(_OneProcess())
    assert result == "saved" and took >= 0.3
    assert record["step_time_s"] < 0.2 and record["tokens_per_s"] > 3 / 0.2


def test_a_live_dpo_reference_adds_one_forward_to_the_step_flops():
    """DPO with a live reference (LoRA with the adapters disabled) runs one more forward per micro-batch: 2 FLOPs
    per weight per token and a third of the attention term, on top of the policy's forward + backward."""
    shape = ModelShape(params=1000, matmul_params=800, layers=2, heads=4, head_dim=8, hidden=32, vocab=50)
    batch = Collator(0)([{"input_ids": [1, 2, 3], "labels": [1, 2, 3]}, {"input_ids": [4, 5], "labels": [4, 5]}])
    plain, live = FlopsMeter(shape, 10), FlopsMeter(shape, 10, reference_forward=True)
    attention = 12 * 2 * 4 * 8 * (9 + 4)
    assert float(plain.batch_flops(batch)) == (4 * 800 + 6 * 10) * 5 + attention
    assert float(live.batch_flops(batch)) == float(plain.batch_flops(batch)) + 2 * 800 * 5 + attention / 3


def test_a_measured_peak_is_kept_per_machine_and_dtype(tmp_path, monkeypatch):
    """Each rank of each CPU run would time matmuls again: the first measurement is kept (per device name, dtype,
    torch version and threads) and read back; a broken cache file is measured over, not an error."""
    import disttrain.metrics.throughput as throughput

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    calls = []
    monkeypatch.setattr(throughput, "measured_peak", lambda device, dtype: calls.append(dtype) or 1e9 * len(calls))
    cpu = torch.device("cpu")
    assert throughput.peak_flops(cpu, torch.float32) == (1e9, "cpu measured peak")
    assert throughput.peak_flops(cpu, torch.float32)[0] == 1e9 and calls == [torch.float32]
    assert throughput.peak_flops(cpu, torch.bfloat16)[0] == 2e9  # another dtype: measured
    assert throughput.peak_cache() == tmp_path / "disttrain" / "peak_flops.json"
    assert sorted(json.loads(throughput.peak_cache().read_text()).values()) == [1e9, 2e9]
    throughput.peak_cache().write_text("{not json")
    assert throughput.peak_flops(cpu, torch.float32)[0] == 3e9 and len(calls) == 3
    assert throughput.peak_flops(cpu, torch.float32)[0] == 3e9 and len(calls) == 3



def test_deepspeeds_cpu_info_is_asked_once_per_process(monkeypatch):
    """ZeRO-Offload's CPU Adam asks py-cpuinfo three times per optimizer, and each answer starts two Python
    processes: kept after the first (a copy each time, so no caller changes another's)."""
    import cpuinfo

    from disttrain.runtime.backends import cpu_info_once

    calls = []
    monkeypatch.setattr(cpuinfo, "get_cpu_info", lambda: calls.append(1) or {"flags": ["avx2"]})
    cpu_info_once()
    cpuinfo.get_cpu_info()["flags"].append("changed by a caller")
    assert cpuinfo.get_cpu_info() == {"flags": ["avx2"]} and len(calls) == 1
    cpu_info_once()  # installed once: the kept answer stays
    assert cpuinfo.get_cpu_info() == {"flags": ["avx2"]} and len(calls) == 1
