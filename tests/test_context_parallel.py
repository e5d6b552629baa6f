"""Context parallelism (accelerate_configs/fsdp_cp.yaml, `make train-fsdp-cp`): FSDP2 with each sequence cut
across the cp processes of a group, attention exchanged around torch's ring (accelerate's ParallelismConfig and
its context-parallel context). On 2 CPU processes as one group of cp=2 (torch's ring on the CPU attention
kernel: tests/cpu_ring/sitecustomize.py, test-only): both read the matrix recipe's 4 rows per step (the
one-process reference's batch), the loop's context cuts every micro-batch in torch's head-tail layout, forward
and backward inside it, and the run trains the model one process trains (tests/strategy_runs.py, the same
tolerances as every strategy), full and LoRA; its checkpoint records the mesh and resumes on it exactly.
In-process: the collated batch (labels shifted on the whole sequence -- the control shifts after the cut and
loses the target at every chunk boundary), the positions each process keeps == torch's own head-tail
balancer's, the plan and the refusals."""

import pytest

from conftest import REPO
from disttrain.data import IGNORE_INDEX, LENGTHS_KEY, SHIFT_LABELS_KEY, SQUARES_KEY, TARGETS_KEY, Collator
from disttrain.data.collation import ContextShard, count_targets, shifted
from disttrain.errors import DisttrainError
from disttrain.metrics.log import read_metrics
from disttrain.runtime.launcher import cpu_ring_env
from disttrain.parallel.plan import ParallelPlan
from strategy_runs import assert_resumes_on_its_mesh, assert_trains_like_one_process, matrix_recipe, small_data
from strategy_runs import make_train, strategy_run
from test_tensor_parallel import tp_run

MESH = "dp_shard=1,cp=2"
RING_ON_CPU = {**cpu_ring_env(), "OMP_NUM_THREADS": "1"}


def cp_run(runs, tiny_model_dir, lora: bool):
    """`make train-fsdp-cp GPUS=2 CP=2` on the matrix recipe with the one-process batch (2 rows x
    accumulation 2): the group of two processes reads what one process reads."""
    def make(folder):
        # the full run also generates its end-of-run sample (outside the context, every rank in step)
        rows = str(small_data(runs))  # evaluated every 5 steps on its own 35 rows, as tp_run's reference is
        recipe = matrix_recipe(folder, tiny_model_dir, {"path": rows, "format": "alpaca", "eval_path": rows,
                                                        "max_seq_len": 48}, "run", processes=1, lora=lora,
                               training={"eval_every": 5}, logging={"samples": 0 if lora else 1, "sample_tokens": 8})
        return folder / "run", make_train("train-fsdp-cp", recipe, "GPUS=2", "CP=2", env=RING_ON_CPU)
    return runs.get(f"context-parallel-{'lora' if lora else 'full'}", make)


@pytest.mark.launch
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_context_parallelism_trains_like_one_process(lora, runs, tiny_model_dir):
    out, stdout = cp_run(runs, tiny_model_dir, lora)
    assert f"mesh={MESH}" in stdout and "processes=2" in stdout
    assert "global_batch=4 rows (2 x 2 accum x 1 groups of 2 procs)" in stdout
    assert "FSDP2 parameters on the mesh (dp_shard_cp=2)" in stdout  # sharded over the cp processes too
    if not lora:
        assert "sample: '<|im_start|>user" in stdout, stdout[-2000:]
    ref = strategy_run(runs, tiny_model_dir, "single_gpu", lora).out
    assert {r["loss_rank_spread"] for r in read_metrics(out) if "loss" in r} == {0.0}  # one data rank
    assert_trains_like_one_process(out, ref, lora)
    # 35 eval rows (odd: the last batch is padded) each counted once, as one process counts them
    evaluated = tp_run(runs, tiny_model_dir, config="single_gpu", lora=lora)[0]
    evals = [[r["eval_loss"] for r in read_metrics(run) if "eval_loss" in r] for run in (out, evaluated)]
    assert len(evals[0]) == 2 and evals[0] == pytest.approx(evals[1], rel=1e-5)


