"""Optimizer and LR schedule from the recipe's training section."""

from __future__ import annotations

import functools
import math

import torch

from disttrain.recipe.schema import TrainingSection
from disttrain.errors import DisttrainError


def _param_groups(model, weight_decay: float) -> list[dict]:
    # No decay on biases and norm weights (1-D tensors), the usual practice for transformers.
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            shape = getattr(p, "ds_shape", p.shape)  # under ZeRO-3 init every local tensor is 1-D and empty
            (decay if len(shape) >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    # DeepSpeed drops empty groups, which would desynchronise the LR scheduler's per-group lists
    return [g for g in groups if g["params"]]


def build_optimizer(model, cfg: TrainingSection) -> torch.optim.Optimizer:
    groups = _param_groups(model, cfg.weight_decay)
    common = dict(lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_epsilon)
    if cfg.optimizer == "adamw_8bit":
        try:
            import bitsandbytes as bnb
        except ImportError:
            raise DisttrainError("training.optimizer=adamw_8bit needs bitsandbytes: pip install bitsandbytes "
                                 "(or `make setup EXTRAS=test,quant`), or use training.optimizer=adamw") from None
        return bnb.optim.AdamW8bit(groups, **common)
    return torch.optim.AdamW(groups, **common)


def warmup_steps(cfg: TrainingSection, total_steps: int) -> int:
    return cfg.warmup_steps or math.ceil(cfg.warmup_ratio * total_steps)


# The four schedules of transformers' get_scheduler, with its formulas (tests/test_optim.py pins them to it
# step for step). Written here because importing transformers.optimization imports its Trainer utilities
# and, through them, peft and bitsandbytes: 1.6 s of every rank's start-up, in runs that use neither.
def _warmup(step: int, warmup: int) -> float:
    return float(step) / float(max(1, warmup))


def _constant(step: int, warmup: int, total: int) -> float:
    return 1.0


def _constant_with_warmup(step: int, warmup: int, total: int) -> float:
    return _warmup(step, warmup) if step < warmup else 1.0


def _linear(step: int, warmup: int, total: int) -> float:
    if step < warmup:
        return _warmup(step, warmup)
    return max(0.0, float(total - step) / float(max(1, total - warmup)))


def _cosine(step: int, warmup: int, total: int) -> float:  # half a cosine period, to 0 (num_cycles=0.5)
    if step < warmup:
        return _warmup(step, warmup)
    progress = float(step - warmup) / float(max(1, total - warmup))
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))


SCHEDULES = {"constant": _constant, "constant_with_warmup": _constant_with_warmup, "linear": _linear,
             "cosine": _cosine}


def build_scheduler(optimizer, cfg: TrainingSection, total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, functools.partial(
        SCHEDULES[cfg.lr_scheduler], warmup=warmup_steps(cfg, total_steps), total=total_steps))
