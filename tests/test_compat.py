from pathlib import Path

import pytest

from disttrain.recipe import compat
from disttrain.recipe.compat import check, check_trackers
from disttrain.recipe.schema import Recipe
from disttrain.errors import DisttrainError, RecipeError


def recipe(**model_and_training) -> Recipe:
    model = {"name_or_path": "Qwen/Qwen2.5-7B-Instruct", **model_and_training.pop("model", {})}
    return Recipe.model_validate({"model": model, "data": {"path": "x", "format": "alpaca"},
                                  "training": model_and_training, "lora": {"r": 4}, "output": {"dir": "o"}})


@pytest.mark.parametrize("strategy", ["single", "ddp", "fsdp", "deepspeed"])
def test_plain_runs_are_allowed_everywhere(strategy, monkeypatch):
    monkeypatch.delenv("DISTTRAIN_ALLOW_UNVERIFIED", raising=False)
    check(recipe(), strategy, gpu=True)
    if strategy != "fsdp":  # QLoRA under FSDP2: refused until verified on GPU (below)
        check(recipe(model={"quantization": "4bit"}), strategy, gpu=True)


def test_qlora_under_fsdp_is_refused_on_gpu_unless_allowed(monkeypatch):
    monkeypatch.delenv("DISTTRAIN_ALLOW_UNVERIFIED", raising=False)
    qlora = recipe(model={"quantization": "4bit"})
    with pytest.raises(DisttrainError) as err:
        check(qlora, "fsdp", gpu=True)
    message = str(err.value)
    assert "unverified on GPU" in message and "axolotl#2992" in message and "accelerate#3983" in message
    assert "ddp config" in message and "DISTTRAIN_ALLOW_UNVERIFIED=1" in message and "\n" not in message
    with pytest.raises(DisttrainError, match="QLoRA\\) needs a CUDA GPU"):  # on CPU the more basic reason
        check(qlora, "fsdp", gpu=False)
    monkeypatch.setenv("DISTTRAIN_ALLOW_UNVERIFIED", "1")  # what the GPU acceptance script sets
    check(qlora, "fsdp", gpu=True)


@pytest.mark.parametrize("strategy, gpu, kwargs, needle", [
    ("fsdp", True, {"optimizer": "adamw_8bit"}, "adamw_8bit is not supported with fsdp"),
    ("deepspeed", True, {"optimizer": "adamw_8bit"}, "adamw_8bit is not supported with deepspeed"),
    ("ddp", False, {"optimizer": "adamw_8bit"}, "needs a CUDA GPU"),
    ("ddp", False, {"model": {"quantization": "4bit"}}, "QLoRA) needs a CUDA GPU"),
    ("ddp", False, {"mixed_precision": "fp16"}, "fp16 needs a GPU"),
    ("ddp", False, {"model": {"attn_implementation": "flash_attention_2"}}, "use sdpa"),
])
def test_impossible_combinations_fail_with_one_line(strategy, gpu, kwargs, needle):
    with pytest.raises(DisttrainError) as err:
        check(recipe(**kwargs), strategy, gpu)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_ddp_8bit_adam_on_gpu_is_allowed():
    check(recipe(optimizer="adamw_8bit"), "ddp", gpu=True)


def test_quantization_without_lora_is_a_recipe_error(tmp_path):
    import yaml

    from disttrain.recipe.schema import load_recipe

    path = tmp_path / "q.yaml"
    path.write_text(yaml.safe_dump({"model": {"name_or_path": "Qwen/Qwen2.5-7B", "quantization": "4bit"},
                                    "data": {"path": "yahma/alpaca-cleaned", "format": "alpaca"},
                                    "output": {"dir": "o"}}))
    with pytest.raises(RecipeError, match="model.quantization needs a lora section"):
        load_recipe(path)


def test_missing_tracker_is_named(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "wandb" else real(name))
    with pytest.raises(DisttrainError, match="report_to includes wandb but it is not installed"):
        check_trackers(["tensorboard", "wandb"])
    check_trackers(["tensorboard", "none"])


DS_CONFIGS = Path(__file__).resolve().parents[1] / "ds_configs"


@pytest.mark.parametrize("version, config, checkpointing, refused", [
    ((0, 19, 2), "zero3.json", True, True),
    ((0, 18, 9), "zero3_offload.json", True, True),
    ((0, 19, 3), "zero3.json", True, False),         # the first release with deepspeed PR #8148
    ((0, 19, 2), "zero3.json", False, False),        # no recomputation, no crash
    ((0, 19, 2), "zero2.json", True, False),         # params are not partitioned below stage 3
    (None, "zero3.json", True, False),               # not installed: accelerate says so itself
])
def test_zero3_lora_checkpointing_needs_a_fixed_deepspeed(monkeypatch, version, config, checkpointing, refused):
    monkeypatch.setattr(compat, "deepspeed_version", lambda: version)
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", str(DS_CONFIGS / config))
    lora = recipe(model={"gradient_checkpointing": checkpointing})
    if refused:
        with pytest.raises(DisttrainError) as err:
            check(lora, "deepspeed", gpu=True)
        message = str(err.value)
        assert f"deepspeed {'.'.join(map(str, version))}" in message and "0.19.3" in message
        assert "pip install 'deepspeed>=0.19.3'" in message and "model.gradient_checkpointing=false" in message
        assert "\n" not in message
    else:
        check(lora, "deepspeed", gpu=True)
    check(lora, "fsdp", gpu=True)  # other strategies never ask
    full = recipe(model={"gradient_checkpointing": checkpointing})
    full.lora = None
    check(full, "deepspeed", gpu=True)  # full fine-tunes are not affected


def test_zero_stage_from_the_accelerate_config(monkeypatch):
    """Without a DeepSpeed JSON the stage comes from the accelerate config's own keys (the same reading as
    the ZeRO-3 export check)."""
    monkeypatch.setattr(compat, "deepspeed_version", lambda: (0, 17, 0))
    monkeypatch.delenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", raising=False)
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "3")
    with pytest.raises(DisttrainError, match="deepspeed 0.17.0 crashes"):
        check(recipe(model={"gradient_checkpointing": True}), "deepspeed", gpu=True)


def test_installed_deepspeed_version_is_parsed():
    import importlib.metadata

    version = compat.deepspeed_version()
    try:
        installed = importlib.metadata.version("deepspeed")
    except importlib.metadata.PackageNotFoundError:
        assert version is None
    else:
        assert ".".join(map(str, version)) == installed.split("+")[0]
