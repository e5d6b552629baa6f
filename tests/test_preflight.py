"""`make preflight` on every shipped recipe: shrunk model of the same architecture, 2 CPU processes."""

import json

import pytest
import torch

from safetensors.torch import load_file

from conftest import REPO, assert_ok, launch
from disttrain.errors import DisttrainError
from disttrain.metrics.log import read_metrics
from disttrain.recipe.schema import load_recipe
from disttrain.tools.preflight import cpu_overrides, find_config_dir, run, shrink_config

pytestmark = pytest.mark.launch

# each recipe under the strategy it is written for (plus variety: tied embeddings under ZeRO-3)
SHIPPED = {
    "tiny/sft.yaml": "ddp",
    "qwen2.5-7b/lora_sft.yaml": "zero3",  # with its gradient checkpointing: needs deepspeed >= 0.19.3
    "qwen2.5-7b/qlora_sft.yaml": "ddp",  # QLoRA under FSDP2 is refused until a GPU run verifies it
    "qwen2.5-0.5b/full_sft.yaml": "zero3",
    "llama-3.1-8b/full_sft_fsdp.yaml": "fsdp",
    "tiny/mix_sft.yaml": "fsdp",
    "tiny/cpt.yaml": "ddp",
    "qwen2.5-1.5b/cpt.yaml": "zero2",
    "tiny/dpo.yaml": "zero3",  # precomputed reference log-probs under ZeRO-3, read back on resume
    "qwen2.5-7b/dpo_lora.yaml": "ddp",  # reference = the base with the adapters disabled
    "qwen2.5-7b/kto_lora.yaml": "ddp",  # KTO on unpaired examples, the adapters-off reference
    # mixture of experts (shrunk to 4 experts, 2 per token), router loss on: LoRA on attention and the fused
    # experts under ZeRO-3 (MoE blocks as leaf modules) and FSDP2; the full fine-tune under FSDP2
    "qwen3-30b-a3b/lora_sft.yaml": "zero3",
    "qwen3-30b-a3b/full_sft.yaml": "fsdp",
    "mixtral-8x7b/lora_sft.yaml": "fsdp",
    # the meshes: Ulysses and context parallelism (2 processes, one sequence group; the ring on the CPU kernel:
    # tests/cpu_ring) and HSDP (4 processes, 2 replicas x 2 shards)
    "qwen2.5-7b/long_sft_32k.yaml": "zero3_ulysses",
    "llama-3.1-8b/long_sft_64k.yaml": "fsdp_cp",
    "qwen2.5-32b/full_sft_hsdp.yaml": "hsdp",
    # online RL: rollouts under DDP (full; LoRA with the adapters-off reference), FSDP2 (the 2-node full recipe),
    # ZeRO-3 (the MoE with LoRA); the tiny one on its own model
    "tiny/grpo.yaml": "fsdp",
    "tiny/reward.yaml": "zero3",  # a reward model: the score head under ZeRO-3
    "tiny/vlm_sft.yaml": "zero3",  # vision-language: shrunk to the tiny model of its family, with its processor
    "gemma-3-4b/full_sft.yaml": "fsdp",  # the same from model_configs/, on the shipped pictures
    "qwen3-1.7b/grpo_gsm8k.yaml": "ddp",
    "qwen2.5-7b/grpo_lora.yaml": "ddp",
    "qwen2.5-7b/grpo_full_2node.yaml": "fsdp",
    "qwen3-30b-a3b/grpo_lora.yaml": "zero3",
    "qwen3-1.7b/grpo_python_gsm8k.yaml": "zero3",  # multi-turn rollouts with the Python sandbox as the tool
    # distillation: the teacher shrunk beside the student; the tiny recipe's teacher is the tiny model
    "tiny/distill.yaml": "zero3",
    "qwen3-1.7b/distill_from_8b.yaml": "fsdp",
}
MOE = [recipe for recipe in SHIPPED if recipe.startswith(("qwen3-30b-a3b/", "mixtral-8x7b/"))]  # GRPO's too
# the expert-parallel recipes: preflight under fsdp_ep and compared with DDP in tests/test_expert_parallel.py
EXPERT_PARALLEL = ("qwen3-30b-a3b/full_sft_ep.yaml", "qwen3-30b-a3b/lora_sft_ep.yaml", "mixtral-8x7b/lora_sft_ep.yaml")


# launched as shipped (shortened) by their own tests: the tiny tool recipes in tests/test_agent_launch.py (the SFT
# warm start and GRPO from it under one process, DDP (resumed), FSDP2 and ZeRO-3, the final model loading), the
# tiny KTO recipe in tests/test_kto_launch.py (one process, DDP, FSDP2, HSDP, ZeRO-1, ZeRO-3)
LAUNCHED = {"tiny/tool_sft.yaml": "test_agent_launch.py", "tiny/tool_grpo.yaml": "test_agent_launch.py",
            "tiny/kto.yaml": "test_kto_launch.py"}


