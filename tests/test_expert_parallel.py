"""Expert parallelism under FSDP2 (accelerate_configs/fsdp_ep.yaml, `make train-fsdp-ep EP=N`), laid out by
transformers as it loads the model: each MoE block's experts split over ep processes, the tokens sent to them
by all-to-all, FSDP2 over the rest (and over the processes holding the same experts). On CPU processes over gloo:
- the shipped EP recipes (Qwen3-30B-A3B full fine-tuning and LoRA on attention, Mixtral-8x7B LoRA on attention,
  each with its router loss),
  shrunk, pass the preflight under 2 processes (train, stop, resume from their DCP shards in a new launch, export
  whole experts) and train as DDP's 2 processes do on the same micro-batches (the router's load-balancing loss is
  computed per micro-batch, so a different split of the batch is a different loss);
- 4 processes with experts on 2 of them (two copies of each expert, FSDP2-sharded: `efsdp` 2), without a router
  loss, train as one process reading the same 4 rows per step, resume from their step-5 checkpoint exactly, and
  `make export` reads their last checkpoint back as the model they exported;
  so do 2 replicas of 2 processes (HSDP, as 2 nodes run it);
- LoRA with dropout draws and averages as DDP does (equal to DDP, not merely close);
- the plan and the refusals, in-process."""

from types import SimpleNamespace

import pytest
import torch

from conftest import assert_ok, base_recipe, launch, write_recipe
from disttrain.errors import DisttrainError
from disttrain.recipe.schema import load_recipe
from strategy_runs import (CHECKPOINT_EVERY, STEPS, assert_exports_from_its_last_checkpoint,
                           assert_preflight_trains_like, assert_same_run,
                           assert_trains_like_one_process, final_weights, grad_norms, losses, make_train,
                           matrix_recipe, mesh_plan, small_data, warm_like_make)


def test_the_plan_reads_its_own_rows_on_every_process_and_splits_the_experts(monkeypatch):
    monkeypatch.delenv("ACCELERATE_USE_FSDP", raising=False)
    plan = mesh_plan(monkeypatch, 4, dp_shard=4, ep=2)
    assert (plan.label, plan.mesh, plan.ep, plan.fsdp_data, plan.group, plan.share) == (
        "fsdp_ep", "dp_shard=4,ep=2", 2, (1, 4), 1, 1.0)
    processes = [SimpleNamespace(process_index=i, num_processes=4) for i in range(4)]
    assert [plan.data_rank(p) for p in processes] == [0, 1, 2, 3]  # EP is data-parallel for the dense weights
    assert [plan.random_stream(p) for p in processes] == [0, 1, 2, 3]
    assert plan.load_kwargs() == {"ep": 2, "fsdp_data": (1, 4)}
    plan = mesh_plan(monkeypatch, 4, dp_shard=2, dp_replicate=2, ep=2)
    assert (plan.label, plan.mesh, plan.fsdp_data) == ("hsdp_ep", "dp_replicate=2,dp_shard=2,ep=2", (2, 2))


def test_without_a_size_the_experts_spread_over_every_process_of_a_replica(monkeypatch):
    monkeypatch.delenv("PARALLELISM_CONFIG_EP_SIZE", raising=False)
    plan = mesh_plan(monkeypatch, 8, dp_shard=4, dp_replicate=2)  # fsdp_ep.yaml launched without the variable
    assert (plan.label, plan.ep) == ("hsdp_ep", 4)


@pytest.mark.parametrize("sizes, fsdp, said", [
    (dict(dp_shard=4, ep=3), False, "PARALLELISM_CONFIG_EP_SIZE=3 must divide dp_shard_size=4"),
    (dict(dp_shard=2, ep=2, tp=2), False, "tp_size=2 runs alone"),
    (dict(dp_shard=4, ep=2), True, "expert parallelism runs under FSDP2 laid out by transformers"),
])
def test_meshes_it_does_not_run_are_refused_in_one_line(monkeypatch, sizes, fsdp, said):
    if fsdp:
        monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    with pytest.raises(DisttrainError, match=said) as info:
        mesh_plan(monkeypatch, 4, **sizes)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("overrides, said", [
    (["training.mixed_precision=fp16"], "training.mixed_precision=fp16"),
    (["lora.r=4", "lora.dropout=0", "lora.target_parameters=[mlp.experts.gate_up_proj]"], "lora.target_parameters"),
    (["data.streaming=true", "training.max_steps=4"], "data.streaming=true"),
    (["training.compile=true"], "training.compile=true"),
])
def test_what_expert_parallelism_has_not_proven_is_refused_in_one_line(tiny_moe_dir, tmp_path, overrides, said):
    from disttrain.parallel.modes import Expert

    recipe = _recipe(tmp_path, tiny_moe_dir, overrides)
    with pytest.raises(DisttrainError, match=said) as info:
        Expert(2, (1, 2)).check_recipe(recipe, gpu=True)
    assert "expert parallelism" in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("model, ep, said", [
    ("dense", 2, "is a dense model"),
    ("moe", 8, "has 4 experts per block: expert parallelism over 8 processes needs them divisible by 8"),
])
def test_models_it_cannot_split_stop_before_any_weight_loads(tiny_model_dir, tiny_moe_dir, tmp_path, model, ep, said):
    from disttrain.parallel.modes import Expert

    recipe = _recipe(tmp_path, tiny_moe_dir if model == "moe" else tiny_model_dir, [])
    with pytest.raises(DisttrainError, match=said) as info:
        Expert(ep, (1, ep)).check_model(recipe)
    assert "\n" not in str(info.value)
    Expert(2, (1, 2)).check_model(_recipe(tmp_path, tiny_moe_dir, []))  # the tiny Qwen3-MoE itself passes


