"""Which strategy x training-mode x optimizer combinations work, checked before anything starts.

A combination that cannot work fails with one line saying why and what to use instead. The matrix and
what was tested are in docs/strategies.md ("Compatibility matrix"); keep the two in step.
"""

from __future__ import annotations

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


def check_trackers(report_to: list[str]) -> None:
    """This machine has the recipe's trackers (accelerate only warns, and the run would log nowhere)."""
    import importlib.util

    modules = {"wandb": "wandb", "tensorboard": "tensorboard"}
    for tracker in report_to:
        if tracker in modules and importlib.util.find_spec(modules[tracker]) is None:
            raise DisttrainError(f"logging.report_to includes {tracker} but it is not installed: pip install "
                                 f"{tracker} (or `make setup EXTRAS=test,tracking`), or remove it from report_to")
