"""HSDP (accelerate_configs/hsdp.yaml, `make train-hsdp`): FSDP2 on a 2-D mesh, sharded within each replica
group and replicated across them, from accelerate's ParallelismConfig. On 4 CPU processes as 2 replicas x 2
shards: the matrix recipe with 4 rows per step (4 processes x 1 row) trains the model (full, and LoRA) one
process trains (tests/strategy_runs.py, the same tolerances as every strategy), the parameters really are laid out as
(Replicate, Shard), its checkpoint records the mesh and resumes on it exactly, another mesh is refused in one
line, and the meshes disttrain does not handle yet (tensor, context parallel) are refused before
anything starts."""

import pytest
import torch

from conftest import assert_ok, launch
from disttrain.errors import DisttrainError
from disttrain.parallel.plan import ParallelPlan
from disttrain.training.checkpoint import CheckpointError, RunShape, check_shape
from strategy_runs import (CHECKPOINT_EVERY, STEPS, assert_same_run, assert_trains_like_one_process, final_weights,
                           losses, make_train, matrix_recipe, small_data, strategy_run, warm_like_make)

MESH = "dp_replicate=2,dp_shard=2"


@pytest.fixture
def hsdp_run(runs, tiny_model_dir):
    """`make train-hsdp GPUS=4 HSDP_REPLICAS=2` on the matrix recipe, 1 row per process and step."""
    def make(folder):
        recipe = matrix_recipe(folder, tiny_model_dir, small_data(runs), "run", training={"grad_accum": 1})
        return folder / "run", make_train("train-hsdp", recipe, "GPUS=4", "HSDP_REPLICAS=2")
    return runs.get("hsdp-full", make)


@pytest.mark.launch
def test_hsdp_trains_like_one_process_on_a_two_dimensional_mesh(hsdp_run, runs, tiny_model_dir):
    out, stdout = hsdp_run
    assert f"mesh={MESH}" in stdout and "processes=4" in stdout
    assert "run: FSDP2 parameters on the mesh (dp_replicate=2, dp_shard_cp=2) as (R, S(0))" in stdout
    ref = strategy_run(runs, tiny_model_dir, "single_gpu", False).out
    assert sorted(losses(out)) == list(range(1, STEPS + 1))
    assert losses(out) == pytest.approx(losses(ref), rel=1e-4)
    ours, single = final_weights(out, False), final_weights(ref, False)
    assert set(ours) == set(single)
    for key, value in single.items():
        torch.testing.assert_close(ours[key], value, atol=1e-4, rtol=1e-3, msg=key)


@pytest.mark.launch
def test_hsdp_trains_lora_like_one_process(runs, tiny_model_dir):
    """The matrix LoRA (merged on export) on the same 2 x 2 mesh: losses and the exported adapter are one
    process's."""
    def make(folder):
        recipe = matrix_recipe(folder, tiny_model_dir, small_data(runs), "run", lora=True, training={"grad_accum": 1})
        return folder / "run", warm_like_make("hsdp", recipe, 4, HSDP_REPLICAS=2)  # hsdp_run: make train-hsdp
    out, stdout = runs.get("hsdp-lora", make)
    assert f"mesh={MESH}" in stdout
    assert_trains_like_one_process(out, strategy_run(runs, tiny_model_dir, "single_gpu", True).out, lora=True)


@pytest.mark.launch
def test_hsdp_resumes_exactly_on_its_mesh_and_refuses_another(hsdp_run, runs, tiny_model_dir, tmp_path):
    out, _ = hsdp_run
    checkpoint = out / "checkpoints" / f"step-{CHECKPOINT_EVERY:08d}"
    recipe = matrix_recipe(tmp_path, tiny_model_dir, small_data(runs), "resumed", training={"grad_accum": 1})
    proc = launch("hsdp", recipe, nproc=4, overrides=[f"output.resume={checkpoint}"])
    assert_ok(proc)
    assert f"resumed from {checkpoint} at step {CHECKPOINT_EVERY}/{STEPS}" in proc.stdout
    assert_same_run(out, tmp_path / "resumed", lora=False, first_step=CHECKPOINT_EVERY + 1)
    # the same 4 processes as plain FSDP2 (one dimension): refused in one line, before any weight is read
    flat = RunShape(4, "fsdp", 1, 1)
    with pytest.raises(CheckpointError) as error:
        check_shape(checkpoint, flat)
    message = str(error.value)
    assert f"was written on the mesh {MESH}, this run is on one dimension" in message and "\n" not in message