def _recipe(folder, model_dir, overrides):
    return load_recipe(str(write_recipe(folder / "r.yaml", base_recipe(model_dir, folder / "out"))), overrides)


EP_RECIPES = ["qwen3-30b-a3b/full_sft_ep.yaml", "qwen3-30b-a3b/lora_sft_ep.yaml", "mixtral-8x7b/lora_sft_ep.yaml"]


@pytest.mark.launch
@pytest.mark.parametrize("recipe", EP_RECIPES)
def test_shipped_moe_recipes_preflight_under_expert_parallelism_and_train_like_ddp(recipe, tmp_path):
    """Both families shrunk to 4 experts, 2 per token, with gradient checkpointing, packing and their router
    loss; under fsdp_ep.yaml on 2 processes (ep 2: two experts each) the preflight trains, checkpoints, resumes in
    a new launch at step 2 and exports; DDP's 2 processes on the same micro-batches then log the same losses and
    end with the same weights (whole experts in the full model; the adapters)."""
    assert_preflight_trains_like(recipe, "fsdp_ep", tmp_path, "ddp", nproc=2)


def ep_run(runs, tiny_moe_dir, config: str, *variables: str):
    """`make train-fsdp-ep GPUS=4 EP=2 [variables]` (config "single_gpu": one process) on the matrix recipe over
    the tiny Qwen3-MoE: 4 rows per step (4 data ranks x 1 row; one process: 2 rows x accumulation 2)."""
    def make(folder):
        recipe = matrix_recipe(folder, tiny_moe_dir, small_data(runs), "run", processes=1)
        if config == "single_gpu":
            proc = launch(config, recipe, nproc=1)
            assert_ok(proc)
            return folder / "run", proc.stdout
        if variables:  # the real launcher for the default mesh (make train-fsdp-ep), warm for the others
            return folder / "run", warm_like_make("fsdp_ep", recipe, 4, "training.micro_batch_size=1",
                                                  "training.grad_accum=1", EP=2,
                                                  **dict(v.split("=") for v in variables))
        return folder / "run", make_train("train-fsdp-ep", recipe, "GPUS=4", "EP=2",
                                          "ARGS=training.micro_batch_size=1 training.grad_accum=1")
    return runs.get(f"ep-{config}-{'-'.join(variables)}", make)


@pytest.mark.launch
def test_experts_on_two_of_four_processes_train_like_one_process_and_resume_exactly(runs, tiny_moe_dir, tmp_path):
    out, stdout = ep_run(runs, tiny_moe_dir, "fsdp_ep")
    assert "mesh=dp_shard=4,ep=2" in stdout and "processes=4" in stdout
    ref, _ = ep_run(runs, tiny_moe_dir, "single_gpu")
    assert_trains_like_one_process(out, ref, lora=False)
    assert grad_norms(out) == pytest.approx(grad_norms(ref), rel=1e-4)  # the experts' gradients across the split
    checkpoint = out / "checkpoints" / f"step-{CHECKPOINT_EVERY:08d}"
    assert (checkpoint / "tp_state" / ".metadata").is_file()  # DCP shards
    recipe = matrix_recipe(tmp_path, tiny_moe_dir, small_data(runs), "resumed", processes=1)
    proc = launch("fsdp_ep", recipe, nproc=4, env={"PARALLELISM_CONFIG_EP_SIZE": "2"},
                  extra_args=["--parallelism_config_dp_shard_size", "4"],
                  overrides=[f"output.resume={checkpoint}", "training.micro_batch_size=1", "training.grad_accum=1"])
    assert_ok(proc)
    assert f"resumed from {checkpoint} at step {CHECKPOINT_EVERY}/{STEPS}" in proc.stdout
    assert_same_run(out, tmp_path / "resumed", lora=False, first_step=CHECKPOINT_EVERY + 1)
    assert_exports_from_its_last_checkpoint(out, tmp_path)  # `make export` of the DCP shards: whole experts


