"""Tensor parallelism alone (accelerate_configs/tp.yaml, `make train-tp`): every process one tensor-parallel
rank, the weights sharded by transformers' own plan for the model (attention and MLP projections, embeddings,
lm_head over the vocabulary), every process running the same batch. On 2 CPU processes (accelerate's
ParallelismConfig check skipped for CPU processes: runtime/fsdp_cpu.py): both read the matrix recipe's 4 rows per
step (the one-process reference's batch) and the run trains the model one process trains (tests/strategy_runs.py,
the same tolerances as every strategy), its metrics count each batch once, its eval loss is the one process's,
its checkpoint (DCP shards of weights and optimizer states: training/accelerator_state.py) resumes exactly on
its mesh, and its export is a plain HF model dir. In-process: the plan and the refusals."""

import pytest
import torch

from conftest import REPO, assert_ok, base_recipe, launch, write_recipe
from disttrain.errors import DisttrainError
from disttrain.metrics.log import read_metrics
from disttrain.parallel.checks import check_tensor_parallel, check_tensor_parallel_model
from disttrain.recipe.schema import load_recipe
from strategy_runs import assert_exports_from_its_last_checkpoint, assert_preflight_trains_like
from strategy_runs import (assert_resumes_on_its_mesh, assert_trains_like_one_process, make_train, matrix_recipe,
                           warm_like_make)
from strategy_runs import mesh_plan, small_data


def tp_run(runs, tiny_model_dir, loss_impl: str = "chunked", config: str = "tp", lora: bool = False):
    """`make train-tp GPUS=2` (config "single_gpu": one process) on the matrix recipe with the one-process batch
    (2 rows x accumulation 2), evaluated at the end on the same rows; `lora`: the matrix's LoRA (column- and
    row-split projections, merged on export)."""
    def make(folder):
        rows = str(small_data(runs))
        data = {"path": rows, "format": "alpaca", "eval_path": rows, "max_seq_len": 48}
        recipe = matrix_recipe(folder, tiny_model_dir, data, "run", processes=1, lora=lora,
                               training={"loss_impl": loss_impl, "eval_every": 5},
                               logging={"samples": 1, "sample_tokens": 8})
        if config == "single_gpu":
            proc = launch(config, recipe, nproc=1)
            assert_ok(proc)
            return folder / "run", proc.stdout
        if loss_impl == "chunked" and not lora:  # the real launcher once (make train-tp), warm otherwise
            return folder / "run", make_train("train-tp", recipe, "GPUS=2")
        return folder / "run", warm_like_make("tp", recipe, 2)
    return runs.get(f"tensor-parallel-{config}-{loss_impl}{'-lora' if lora else ''}", make)


@pytest.mark.launch
@pytest.mark.parametrize("loss_impl", ["chunked", "plain"])
def test_tensor_parallelism_trains_like_one_process(loss_impl, runs, tiny_model_dir):
    out, stdout = tp_run(runs, tiny_model_dir, loss_impl)
    assert "mesh=tp=2" in stdout and "processes=2" in stdout
    assert "global_batch=4 rows (2 x 2 accum x 1 groups of 2 procs)" in stdout
    assert "tensor-parallel parameters on the mesh (tp=2)" in stdout
    ref, ref_stdout = tp_run(runs, tiny_model_dir, loss_impl, "single_gpu")
    assert_trains_like_one_process(out, ref, lora=False)
    ours, single = ([r for r in read_metrics(run) if "loss" in r] for run in (out, ref))
    # each batch counted once (both ranks see all of it), not once per rank
    assert [(r["target_tokens"], r["tokens"]) for r in ours] == [(r["target_tokens"], r["tokens"]) for r in single]
    evals = [[r["eval_loss"] for r in read_metrics(run) if "eval_loss" in r] for run in (out, ref)]
    assert evals[0] and evals[0] == pytest.approx(evals[1], rel=1e-5)  # every eval row once per rank, not split
    sample = [line for line in stdout.splitlines() if line.startswith("sample: ")]  # both ranks generate it
    assert sample and sample == [line for line in ref_stdout.splitlines() if line.startswith("sample: ")]


@pytest.mark.launch
def test_lora_under_tensor_parallelism_trains_like_one_process_and_resumes_exactly(runs, tiny_model_dir, tmp_path):
    """LoRA on q_proj, v_proj (column-split: lora_B split) and down_proj (row-split: lora_A split), the adapters
    drawn alike in both runs (model/lora_init.py): losses, eval losses and the exported adapter (gathered whole)
    equal one process's, and the merged model is written."""
    out, stdout = tp_run(runs, tiny_model_dir, lora=True)
    assert "mesh=tp=2" in stdout
    ref, _ = tp_run(runs, tiny_model_dir, config="single_gpu", lora=True)
    assert_trains_like_one_process(out, ref, lora=True)
    evals = [[r["eval_loss"] for r in read_metrics(run) if "eval_loss" in r] for run in (out, ref)]
    assert evals[0] and evals[0] == pytest.approx(evals[1], rel=1e-5)
    assert (out / "final" / "merged" / "model.safetensors").is_file()
    # a new launch from its step-5 checkpoint (DCP shards of the base and the adapters) repeats steps 6-10
    assert_resumes_on_its_mesh(runs, tiny_model_dir, out, "tp", tmp_path, lora=True)