def test_every_shipped_recipe_is_covered():
    from test_expert_parallel import EP_RECIPES

    shipped = {str(p.relative_to(REPO / "recipes")) for p in (REPO / "recipes").rglob("*.yaml")}
    assert set(EP_RECIPES) == set(EXPERT_PARALLEL)
    assert shipped == set(SHIPPED) | set(EXPERT_PARALLEL) | set(LAUNCHED)
    assert all(f"recipes/{recipe}" in (REPO / "tests" / test).read_text() for recipe, test in LAUNCHED.items())


# what preflight proves is that the recipe trains, checkpoints, resumes and exports; the end-of-run samples and
# the model card (~5 CPU-s a launch) are proven under every strategy elsewhere (test_report, the ZeRO-3 matrix run)
QUIET = ["logging.samples=0", "output.report=false"]


def preflight(runs, recipe: str, tiny_model_dir):
    """`make preflight` of a shipped recipe under the strategy it is written for, once per session: (its report's
    rows, its work dir: model/, run/, save.log)."""
    def make(folder):
        tiny = tiny_model_dir
        if recipe == "tiny/vlm_sft.yaml":  # its own tiny model (preflight shrinks it to the same again)
            from disttrain.tools.tiny import build_vlm_dir
            tiny = build_vlm_dir(folder / "tiny-gemma3-vl")
        overrides = QUIET + ([f"model.name_or_path={tiny}"] if recipe.startswith("tiny/") else [])
        overrides += [f"distill.teacher={tiny}"] if recipe == "tiny/distill.yaml" else []
        report = run(str(REPO / "recipes" / recipe), SHIPPED[recipe], nproc=None, steps=4, work_dir=folder / "pf",
                     overrides=overrides)
        return report.rows, folder / "pf"
    return runs.get("preflight-" + recipe.replace("/", "-"), make)


@pytest.mark.parametrize("recipe, strategy", sorted(SHIPPED.items()))
def test_preflight_passes(recipe, strategy, runs, tiny_model_dir):
    rows, work = preflight(runs, recipe, tiny_model_dir)
    assert [stage for stage, _, _ in rows] == ["recipe", "compatibility", "shrink", "save", "resume", "export"]
    assert all(status == "PASS" for _, status, _ in rows), rows
    run_dir = work / "run"
    assert (run_dir / "final").is_dir()
    # the shipped data recipes: only the main process tokenises (rank 1 reads its datasets cache), the
    # mixture's three sources are mixed, the continued-pretraining rows are full 128-token chunks
    data = json.loads((run_dir / "data_report.json").read_text())
    others = [r["tokenised_here"] for r in data["preparation_per_rank"] if r["rank"] != 0]
    assert len(others) in (1, 3) and not any(others)  # 2 processes, or HSDP's 2 x 2
    if recipe == "tiny/mix_sft.yaml":
        assert set(data["train"]["sources"]) == {"alpaca", "chat", "tools"}
        assert "mixture: tools:" in (work / "save.log").read_text()
    if recipe == "qwen3-30b-a3b/lora_sft.yaml":  # ZeRO-3 gathers each MoE block whole on every rank
        assert "ZeRO-3: MoE blocks gathered whole on every rank (Qwen3MoeSparseMoeBlock)" in \
            (work / "save.log").read_text()
    if recipe == "tiny/cpt.yaml":
        assert data["train"]["tokens"] == data["train"]["rows"] * 128
        assert 0 <= data["train"]["dropped_remainder_tokens"] < 128 and data["train"]["truncated"] == 0


def moe_single_process(runs, recipe: str, tiny_model_dir):
    """One process on the MoE recipe's shrunk model and rows, once per session: each micro-batch of a 2-process
    run is one of its micro-batches (accumulation doubled), so the router's load-balancing loss, computed per
    micro-batch, is the same too. Returns (its output dir, the preflight's work dir)."""
    _, work = preflight(runs, recipe, tiny_model_dir)

    def make(folder):
        spec = load_recipe(str(REPO / "recipes" / recipe))
        overrides, _ = cpu_overrides(spec, work / "model", folder / "single", 4)
        accum = min(spec.training.grad_accum, 2)
        proc = launch("single_gpu", REPO / "recipes" / recipe, nproc=1,
                      overrides=[*QUIET, *overrides, f"training.grad_accum={2 * accum}"])
        assert_ok(proc)
        return folder / "single"
    return runs.get("moe-single-" + recipe.replace("/", "-"), make), work


def assert_moe_runs_equal(recipe: str, ours, single) -> None:
    """Per-step losses 1e-4 (online RL: its rewards, entropy and completion lengths; its on-policy loss is 0 up to
    rounding), exported weights (the adapters, or the whole model) 1e-4, experts included where trained."""
    spec = load_recipe(str(REPO / "recipes" / recipe))
    keys = ("reward", "entropy", "completions/mean_length") if spec.training.objective == "grpo" else ("loss",)
    logged = [{(r["step"], k): r[k] for r in read_metrics(out) for k in keys if k in r} for out in (ours, single)]
    assert sorted({s for s, _ in logged[0]}) == [1, 2, 3, 4] and logged[0] == pytest.approx(logged[1], rel=1e-4)
    name = "adapter_model.safetensors" if spec.lora else "model.safetensors"
    ours, single = load_file(ours / "final" / name), load_file(single / "final" / name)
    experts = spec.lora is None or bool(spec.lora.target_parameters)  # the GRPO recipe adapts attention only
    assert set(ours) == set(single) and any("experts" in key for key in ours) == experts
    for key, value in single.items():
        torch.testing.assert_close(ours[key], value, atol=1e-4, rtol=1e-3, msg=key)