@pytest.mark.launch
def test_context_parallelism_resumes_exactly_on_its_mesh(runs, tiny_model_dir, tmp_path):
    out, _ = cp_run(runs, tiny_model_dir, False)
    assert_resumes_on_its_mesh(runs, tiny_model_dir, out, "fsdp_cp", tmp_path, env=RING_ON_CPU)


@pytest.mark.launch
def test_context_parallelism_without_a_gpu_is_refused_in_one_line_before_the_process_group(tmp_path):
    """`make train-fsdp-cp` on a CPU without the test-only ring kernel (what a user gets): one line, exit 1, no
    traceback (it was torch's NotImplementedError from inside the ring's first forward)."""
    import os
    import subprocess

    from conftest import base_recipe, write_recipe
    from disttrain.runtime.launcher import free_port

    recipe = write_recipe(tmp_path / "r.yaml", base_recipe(REPO / "artifacts/tiny-llama", tmp_path / "out",
                                                           training={"max_steps": 2}))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(["make", "-s", "train-fsdp-cp", "GPUS=2", "CP=2", f"MASTER_PORT={free_port()}",
                           f"RECIPE={recipe}"], cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert errors and "fsdp_cp.yaml (context parallelism) needs CUDA GPUs" in errors[0], proc.stderr[-2000:]
    # the workers' output: no traceback of theirs (torchrun's agent prints its own ChildFailedError after them)
    assert 'File "' + str(REPO / "train.py") not in proc.stderr and "NotImplementedError" not in proc.stderr
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


def test_the_ring_kernel_check_passes_with_the_cpu_mapping_or_a_gpu(monkeypatch):
    import torch
    from torch.distributed.tensor.experimental._context_parallel import _attention as ring

    from disttrain.parallel.checks import check_ring_kernel

    check_ring_kernel(2, gpu=True)
    check_ring_kernel(1, gpu=False)
    with pytest.raises(DisttrainError, match="needs CUDA GPUs"):
        check_ring_kernel(2, gpu=False)
    monkeypatch.setitem(ring.custom_ops, torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default, None)
    check_ring_kernel(2, gpu=False)


ROWS = [{"input_ids": [5, 6, 7, 8, 9], "labels": [IGNORE_INDEX, IGNORE_INDEX, 7, 8, 9]},
        {"input_ids": [5, 6, 7], "labels": [IGNORE_INDEX, 6, 7]}]


def test_a_context_shard_gives_whole_sequences_and_counts_its_own_part():
    whole = Collator(pad_token_id=0)(ROWS)
    parts = [ContextShard(Collator(pad_token_id=0), i, 2)(ROWS) for i in range(2)]
    # whole sequences, right-padded to a multiple of 2 x cp = 4 (5 -> 8 positions); the context cuts them later
    assert parts[0]["input_ids"].tolist() == [[5, 6, 7, 8, 9, 0, 0, 0], [5, 6, 7, 0, 0, 0, 0, 0]]
    assert parts[0][SHIFT_LABELS_KEY].tolist() == [[IGNORE_INDEX, 7, 8, 9] + [IGNORE_INDEX] * 4,
                                                   [6, 7] + [IGNORE_INDEX] * 6]
    assert parts[0]["position_ids"].tolist() == [list(range(8))] * 2 and "attention_mask" not in parts[0]
    # head-tail: process 0 keeps chunks 0 and 3 (positions 0,1,6,7), process 1 chunks 1 and 2 (2..5)
    assert [p.tolist() for p in (ContextShard(Collator(0), i, 2).kept(8) for i in range(2))] == [[0, 1, 6, 7],
                                                                                                 [2, 3, 4, 5]]
    # every target and token counted once over the group (before the cut), the attention cost split over it
    assert [int(p[TARGETS_KEY]) for p in parts] == [3, 2]
    assert sum(int(count_targets(p)) for p in parts) == int(count_targets(whole)) == 5
    assert (parts[0][LENGTHS_KEY] + parts[1][LENGTHS_KEY]).tolist() == whole[LENGTHS_KEY].tolist() == [5, 3]
    assert (parts[0][SQUARES_KEY] + parts[1][SQUARES_KEY]).tolist() == whole[SQUARES_KEY].tolist()
    # the control: shifting after the cut (what the loss did before shift_labels) loses the targets across chunk
    # boundaries: token 7 of both rows (row 0: predicted at position 1, its token at position 2 in the other
    # process's chunk; row 1: at position 1 of process 0, token 7 at position 2, again in the other chunk)
    after = 0
    for i in range(2):
        kept = ContextShard(Collator(0), i, 2).kept(8)
        after += int((shifted(parts[i]["labels"][:, kept]) != IGNORE_INDEX).sum())
    assert after == 3


@pytest.mark.parametrize("cp,length", [(2, 8), (2, 48), (4, 64)])
def test_the_kept_positions_are_torchs_head_tail_layout(cp, length):
    """What the context keeps on each process (torch's _HeadTailLoadBalancer, which the context uses for a
    length divisible by 2 x cp) is what the bookkeeping counts."""
    from torch.distributed.tensor.experimental._context_parallel._load_balancer import _HeadTailLoadBalancer

    order = _HeadTailLoadBalancer(length, cp, "cpu")._generate_indices()[0]
    for rank in range(cp):
        torchs = order.chunk(cp)[rank]
        assert ContextShard(Collator(0), rank, cp).kept(length).tolist() == torchs.tolist()


def test_a_context_parallel_launch_is_planned_and_labelled(monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_PARALLELISM_CONFIG", "true")
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_OFFLOAD_PARAMS", "false")
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("PARALLELISM_CONFIG_DP_SHARD_SIZE", "2")
    monkeypatch.setenv("PARALLELISM_CONFIG_CP_SIZE", "4")
    plan = ParallelPlan.from_launch()
    assert (plan.label, plan.mesh, plan.cp, plan.sp, plan.group) == ("fsdp_cp", "dp_shard=2,cp=4", 4, 1, 4)

    class Rank:
        num_processes, process_index = 8, 6

    assert (plan.data_rank(Rank), plan.data_ranks(Rank), plan.context_slice(Rank)) == (1, 2, (2, 4))
    assert plan.sequence_slice(Rank) is None


@pytest.mark.parametrize("overrides, expected", [
    (["data.packing=true"], "data.packing=true is not supported under accelerate_configs/fsdp_cp.yaml"),
    (["data.streaming=true", "training.max_steps=5"], "data.streaming=true is not supported"),
    (["model.attn_implementation=eager"], "model.attn_implementation=eager is not supported under accelerate_"
                                          "configs/fsdp_cp.yaml (cp_size > 1): torch's ring attention replaces "
                                          "sdpa's kernels only"),
])
def test_what_the_ring_cannot_train_is_refused_in_one_line(overrides, expected):
    from disttrain.parallel.checks import check_sequence_parallel
    from disttrain.recipe.schema import load_recipe

    recipe = load_recipe(str(REPO / "recipes/tiny/sft.yaml"), overrides)
    check_sequence_parallel(recipe, 1, 1)  # without context parallelism all of these train
    with pytest.raises(DisttrainError) as error:
        check_sequence_parallel(recipe, 1, 2)
    assert expected in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize("config, expected", [
    ({"layer_types": ["full_attention", "sliding_attention"]}, "['sliding_attention'] layers: not supported"),
    ({"sliding_window": 4096}, "['sliding_attention'] layers: not supported"),
    ({"output_router_logits": True}, "the router's load-balancing loss) is not supported"),
])
def test_models_the_sequence_meshes_would_train_wrongly_are_refused(config, expected):
    from types import SimpleNamespace

    from disttrain.parallel.checks import check_sequence_model

    model_config = SimpleNamespace(**config)
    check_sequence_model(model_config, 1, 1)
    for sp, cp in ((2, 1), (1, 2)):
        with pytest.raises(DisttrainError, match=expected.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
            check_sequence_model(model_config, sp, cp)
