"""training.compile: regional torch.compile (accelerate's TorchDynamoPlugin) trains exactly like eager, and
compiles once: no recompilation while training on batches of varying sequence lengths."""

from __future__ import annotations

import pytest

from conftest import assert_ok, base_recipe, launch, write_recipe
from disttrain.metrics.log import read_metrics


@pytest.mark.launch
def test_compiled_run_matches_eager_losses_without_recompiles(tmp_path, tiny_model_dir):
    losses = {}
    for compiled in (False, True):
        out = tmp_path / f"compile-{compiled}"
        # no samples: generating with a KV cache compiles inference graphs of its own (not what is checked)
        recipe = write_recipe(tmp_path / f"{compiled}.yaml", base_recipe(
            tiny_model_dir, out, training={"max_steps": 3, "compile": compiled}, logging={"samples": 0},
            output={"save_final_model": False, "checkpoint_at_end": False}))
        proc = launch("single_gpu", recipe, nproc=1, timeout=900, env={"TORCH_LOGS": "recompiles"})
        assert_ok(proc)
        assert f"compile={'regional' if compiled else 'no'}" in proc.stdout
        # each training step has another sequence length: with dynamic shapes nothing recompiles (lm_head's
        # chunked loss once recompiled for every length until Dynamo's limit, then ran eagerly)
        recompiles = [line for line in proc.stderr.splitlines() if "Recompiling function" in line]
        assert not recompiles, recompiles[:3]
        losses[compiled] = [r["loss"] for r in read_metrics(out) if "loss" in r]
    assert len(losses[True]) == 3 and losses[True] == pytest.approx(losses[False], rel=1e-4)
