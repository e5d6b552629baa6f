"""FSDP2 + tensor parallelism (accelerate_configs/fsdp_tp.yaml, `make train-fsdp-tp`): a 2-D mesh, dp_shard x tp,
laid out by transformers as it loads the model (its TP plan inside each group of tp processes, then FSDP2 by
its FSDP plan over the groups), accelerate leaving the model as it is. On 4 CPU processes (2 groups of 2): the
two groups read the matrix recipe's 4 rows per step between them, and the run trains the model one process
trains (tests/strategy_runs.py, the same tolerances as every strategy), with accumulation deferring FSDP2's
reduction to the window's last micro-batch, gradients clipped across the two meshes the weights live on
(accelerate's clip_grad_norm_ takes the norm per mesh: the logged norms equal one process's), its metrics
counting each batch once, its eval loss the one process's; its checkpoint
(DCP shards: training/accelerator_state.py) resumes exactly on its mesh, and its export is a plain HF model dir.
In-process: the plan, the refusals."""

from types import SimpleNamespace

import pytest

from conftest import REPO, assert_ok, launch
from disttrain.errors import DisttrainError
from disttrain.metrics.log import read_metrics
from strategy_runs import assert_exports_from_its_last_checkpoint, assert_preflight_trains_like
from strategy_runs import (assert_resumes_on_its_mesh, assert_trains_like_one_process, make_train, matrix_recipe,
                           warm_like_make)
from strategy_runs import mesh_plan, small_data


def fsdp_tp_run(runs, tiny_model_dir, config: str = "fsdp_tp", *variables: str):
    """`make train-fsdp-tp GPUS=4 TP=2 [variables]` (config "single_gpu": one process) on the matrix recipe: 2
    data ranks x 1 row x accumulation 2 (one process: 2 rows x 2), evaluated at the end on the same rows."""
    def make(folder):
        rows = str(small_data(runs))
        data = {"path": rows, "format": "alpaca", "eval_path": rows, "max_seq_len": 48}
        processes = 1 if config == "single_gpu" else 2  # data ranks
        recipe = matrix_recipe(folder, tiny_model_dir, data, "run", processes=processes,
                               training={"eval_every": 5}, logging={"samples": 1, "sample_tokens": 8})
        if config == "single_gpu":
            proc = launch(config, recipe, nproc=1)
            assert_ok(proc)
            return folder / "run", proc.stdout
        if variables:  # the real launcher for the default mesh (make train-fsdp-tp), warm for the others
            return folder / "run", warm_like_make("fsdp_tp", recipe, 4, TP=2, **dict(v.split("=") for v in variables))
        return folder / "run", make_train("train-fsdp-tp", recipe, "GPUS=4", "TP=2")
    return runs.get(f"fsdp-tp-{config}-{'-'.join(variables)}", make)


@pytest.mark.launch
def test_fsdp2_with_tensor_parallelism_trains_like_one_process(runs, tiny_model_dir):
    out, stdout = fsdp_tp_run(runs, tiny_model_dir)
    assert "mesh=dp_shard=2,tp=2" in stdout and "processes=4" in stdout
    ref, ref_stdout = fsdp_tp_run(runs, tiny_model_dir, "single_gpu")
    assert_trains_like_one_process(out, ref, lora=False)
    ours, single = ([r for r in read_metrics(run) if "loss" in r] for run in (out, ref))
    assert [(r["target_tokens"], r["tokens"]) for r in ours] == [(r["target_tokens"], r["tokens"]) for r in single]
    assert [r["grad_norm"] for r in ours] == pytest.approx([r["grad_norm"] for r in single], rel=1e-4)
    evals = [[r["eval_loss"] for r in read_metrics(run) if "eval_loss" in r] for run in (out, ref)]
    assert evals[0] and evals[0] == pytest.approx(evals[1], rel=1e-5)
    sample = [line for line in stdout.splitlines() if line.startswith("sample: ")]
    assert sample and sample == [line for line in ref_stdout.splitlines() if line.startswith("sample: ")]



@pytest.mark.launch
def test_fsdp2_with_tensor_parallelism_resumes_exactly_on_its_mesh_and_exports_from_its_shards(runs, tiny_model_dir,
                                                                                               tmp_path):
    out, _ = fsdp_tp_run(runs, tiny_model_dir)
    assert (out / "checkpoints" / "step-00000005" / "tp_state" / ".metadata").is_file()  # DCP shards
    assert_resumes_on_its_mesh(runs, tiny_model_dir, out, "fsdp_tp", tmp_path, nproc=4, data_ranks=2)
    assert_exports_from_its_last_checkpoint(out, tmp_path)