@pytest.mark.launch
def test_random_draws_are_the_same_across_a_tensor_parallel_group(runs, tiny_model_dir, tmp_path):
    """LoRA dropout 0.3 and NEFTune under tp.yaml, with lm-eval scoring the step-5 checkpoint while training.
    The processes of a TP group run one batch, so they must draw one random stream: with a stream per process
    (the seed was run seed + process index) peft's lora_A on the column-split q_proj/v_proj, held whole by every
    rank and never all-reduced, took each rank's own dropout mask and drifted apart, which the replica check
    (every step here; it now compares the unsplit parameters under TP) stops as a ReplicaMismatch. The scoring
    reads the DCP checkpoint on the main process alone while the other rank waits (it hung before)."""
    rows = str(small_data(runs))
    recipe = matrix_recipe(tmp_path, tiny_model_dir, {"path": rows, "format": "alpaca", "max_seq_len": 48}, "run",
                           processes=1, lora={"dropout": 0.3}, training={"neftune_alpha": 5.0},
                           evaluation={"tasks": ["disttrain_tiny_choice"], "every_steps": 5, "limit": 5},
                           distributed={"timeout_s": 300})
    stdout = warm_like_make("tp", recipe, 2)
    assert "mesh=tp=2" in stdout
    records = read_metrics(tmp_path / "run")
    assert [r["step"] for r in records if "lm_eval/disttrain_tiny_choice/acc" in r] == [5, 10]
    losses = [r["loss"] for r in records if "loss" in r]
    assert len(losses) == 10 and all(0 < loss < 10 for loss in losses)


@pytest.mark.launch
def test_tensor_parallelism_resumes_exactly_on_its_mesh(runs, tiny_model_dir, tmp_path):
    out, _ = tp_run(runs, tiny_model_dir)
    assert (out / "checkpoints" / "step-00000005" / "tp_state" / ".metadata").is_file()  # DCP shards
    assert_resumes_on_its_mesh(runs, tiny_model_dir, out, "tp", tmp_path)
    assert_exports_from_its_last_checkpoint(out, tmp_path)


@pytest.mark.launch
@pytest.mark.parametrize("recipe", ["llama-3.1-8b/full_sft_fsdp.yaml", "qwen3-30b-a3b/full_sft.yaml",
                                    "qwen2.5-0.5b/full_sft.yaml"])
def test_shipped_full_fine_tunes_preflight_under_tensor_parallelism_and_train_like_one_process(recipe, tmp_path):
    """Three families shrunk (Llama-3.1 with gradient checkpointing; Qwen3-MoE with its experts and router loss;
    Qwen2.5 with qkv biases and tied embeddings), 2 processes under tp.yaml: the preflight trains, checkpoints,
    resumes in a new launch at step 2 and exports; one process on the same recipe (its copy in the run dir:
    the shrunk model, the same rows and batch: TP ranks share the batch) logs the same losses and ends with the
    same weights."""
    assert_preflight_trains_like(recipe, "tp", tmp_path)


FAMILIES = {  # what each adds to the path: logit scaling (Granite divides, Cohere multiplies), final-logit
    # softcapping with sliding-window layers (Gemma 2), fused qkv and gate_up projections (Phi-3), MoE experts
    # with the router loss (Mixtral)
    "granite": ("GraniteConfig", "GraniteForCausalLM", {"logits_scaling": 16.0}, "sdpa"),
    "cohere": ("CohereConfig", "CohereForCausalLM", {"logit_scale": 0.25}, "sdpa"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"final_logit_softcapping": 0.5, "head_dim": 8}, "eager"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {}, "sdpa"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2,
                                                        "output_router_logits": True, "router_aux_loss_coef": 1.0},
                "sdpa"),
}


@pytest.mark.launch
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_families_with_logit_transforms_fused_projections_or_experts_train_like_one_process(family, tmp_path,
                                                                                           tiny_model_dir):
    """A tiny model of each family (embeddings untied, lm_head scaled up so that scaling and capping change the
    loss), 3 steps of 4 rows with the chunked loss and an evaluation: under tp.yaml on 2 processes, and under
    fsdp_tp.yaml on 4 (2 groups of 2 reading 2 rows each, FSDP2 by the family's own plan over them), the losses
    are one process's. The router loss depends on how the batch is split (transformers computes it per forward),
    so Mixtral's fsdp_tp run is compared with DDP's 2 processes of 2 rows each, whose split it shares."""
    import transformers

    config_name, model_name, extra, attention = FAMILIES[family]
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_model_dir)
    config = getattr(transformers, config_name)(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False, **extra)
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(config).float()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(40)
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    logged = {}
    launches = [("tp", 2, 4), ("fsdp_tp", 4, 2), ("single_gpu", 1, 4)] + [("ddp", 2, 2)] * (family == "mixtral")
    for config_file, nproc, micro_batch in launches:
        recipe = write_recipe(tmp_path / f"{config_file}.yaml", base_recipe(
            tmp_path / "model", tmp_path / config_file, model={"attn_implementation": attention},
            data={"eval_fraction": 0.05},
            training={"max_steps": 3, "micro_batch_size": micro_batch, "eval_every": 3},
            output={"save_final_model": False, "checkpoint_at_end": False}, logging={"samples": 0}))
        assert_ok(launch(config_file, recipe, nproc=nproc))
        logged[config_file] = [(r.get("loss"), r.get("eval_loss")) for r in read_metrics(tmp_path / config_file)]
    single = [tuple(pytest.approx(v, rel=1e-5) if v is not None else None for v in row) for row in logged["single_gpu"]]
    assert any(e is not None for _, e in logged["tp"]) and logged["tp"] == single
    split_alike = single if family != "mixtral" else [tuple(pytest.approx(v, rel=1e-5) if v is not None else None
                                                            for v in row) for row in logged["ddp"]]
    assert logged["fsdp_tp"] == split_alike


