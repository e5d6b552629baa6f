"""Optimizer and LR schedule from the recipe's training section."""

from __future__ import annotations

import math

import torch

from disttrain.config import TrainingSection
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
                                 "(or `make setup EXTRAS=quant`), or use training.optimizer=adamw") from None
        return bnb.optim.AdamW8bit(groups, **common)
    return torch.optim.AdamW(groups, **common)


def warmup_steps(cfg: TrainingSection, total_steps: int) -> int:
    return cfg.warmup_steps or math.ceil(cfg.warmup_ratio * total_steps)


def build_scheduler(optimizer, cfg: TrainingSection, total_steps: int):
    from transformers import get_scheduler

    return get_scheduler(cfg.lr_scheduler, optimizer, num_warmup_steps=warmup_steps(cfg, total_steps),
                         num_training_steps=total_steps)
