"""Model FLOPs of what a rank really processed, and the peak they are measured against (MFU).

FLOPs per micro-batch = dense FLOPs/token x non-padding tokens + attention coefficient x sum over
sequences of length^2 (packed examples counted separately: they do not attend to each other). Padding is
not counted: MFU here is useful work. Peak: the dense bf16 figure of the device from disttrain/metrics/hardware.py
when its name is known, else (CPUs, unknown GPUs) the best of timed matmuls at the run's dtype, labelled
"measured". A measurement is kept per machine (peak_cache(): by the device's name, the dtype, torch's version and
thread count), so each rank of each run does not time matmuls again (up to a few seconds on a GPU, and every
launch on a CPU); delete the file to measure again.
"""

from __future__ import annotations

import json
import os
import platform
import re
import time
from pathlib import Path

import torch

from disttrain.data import LENGTHS_KEY, SQUARES_KEY
from disttrain.metrics.flops import ModelShape
from disttrain.metrics.hardware import ACCELERATORS
from disttrain.runtime.backends import bare_model

# Tokens of the torch device name (split on spaces, '-', '_') -> hardware table entry. Tokens match exactly,
# so "L40" is not "L4" and "A10G" (a different, slower part) is not "A10"; variants (more tokens) come first.
_NAME_PATTERNS = [(("H100", "PCIE"), "H100-PCIe"), (("H100", "NVL"), "H100-NVL"), (("H100",), "H100"),
                  (("H200",), "H200"), (("B200",), "B200"), (("A100", "40GB"), "A100-40GB"), (("A100",), "A100"),
                  (("L40S",), "L40S"), (("L40",), "L40"), (("L4",), "L4"), (("A10",), "A10"),
                  (("RTX", "4090"), "RTX 4090"), (("RTX", "3090"), "RTX 3090"), (("A6000",), "A6000"),
                  (("V100",), "V100"), (("MI250X",), "MI250X"), (("MI300X",), "MI300X")]


def table_peak(device_name: str) -> float | None:
    """Dense bf16 FLOP/s of a known accelerator, from its torch device name (None: not in the table)."""
    tokens = set(re.split(r"[\s\-_]+", device_name.upper()))
    for required, key in _NAME_PATTERNS:
        if tokens.issuperset(required):
            return ACCELERATORS[key].peak_tflops * 1e12
    return None


def measured_peak(device: torch.device, dtype: torch.dtype, sizes: tuple[int, ...] | None = None,
                  repeats: int = 5, budget_s: float = 0.25) -> float:
    """Best FLOP/s of square matmuls on this device and dtype: best of `repeats` per size, max over sizes.
    One small matmul underestimates a GPU (launch overhead, unsaturated SMs), which pushed MFU over 100 %.
    Sizes stop growing when one matmul of the next would take over `budget_s` (e.g. fp16 on a CPU), so this
    stays cheap: well under a second on a CPU, a few on a GPU (the first cuBLAS call included)."""
    cuda = device.type == "cuda"
    sizes = sizes or ((2048, 4096, 8192) if cuda else (256, 512, 1024))
    best_flops = 0.0
    # its own generator: the global stream is seeded per random stream before this runs, and a rank measuring
    # while another reads the kept peak would leave them different dropout masks where they must share them
    # (a tensor-parallel group: the replica guard stopped such a run at step 2)
    generator = torch.Generator(device=device).manual_seed(0)
    for n in sizes:
        a = torch.randn(n, n, device=device, dtype=dtype, generator=generator)
        b = torch.randn(n, n, device=device, dtype=dtype, generator=generator)
        times = []
        for _ in range(repeats + 1):
            if cuda:
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            a @ b
            if cuda:
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - start)
            if times[-1] > budget_s:
                break
        # the first run is a warm-up (kernel selection, caches): not counted unless it is all there is
        best_flops = max(best_flops, 2 * n**3 / min(times[1:] or times))
        if 8 * min(times) > budget_s:  # the next size (2x) would cost 8x
            break
    return best_flops


def peak_flops(device: torch.device, dtype: torch.dtype) -> tuple[float, str]:
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = table_peak(name)
        if peak is not None:
            return peak, f"{name} datasheet"
        return _kept_measurement(name, device, dtype), f"{name} measured peak"
    return _kept_measurement(platform.processor() or platform.machine(), device, dtype), f"{device.type} measured peak"


