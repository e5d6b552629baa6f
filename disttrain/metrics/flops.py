"""Training FLOPs per token from a model config (PaLM appendix B; what nanoGPT and torchtitan use).

    full fine-tune:  6 * N_matmul + 12 * L * H * d_head * T
    LoRA:            4 * N_frozen + 6 * N_adapter + 12 * L * H * d_head * T
N_matmul counts the weights of every matmul, the output projection included (also when it is tied to the
embedding); the embedding lookup itself is no matmul. The attention term is the QK^T and AV products
(forward 2 matmuls x 2 FLOPs, backward 2x), with H query heads and d_head their dimension, so GQA does not
shrink it; causal masking is not discounted, as in PaLM. Frozen weights need no weight gradients: 2 FLOPs
forward + 2 backward (input gradients) per weight instead of 6.

Mixture of experts: a token runs through its top-k experts only, so N_matmul counts the routed experts'
weights times k / E (the *active* parameters) plus the router; memory counts all of them (`params`). transformers
stores the experts of a block fused, as 3-D parameters [E, out, in] (not nn.Linear), read here by that shape.
"""

from __future__ import annotations

from dataclasses import dataclass

from disttrain.model.family import Family, text_config
from disttrain.model.params import numel


@dataclass(frozen=True)
class ModelShape:
    params: int            # all parameters
    matmul_params: int     # weights that take part in a matmul (output projection included)
    layers: int
    heads: int
    head_dim: int
    hidden: int
    vocab: int
    expert_params: int = 0  # all routed-expert weights (MoE); matmul_params holds their active share
    kv_heads: int = 0       # key/value heads (grouped-query attention); 0: as many as `heads`


def shape_from_model(model, config) -> ModelShape:
    """Counts from a live model (sharded or not); LoRA adapter matrices are not part of N_matmul."""
    import torch

    text = text_config(config)
    params = sum(numel(p) for n, p in model.named_parameters() if "lora_" not in n)
    matmul = sum(numel(m.weight) for name, m in model.named_modules()
                 if isinstance(m, torch.nn.Linear) and "lora_" not in name)
    routing = Family.of(config).routing
    experts = router = 0
    if routing is not None:
        experts, router = _moe_weights(model, routing[0], text.hidden_size)
        matmul += router + experts * routing[1] // routing[0]
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return ModelShape(params, matmul, text.num_hidden_layers, heads, head_dim, text.hidden_size, text.vocab_size,
                      experts, getattr(text, "num_key_value_heads", None) or heads)


def _moe_weights(model, experts: int, hidden: int) -> tuple[int, int]:
    """(all fused expert weights, router weights): parameters outside nn.Linear that are 3-D with `experts`
    leading (the experts of a block) or experts x hidden (the router's scores)."""
    import torch

    fused = router = 0
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) or "lora_" in name:
            continue
        for p in module.parameters(recurse=False):
            shape = tuple(getattr(p, "ds_shape", None) or p.shape)  # ZeRO-3 keeps the full shape in ds_shape
            if len(shape) == 3 and shape[0] == experts:
                fused += numel(p)
            elif shape == (experts, hidden):
                router += numel(p)
    return fused, router


def shape_from_config(config) -> ModelShape:
    """Exact counts from an empty (meta-device) instance of the architecture: nothing is allocated."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return shape_from_model(model, config)


def attention_flops_per_token(shape: ModelShape, seq_len: int) -> float:
    return 12.0 * shape.layers * shape.heads * shape.head_dim * seq_len


def forward_flops_per_token(shape: ModelShape, seq_len: int) -> float:
    """One forward pass only (a reference model's): 2 FLOPs per weight per token, a third of the attention term."""
    return 2.0 * shape.matmul_params + attention_flops_per_token(shape, seq_len) / 3


def training_flops_per_token(shape: ModelShape, seq_len: int, trainable_params: int | None = None) -> float:
    """`trainable_params` = adapter parameters for LoRA (None: full fine-tune)."""
    if trainable_params is None:
        dense = 6.0 * shape.matmul_params
    else:
        dense = 4.0 * shape.matmul_params + 6.0 * trainable_params
    return dense + attention_flops_per_token(shape, seq_len)
