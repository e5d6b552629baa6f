"""Parameter counts that hold under every strategy and quantization (FLOPs, the run description, MFU)."""

from __future__ import annotations


def numel(p) -> int:
    """Full size of a parameter: ZeRO-3 keeps an empty local placeholder (ds_numel); DTensors are global.
    bitsandbytes' quantized 4-bit weights (Params4bit) pack two values per byte of their storage dtype, so
    numel() is the packed count: scaled back as transformers' num_parameters does."""
    n = getattr(p, "ds_numel", None)
    n = p.numel() if n is None else n
    # by class name: bitsandbytes stays an optional import; bnb_quantized is False until the weight is packed
    if type(p).__name__ == "Params4bit" and getattr(p, "bnb_quantized", False):
        n *= 2 * p.element_size()
    return n


def count_parameters(model) -> tuple[int, int]:
    """(all parameters, trainable ones), full sizes whatever shards or packs them."""
    total = trainable = 0
    for p in model.parameters():
        n = numel(p)
        total += n
        trainable += n if p.requires_grad else 0
    return total, trainable
