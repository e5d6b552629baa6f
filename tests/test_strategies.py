"""Same train.py, same recipe, only --config_file changes: every strategy trains the model one process trains,
and continues exactly from its own mid-run checkpoint.

The runs (tests/strategy_runs.py) are made once per session and shared. Equivalence: per-step losses within
1e-4 relative and exported weights within 1e-4 absolute after 10 AdamW steps across an epoch boundary (only
the summation order differs); a real bug (wrong normalisation, a rank reading the same rows, a missed LR
step) moves them by > 1e-2. Resume: a new launch given the run's step-5 checkpoint (output.resume=<dir>)
repeats steps 6-10 to 1e-6 and ends with the same weights: model, optimizer (sharded as the strategy
shards it), schedule, data position mid-epoch with accumulation and the next epoch's reshuffle, all
restored.
"""

import json

import pytest
import torch

from conftest import assert_ok, launch
from disttrain.metrics.log import read_metrics
from strategy_runs import (CHECKPOINT_EVERY, LORA, SAMPLED, STEPS, STRATEGIES, assert_same_run, final_weights,
                           matrix_recipe, small_data, strategy_run)

pytestmark = pytest.mark.launch


def lines(out, key="loss") -> dict:
    return {r["step"]: r[key] for r in read_metrics(out) if key in r}


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_strategy_matches_single_process(strategy, lora, runs, tiny_model_dir):
    ref = strategy_run(runs, tiny_model_dir, "single_gpu", lora)
    run = strategy_run(runs, tiny_model_dir, strategy, lora)
    assert "processes=2" in run.stdout and "processes=1" in ref.stdout
    if strategy in SAMPLED:  # generated at the end with sharded weights, every rank in step
        assert "sample: '<|im_start|>user" in run.stdout, run.stdout[-2000:]

    ref_losses, losses = lines(ref.out), lines(run.out)
    assert sorted(losses) == list(range(1, STEPS + 1))
    assert losses == pytest.approx(ref_losses, rel=1e-4), f"{strategy}: {losses} vs {ref_losses}"
    assert lines(run.out, "lr") == pytest.approx(lines(ref.out, "lr"))

    ref_w, w = final_weights(ref.out, lora), final_weights(run.out, lora)
    assert set(w) == set(ref_w)
    for key, value in ref_w.items():
        assert w[key].numel() > 0, f"{key} exported empty"  # the torch.Size([0]) adapter failure
        torch.testing.assert_close(w[key], value, atol=1e-4, rtol=1e-3, msg=f"{strategy}: {key}")
    if lora:
        config = json.loads((run.out / "final" / "adapter_config.json").read_text())
        assert config["r"] == LORA["r"]
        assert not (run.out / "final" / "model.safetensors").exists()


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "zero2", "zero3"])
def test_resume_from_a_mid_run_checkpoint_matches_uninterrupted(strategy, lora, runs, tiny_model_dir, tmp_path):
    run = strategy_run(runs, tiny_model_dir, strategy, lora)
    checkpoint = run.out / "checkpoints" / f"step-{CHECKPOINT_EVERY:08d}"
    recipe = matrix_recipe(tmp_path, tiny_model_dir, small_data(runs), "resumed", lora=lora)
    proc = launch(strategy, recipe, overrides=[f"output.resume={checkpoint}"])
    assert_ok(proc)
    assert f"resumed from {checkpoint} at step {CHECKPOINT_EVERY}/{STEPS}" in proc.stdout
    assert_same_run(run.out, tmp_path / "resumed", lora, first_step=CHECKPOINT_EVERY + 1)


@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3"])
def test_zero_with_bf16_exports_the_fp32_masters_its_checkpoints_hold(strategy, runs, tiny_model_dir, tmp_path):
    """model.dtype float32 + bf16 under ZeRO: DeepSpeed trains a bf16 copy of the module and keeps fp32 masters
    in the optimizer. final/ must hold what the checkpoint readers (`make eval` / `make export` of the last
    checkpoint, DeepSpeed's zero_to_fp32) return, the fp32 masters, in a config that loads as float32 (it held
    the bf16-rounded weights: a run and its last checkpoint scored different models)."""
    from safetensors.torch import load_file

    from strategy_runs import assert_exports_from_its_last_checkpoint

    recipe = matrix_recipe(tmp_path, tiny_model_dir, small_data(runs), "bf16", training={"mixed_precision": "bf16"},
                           output={"checkpoint_every": STEPS})
    assert_ok(launch(strategy, recipe))
    final = load_file(tmp_path / "bf16" / "final" / "model.safetensors")
    assert {value.dtype for value in final.values()} == {torch.float32}
    rounded = [key for key, value in final.items() if not torch.equal(value, value.bfloat16().float())]
    assert rounded, "the fp32 masters carry more than bf16's bits"
    assert json.loads((tmp_path / "bf16" / "final" / "config.json").read_text())["dtype"] == "float32"
    assert_exports_from_its_last_checkpoint(tmp_path / "bf16", tmp_path)