def test_a_model_whose_heads_do_not_divide_over_the_processes_is_refused_in_one_line():
    from transformers import LlamaConfig

    check_tensor_parallel_model(LlamaConfig(num_attention_heads=8, num_key_value_heads=8), 4)
    with pytest.raises(DisttrainError, match=r"^LlamaConfig has 8 attention and 2 key/value heads: tensor parallelism "
                                             r"over 4 processes needs both divisible by 4"):
        check_tensor_parallel_model(LlamaConfig(num_attention_heads=8, num_key_value_heads=2), 4)
    planless = LlamaConfig()
    planless.base_model_tp_plan = None
    with pytest.raises(DisttrainError, match=r"^LlamaConfig has no tensor-parallel plan in transformers"):
        check_tensor_parallel_model(planless, 2)


def test_tied_embeddings_under_fsdp2_with_tensor_parallelism_are_refused_in_one_line():
    """transformers 5 wraps tied embeddings and lm_head in two FSDP2 groups (measured: tiny Cohere and Gemma 2,
    tied, left one process's losses at step 2 under fsdp_tp.yaml); alone, tensor parallelism trains them."""
    from transformers import Qwen2Config

    tied = Qwen2Config(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    check_tensor_parallel_model(tied, 2)
    check_tensor_parallel_model(Qwen2Config(num_attention_heads=4, num_key_value_heads=2,
                                            tie_word_embeddings=False), 2, data_parallel=2)
    with pytest.raises(DisttrainError, match=r"^Qwen2Config ties its input and output embeddings .* under FSDP2 \+ "
                                             r"TP \(fsdp_tp.yaml\) .*; use tp.yaml"):
        check_tensor_parallel_model(tied, 2, data_parallel=2)


def test_the_plan_groups_every_process_around_one_batch_and_refuses_other_meshes(monkeypatch):
    plan = mesh_plan(monkeypatch, 4, tp=4)
    assert (plan.label, plan.mesh, plan.tp, plan.group, plan.share) == ("tp", "tp=4", 4, 4, 0.25)
    with pytest.raises(DisttrainError, match=r"tp_size=2 must equal the 4 processes launched"):
        mesh_plan(monkeypatch, 4, tp=2)
    with pytest.raises(DisttrainError, match=r"tp_size=2 runs alone .* not with \{'cp': 2\}"):
        mesh_plan(monkeypatch, 4, tp=2, cp=2)
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    with pytest.raises(DisttrainError, match=r"not with an FSDP or DeepSpeed config"):
        mesh_plan(monkeypatch, 2, tp=2, dp_shard=1)


@pytest.mark.parametrize("recipe_file, override, named", [
    ("sft", "lora.r=8 lora.use_dora=true", "lora.use_dora"), ("dpo", "training.max_steps=2", "training.objective=dpo"),
    ("sft", "data.streaming=true training.max_steps=4", "data.streaming=true"),
    ("sft", "training.loss_impl=trl", "training.loss_impl=trl"),
    ("sft", "training.compile=true", "training.compile=true"),
    ("sft", "training.mixed_precision=fp16", "training.mixed_precision=fp16")])
def test_what_tensor_parallelism_does_not_verify_is_refused_in_one_line(recipe_file, override, named):
    recipe = load_recipe(str(REPO / f"recipes/tiny/{recipe_file}.yaml"), override.split())
    with pytest.raises(DisttrainError, match=rf"^{named}.* is not supported under tensor parallelism "
                                             r"\(accelerate_configs/tp.yaml or fsdp_tp.yaml"):
        check_tensor_parallel(recipe, 2)
    check_tensor_parallel(recipe, 1)  # without tensor parallelism: nothing to refuse here


def test_lora_runs_under_tensor_parallelism_alone_and_is_refused_under_fsdp2_with_it():
    recipe = load_recipe(str(REPO / "recipes/tiny/sft.yaml"), ["lora.r=8"])
    check_tensor_parallel(recipe, 2)
    with pytest.raises(DisttrainError, match=r"^a lora section under FSDP2 \+ TP .* LoRA runs under tp.yaml alone"):
        check_tensor_parallel(recipe, 2, data_parallel=2)
