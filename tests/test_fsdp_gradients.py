"""FSDP2 with gradient accumulation: between micro-batches a rank holds only its gradient shard (the default),
and gradients are reduced in fp32 under bf16 mixed precision. Measured on 2 CPU processes with the same
accelerate config users launch (tests/scripts/fsdp_grad_probe.py counts the gradient tensors FSDP keeps)."""

import json

import pytest

from conftest import assert_ok, base_recipe, launch, write_recipe

pytestmark = pytest.mark.launch


def probe(tmp_path, tiny_model_dir, name, **distributed):
    out = tmp_path / name
    recipe = base_recipe(tiny_model_dir, out, training={"grad_accum": 2, "micro_batch_size": 2,
                                                        "mixed_precision": "bf16"}, distributed=distributed)
    assert_ok(launch("fsdp", write_recipe(tmp_path / f"{name}.yaml", recipe),
                     script="tests/scripts/fsdp_grad_probe.py"))
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def test_default_holds_the_gradient_shard_between_micro_batches_and_reduces_in_fp32(tmp_path, tiny_model_dir):
    for rank in probe(tmp_path, tiny_model_dir, "default"):
        held, params = rank["recipe"], rank["recipe"]["params"]
        assert held["sync_each_micro_batch"] is True
        assert held["unsharded"] == 0
        assert held["sharded"] <= params / 2 + 1024  # this rank's shard (dim-0 split, rounding per tensor)
        assert held["reduce_dtypes"] == ["torch.float32"]
        # the control in the same launch: no-sync micro-batches keep every layer's unsharded gradient
        assert rank["opposite"]["unsharded"] == params


def test_opting_out_keeps_unsharded_gradients_and_low_precision_reduction(tmp_path, tiny_model_dir):
    for rank in probe(tmp_path, tiny_model_dir, "opt_out", fsdp_sync_each_micro_batch=False,
                      fsdp_reduce_in_fp32=False):
        assert rank["recipe"]["unsharded"] == rank["recipe"]["params"]
        assert rank["recipe"]["reduce_dtypes"] == ["torch.bfloat16"]  # accelerate's own default
        assert rank["opposite"]["unsharded"] == 0
