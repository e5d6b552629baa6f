"""Mixture of experts as a family of its own (tiny Qwen3-MoE, in one process): the router's load-balancing
loss turned on from the recipe and added as transformers adds it, refused in one line for a dense model; LoRA
on the experts' fused 3-D weights (peft's target_parameters) trains them, with the chunked loss equal to the
model's own; FLOPs count the routed experts' active share (tests/test_cost_and_flops.py has the totals)."""

import pytest
import torch

from disttrain.data import Collator, count_targets
from disttrain.errors import DisttrainError
from disttrain.metrics.flops import shape_from_model
from disttrain.model.loading import load_model
from disttrain.objectives.token_loss import TokenLoss
from disttrain.recipe.schema import LoraSection, ModelSection
from tests_support import assert_same_loss_and_grads, loss_and_grads

EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def batch():
    g = torch.Generator().manual_seed(3)
    rows = [torch.randint(3, 200, (n,), generator=g).tolist() for n in (13, 9, 11)]
    return Collator(0)([{"input_ids": r, "labels": [-100] * 3 + r[3:]} for r in rows])


def test_the_recipe_turns_the_router_loss_on_and_the_loss_adds_it(tiny_moe_dir):
    off = load_model(ModelSection(name_or_path=str(tiny_moe_dir), dtype="float32"), None)
    on = load_model(ModelSection(name_or_path=str(tiny_moe_dir), dtype="float32", router_aux_loss_coef=0.5), None)
    b = batch()
    with torch.no_grad():  # the model's own load-balancing loss, before a chunked head is installed
        aux = on(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).aux_loss
    assert not off.config.output_router_logits and TokenLoss(off, "chunked").router_aux_coef == 0.0
    assert on.config.output_router_logits and on.config.router_aux_loss_coef == 0.5
    n = count_targets(b).float()  # training losses (with gradients: under no_grad the head gives per-token losses)
    plain_on = TokenLoss(on, "plain").training_loss(on, b, n).detach()
    chunked_on = TokenLoss(on, "chunked").training_loss(on, b, n).detach()
    chunked_off = TokenLoss(off, "chunked").training_loss(off, b, n).detach()
    torch.testing.assert_close(chunked_on, plain_on, rtol=1e-5, atol=1e-6)  # transformers' loss, router term in
    torch.testing.assert_close(chunked_on - chunked_off, 0.5 * aux, rtol=1e-4, atol=1e-6)  # same weights: only it


def test_a_dense_model_with_a_router_coefficient_is_one_line(tiny_model_dir):
    with pytest.raises(DisttrainError, match=r"model.router_aux_loss_coef: .* is not a mixture of experts"):
        load_model(ModelSection(name_or_path=str(tiny_model_dir), dtype="float32", router_aux_loss_coef=0.01), None)


def test_lora_on_the_fused_experts_trains_them_and_the_chunked_loss_is_the_models(tiny_moe_dir):
    spec = ModelSection(name_or_path=str(tiny_moe_dir), dtype="float32", router_aux_loss_coef=0.5)
    lora = LoraSection(r=4, alpha=8, dropout=0.0, target_modules=["q_proj", "v_proj"], target_parameters=EXPERTS,
                       init_lora_weights=False)  # random B: the adapters change the output, so gradients flow
    model = load_model(spec, lora)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert any("experts" in n for n in trainable) and any("q_proj" in n for n in trainable)
    assert all("lora_" in n for n in trainable)  # the fused expert weights themselves stay frozen
    b = batch()
    chunked, plain = loss_and_grads(model, "chunked", b), loss_and_grads(model, "plain", b)
    assert_same_loss_and_grads(chunked, plain, rtol=1e-4, atol=1e-6)
    assert any("experts" in name and grad.abs().sum() > 0 for name, grad in chunked[1].items())
    # FLOPs: the adapters are not base matmul weights; the experts still count at their routed share
    base = load_model(ModelSection(name_or_path=str(tiny_moe_dir), dtype="float32"), None)
    assert shape_from_model(model, model.config).matmul_params == shape_from_model(base, base.config).matmul_params
