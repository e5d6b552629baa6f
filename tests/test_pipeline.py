"""Pipeline parallelism (accelerate_configs/fsdp_pp.yaml, disttrain/parallel/pipeline.py): the stage cut in process
(names kept, the stages chained equal to the model's own loss, on Llama and Qwen3), what it refuses in one line,
and launches equal to one process: the stages alone (1F1B) across a resume with the checkpoint's clock saving
every step, FSDP2 over the stages (GPipe, 2 x 2 processes) through `make train-fsdp-pp`, bf16 on concatenated
text chunks."""

from __future__ import annotations

import copy

import pytest
import torch

from conftest import REPO, assert_ok, kill_launch, launch
from disttrain.errors import DisttrainError
from disttrain.metrics.log import read_metrics
from disttrain.model import stages as stage_cut
from disttrain.parallel import pipeline
from strategy_runs import STEPS, losses, make_train, matrix_recipe, small_data, strategy_run

PP_ENV = {"PARALLELISM_CONFIG_PP_SIZE": "2"}
RTOL = 1e-4  # fp32: the stages run the same operations as one process, in the same order


def _tiny_qwen3():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=439, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False,
                         use_sliding_window=False)
    return Qwen3ForCausalLM(config).eval()


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3_moe"])
def test_stages_keep_the_models_names_and_chain_to_its_own_loss(family, tiny_model_dir, tiny_moe_dir):
    from transformers import AutoModelForCausalLM

    whole = {"llama": lambda: AutoModelForCausalLM.from_pretrained(tiny_model_dir), "qwen3": _tiny_qwen3,
             "qwen3_moe": lambda: AutoModelForCausalLM.from_pretrained(tiny_moe_dir)}[family]().eval()
    layers = whole.config.num_hidden_layers
    stages = [pipeline.cut(copy.deepcopy(whole), stage_cut.StagePlace(
        s, 2, 0, 1, stage_cut.stage_layers(layers, s, 2))) for s in range(2)]
    first, last = (set(dict(stage.named_parameters())) for stage in stages)
    assert first.isdisjoint(last) and first | last == set(dict(whole.named_parameters()))
    assert "model.embed_tokens.weight" in first and "lm_head.weight" in last and "model.norm.weight" in last
    assert f"model.layers.{layers - 1}.input_layernorm.weight" in last
    assert "model.layers.0.input_layernorm.weight" in first
    torch.manual_seed(1)
    ids = torch.randint(3, 400, (3, 24))
    labels = ids.clone()
    labels[:, :6] = -100  # a prompt
    with torch.no_grad():
        summed = stages[1](stages[0](ids), labels=labels)
        theirs = whole(input_ids=ids, labels=labels).loss  # transformers' own mean over the targets
    assert float(summed) / int((labels[:, 1:] != -100).sum()) == pytest.approx(float(theirs), rel=1e-5)


