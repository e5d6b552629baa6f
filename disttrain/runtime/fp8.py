"""FP8 training (`training.mixed_precision: fp8`): torchao's float8 linear layers through accelerate's torchao
recipe (AORecipeKwargs), which swaps the chosen nn.Linear layers for torchao's Float8Linear when the model is
prepared. Written here: only which layers, the recipe's settings per machine, and what is refused.

- Scales: tensorwise and dynamic (computed from each tensor at each use), the recipe torchao's FSDP2 float8
  all-gather needs. On a GPU with FP8 (compute capability >= 8.9) the matmuls are torch._scaled_mm and FSDP2
  all-gathers the weights in float8; on a CPU torchao emulates them (the same float8 casts and scales, the
  product in high precision): the wiring, the casts' rounding and the checkpoints are proven on CPU, the speed
  only on a GPU (scripts/gpu/acceptance.py: fp8_vs_bf16).
- Which layers: every nn.Linear whose two dimensions divide by 16 (float8 matmuls' alignment), but the output
  head and a mixture of experts' router (torchtitan's rule too: both decide the output distribution or the
  routing from small differences, and the head's vocabulary is rarely aligned). accelerate's default rule also
  skips the model's first linear layer (an attention projection), which nothing here needs.
- The weights, their gradients, the optimizer's states, the checkpoints and the export stay in the model's
  dtype: a Float8Linear is an nn.Linear with the same parameters (the export loads as the plain family).
"""

from __future__ import annotations

import dataclasses
import os

import torch

from disttrain.errors import DisttrainError

# leaf names of the layers kept in high precision: the output heads, a mixture of experts' routers
KEPT = ("lm_head", "score", "gate", "router")
ALIGNMENT = 16
# the launch labels proven equal to one process (tests/test_fp8.py; disttrain/recipe/matrix.py, row fp8)
PROVEN = ("single", "ddp", "fsdp")


def quiet_torchao_on_cpu() -> None:
    """Without a GPU, torchao's import warns that its CUDA extensions cannot load (float8 training needs none of
    them; nothing else here uses them) and its enums trigger a deprecation in torch: muted. transformers imports
    torchao whenever it is installed (its quantizers, at every from_pretrained), so every run would print them."""
    import logging

    if not torch.cuda.is_available():
        for name in ("torchao", "torch.utils._pytree"):
            logging.getLogger(name).setLevel(logging.ERROR)


def _float8():
    """torchao.float8, its import quieted on a CPU."""
    quiet_torchao_on_cpu()
    import torchao.float8

    return torchao.float8


def converts(module: torch.nn.Module, fqn: str) -> bool:
    """torchao's module filter: whether this layer computes in float8."""
    if not isinstance(module, torch.nn.Linear) or fqn.rsplit(".", 1)[-1] in KEPT:
        return False
    return module.in_features % ALIGNMENT == 0 and module.out_features % ALIGNMENT == 0


def recipe_kwargs(strategy: str, gpu: bool):
    """accelerate's torchao recipe for this machine: real float8 matmuls on a GPU, emulated ones on a CPU; FSDP2's
    float8 all-gather on a GPU (gloo has no float8 collectives)."""
    from accelerate.utils import AORecipeKwargs

    config = dataclasses.replace(_float8().Float8LinearConfig.from_recipe_name("tensorwise"), emulate=not gpu,
                                 pad_inner_dim=True, enable_fsdp_float8_all_gather=gpu and strategy == "fsdp")
    return AORecipeKwargs(config=config, module_filter_func=converts)


def load_whole_on_every_rank() -> None:
    """FSDP2: accelerate refuses torchao's conversion with cpu_ram_efficient_loading (rank 0 loading, the others on
    the meta device), so every rank loads the model into host memory before it is converted and sharded. Set
    before the Accelerator exists: its FSDP plugin and transformers' loading both read it from the environment."""
    os.environ["FSDP_CPU_RAM_EFFICIENT_LOADING"] = "false"


def check(recipe, label: str, gpu: bool) -> None:
    """What FP8 refuses, one line each, before the process group exists."""
    t = recipe.training
    if t.mixed_precision != "fp8":
        return
    try:
        _float8()
    except ImportError:
        raise DisttrainError("training.mixed_precision=fp8 needs torchao (the fp8 extra: `make setup EXTRAS=fp8` or "
                             "`pip install 'disttrain[fp8]'`), or set training.mixed_precision=bf16") from None
    if gpu and torch.cuda.get_device_capability() < (8, 9):
        name = torch.cuda.get_device_name()
        raise DisttrainError(f"training.mixed_precision=fp8 needs a GPU with FP8 matmuls (compute capability 8.9+: "
                             f"H100, H200, L4, L40S, B200); {name} has {torch.cuda.get_device_capability()}, where "
                             "accelerate would silently train in fp16; use training.mixed_precision=bf16")
    refused = [(label not in PROVEN, f"under {label} (proven: one process, ddp.yaml, fsdp.yaml; DeepSpeed's FP8 "
                                     "is another library's; tensor, context, sequence and expert parallelism split "
                                     "the tensors float8 scales are computed over; offload and HSDP unverified)"),
               (t.objective != "sft", f"with training.objective={t.objective} (its second model or its sampling "
                                      "in float8, unverified here)"),
               (recipe.lora is not None or recipe.model.quantization is not None,
                "with a lora section or model.quantization (float8 under frozen or 4-bit base layers, unverified "
                "here)")]
    for found, what in refused:
        if found:
            raise DisttrainError(f"training.mixed_precision=fp8 is not supported {what}; use "
                                 "training.mixed_precision=bf16 there")


def describe(model: torch.nn.Module) -> str:
    """The run summary's line: how many linear layers compute in float8, and which (by leaf name) stay."""
    from torchao.float8.float8_linear import Float8Linear

    linear = {name: module for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)}
    converted = [m for m in linear.values() if isinstance(m, Float8Linear)]
    kept = sorted({name.rsplit(".", 1)[-1] for name, m in linear.items() if not isinstance(m, Float8Linear)})
    how = ("emulated on CPU" if converted[0].config.emulate else "torch._scaled_mm") if converted else "none aligned"
    return (f"fp8: {len(converted)} of {len(linear)} linear layers compute in float8 (tensorwise dynamic scales, "
            f"{how}); kept in high precision: {', '.join(kept) or 'none'}")
