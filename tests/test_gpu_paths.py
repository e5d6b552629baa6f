"""Code paths GPU runs take, checked on CPU: QLoRA parameter / FLOP counts on real bitsandbytes 4-bit weights,
and the merged LoRA export reloading the base model as the recipe loaded it."""

import pytest
import torch

from disttrain.recipe.schema import LoraSection, ModelSection
from disttrain.metrics.flops import numel, shape_from_model, training_flops_per_token


def _quantized(weight: torch.Tensor, storage: torch.dtype):
    bnb = pytest.importorskip("bitsandbytes")
    return bnb.nn.Params4bit(weight.detach().clone(), requires_grad=False, quant_type="nf4",
                             quant_storage=storage)._quantize("cpu")


@pytest.mark.parametrize("storage", [torch.uint8, torch.bfloat16])
def test_packed_4bit_weights_count_in_full(storage):
    """Params4bit.numel() is the packed count (2 values per byte of storage): 1/2 of the real count in uint8,
    1/4 in bf16 (QLoRA under FSDP / ZeRO-3 stores them in the compute dtype)."""
    p = _quantized(torch.randn(64, 32), storage)
    assert p.numel() == 64 * 32 // (2 * torch.empty((), dtype=storage).element_size())
    assert numel(p) == 64 * 32
    p.ds_numel = p.numel()  # ZeRO-3 placeholder: its ds_numel is the packed count too
    assert numel(p) == 64 * 32
    bnb = pytest.importorskip("bitsandbytes")
    unpacked = bnb.nn.Params4bit(torch.randn(64, 32), requires_grad=False)  # not quantized yet: real shape
    assert numel(unpacked) == 64 * 32


@pytest.mark.parametrize("storage", [torch.uint8, torch.bfloat16])
def test_quantizing_a_linear_keeps_params_and_flops(storage):
    """A model with one 4-bit Linear has the parameter count and FLOPs/token of the unquantized model."""
    bnb = pytest.importorskip("bitsandbytes")
    from transformers import AutoModelForCausalLM, LlamaConfig

    from disttrain.model.params import count_parameters

    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    model = AutoModelForCausalLM.from_config(cfg)
    before = shape_from_model(model, cfg)
    total_before = count_parameters(model)[0]
    mlp = model.model.layers[0].mlp
    q = bnb.nn.Linear4bit(64, 128, bias=False, quant_type="nf4", quant_storage=storage)
    q.weight = _quantized(mlp.up_proj.weight, storage)
    mlp.up_proj = q
    assert type(mlp.up_proj.weight).__name__ == "Params4bit" and mlp.up_proj.weight.numel() < 64 * 128
    after = shape_from_model(model, cfg)
    assert after == before
    assert count_parameters(model)[0] == total_before
    assert training_flops_per_token(after, 512, trainable_params=1000) == \
        training_flops_per_token(before, 512, trainable_params=1000)


class _OneProcess:
    """What export needs of an Accelerator, for one process (no global accelerate state in the test process)."""
    is_main_process = True

    def get_state_dict(self, model):
        return model.state_dict()

    def unwrap_model(self, model, keep_torch_compile=True):
        return model

    def wait_for_everyone(self):
        pass


def test_merged_export_reloads_the_base_as_the_recipe_did(tiny_model_dir, tokenizer, tmp_path, monkeypatch):
    """revision, trust_remote_code and the recipe dtype reach the base reload; before, only the live model's
    dtype did (float32 here, so the bfloat16 recipe got a float32 merged model)."""
    import transformers
    from safetensors import safe_open

    from disttrain.model.export import export_model
    from disttrain.model.loading import load_model

    train_spec = ModelSection(name_or_path=str(tiny_model_dir), dtype="float32")
    model = load_model(train_spec, LoraSection(r=4, dropout=0.0))
    recipe_spec = ModelSection(name_or_path=str(tiny_model_dir), dtype="bfloat16", revision="main")
    calls = []
    real = transformers.AutoModelForCausalLM.from_pretrained.__func__

    def recording(cls, *args, **kwargs):
        calls.append(kwargs)
        return real(cls, *args, **kwargs)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", classmethod(recording))
    out = export_model(_OneProcess(), model, tokenizer, tmp_path / "final", merge_lora=True, spec=recipe_spec)
    assert len(calls) == 1
    assert calls[0] == {"revision": "main", "trust_remote_code": False, "dtype": torch.bfloat16,
                        "use_safetensors": True}
    with safe_open(out / "merged" / "model.safetensors", "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