def peak_cache() -> Path:
    """Where measured peaks are kept: $XDG_CACHE_HOME/disttrain (default ~/.cache/disttrain)/peak_flops.json."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "disttrain" / "peak_flops.json"


def _kept_measurement(name: str, device: torch.device, dtype: torch.dtype) -> float:
    """measured_peak once per machine, device, dtype, torch version and thread count; read back after that. An
    unreadable or unwritable cache only costs the measurement."""
    key = f"{name}|{device.type}|{dtype}|torch {torch.__version__}|threads {torch.get_num_threads()}"
    path = peak_cache()
    try:
        kept = json.loads(path.read_text())
    except (OSError, ValueError):
        kept = {}
    if isinstance(kept, dict) and isinstance(kept.get(key), (int, float)):
        return float(kept[key])
    peak = measured_peak(device, dtype)
    try:  # ranks measuring at once each write the whole file; the rename keeps it whole
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({**(kept if isinstance(kept, dict) else {}), key: peak}, indent=1))
        tmp.replace(path)
    except OSError:
        pass
    return peak


class FlopsMeter:
    def __init__(self, shape: ModelShape, trainable_params: int | None, recompute: bool = False,
                 reference_forward: bool = False):
        """`trainable_params` for LoRA (frozen weights: 4 FLOPs/weight/token instead of 6), None for full;
        `recompute`: activation checkpointing runs the forward pass twice (counted in HFU, not in MFU);
        `reference_forward`: preference tuning with a live reference runs one more forward per micro-batch
        (model FLOPs: the step really computes it)."""
        if trainable_params is None:
            self.dense_per_token = 6.0 * shape.matmul_params
        else:
            self.dense_per_token = 4.0 * shape.matmul_params + 6.0 * trainable_params
        self.attention_coefficient = 12.0 * shape.layers * shape.heads * shape.head_dim
        self.forward_dense_per_token = 2.0 * shape.matmul_params
        self.recompute = recompute
        self.reference_forward = reference_forward

    def batch_flops(self, batch: dict) -> torch.Tensor:
        """Model FLOPs (what MFU counts) of one micro-batch."""
        flops = (self.dense_per_token * batch[LENGTHS_KEY].sum().double()
                 + self.attention_coefficient * batch[SQUARES_KEY].sum().double())
        if self.reference_forward:
            flops = flops + self._forward_flops(batch)
        return flops

    def _forward_flops(self, batch: dict) -> torch.Tensor:
        """One forward pass: 2 FLOPs per weight per token, a third of the attention term."""
        return (self.forward_dense_per_token * batch[LENGTHS_KEY].sum().double()
                + self.attention_coefficient / 3 * batch[SQUARES_KEY].sum().double())

    def recompute_flops(self, batch: dict) -> torch.Tensor:
        """Extra hardware FLOPs of re-running the forward pass (a third of the attention term)."""
        if not self.recompute:
            return torch.zeros((), dtype=torch.float64, device=batch[LENGTHS_KEY].device)
        return self._forward_flops(batch)


MFU_BANDS = ((0.15, "problem"), (0.30, "normal"), (0.45, "good"), (0.55, "excellent"), (float("inf"), "near the limit"))


def mfu_band(mfu: float) -> str:
    """The seed chapter's reading of an MFU figure (<15 % problem ... >55 % near the limit)."""
    return next(label for bound, label in MFU_BANDS if mfu < bound)


def peak_memory_gb(device: torch.device) -> float:
    """Peak allocated memory on a GPU; on a CPU the process's peak resident set size (ru_maxrss, which
    includes what the allocator keeps cached)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    import resource

    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return kib * 1024 / 1e9


def meter_for(accelerator, recipe, model):
    """FLOPs meter for this model (LoRA-aware) and the peak FLOP/s that MFU is measured against."""
    import torch

    from disttrain.metrics.flops import shape_from_model
    from disttrain.model.params import count_parameters

    unwrapped = bare_model(accelerator, model)
    config = getattr(unwrapped, "config", None)
    if hasattr(unwrapped, "get_base_model"):  # peft: the architecture is the base model's
        config = unwrapped.get_base_model().config
    _, trainable = count_parameters(unwrapped)
    live_reference = recipe.training.objective == "dpo" and recipe.reference_mode() in ("adapters", "model")
    meter = FlopsMeter(shape_from_model(unwrapped, config), trainable if recipe.lora else None,
                       recompute=recipe.model.gradient_checkpointing, reference_forward=live_reference)
    # fp8 against bf16's peak, as torchtitan reports it: a faster fp8 run shows as a higher MFU than its bf16 twin
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16}.get(
        recipe.training.mixed_precision, torch.float32)
    peak, source = peak_flops(accelerator.device, dtype)
    accelerator.print(f"run: {meter.dense_per_token / 1e6:.2f} MFLOPs/token (dense); MFU against "
                      f"{peak / 1e12:.3g} TFLOP/s per device ({source})")
    return meter, peak