def test_what_a_pipeline_cannot_take_is_refused_in_one_line(tiny_model_dir, monkeypatch):
    from transformers import GemmaConfig, LlamaConfig

    from disttrain.parallel.checks import check_pipeline
    from disttrain.parallel.mesh import read_mesh
    from disttrain.recipe.schema import load_recipe

    def said(call) -> str:
        with pytest.raises(DisttrainError) as caught:
            call()
        assert "\n" not in str(caught.value)
        return str(caught.value)

    llama = LlamaConfig(num_hidden_layers=3, tie_word_embeddings=False)
    assert "has 3 decoder layers: 2 pipeline stages need them divisible by 2" in said(
        lambda: pipeline.check_model(llama, "m", 2))
    assert "ties its input and output embeddings" in said(
        lambda: pipeline.check_model(LlamaConfig(num_hidden_layers=2, tie_word_embeddings=True), "m", 2))
    assert "is a gemma model: pipeline parallelism" in said(lambda: pipeline.check_model(GemmaConfig(), "m", 2))
    assert "trains its router's load-balancing loss" in said(lambda: pipeline.check_model(llama, "m", 2, True))
    monkeypatch.setenv("PARALLELISM_CONFIG_PP_SIZE", "3")
    assert "PARALLELISM_CONFIG_PP_SIZE=3 must divide the 4 processes" in said(lambda: read_mesh("ddp", 4))
    assert "not from this FSDP or DeepSpeed config" in said(lambda: read_mesh("fsdp", 4))
    monkeypatch.setenv("PARALLELISM_CONFIG_PP_SIZE", "2")
    assert read_mesh("ddp", 4).label == "pp=2,dp_shard=2"
    recipe = lambda *o: load_recipe(REPO / "recipes/tiny/sft.yaml", ["logging.samples=0", *o])  # noqa: E731
    check_pipeline(recipe(), 2)
    check_pipeline(recipe("lora.r=8", "lora.dropout=0"), 2)
    assert "training.grad_accum=2 gives the pipeline's 4 stages fewer micro-batches than stages" in said(
        lambda: check_pipeline(recipe(), 4))
    check_pipeline(recipe("training.pp_schedule=gpipe"), 4)
    assert "lora.dropout > 0 (each stage's masks, unverified) is not supported under pipeline parallelism" in said(
        lambda: check_pipeline(recipe("lora.r=8"), 2))
    assert "lora.use_dora, use_rslora" in said(lambda: check_pipeline(recipe("lora.r=8", "lora.use_dora=true"), 2))
    assert "logging.samples > 0" in said(lambda: check_pipeline(recipe("logging.samples=2"), 2))


def _pipeline_run(folder, model_dir, runs, name: str, processes: int, data_ranks: int, schedule: str,
                  lora: bool = False, **extra):
    """The strategy matrix's recipe (4 rows a step: data_ranks x micro-batch x accumulation 2) under fsdp_pp."""
    return matrix_recipe(folder, model_dir, small_data(runs), name, data_ranks, lora,
                         training={"pp_schedule": schedule, **extra.pop("training", {})}, **extra)


def _same_weights(ours, theirs) -> None:
    from transformers import AutoModelForCausalLM

    a = AutoModelForCausalLM.from_pretrained(ours / "final").state_dict()
    b = AutoModelForCausalLM.from_pretrained(theirs / "final").state_dict()
    assert set(a) == set(b)
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=RTOL, atol=1e-6, msg=name)


@pytest.mark.launch
def test_pipeline_stages_alone_train_like_one_process_and_resume_exactly(runs, tiny_model_dir, tmp_path):
    """Two stages, no data parallelism (1F1B over the step's 2 micro-batches): stopped after step 5 (the clock saving
    a complete checkpoint at every step, DCP shards of both stages), launched again to step 10: every step's loss
    and gradient norm equal to one process's, the export (one file per stage and their index) the same weights."""
    single = strategy_run(runs, tiny_model_dir, "single_gpu", False).out
    recipe = _pipeline_run(tmp_path, tiny_model_dir, runs, "pp", 2, 1, "1f1b",
                           output={"checkpoint_minutes": 0.000001, "keep_last": 8})
    first = launch("fsdp_pp", recipe, nproc=2, overrides=["training.stop_at_step=5"], env=PP_ENV)
    assert_ok(first)
    out = tmp_path / "pp"
    saved = sorted(p.name for p in (out / "checkpoints").glob("step-*"))
    assert saved == [f"step-{s:08d}" for s in range(1, 6)]
    assert all((out / "checkpoints" / name / "manifest.json").is_file() for name in saved)
    second = launch("fsdp_pp", recipe, nproc=2, env=PP_ENV)
    assert_ok(second)
    assert "resumed from" in second.stdout and "at step 5/10" in second.stdout
    ours, theirs = losses(out), losses(single)
    assert sorted(ours) == list(range(1, STEPS + 1))
    assert list(ours.values()) == pytest.approx([theirs[s] for s in ours], rel=RTOL)
    norms = {r["step"]: r["grad_norm"] for r in read_metrics(out) if "grad_norm" in r}
    reference = {r["step"]: r["grad_norm"] for r in read_metrics(single) if "grad_norm" in r}
    assert list(norms.values()) == pytest.approx([reference[s] for s in norms], rel=RTOL)
    assert sorted(p.name for p in (out / "final").glob("*.safetensors")) == \
        ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    _same_weights(out, single)


