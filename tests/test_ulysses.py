"""Ulysses sequence parallelism (accelerate_configs/zero3_ulysses.yaml, `make train-zero3-ulysses`): DeepSpeed
ZeRO-3 with each sequence cut across the sp processes of a group (DeepSpeed's ALST attention, registered by
accelerate's ParallelismConfig). On 2 CPU processes as one group of sp=2: both read the matrix recipe's 4
rows per step (the one-process reference's batch), each keeps half of every sequence, and the run trains the
model one process trains (tests/strategy_runs.py, the same tolerances as every strategy), full and LoRA; its
checkpoint records the mesh and resumes on it exactly. In-process: the slices (labels shifted on the whole
sequence, so no target is lost at a slice boundary: the control shifts inside each slice and loses exactly
those), the plan and the refusals (the mesh's own: tests/test_hsdp.py)."""

import pytest
import torch

from conftest import REPO
from disttrain.data import IGNORE_INDEX, LENGTHS_KEY, SHIFT_LABELS_KEY, SQUARES_KEY, Collator
from disttrain.data.collation import SequenceShard, count_targets, shifted
from disttrain.errors import DisttrainError
from disttrain.metrics.log import read_metrics
from disttrain.parallel.plan import ParallelPlan
from strategy_runs import assert_resumes_on_its_mesh, assert_trains_like_one_process, matrix_recipe, small_data
from strategy_runs import make_train, strategy_run, warm_like_make

MESH = "dp_shard=1,sp=2"


def ulysses_run(runs, tiny_model_dir, lora: bool):
    """`make train-zero3-ulysses GPUS=2 SP=2` on the matrix recipe with the one-process batch (2 rows x
    accumulation 2): the group of two processes reads what one process reads."""
    def make(folder):
        recipe = matrix_recipe(folder, tiny_model_dir, small_data(runs), "run", processes=1, lora=lora)
        if lora:  # the real launcher for the full run (make train-zero3-ulysses), warm for this one
            return folder / "run", warm_like_make("zero3_ulysses", recipe, 2, SP=2)
        return folder / "run", make_train("train-zero3-ulysses", recipe, "GPUS=2", "SP=2")
    return runs.get(f"ulysses-{'lora' if lora else 'full'}", make)


@pytest.mark.launch
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_ulysses_trains_like_one_process(lora, runs, tiny_model_dir):
    out, stdout = ulysses_run(runs, tiny_model_dir, lora)
    assert f"mesh={MESH}" in stdout and "processes=2" in stdout
    assert "global_batch=4 rows (2 x 2 accum x 1 groups of 2 procs)" in stdout
    ref = strategy_run(runs, tiny_model_dir, "single_gpu", lora).out
    # one data rank: the two processes' slices are one sequence group, not ranks whose losses should agree
    assert {r["loss_rank_spread"] for r in read_metrics(out) if "loss" in r} == {0.0}
    assert_trains_like_one_process(out, ref, lora)


@pytest.mark.launch
def test_ulysses_resumes_exactly_on_its_mesh(runs, tiny_model_dir, tmp_path):
    out, _ = ulysses_run(runs, tiny_model_dir, False)
    assert_resumes_on_its_mesh(runs, tiny_model_dir, out, "zero3_ulysses", tmp_path)


ROWS = [{"input_ids": [5, 6, 7, 8, 9], "labels": [IGNORE_INDEX, IGNORE_INDEX, 7, 8, 9]},
        {"input_ids": [5, 6, 7], "labels": [IGNORE_INDEX, 6, 7]}]


def test_a_sequence_shard_keeps_its_slice_with_targets_shifted_on_the_whole_sequence():
    whole = Collator(pad_token_id=0)(ROWS)
    shards = [SequenceShard(Collator(pad_token_id=0), i, 2)(ROWS) for i in range(2)]
    # padded to a multiple of 2 (5 -> 6 positions), 3 per process, right padding
    assert [s["input_ids"].tolist() for s in shards] == [[[5, 6, 7], [5, 6, 7]], [[8, 9, 0], [0, 0, 0]]]
    assert torch.cat([s[SHIFT_LABELS_KEY] for s in shards], 1).tolist() == [
        [IGNORE_INDEX, 7, 8, 9, IGNORE_INDEX, IGNORE_INDEX], [6, 7, IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX,
                                                              IGNORE_INDEX]]
    assert torch.cat([s["position_ids"] for s in shards], 1).tolist() == [list(range(6))] * 2
    assert "attention_mask" not in shards[0]  # Ulysses attends causally with no mask: right padding is exact
    # every target and every token counted once over the group; the attention cost split over it
    assert sum(int(count_targets(s)) for s in shards) == int(count_targets(whole)) == 5
    assert (shards[0][LENGTHS_KEY] + shards[1][LENGTHS_KEY]).tolist() == whole[LENGTHS_KEY].tolist() == [5, 3]
    assert (shards[0][SQUARES_KEY] + shards[1][SQUARES_KEY]).tolist() == whole[SQUARES_KEY].tolist()
    # the control: shifting inside each slice (what the loss did before shift_labels) loses the target at the
    # slice boundary (row 0: token 8, predicted from position 2)
    inside = sum(int((shifted(s["labels"]) != IGNORE_INDEX).sum()) for s in shards)
    assert inside == 4


def test_a_ulysses_launch_is_planned_and_labelled(monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_PARALLELISM_CONFIG", "true")
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "3")
    monkeypatch.delenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("PARALLELISM_CONFIG_DP_SHARD_SIZE", "2")
    monkeypatch.setenv("PARALLELISM_CONFIG_SP_SIZE", "4")
    plan = ParallelPlan.from_launch()
    assert (plan.label, plan.mesh, plan.sp) == ("zero3_ulysses", "dp_shard=2,sp=4", 4)

    class Rank:
        num_processes, process_index = 8, 6

    assert (plan.data_rank(Rank), plan.data_ranks(Rank), plan.sequence_slice(Rank)) == (1, 2, (2, 4))


@pytest.mark.parametrize("recipe, overrides, expected", [
    ("sft", ["data.packing=true"], "data.packing=true is not supported under accelerate_configs/zero3_ulysses.yaml"),
    ("sft", ["data.streaming=true", "training.max_steps=5"], "data.streaming=true is not supported"),
    ("dpo", [], "training.objective=dpo is not supported"),
    ("sft", ["model.attn_implementation=eager"], "model.attn_implementation=eager differs from the accelerate "
                                                 "config's parallelism_config_sp_attn_implementation=sdpa"),
])
def test_what_ulysses_cannot_train_is_refused_in_one_line(recipe, overrides, expected, monkeypatch):
    from disttrain.parallel.checks import check_sequence_parallel
    from disttrain.recipe.schema import load_recipe

    monkeypatch.setenv("PARALLELISM_CONFIG_SP_ATTN_IMPLEMENTATION", "sdpa")
    recipe = load_recipe(str(REPO / f"recipes/tiny/{recipe}.yaml"), overrides)
    check_sequence_parallel(recipe, 1)  # without sequence parallelism all of these train
    with pytest.raises(DisttrainError) as error:
        check_sequence_parallel(recipe, 2)
    assert expected in str(error.value) and "\n" not in str(error.value)
