import pytest

from disttrain.compat import check, check_trackers
from disttrain.config import Recipe
from disttrain.errors import DisttrainError, RecipeError


def recipe(**model_and_training) -> Recipe:
    model = {"name_or_path": "Qwen/Qwen2.5-7B-Instruct", **model_and_training.pop("model", {})}
    return Recipe.model_validate({"model": model, "data": {"path": "x", "format": "alpaca"},
                                  "training": model_and_training, "lora": {"r": 4}, "output": {"dir": "o"}})


@pytest.mark.parametrize("strategy", ["single", "ddp", "fsdp", "deepspeed"])
def test_plain_runs_are_allowed_everywhere(strategy):
    check(recipe(), strategy, gpu=True)
    check(recipe(model={"quantization": "4bit"}), strategy, gpu=True)


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

    from disttrain.config import load_recipe

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
