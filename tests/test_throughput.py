import pytest
import torch

from disttrain.data import Collator
from disttrain.flops import ModelShape
from disttrain.throughput import FlopsMeter, measured_peak, mfu_band, table_peak


@pytest.mark.parametrize("name, tflops", [
    ("NVIDIA H100 80GB HBM3", 989), ("NVIDIA H100 PCIe", 756), ("NVIDIA H100 NVL", 835), ("NVIDIA H200", 989),
    ("NVIDIA A100-SXM4-80GB", 312), ("NVIDIA A10G", 125), ("NVIDIA L40S", 362), ("NVIDIA L4", 121),
    ("NVIDIA GeForce RTX 4090", 165), ("NVIDIA RTX A6000", 155), ("Tesla V100-SXM2-32GB", 125),
    ("AMD Instinct MI300X", 1307),
])
def test_device_names_map_to_dense_peaks(name, tflops):
    assert table_peak(name) == tflops * 1e12


def test_unknown_devices_get_a_measured_peak():
    assert table_peak("Some Future GPU") is None
    assert measured_peak(torch.device("cpu"), torch.float32, n=256, repeats=2) > 1e8


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
