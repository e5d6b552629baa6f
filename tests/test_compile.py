"""training.compile: regional torch.compile (accelerate's TorchDynamoPlugin) trains exactly like eager."""

from __future__ import annotations

import pytest

from conftest import assert_ok, base_recipe, launch, write_recipe
from disttrain.metrics import read_metrics


@pytest.mark.launch
def test_compiled_run_matches_eager_losses_without_recompile_storms(tmp_path, tiny_model_dir):
    losses = {}
    for compiled in (False, True):
        out = tmp_path / f"compile-{compiled}"
        recipe = write_recipe(tmp_path / f"{compiled}.yaml", base_recipe(
            tiny_model_dir, out, training={"max_steps": 3, "compile": compiled},
            output={"save_final_model": False, "checkpoint_at_end": False}))
        proc = launch("single_gpu", recipe, nproc=1, timeout=900)
        assert_ok(proc)
        assert f"compile={'regional' if compiled else 'no'}" in proc.stdout
        # variable sequence lengths must not exhaust dynamo's recompile limit (it would fall back to eager)
        assert "recompile_limit" not in proc.stderr
        losses[compiled] = [r["loss"] for r in read_metrics(out) if "loss" in r]
    assert losses[True] == pytest.approx(losses[False], rel=1e-4)
