"""`make preflight` on every shipped recipe: shrunk model of the same architecture, 2 CPU processes."""

import json

import pytest

from conftest import REPO
from disttrain.errors import DisttrainError
from disttrain.tools.preflight import find_config_dir, run, shrink_config

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
}


def test_every_shipped_recipe_is_covered():
    shipped = {str(p.relative_to(REPO / "recipes")) for p in (REPO / "recipes").rglob("*.yaml")}
    assert shipped == set(SHIPPED)


@pytest.mark.parametrize("recipe, strategy", sorted(SHIPPED.items()))
def test_preflight_passes(recipe, strategy, tmp_path, tiny_model_dir):
    overrides = [f"model.name_or_path={tiny_model_dir}"] if recipe.startswith("tiny/") else []
    report = run(str(REPO / "recipes" / recipe), strategy, nproc=2, steps=4, work_dir=tmp_path / "pf",
                 overrides=overrides)
    assert [stage for stage, _, _ in report.rows] == ["recipe", "compatibility", "shrink", "save", "resume", "export"]
    assert not report.failed(), report.rows
    run_dir = tmp_path / "pf" / "run"
    assert (run_dir / "final").is_dir()
    # the shipped data recipes: only the main process tokenises (rank 1 reads its datasets cache), the
    # mixture's three sources are mixed, the continued-pretraining rows are full 128-token chunks
    data = json.loads((run_dir / "data_report.json").read_text())
    assert [r["tokenised_here"] for r in data["preparation_per_rank"] if r["rank"] != 0] == [False]
    if recipe == "tiny/mix_sft.yaml":
        assert set(data["train"]["sources"]) == {"alpaca", "chat", "tools"}
        assert "mixture: tools:" in (tmp_path / "pf" / "save.log").read_text()
    if recipe == "tiny/cpt.yaml":
        assert data["train"]["tokens"] == data["train"]["rows"] * 128
        assert 0 <= data["train"]["dropped_remainder_tokens"] < 128 and data["train"]["truncated"] == 0


def test_shrunk_model_keeps_the_architecture(tokenizer):
    config = shrink_config(find_config_dir("Qwen/Qwen2.5-0.5B-Instruct"), tokenizer)
    assert config.model_type == "qwen2" and config.tie_word_embeddings is True
    assert config.num_attention_heads == 4 and config.num_key_value_heads == 1  # 14:2 GQA -> 4:1 (ratio capped)
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