@pytest.mark.parametrize("recipe", sorted(MOE))
def test_moe_recipes_train_like_one_process_across_their_resume(recipe, runs, tiny_model_dir):
    """The MoE recipes' preflight (2 processes under ZeRO-3 or FSDP2, stopped at step 2 and resumed in a new
    launch) against one process on the same shrunk model and rows."""
    single, work = moe_single_process(runs, recipe, tiny_model_dir)
    assert_moe_runs_equal(recipe, work / "run", single)


@pytest.mark.parametrize("recipe, strategy", [("qwen3-30b-a3b/lora_sft.yaml", "ddp"),
                                              ("qwen3-30b-a3b/full_sft.yaml", "zero3"),
                                              *[("qwen3-30b-a3b/lora_sft.yaml", config) for config in
                                                ("fsdp_offload", "hsdp", "zero1", "zero2", "zero3_offload")]])
def test_moe_recipes_train_like_one_process_under_the_other_strategies(recipe, strategy, runs, tmp_path,
                                                                        tiny_model_dir):
    """With the preflights above, every strategy meets a MoE model (the router loss on, LoRA on the fused experts):
    LoRA under DDP, FSDP2 + offload, HSDP (2 x 2, each micro-batch one of the single run's), ZeRO-1/2 and ZeRO-3 +
    offload (here), FSDP2 and ZeRO-3 (the Mixtral and Qwen3 LoRA preflights); full under FSDP2 (the Qwen3 full
    preflight) and ZeRO-3 (here, the experts' fused weights partitioned and gathered). One launch, against the
    same one-process run (disttrain/recipe/matrix.py names these cells)."""
    single, work = moe_single_process(runs, recipe, tiny_model_dir)
    spec = load_recipe(str(REPO / "recipes" / recipe))
    overrides, _ = cpu_overrides(spec, work / "model", tmp_path / "run", 4)
    processes = 4 if strategy == "hsdp" else 2
    if processes == 4:  # the single run's 2 x accumulation micro-batches per step, one per process
        overrides.append(f"training.grad_accum={min(spec.training.grad_accum, 2) // 2}")
    assert_ok(launch(strategy, REPO / "recipes" / recipe, nproc=processes, overrides=[*QUIET, *overrides]))
    assert_moe_runs_equal(recipe, tmp_path / "run", single)


def test_shrunk_model_keeps_the_architecture(tokenizer):
    config = shrink_config(find_config_dir("Qwen/Qwen2.5-0.5B-Instruct"), tokenizer)
    assert config.model_type == "qwen2" and config.tie_word_embeddings is True
    assert config.num_attention_heads == 4 and config.num_key_value_heads == 1  # 14:2 GQA -> 4:1 (ratio capped)
    config = shrink_config(find_config_dir("Qwen/Qwen3-30B-A3B"), tokenizer)  # 128 experts, 8 per token
    assert (config.model_type, config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == \
        ("qwen3_moe", 4, 2, 32)
    config = shrink_config(find_config_dir("mistralai/Mixtral-8x7B-Instruct-v0.1"), tokenizer)
    assert (config.num_local_experts, config.num_experts_per_tok) == (4, 2)
    config = shrink_config(find_config_dir("meta-llama/Llama-3.1-8B-Instruct"), tokenizer)
    assert config.rope_scaling["rope_type"] == "llama3" and config.num_key_value_heads == 1


def test_preflight_reports_each_failure(tmp_path):
    with pytest.raises(DisttrainError, match="no config.json for 'acme/unknown-7b'.*model_configs/acme__unknown-7b"):
        find_config_dir("acme/unknown-7b")
    report = run(str(REPO / "recipes/qwen2.5-7b/lora_sft.yaml"), "zero3", 2, 3, tmp_path / "pf",
                 overrides=["training.optimizer=adamw_8bit"])
    assert report.rows[-1][0] == "compatibility" and report.failed()
    assert "adamw_8bit is not supported with deepspeed" in report.rows[-1][2]
    report = run(str(REPO / "recipes/qwen2.5-7b/lora_sft.yaml"), "zero9", 2, 3, tmp_path / "pf")
    assert report.failed() and "no accelerate_configs/zero9.yaml" in report.rows[-1][2]
    # a LoRA target that does not exist in the architecture is caught by the dry run itself
    report = run(str(REPO / "recipes/qwen2.5-7b/lora_sft.yaml"), "ddp", 2, 2, tmp_path / "pf2",
                 overrides=["lora.target_modules=[query_key_value]"])
    assert report.rows[-1][0] == "save" and report.failed()