@pytest.mark.launch
def test_fsdp2_over_pipeline_stages_trains_like_one_process_through_make(runs, tiny_model_dir, tmp_path):
    """2 stages x FSDP2 over 2 processes each (GPipe), as `make train-fsdp-pp GPUS=4 PP=2` launches it: the two data
    ranks see the rows one process sees, every step's loss equal, the export the same weights."""
    single = strategy_run(runs, tiny_model_dir, "single_gpu", False).out
    recipe = _pipeline_run(tmp_path, tiny_model_dir, runs, "pp4", 4, 2, "gpipe")
    stdout = make_train("train-fsdp-pp", recipe, "GPUS=4", "PP=2")
    assert "mesh=pp=2,dp_shard=2" in stdout
    ours, theirs = losses(tmp_path / "pp4"), losses(single)
    assert sorted(ours) == list(range(1, STEPS + 1))
    assert list(ours.values()) == pytest.approx([theirs[s] for s in ours], rel=RTOL)
    _same_weights(tmp_path / "pp4", single)


DATA = {  # the matrix's concat_chunk and mixture data, each with a held-out set
    "text_chunks": {"path": str(REPO / "data/tiny_text.jsonl"), "format": "text", "concat_and_chunk": True,
                    "max_seq_len": 48, "eval_fraction": 0.1},
    "mixture": {"sources": [{"path": str(REPO / "data/tiny_alpaca.jsonl"), "format": "alpaca", "weight": 2},
                            {"path": str(REPO / "data/tiny_chat.jsonl"), "format": "chat", "eval_fraction": 0.1}],
                "max_seq_len": 48},
}


@pytest.mark.launch
@pytest.mark.parametrize("data", list(DATA))
def test_bf16_stages_train_and_evaluate_like_one_process(data, tiny_model_dir, tmp_path):
    """bf16 autocast on concatenated text chunks, or on a mixture of two sources, a held-out part evaluated every 3
    steps (a forward through both stages per eval batch, rows and lengths unlike the training ones): the stages
    compute what one process computes, step for step, eval losses included (a mixture's per source too)."""
    results = {}
    for name, config, processes in (("one", "single_gpu", 1), ("pp", "fsdp_pp", 2)):
        recipe = matrix_recipe(tmp_path, tiny_model_dir, DATA[data], name, 1,
                               training={"mixed_precision": "bf16", "max_steps": 6, "pp_schedule": "gpipe",
                                         "eval_every": 3})
        proc = launch(config, recipe, nproc=processes, env=PP_ENV if processes > 1 else None)
        assert_ok(proc)
        records = read_metrics(tmp_path / name)
        results[name] = (losses(tmp_path / name),
                         {(r["step"], k): v for r in records for k, v in r.items() if k.startswith("eval_loss")})
    (ours, our_eval), (theirs, their_eval) = results["pp"], results["one"]
    assert len(ours) == 6 and sorted({step for step, _ in our_eval}) == [3, 6]
    assert sorted(our_eval) == sorted(their_eval)
    assert list(ours.values()) == pytest.approx(list(theirs.values()), rel=1e-3)
    assert [our_eval[k] for k in sorted(our_eval)] == pytest.approx([their_eval[k] for k in sorted(our_eval)],
                                                                     rel=1e-3)


