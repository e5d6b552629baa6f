"""Test-only: torch's ring attention on the CPU. torch's context parallelism maps only its CUDA attention kernels
(flash, efficient, cuDNN) to their ring versions; on a CPU, sdpa runs `_scaled_dot_product_flash_attention_for_cpu`,
which the context does not know, so a CP launch fails there. This registers that kernel (forward and backward)
with the same ring templates torch uses for the CUDA ones (`_templated_ring_attention[_backward]`, the same
head-tail load balancing, the same merging of partial results): the exchange of keys and values, the causal
masking of chunks and the merge are torch's own code, only the per-chunk kernel is the CPU one.

Loaded by putting this directory on PYTHONPATH (python imports `sitecustomize` at start-up) for the launches of
tests/test_context_parallel.py only; it never ships in disttrain/."""

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._op_schema import OpSchema, OpStrategy, RuntimeSchemaInfo
from torch.distributed.tensor._ops.utils import expand_to_full_mesh_op_strategy, register_op_strategy
from torch.distributed.tensor.experimental._context_parallel import _attention as ring
from torch.distributed.tensor.placement_types import Shard

FORWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
SEQUENCE_DIM = 2  # [batch, heads, sequence, head_dim]


@register_op_strategy(FORWARD, schema_info=RuntimeSchemaInfo(3))
def _forward_strategy(op_schema: OpSchema) -> OpStrategy:  # q, k, v and both outputs sharded on the sequence
    return expand_to_full_mesh_op_strategy(op_schema.get_mesh_from_args(), op_schema, [[Shard(2)] * 5],
                                           input_index=2)


@register_op_strategy(BACKWARD, schema_info=RuntimeSchemaInfo(6))
def _backward_strategy(op_schema: OpSchema) -> OpStrategy:
    return expand_to_full_mesh_op_strategy(op_schema.get_mesh_from_args(validate=False), op_schema,
                                           [[Shard(2)] * 9], input_index=3)


def _forward(mesh, query, key, value, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None):
    assert attn_mask is None, "the ring attends causally without a mask"
    return ring._templated_ring_attention(mesh.get_group(), SEQUENCE_DIM, FORWARD, query=query, key=key,
                                          value=value, is_causal=is_causal, dropout_p=dropout_p, scale=scale)


def _backward(mesh, grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, *, attn_mask=None,
              scale=None):
    return ring._templated_ring_attention_backward(
        mesh.get_group(), SEQUENCE_DIM, BACKWARD, grad_out=grad_out, grad_out_name="grad_out", query=query,
        key=key, value=value, out=out, logsumexp=logsumexp, is_causal=is_causal, dropout_p=dropout_p, scale=scale)


def _handler(op_call, args, kwargs):
    info = DTensor._op_dispatcher.unwrap_to_op_info(op_call, args, kwargs)
    DTensor._op_dispatcher.sharding_propagator.propagate(info)
    result = (_forward if op_call is FORWARD else _backward)(info.compute_mesh, *info.local_args, **info.local_kwargs)
    return DTensor._op_dispatcher.wrap(result, info.output_sharding.output_spec)


# copied into DTensor's handlers each time a context_parallel() context is entered
ring.custom_ops[FORWARD] = _handler
ring.custom_ops[BACKWARD] = _handler
