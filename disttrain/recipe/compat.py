"""Which strategy x training-mode x optimizer combinations work, checked before anything starts.

A combination that cannot work fails with one line saying why and what to use instead. The matrix and
what was tested are in docs/strategies.md ("Compatibility matrix"); keep the two in step.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from disttrain.recipe.schema import Recipe
from disttrain.errors import DisttrainError


# Combinations not yet proven on a GPU are refused unless this is "1" (the GPU acceptance script sets it).
ALLOW_UNVERIFIED = "DISTTRAIN_ALLOW_UNVERIFIED"

# First deepspeed release with deepspeed PR #8148 (ZeRO-3 + frozen weights + activation checkpointing
# recomputed gathered params with other metadata: torch CheckpointError, transformers issue #47254).
DEEPSPEED_CHECKPOINTING_FIX = (0, 19, 3)


def check(recipe: Recipe, strategy: str, gpu: bool) -> None:
    t, m = recipe.training, recipe.model
    # GPU only: without one, QLoRA is refused just below whatever the strategy (the more basic reason)
    if m.quantization and strategy == "fsdp" and gpu and os.environ.get(ALLOW_UNVERIFIED) != "1":
        raise DisttrainError("model.quantization=4bit (QLoRA) under FSDP2 is unverified on GPU (upstream reports "
                             "FSDP2 unsharding Params4bit without its quant_state: axolotl#2992, accelerate#3983); "
                             "use the ddp config, or plain LoRA under FSDP (model.quantization=null), or set "
                             f"{ALLOW_UNVERIFIED}=1 to try it")
    if m.quantization and not gpu:
        raise DisttrainError("model.quantization=4bit (QLoRA) needs a CUDA GPU (bitsandbytes kernels); on CPU "
                             "drop model.quantization (plain LoRA), e.g. `model.quantization=null`")
    if t.optimizer == "adamw_8bit":
        if strategy in ("fsdp", "deepspeed"):
            raise DisttrainError(f"training.optimizer=adamw_8bit is not supported with {strategy}: bitsandbytes "
                                 "keeps its own unsharded states; use training.optimizer=adamw (ZeRO/FSDP already "
                                 "shard Adam states) or the ddp config")
        if not gpu:
            raise DisttrainError("training.optimizer=adamw_8bit needs a CUDA GPU (bitsandbytes); use "
                                 "training.optimizer=adamw on CPU")
    if t.mixed_precision == "fp16" and not gpu:
        raise DisttrainError("training.mixed_precision=fp16 needs a GPU; use bf16 or no on CPU")
    if m.attn_implementation.startswith("flash_attention") and not gpu:
        raise DisttrainError(f"model.attn_implementation={m.attn_implementation} needs a CUDA GPU with "
                             "flash-attn installed; use sdpa")
    if m.router_balance == "global" and (t.loss_impl != "chunked" or t.objective != "sft"):
        raise DisttrainError(f"model.router_balance=global is built for training.objective=sft with the chunked loss "
                             f"(training.loss_impl=chunked), not objective={t.objective}, loss_impl={t.loss_impl}: "
                             "set model.router_balance=micro_batch (transformers' own router loss)")
    check_deepspeed_version(recipe, strategy)


def deepspeed_version() -> tuple[int, ...] | None:
    """The installed deepspeed release (None: not installed); a function so tests can replace it."""
    import importlib.metadata
    import re

    try:
        version = importlib.metadata.version("deepspeed")
    except importlib.metadata.PackageNotFoundError:
        return None
    return tuple(int(x) for x in re.findall(r"\d+", version)[:3])


def check_deepspeed_version(recipe: Recipe, strategy: str) -> None:
    """ZeRO-3 + LoRA + gradient checkpointing crashes in the first backward on deepspeed before 0.19.3."""
    if strategy != "deepspeed" or recipe.lora is None or not recipe.model.gradient_checkpointing:
        return
    stage, _, _ = _zero_settings()
    found = deepspeed_version()
    if stage == 3 and found is not None and found < DEEPSPEED_CHECKPOINTING_FIX:
        fix = ".".join(map(str, DEEPSPEED_CHECKPOINTING_FIX))
        raise DisttrainError(f"deepspeed {'.'.join(map(str, found))} crashes with ZeRO-3 + LoRA + gradient "
                             f"checkpointing (CheckpointError; fixed in {fix}, deepspeed PR #8148): pip install "
                             f"'deepspeed>={fix}', or set model.gradient_checkpointing=false")


def _zero_settings() -> tuple[int | None, bool, str]:
    """ZeRO stage, stage3_gather_16bit_weights_on_model_save, and where they came from: the DeepSpeed JSON
    named by the accelerate config, else the accelerate config's own deepspeed_config keys."""
    config_file = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE", "")
    if config_file and config_file != "none" and Path(config_file).is_file():
        zero = json.loads(Path(config_file).read_text()).get("zero_optimization", {})
        return zero.get("stage"), zero.get("stage3_gather_16bit_weights_on_model_save", False), config_file
    stage = int(os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", "0") or 0)
    gather = os.environ.get("ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL", "false").lower() == "true"
    return stage, gather, "the accelerate config (zero3_save_16bit_model)"


def check_zero3_export(recipe: Recipe, strategy: str) -> None:
    """ZeRO-3 can only export the final model if it gathers the 16-bit weights on save. Without the setting the
    run would train for hours and then fail at the very end; say so before the first step."""
    if strategy != "deepspeed" or not recipe.output.save_final_model:
        return
    stage, gather, config_file = _zero_settings()
    if stage == 3 and gather is not True:
        raise DisttrainError(f"{config_file}: ZeRO-3 with stage3_gather_16bit_weights_on_model_save unset or false "
                             "cannot export the final model (no rank holds all weights): set it to true, or set "
                             "output.save_final_model=false and convert checkpoints with zero_to_fp32.py")


def check_trackers(report_to: list[str]) -> None:
    """This machine has the recipe's trackers (accelerate only warns, and the run would log nowhere)."""
    import importlib.util

    modules = {"wandb": "wandb", "tensorboard": "tensorboard", "mlflow": "mlflow"}
    extras = {"wandb": "`make setup EXTRAS=test,tracking`", "tensorboard": "`make setup EXTRAS=test,tracking`",
              "mlflow": "`make setup EXTRAS=test,mlflow`"}
    for tracker in report_to:
        if tracker in modules and importlib.util.find_spec(modules[tracker]) is None:
            raise DisttrainError(f"logging.report_to includes {tracker} but it is not installed: pip install "
                                 f"{tracker} (or {extras[tracker]}), or remove it from report_to")


# Launch labels where training.compile is proven (tests/test_compile.py: compiled == eager, no recompiles) and
# data.streaming (tests/test_streaming.py: exact resume); the matrix's cells say the same, and tests/test_matrix.py
# fails when the two disagree (a Proven cell refused here, or a Refused one let through)
COMPILE_PROVEN = ("single", "ddp", "fsdp")
STREAMING_PROVEN = ("single", "ddp", "fsdp", "zero3")
ROUTER_GLOBAL_PROVEN = ("single", "ddp", "fsdp_ep")


def check_unproven(recipe: Recipe, label: str) -> None:
    """Features that run under many configs but are proven only under some (disttrain/recipe/matrix.py): refused
    under the others in one line, unless DISTTRAIN_ALLOW_UNVERIFIED=1 (to try one on purpose)."""
    if os.environ.get(ALLOW_UNVERIFIED) == "1":
        return
    t, d = recipe.training, recipe.data
    if t.compile and label not in COMPILE_PROVEN:
        raise DisttrainError(f"training.compile=true is unverified under {label} (proven: one process, ddp.yaml, "
                             f"fsdp.yaml; compiled == eager in tests/test_compile.py): set training.compile=false, "
                             f"use one of those, or set {ALLOW_UNVERIFIED}=1 to try it")
    if recipe.model.router_balance == "global" and label not in ROUTER_GLOBAL_PROVEN:
        raise DisttrainError(f"model.router_balance=global is not proven under {label} (proven: one process, "
                             f"ddp.yaml, fsdp_ep.yaml: tests/test_expert_parallel.py): use one of those, "
                             f"model.router_balance=micro_batch, or set {ALLOW_UNVERIFIED}=1 to try it")
    if d.streaming and label not in STREAMING_PROVEN:
        raise DisttrainError(f"data.streaming=true is not proven under {label} (proven: one process, ddp.yaml, "
                             f"fsdp.yaml, zero3.yaml): use a map-style dataset (data.streaming=false), one of those "
                             f"configs, or set {ALLOW_UNVERIFIED}=1 to try it")