@pytest.mark.launch
def test_lora_on_pipeline_stages_trains_like_one_process(runs, tiny_model_dir, tmp_path):
    """The matrix's LoRA (q, v and down projections; merged on export) on two stages, each FSDP2-sharded over two
    processes (its frozen base and its adapters in the same units): each stage trains the adapters of its layers;
    every step's loss equal to one process's, the adapter gathered from both stages and the merged model the same
    weights."""
    from safetensors.torch import load_file

    single = strategy_run(runs, tiny_model_dir, "single_gpu", True).out
    recipe = _pipeline_run(tmp_path, tiny_model_dir, runs, "lora", 4, 2, "1f1b", lora=True)
    assert_ok(launch("fsdp_pp", recipe, nproc=4, env=PP_ENV))
    out = tmp_path / "lora"
    ours, theirs = losses(out), losses(single)
    assert sorted(ours) == list(range(1, STEPS + 1))
    assert list(ours.values()) == pytest.approx([theirs[s] for s in ours], rel=RTOL)
    a, b = (load_file(run / "final" / "adapter_model.safetensors") for run in (out, single))
    assert set(a) == set(b) and any(".layers.0." in k for k in a) and any(".layers.1." in k for k in a)
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=RTOL, atol=1e-6, msg=name)
    merged, reference = (load_file(run / "final" / "merged" / "model.safetensors") for run in (out, single))
    for name in reference:
        torch.testing.assert_close(merged[name], reference[name], rtol=RTOL, atol=1e-6, msg=name)


@pytest.mark.launch
def test_a_mixture_of_experts_on_pipeline_stages_trains_like_one_process(runs, tiny_moe_dir, tmp_path):
    """The tiny Qwen3-MoE (4 experts per block, 2 per token) on two stages (1F1B): every step's loss and gradient
    norm equal to one process's (expert parallelism's reference run), the export the same weights."""
    from test_expert_parallel import ep_run

    single, _ = ep_run(runs, tiny_moe_dir, "single_gpu")
    recipe = _pipeline_run(tmp_path, tiny_moe_dir, runs, "moe", 2, 1, "1f1b")
    assert_ok(launch("fsdp_pp", recipe, nproc=2, env=PP_ENV))
    out = tmp_path / "moe"
    ours, theirs = losses(out), losses(single)
    assert sorted(ours) == list(range(1, STEPS + 1))
    assert list(ours.values()) == pytest.approx([theirs[s] for s in ours], rel=RTOL)
    norms = {r["step"]: r["grad_norm"] for r in read_metrics(out) if "grad_norm" in r}
    assert list(norms.values()) == pytest.approx([r["grad_norm"] for r in read_metrics(single) if "grad_norm" in r],
                                                 rel=RTOL)
    _same_weights(out, single)


@pytest.mark.launch
def test_sigterm_to_the_launcher_checkpoints_every_stage_and_the_same_command_resumes(runs, tiny_model_dir, tmp_path):
    """`make train-fsdp-pp GPUS=2 PP=2`, its launcher sent SIGTERM (as a cluster's entry forwards kubelet's or
    SLURM's): both stages finish the step (the stop flag rides the step's all-reduce, which the stages share),
    write one complete checkpoint and exit; the same launch resumes from it."""
    from test_resume import signal_the_launcher_after, start_make

    recipe = _pipeline_run(tmp_path, tiny_model_dir, runs, "pp", 2, 1, "1f1b", training={"max_steps": 400},
                           output={"checkpoint_every": None})
    job = start_make("train-fsdp-pp", recipe, tmp_path / "pp.log", None, "GPUS=2", "PP=2")
    try:
        signal_the_launcher_after(job, tmp_path / "pp" / "metrics.jsonl", lines=5)
        job.wait(timeout=180)
    finally:
        kill_launch(job)
    out = (tmp_path / "pp.log").read_text()
    stopped = [line for line in out.splitlines() if line.startswith("stopped at step")]
    assert stopped, out[-3000:]
    step = int(stopped[0].split()[3].split("/")[0])
    checkpoint = tmp_path / "pp" / "checkpoints" / f"step-{step:08d}"
    assert 5 <= step < 400 and (checkpoint / "manifest.json").is_file(), out[-3000:]
    assert len(list((checkpoint / "tp_state").glob("*.distcp"))) == 2  # both stages' shards
    resumed = launch("fsdp_pp", recipe, nproc=2, env=PP_ENV, overrides=[f"training.stop_at_step={step + 2}"])
    assert_ok(resumed)
    assert f"step-{step:08d} at step {step}/400" in resumed.stdout
