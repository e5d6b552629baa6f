"""Mixture of experts as a family of its own (tiny Qwen3-MoE, in one process): the router's load-balancing
loss turned on from the recipe and added as transformers adds it, refused in one line for a dense model; LoRA
on the experts' fused 3-D weights (peft's target_parameters) trains them, with the chunked loss equal to the
model's own; FLOPs count the routed experts' active share (tests/test_cost_and_flops.py has the totals); the router
loss over every rank's micro-batch together (model.router_balance: global) is transformers' own on one process and,
split over two simulated ranks, averages to the one-process loss and gradients of all the rows."""

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


def test_the_global_router_balance_is_transformers_loss_and_two_ranks_average_to_one_process(tiny_moe_dir,
                                                                                             monkeypatch):
    """model.router_balance=global. One process: the loss and gradients equal transformers' router loss (padding
    masked). Two ranks (rows 0-1 and row 2, padded apart; the all-reduce replaced by the other rank's counts): the
    mean of their terms and of their gradients, as DDP averages them, is the router loss of all three rows in one
    forward -- transformers' per-rank loss is not."""
    from disttrain.objectives.router_balance import GlobalRouterBalance, switch_terms

    model = load_model(ModelSection(name_or_path=str(tiny_moe_dir), dtype="float32", router_aux_loss_coef=1.0), None)
    balance = GlobalRouterBalance((model.config.num_experts, model.config.num_experts_per_tok))
    whole = batch()
    rows = [{"input_ids": r[m.bool()].tolist(), "labels": r[m.bool()].tolist()}
            for r, m in zip(whole["input_ids"], whole["attention_mask"])]
    halves = [Collator(0)(rows[:2]), Collator(0)(rows[2:])]
    params = [p for p in model.parameters() if p.requires_grad]

    def term(b, ranks_terms=None):
        out = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"])
        ours = balance.loss(out, b["attention_mask"], across_ranks=ranks_terms is not None)
        return ours, out.aux_loss, torch.autograd.grad(ours, params, allow_unused=True)

    ours, theirs, _ = term(whole)
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7)  # one process: transformers' own loss
    expected = torch.autograd.grad(model(**{k: whole[k] for k in ("input_ids", "attention_mask")}).aux_loss,
                                   params, allow_unused=True)

    with torch.no_grad():
        counted = []
        for half in halves:
            out = model(input_ids=half["input_ids"], attention_mask=half["attention_mask"])
            counts, _, n = switch_terms(out.router_logits, balance.experts, balance.top_k, half["attention_mask"])
            counted.append(torch.cat([counts, n.reshape(1)]))
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
    per_rank, grads, local = [], [], []
    for rank, half in enumerate(halves):
        monkeypatch.setattr(torch.distributed, "all_reduce",
                            lambda t, *a, other=counted[1 - rank], **k: t.add_(other))
        value, transformers_value, grad = term(half, ranks_terms=True)
        per_rank.append(value), grads.append(grad), local.append(transformers_value)
    torch.testing.assert_close((per_rank[0] + per_rank[1]) / 2, theirs, rtol=1e-5, atol=1e-7)
    assert abs(float((local[0] + local[1]).detach() / 2 - theirs)) > 1e-4  # the per-rank loss is another loss
    for a, b, want in zip(*grads, expected):
        if want is not None:
            torch.testing.assert_close((a + b) / 2, want, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_the_global_router_balance_is_the_other_families_own_loss_on_one_process(family):
    """The same computation equals Mixtral's and Qwen2-MoE's own router loss (their load_balancing_loss_func,
    padding masked), each a tiny random model of the family's real configuration class."""
    from transformers import MixtralConfig, MixtralForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM

    from disttrain.objectives.router_balance import GlobalRouterBalance

    shape = dict(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, output_router_logits=True, router_aux_loss_coef=1.0)
    torch.manual_seed(0)
    if family == "mixtral":
        model = MixtralForCausalLM(MixtralConfig(num_local_experts=4, num_experts_per_tok=2, **shape))
    else:
        model = Qwen2MoeForCausalLM(Qwen2MoeConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                                   shared_expert_intermediate_size=32, **shape))
    b = batch()
    out = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"])
    ours = GlobalRouterBalance((4, 2)).loss(out, b["attention_mask"], across_ranks=False)
    torch.testing.assert_close(ours, out.aux_loss.float(), rtol=1e-5, atol=1e-7)


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
