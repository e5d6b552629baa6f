"""model/lora_init.py: every LoRA adapter is drawn from a generator of its own (the run's seed, the layer's
name), so a strategy that draws other random numbers first (tensor parallelism's smaller split adapters) starts
from the adapters one process starts from; peft's own draws from the shared generator would not (the control)."""

import pytest
import torch

from disttrain.model.loading import load_model
from disttrain.recipe.schema import LoraSection, ModelSection

LORA = {"r": 4, "alpha": 8, "dropout": 0.0, "target_modules": ["q_proj", "down_proj"]}


def _adapters(model_dir, seed: int, draw_first: int = 0, **lora) -> dict:
    torch.manual_seed(seed)
    torch.rand(draw_first)  # what another strategy might draw before the adapters
    model = load_model(ModelSection(name_or_path=str(model_dir), dtype="float32"), LoraSection(**{**LORA, **lora}))
    return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}


@pytest.mark.parametrize("init", [True, "gaussian", False])
def test_adapters_start_alike_whatever_was_drawn_before(tiny_model_dir, init):
    one, other = (_adapters(tiny_model_dir, 7, draw_first=n, init_lora_weights=init) for n in (0, 1000))
    assert one.keys() == other.keys() and len(one) == 8
    for name, value in one.items():
        torch.testing.assert_close(other[name], value, rtol=0, atol=0, msg=name)
        assert (("lora_B" in name) and init is not False) == (value.abs().sum() == 0)  # B at zero unless false
    another_seed = _adapters(tiny_model_dir, 8, init_lora_weights=init)
    assert all(not torch.equal(another_seed[n], v) for n, v in one.items() if "lora_A" in n)


def test_kaiming_adapters_keep_peft_s_bound(tiny_model_dir):
    """lora_A ~ U(-1/sqrt(fan_in), 1/sqrt(fan_in)) (Kaiming-uniform with a = sqrt(5), as nn.Linear and peft)."""
    for name, value in _adapters(tiny_model_dir, 7).items():
        if "lora_A" in name:
            bound = 1 / value.shape[1] ** 0.5
            assert value.abs().max() <= bound and value.abs().max() > 0.9 * bound, name


def test_the_control_peft_s_own_draws_move_with_what_was_drawn_before(tiny_model_dir, monkeypatch):
    from disttrain.model import lora_init

    monkeypatch.setattr(lora_init, "seed_adapters", lambda model, init: None)
    one, other = (_adapters(tiny_model_dir, 7, draw_first=n) for n in (0, 1000))
    assert any(not torch.equal(other[n], v) for n, v in one.items() if "lora_A" in n)