@pytest.mark.parametrize("env, expected", [
    ({"PARALLELISM_CONFIG_DP_REPLICATE_SIZE": "2", "PARALLELISM_CONFIG_DP_SHARD_SIZE": "4"},
     "dp_replicate_size=2 x dp_shard_size=4 must equal the 4 processes launched"),
    # tensor parallelism (tests/test_tensor_parallel.py, test_fsdp_tp.py): in MULTI_GPU configs (transformers lays
    # FSDP2 over its groups), not under accelerate's FSDP
    ({"PARALLELISM_CONFIG_DP_SHARD_SIZE": "2", "PARALLELISM_CONFIG_TP_SIZE": "2"},
     "tp_size=2 runs alone (accelerate_configs/tp.yaml) or under FSDP2 laid out by transformers "
     "(accelerate_configs/fsdp_tp.yaml, distributed_type MULTI_GPU), not with an FSDP or DeepSpeed config"),
    # context parallelism (tests/test_context_parallel.py): FSDP2's, one dimension of groups, covering the processes
    ({"PARALLELISM_CONFIG_DP_SHARD_SIZE": "1", "PARALLELISM_CONFIG_CP_SIZE": "2"},
     "dp_shard_size=1 x cp_size=2 must equal the 4 processes launched"),
    ({"PARALLELISM_CONFIG_DP_REPLICATE_SIZE": "2", "PARALLELISM_CONFIG_CP_SIZE": "2"},
     "cp_size=2 needs FSDP2 without dp_replicate or sp"),
    ({"ACCELERATE_USE_DEEPSPEED": "true", "PARALLELISM_CONFIG_CP_SIZE": "2", "PARALLELISM_CONFIG_DP_SHARD_SIZE": "2"},
     "cp_size=2 needs FSDP2"),
    # Ulysses (tests/test_ulysses.py): DeepSpeed's, and its groups must cover the processes too
    ({"PARALLELISM_CONFIG_SP_SIZE": "2"}, "sp_size=2 needs DeepSpeed"),
    ({"ACCELERATE_USE_DEEPSPEED": "true", "PARALLELISM_CONFIG_SP_SIZE": "2", "PARALLELISM_CONFIG_DP_SHARD_SIZE": "1"},
     "dp_shard_size=1 x sp_size=2 must equal the 4 processes launched"),
])
def test_meshes_that_do_not_fit_are_refused_in_one_line(env, expected, monkeypatch):
    for name in ("DP_REPLICATE", "DP_SHARD", "TP", "CP", "SP"):
        monkeypatch.delenv(f"PARALLELISM_CONFIG_{name}_SIZE", raising=False)
    monkeypatch.setenv("ACCELERATE_USE_PARALLELISM_CONFIG", "true")
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "false" if "ACCELERATE_USE_DEEPSPEED" in env else "true")
    monkeypatch.setenv("WORLD_SIZE", "4")
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(DisttrainError) as error:
        ParallelPlan.from_launch()
    assert expected in str(error.value) and "\n" not in str(error.value)


def test_an_hsdp_launch_is_planned_and_labelled(monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_PARALLELISM_CONFIG", "true")
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("WORLD_SIZE", "16")
    monkeypatch.setenv("PARALLELISM_CONFIG_DP_REPLICATE_SIZE", "2")
    monkeypatch.setenv("PARALLELISM_CONFIG_DP_SHARD_SIZE", "8")
    plan = ParallelPlan.from_launch()
    assert (plan.strategy, plan.label, plan.mesh, plan.processes) == ("fsdp", "hsdp", "dp_replicate=2,dp_shard=8", 16)
