"""Which strategy x training-mode x optimizer combinations work, checked before anything starts.

A combination that cannot work fails with one line saying why and what to use instead. The matrix and
what was tested are in docs/strategies.md ("Compatibility matrix"); keep the two in step.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from disttrain.config import Recipe
from disttrain.errors import DisttrainError


def check(recipe: Recipe, strategy: str, gpu: bool) -> None:
    t, m = recipe.training, recipe.model
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


def check_zero3_export(recipe: Recipe, strategy: str) -> None:
    """ZeRO-3 can only export the final model if it gathers the 16-bit weights on save. Without the setting the
    run would train for hours and then fail at the very end; say so before the first step."""
    if strategy != "deepspeed" or not recipe.output.save_final_model:
        return
    config_file = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE", "")
    if config_file and config_file != "none" and Path(config_file).is_file():
        zero = json.loads(Path(config_file).read_text()).get("zero_optimization", {})
        stage, gather = zero.get("stage"), zero.get("stage3_gather_16bit_weights_on_model_save", False)
    else:
        stage = int(os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", "0") or 0)
        gather = os.environ.get("ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL", "false").lower() == "true"
        config_file = "the accelerate config (zero3_save_16bit_model)"
    if stage == 3 and gather is not True:
        raise DisttrainError(f"{config_file}: ZeRO-3 with stage3_gather_16bit_weights_on_model_save unset or false "
                             "cannot export the final model (no rank holds all weights): set it to true, or set "
                             "output.save_final_model=false and convert checkpoints with zero_to_fp32.py")


def check_trackers(report_to: list[str]) -> None:
    """This machine has the recipe's trackers (accelerate only warns, and the run would log nowhere)."""
    import importlib.util

    modules = {"wandb": "wandb", "tensorboard": "tensorboard"}
    for tracker in report_to:
        if tracker in modules and importlib.util.find_spec(modules[tracker]) is None:
            raise DisttrainError(f"logging.report_to includes {tracker} but it is not installed: pip install "
                                 f"{tracker} (or `make setup EXTRAS=test,tracking`), or remove it from report_to")
