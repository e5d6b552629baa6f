"""LoRA adapters as every strategy and mesh starts them: the same initial values, and under tensor
parallelism sizes that match their split weights.

Initial values. peft draws each adapter's `lora_A` from torch's shared generator as it creates the adapters,
layer after layer, so the values depend on everything drawn before: under tensor parallelism peft creates
smaller column-split `lora_B`s (their nn.Linear initialisation, overwritten with zeros, still draws), and from
the same seed the first layer's `lora_A` came out different from one process's (it summed to -0.111 against
-0.426). Here each `lora_A` (and an embedding adapter's `lora_embedding_B`) is drawn again from a generator of
its own, seeded by the run's seed and the layer's name, with peft's own distribution for
`init_lora_weights` (true: Kaiming-uniform as nn.Linear, over the whole matrix's fan-in; "gaussian": normal,
std 1/r; `lora_B` stays zero; false: both Kaiming-uniform, as peft leaves nn.Linear's), whole on every process
and split like the parameter it fills. Every strategy
gets the same adapters, whatever it drew before; no other initialisation does this for a split adapter.

Sizes (tensor parallelism). peft 0.21 makes a split `lora_A` (row-split projections: o_proj, down_proj) a
global DTensor but leaves its nn.Linear's `in_features` at the local size, and transformers' row-split forward
sizes its input by `in_features`: the forward failed (`shape '[44, 44]' is invalid for input of size 3872`).
The sizes are set to the DTensor's global shape.
"""

from __future__ import annotations

import math
import zlib

import torch


@torch.no_grad()
def seed_adapters(model, init: bool | str) -> None:
    from torch.distributed.tensor import DTensor, distribute_tensor

    seed = torch.initial_seed()  # the recipe's training.seed (set_seed before the model is loaded)
    for name, module in model.named_modules():
        # (what, the parameter, its distribution: a normal's std, or None for nn.Linear's Kaiming-uniform)
        drawn = [(f"{name}.lora_A.{adapter}", linear.weight, 1.0 / module.r[adapter] if init == "gaussian" else None)
                 for adapter, linear in getattr(module, "lora_A", {}).items()]
        if init is False:  # peft keeps nn.Linear's own initialisation for both (B not zero): drawn alike
            drawn += [(f"{name}.lora_B.{adapter}", linear.weight, None)
                      for adapter, linear in getattr(module, "lora_B", {}).items()]
        drawn += [(f"{name}.lora_embedding_B.{adapter}", weight, 1.0)  # an embedding's B: peft's normal_
                  for adapter, weight in getattr(module, "lora_embedding_B", {}).items()]
        for key, weight, std in drawn:
            generator = torch.Generator().manual_seed((seed + zlib.crc32(key.encode())) % 2**63)
            whole = torch.empty(weight.shape, dtype=torch.float32)
            if std is None:
                torch.nn.init.kaiming_uniform_(whole, a=math.sqrt(5), generator=generator)
            else:
                whole.normal_(0.0, std, generator=generator)
            if isinstance(weight, DTensor):  # this process's part (every process drew the whole alike)
                weight.to_local().copy_(distribute_tensor(whole, weight.device_mesh, weight.placements,
                                                          src_data_rank=None).to_local())
            else:
                weight.copy_(whole)


def size_split_adapters(model) -> None:
    from torch.distributed.tensor import DTensor

    for layer in model.modules():
        for adapters in (getattr(layer, "lora_A", {}), getattr(layer, "lora_B", {})):
            for linear in adapters.values():
                if isinstance(linear, torch.nn.Linear) and isinstance(linear.weight, DTensor):
                    linear.out_features, linear.in_features = linear.weight.shape
