"""The chunked loss equals the model's own loss -- transformers' forward with labels -- for the families users
bring, not only the tiny Llama: logit scaling (Granite divides by `logits_scaling`, Cohere multiplies by
`logit_scale`), final-logit softcapping (Gemma 2), the MoE load-balancing loss (Qwen3-MoE, Mixtral with
`output_router_logits`), and plain ones (Qwen2, Phi-3). Loss, every gradient and evaluation's per-token
losses, in fp32, full fine-tuning, unpacked and packed. A family the chunked path does not know is stopped
by the start-up self-check in one line."""

import copy
import types

import pytest
import torch

from disttrain.objectives import token_loss as loss_module
from disttrain.data import Collator, count_targets, pack_rows
from disttrain.errors import DisttrainError
from disttrain.objectives.token_loss import TokenLoss
from tests_support import assert_same_loss_and_grads, loss_and_grads

SMALL = dict(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, output_router_logits=True,
           router_aux_loss_coef=1.0)  # a coefficient of 1 so that the load-balancing loss shows

FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {}),
    "granite": ("GraniteConfig", "GraniteForCausalLM", {"logits_scaling": 16.0}),
    "cohere": ("CohereConfig", "CohereForCausalLM", {"logit_scale": 0.25}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"final_logit_softcapping": 0.5, "head_dim": 8}),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {**MOE, "head_dim": 8}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2,
                                                        "output_router_logits": True, "router_aux_loss_coef": 1.0}),
}


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    monkeypatch.setattr(loss_module, "CHUNK_LOGITS", 5 * 128)  # 5 tokens per chunk: several chunks per batch


def tiny(family: str):
    import transformers

    config_name, model_name, extra = FAMILIES[family]
    config = getattr(transformers, config_name)(**SMALL, **extra)
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(config).float()
    with torch.no_grad():  # larger logits than a fresh init, so that scaling and capping change the loss
        model.get_output_embeddings().weight.mul_(40)
    return model


def batches():
    g = torch.Generator().manual_seed(1)
    rows = [torch.randint(1, 128, (n,), generator=g).tolist() for n in (11, 7, 9, 5)]
    rows = [{"input_ids": r, "labels": [-100] * 2 + r[2:]} for r in rows]
    packed = pack_rows([r["input_ids"] for r in rows], [r["labels"] for r in rows], max_len=20)
    packed_rows = [{k: v[i] for k, v in packed.items()} for i in range(len(packed["input_ids"]))]
    return {"unpacked": Collator(0)(rows), "packed": Collator(0)(packed_rows)}


@pytest.mark.parametrize("layout", ["unpacked", "packed"])
@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("engine", ["chunked", "trl"])  # ours, and TRL's fused head (the comparison's bar)
def test_chunked_loss_equals_the_models_own_loss_and_gradients(engine, family, layout):
    plain_model = tiny(family)
    chunked_model = copy.deepcopy(plain_model)
    batch = batches()[layout]
    plain = loss_and_grads(plain_model, "plain", batch)
    chunked = loss_and_grads(chunked_model, engine, batch)
    assert_same_loss_and_grads(chunked, plain, rtol=1e-5, atol=1e-5, grad_rtol=1e-4)
    if "router_aux_loss_coef" not in FAMILIES[family][2]:  # evaluation: the token losses alone
        torch.testing.assert_close(chunked[2], plain[2], rtol=1e-5, atol=1e-5)
    # the model's own transform is back in place after every chunked forward (exports and samples use it)
    assert chunked_model.config.to_dict() == plain_model.config.to_dict()
    inputs = {"input_ids": batch["input_ids"][:1]}
    torch.testing.assert_close(chunked_model(**inputs).logits, plain_model(**inputs).logits)
    chunked[3].check_against_model(OneRank(), chunked_model, batch)  # the start-up self-check passes


def test_the_transforms_change_the_loss_so_the_equality_proves_something():
    batch = batches()["unpacked"]
    values = {}
    for family in ("granite", "gemma2", "qwen3_moe"):
        model = tiny(family)
        values[family] = float(TokenLoss(model, "plain").training_loss(model, batch, count_targets(batch).float()))
        if family == "qwen3_moe":
            model.config.output_router_logits = False
        else:
            setattr(model.config, "logits_scaling" if family == "granite" else "final_logit_softcapping",
                    1.0 if family == "granite" else None)
        without = float(TokenLoss(model, "plain").training_loss(model, batch, count_targets(batch).float()))
        assert abs(values[family] - without) > 0.05 * without, family


class OneRank:
    """The accelerator calls the self-check makes, for one process."""

    @staticmethod
    def reduce(tensor, reduction="sum"):
        return tensor


def test_the_self_check_stops_a_family_the_chunked_path_does_not_know():
    """A causal LM that transforms its logits in a way disttrain does not apply: the first micro-batch says
    so in one line, naming training.loss_impl=plain, instead of training on a wrong loss."""
    model = tiny("llama")
    original = type(model).forward

    def forward(self, *args, labels=None, **kwargs):  # an unknown family: logits * 3 before the loss
        out = original(self, *args, **kwargs)
        out.logits = out.logits * 3
        if labels is not None:
            out.loss = self.loss_function(out.logits, labels, self.config.vocab_size)
        return out

    model.forward = types.MethodType(forward, model)
    token_loss = TokenLoss(model, "chunked")
    with pytest.raises(DisttrainError) as error:
        token_loss.check_against_model(OneRank(), model, batches()["packed"])
    message = str(error.value)
    assert message.startswith("training.loss_impl=chunked: on the first micro-batch the chunked loss is")
    assert "set training.loss_impl=plain" in message and "\n" not in message
    assert model.training  # the check ran in eval mode and put the model back


def test_low_precision_weight_gradients_neither_overflow_nor_carry_a_rounded_scale():
    """fp16 weights: the weight's gradient is a sum over every target token until the backward scales it; a
    frequent target over a long batch (70,000 tokens here) passed fp16's 65,504 and became inf. bf16: the
    scale factor (1/3 here) was rounded to bf16 before multiplying, biasing every gradient by 0.2 %."""
    from disttrain.objectives.token_loss import _ChunkedCrossEntropySum

    torch.manual_seed(0)
    for dtype, tokens, factor in ((torch.float16, 70_000, 1 / 70_000), (torch.bfloat16, 600, 1 / 3)):
        hidden = (torch.randn(tokens, 16).abs() + 1).to(dtype)
        weight = (torch.randn(8, 16) * 0.1).to(dtype).requires_grad_()
        targets = torch.zeros(tokens, dtype=torch.long)  # every token the same target
        total = _ChunkedCrossEntropySum.apply(hidden, weight, None, targets, dtype, None, None)
        (total * factor).backward()
        reference = weight.detach().float().requires_grad_()
        logits = hidden.float() @ reference.t()
        (torch.nn.functional.cross_entropy(logits, targets, reduction="sum") * factor).backward()
        assert weight.grad.dtype == dtype and torch.isfinite(weight.grad).all(), dtype
        ratio = (weight.grad.float() / reference.grad).mean()
        assert abs(float(ratio) - 1) < 5e-4, (dtype, float(ratio))  # no systematic bias
