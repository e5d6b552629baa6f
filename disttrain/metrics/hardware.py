"""Accelerator facts used by the cost planner (and the MFU computation): memory, dense peak, price.

Peaks are dense BF16/FP16 tensor-core TFLOP/s per device, from the vendors' datasheets (not the
"with sparsity" figures, which are 2x: e.g. H100 SXM is 989 dense, 1979 sparse). V100 has no BF16: FP16.
MI250X is per GCD (one of its two dies, which torch sees as a device).
Prices are round on-demand USD per GPU-hour used only as defaults for comparison; pass --price for yours.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Accelerator:
    name: str
    memory_gb: float
    peak_tflops: float
    price_per_hour: float


# name: memory GB, dense bf16 TFLOP/s, USD/GPU-hour (default)
ACCELERATORS = {a.name: a for a in [
    Accelerator("A100", 80, 312, 1.8),        # A100 SXM/PCIe 80GB; NVIDIA A100 datasheet
    Accelerator("A100-40GB", 40, 312, 1.3),
    Accelerator("H100", 80, 989, 3.0),        # H100 SXM; NVIDIA H100 datasheet (1979 is with sparsity)
    Accelerator("H100-PCIe", 80, 756, 2.5),
    Accelerator("H100-NVL", 94, 835, 2.8),
    Accelerator("H200", 141, 989, 3.8),       # same compute as H100 SXM, more/faster HBM
    Accelerator("B200", 180, 2250, 5.5),      # NVIDIA HGX B200 datasheet, per GPU
    Accelerator("L40S", 48, 362, 1.0),
    Accelerator("L40", 48, 181, 0.9),         # NVIDIA L40 datasheet (362 is with sparsity)
    Accelerator("L4", 24, 121, 0.7),
    Accelerator("A10", 24, 125, 0.8),
    Accelerator("RTX 4090", 24, 165, 0.8),    # Ada whitepaper, FP16/BF16 tensor with FP16 accumulate
    Accelerator("RTX 3090", 24, 71, 0.4),
    Accelerator("A6000", 48, 155, 0.8),       # RTX A6000
    Accelerator("V100", 32, 125, 0.9),        # FP16 (no BF16)
    Accelerator("MI250X", 64, 191.5, 1.5),    # per GCD
    Accelerator("MI300X", 192, 1307, 3.5),
]}


def lookup(name: str) -> Accelerator:
    key = name.strip().lower().replace("_", " ")
    for acc in ACCELERATORS.values():
        if acc.name.lower() == key or acc.name.lower().replace(" ", "") == key.replace(" ", ""):
            return acc
    raise KeyError(f"unknown GPU {name!r}; known: {', '.join(ACCELERATORS)} (or pass --peak-tflops and --memory-gb)")
