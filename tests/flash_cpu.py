"""transformers' flash-attention code path on CPU: its own dispatch (`_flash_attention_forward`: padded, varlen
kwargs, packed position ids, plain) with reference kernels in place of the flash_attn CUDA kernels. Lets CPU
tests see which kernel transformers would call for a batch, and so whether packed examples stay isolated."""

from __future__ import annotations

from contextlib import contextmanager

import torch


def _attend(q, k, v, causal: bool, scale):
    """One sequence: q [T, H, D], k/v [T, H_kv, D] (grouped-query heads repeated)."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    out = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                                           is_causal=causal, scale=scale)
    return out.transpose(0, 1)


def flash_fn(q, k, v, dropout_p=0.0, softmax_scale=None, causal=True, **_):
    """flash_attn_func: every row of the batch is one causal sequence."""
    return torch.stack([_attend(q[b], k[b], v[b], causal, softmax_scale) for b in range(q.shape[0])])


def flash_varlen_fn(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None, dropout_p=0.0,
                    softmax_scale=None, causal=True, **_):
    """flash_attn_varlen_func: tokens of all sequences in one dimension, cut at cu_seqlens."""
    bounds = cu_seqlens_q.tolist()
    return torch.cat([_attend(q[s:e], k[s:e], v[s:e], causal, softmax_scale) for s, e in zip(bounds, bounds[1:])])


@contextmanager
def cpu_flash_attention(model, implementation: str = "flash_attention_2"):
    """Run `model` through transformers' flash-attention integration with the reference kernels above."""
    import transformers.modeling_flash_attention_utils as fa

    def lazy_import(*_args, **_kwargs):
        process = fa._lazy_define_process_function(flash_varlen_fn)
        return (flash_fn, flash_varlen_fn, None, None, None), (process, dict)

    original_import, original_impl = fa.lazy_import_flash_attention, model.config._attn_implementation
    fa.lazy_import_flash_attention = lazy_import
    model.config._attn_implementation = implementation
    try:
        yield model
    finally:
        fa.lazy_import_flash_attention = original_import
        model.config._attn_implementation = original_impl