@pytest.mark.launch
def test_hsdp_with_tensor_parallelism_replicates_across_groups_like_one_process(runs, tiny_model_dir):
    """dp_replicate=2 x tp=2 (HSDP_REPLICAS=2: what a 2-node launch gets by default, one replica per node)."""
    out, stdout = fsdp_tp_run(runs, tiny_model_dir, "fsdp_tp", "HSDP_REPLICAS=2")
    assert "mesh=dp_replicate=2,tp=2" in stdout
    ref, _ = fsdp_tp_run(runs, tiny_model_dir, "single_gpu")
    assert_trains_like_one_process(out, ref, lora=False)


def test_the_plan_lays_data_ranks_over_the_tensor_parallel_groups(monkeypatch):
    plan = mesh_plan(monkeypatch, 8, tp=2, dp_shard=4)
    assert (plan.label, plan.mesh, plan.tp, plan.fsdp_data, plan.group, plan.share) == (
        "fsdp_tp", "dp_shard=4,tp=2", 2, (1, 4), 2, 0.5)
    ranks = [plan.data_rank(SimpleNamespace(process_index=i)) for i in range(8)]
    assert ranks == [0, 0, 1, 1, 2, 2, 3, 3]  # transformers' mesh (dp_replicate, fsdp, tp): tp innermost
    plan = mesh_plan(monkeypatch, 8, tp=2, dp_shard=2, dp_replicate=2)
    assert (plan.label, plan.mesh, plan.fsdp_data) == ("hsdp_tp", "dp_replicate=2,dp_shard=2,tp=2", (2, 2))
    with pytest.raises(DisttrainError, match=r"dp_replicate_size=1 x dp_shard_size=2 x tp_size=2 must equal the 8 "
                                             r"processes launched"):
        mesh_plan(monkeypatch, 8, tp=2, dp_shard=2, dp_replicate=1)


class _Recorder:
    """FSDP2's two switches, recorded."""

    def __init__(self):
        self.calls = []

    def set_requires_gradient_sync(self, value):
        self.calls.append(("sync", value))

    def set_requires_all_reduce(self, value):
        self.calls.append(("all_reduce", value))


@pytest.mark.parametrize("replicas, deferred", [(1, ("sync", False)), (2, ("all_reduce", False))])
def test_fsdp2_reduces_the_gradients_once_per_accumulation_window(monkeypatch, replicas, deferred):
    """accelerate's `accumulate` defers DDP's reduction and its own FSDP2's, not the FSDP2 transformers applied:
    the plan's micro-batch context switches it off for every micro-batch but the window's last (with replicas,
    only the all-reduce across them), and on again after each."""
    plan = mesh_plan(monkeypatch, 4, tp=2, dp_shard=2 // replicas, dp_replicate=replicas)
    model, accelerator = _Recorder(), SimpleNamespace(sync_gradients=False)
    context = plan.micro_batch_context(accelerator, model)
    with context({}):
        assert model.calls == [deferred]
    accelerator.sync_gradients = True
    with context({}):
        pass
    assert model.calls == [deferred, ("sync", True), ("sync", True)]


@pytest.mark.launch
@pytest.mark.parametrize("recipe, reference", [("llama-3.1-8b/full_sft_fsdp.yaml", "single_gpu"),
                                               ("qwen3-30b-a3b/full_sft.yaml", "ddp")])
def test_shipped_full_fine_tunes_preflight_under_fsdp2_with_tensor_parallelism(recipe, reference, tmp_path):
    """Two families shrunk (Llama-3.1 with gradient checkpointing; Qwen3-MoE with its experts and router loss),
    4 processes under fsdp_tp.yaml: the preflight trains, checkpoints, resumes in a new launch at step 2 and
    exports; the same recipe (its copy in the run dir) then logs the same losses and ends with the same weights
    in one process reading both groups' rows (Llama) or, since the router loss depends on how the batch is
    split, in DDP's 2 processes (Qwen3-MoE)."""
    # one process reads both groups' rows per micro-batch; each DDP rank one group's
    nproc, factor = (1, 2) if reference == "single_gpu" else (2, 1)
    assert_preflight_trains_like(recipe, "fsdp_tp", tmp_path, reference, nproc, factor)


@pytest.mark.launch
def test_a_tied_embedding_model_stops_the_fsdp_tp_preflight_in_one_line(tmp_path):
    """Qwen2.5-0.5B ties its embeddings: the dry run's first launch stops before training, naming why."""
    from disttrain.tools.preflight import run

    report = run(str(REPO / "recipes/qwen2.5-0.5b/full_sft.yaml"), "fsdp_tp", nproc=None, steps=2,
                 work_dir=tmp_path / "pf", overrides=["logging.samples=0", "output.report=false"])
    stage, status, detail = report.rows[-1]
    assert (stage, status) == ("save", "FAIL")
    assert "Qwen2Config ties its input and output embeddings" in detail and "use tp.yaml" in detail