@pytest.mark.launch
def test_replicas_of_the_expert_parallel_group_train_like_one_process(runs, tiny_moe_dir):
    """HSDP_REPLICAS=2 (what a 2-node launch gets by default: one replica per node, the all-to-all inside each):
    dp_replicate 2 x dp_shard 2, the experts split over each replica's 2 processes."""
    out, stdout = ep_run(runs, tiny_moe_dir, "fsdp_ep", "HSDP_REPLICAS=2")
    assert "mesh=dp_replicate=2,dp_shard=2,ep=2" in stdout
    ref, _ = ep_run(runs, tiny_moe_dir, "single_gpu")
    assert_trains_like_one_process(out, ref, lora=False)
    assert grad_norms(out) == pytest.approx(grad_norms(ref), rel=1e-4)


@pytest.mark.launch
def test_the_router_balanced_over_every_ranks_rows_trains_like_one_process(runs, tiny_moe_dir, tmp_path):
    """model.router_balance=global, the router loss at 0.1: 4 processes under fsdp_ep (ep 2, a row each) and 2 under
    DDP (2 rows each) log the losses and gradient norms of one process reading the step's 4 rows in one
    micro-batch, and end with its weights (1e-4); transformers' per-rank router loss would be another loss."""
    steps = {"max_steps": 4, "grad_accum": 1}
    outs = {}
    for config, processes in (("single_gpu", 1), ("ddp", 2), ("fsdp_ep", 4)):
        recipe = matrix_recipe(tmp_path, tiny_moe_dir, small_data(runs), config, processes=1,
                               model={"router_aux_loss_coef": 0.1, "router_balance": "global"},
                               training={**steps, "micro_batch_size": 4 // processes},
                               output={"checkpoint_every": None})
        env = {"PARALLELISM_CONFIG_EP_SIZE": "2"} if config == "fsdp_ep" else None
        extra = ["--parallelism_config_dp_shard_size", "4"] if config == "fsdp_ep" else ()
        assert_ok(launch(config, recipe, nproc=processes, env=env, extra_args=extra))
        outs[config] = tmp_path / config
    single = outs.pop("single_gpu")
    for config, out in outs.items():
        assert sorted(losses(out)) == [1, 2, 3, 4] and losses(out) == pytest.approx(losses(single), rel=1e-4), config
        assert grad_norms(out) == pytest.approx(grad_norms(single), rel=1e-4), config
        ours, theirs = final_weights(out, lora=False), final_weights(single, lora=False)
        for key, value in theirs.items():
            torch.testing.assert_close(ours[key], value, atol=1e-4, rtol=1e-3, msg=f"{config}: {key}")


@pytest.mark.launch
def test_lora_with_dropout_draws_as_ddp_draws(runs, tiny_moe_dir, tmp_path):
    """LoRA on attention with dropout 0.1 (and the router loss, rsLoRA): each process draws its own stream as
    under DDP, and the adapters (outside transformers' FSDP2) are averaged as DDP averages them: the losses and
    adapters equal DDP's on the same micro-batches (1e-5), not merely close."""
    lora = {"dropout": 0.1, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"], "use_rslora": True,
            "merge_on_export": False}
    outs = {}
    for config, env in (("fsdp_ep", {"PARALLELISM_CONFIG_EP_SIZE": "2"}), ("ddp", None)):
        recipe = matrix_recipe(tmp_path, tiny_moe_dir, small_data(runs), config, processes=2, lora=lora,
                               model={"router_aux_loss_coef": 0.01}, training={"max_steps": 4})
        assert_ok(launch(config, recipe, nproc=2, env=env))
        outs[config] = tmp_path / config
    ours, theirs = (losses(outs[c]) for c in ("fsdp_ep", "ddp"))
    assert sorted(ours) == [1, 2, 3, 4] and ours == pytest.approx(theirs, rel=1e-5)
    adapters = [final_weights(outs[c], lora=True) for c in ("fsdp_ep", "ddp")]
    assert set(adapters[0]) == set(adapters[1])
    for key, value in adapters[1].items():
        torch.testing.assert_close(adapters[0][key], value, rtol=1e-4, atol=1e-5, msg=key)


@pytest.mark.launch
def test_the_planners_states_per_process_agree_with_what_each_process_holds(tmp_path):
    """`make cost --ep`'s states per GPU against the bytes each of 4 processes holds after an AdamW step under
    fsdp_ep.yaml with ep 2 (weights, gradients and optimizer states, its shards; bench/experts.py measures them):
    within 15 % (the issue's bar), the largest process counted."""
    from disttrain.bench.experts import build_moe, measured_states, planned_states_gb

    model = build_moe(tmp_path / "moe")
    states = measured_states(model, 4, 2, tmp_path / "states.json")
    assert states["mesh"] == "dp_shard=4,ep=2" and len(states["bytes"]) == 4
    planned, measured = planned_states_gb(model, 4, 2), max(states["bytes"]) / 1e9
    assert planned == pytest.approx(measured, rel=0.15), (planned, states["bytes"])
