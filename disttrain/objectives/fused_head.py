"""training.loss_impl: trl -- TRL's fused LM head as the token-loss engine, for comparison with the chunked loss.

`trl.trainer.utils.add_fused_lm_head` (TRL's SFT/DPO/KTO/GRPO trainers run on it) makes
`model(..., labels=..., fused_lm_head=True)` return per-token log-probs and the loss without full logits: it
runs the backbone, then projects the hidden states through lm_head in [4096 tokens x 32768 vocab] tiles
(Triton on CUDA/XPU, the same tiles in torch elsewhere), recomputes each tile in the backward, and applies
what the family adds itself (softcapping and logit scales read through the text config, the MoE
load-balancing loss with transformers' function). Nothing here re-implements it; this module only calls it
the way LossEngine calls its other engines. Why the chunked loss stays the default: docs/benchmarks.md
("Loss engines"; memory and step time per strategy by `make bench-memory`).
"""

from __future__ import annotations

import torch

from disttrain.data import SHIFT_LABELS_KEY
from disttrain.errors import DisttrainError


def install(model) -> None:
    """Patch the model's forward with TRL's fused head (on the model under a peft wrapper: peft's forward
    passes `fused_lm_head` and `num_items_in_batch` through to it)."""
    try:
        from trl.trainer.utils import add_fused_lm_head  # imports TRL's trainer utilities: only when chosen
    except ImportError as error:
        raise DisttrainError(f"training.loss_impl: trl needs TRL ({error}): pip install 'trl>=1.16,<1.17' "
                             "(the project's [trl] extra), or use training.loss_impl: chunked") from None
    add_fused_lm_head(model.get_base_model() if hasattr(model, "get_base_model") else model)


def _output(model, inputs: dict, batch: dict, num_items_in_batch=None):
    # pre-shifted targets go to TRL as they are (its `shift_labels`); otherwise it shifts `labels` itself
    return model(**inputs, labels=batch["labels"], shift_labels=batch.get(SHIFT_LABELS_KEY), fused_lm_head=True,
                 num_items_in_batch=num_items_in_batch)


def loss(model, inputs: dict, batch: dict, num_items_in_batch=None) -> torch.Tensor:
    """Sum of the batch's target-token losses / num_items_in_batch (their count when None), plus the MoE
    load-balancing loss x router_aux_loss_coef when the model returns router logits (TRL adds it)."""
    return _output(model, inputs, batch, num_items_in_batch).loss


@torch.no_grad()
def token_losses(model, inputs: dict, batch: dict) -> torch.Tensor:
    """fp32 per-token losses (0 where there is no target): [batch, seq - 1] from `labels`, [batch, seq] from
    `shift_labels`."""
    return -_output(model, inputs, batch).log_probs.float()
