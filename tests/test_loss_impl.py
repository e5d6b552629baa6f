"""training.loss_impl: chunked (the default) gives transformers' plain loss and gradients without ever
holding full-vocabulary logits. fp32, tiny model, several chunks per micro-batch (the chunk size is shrunk
so the tiny vocabulary still needs many)."""

import copy

import pytest
import torch

import tests_support

from disttrain.objectives import token_loss as loss_module
from disttrain.recipe.schema import LoraSection, ModelSection
from disttrain.data import Collator, count_targets, pack_rows, with_shift_labels
from disttrain.objectives.token_loss import TokenLoss
from disttrain.model.loading import load_model


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    monkeypatch.setattr(loss_module, "CHUNK_LOGITS", 7 * 512)  # 7 tokens per chunk at the tiny vocabulary


def batches(tokenizer):
    texts = ["apple river stone cloud green", "quick light", "stone apple river", "cloud river green quick stone"]
    rows = []
    for t in texts:
        ids = tokenizer(t)["input_ids"]
        rows.append({"input_ids": ids, "labels": [-100] * 2 + ids[2:]})  # a masked prompt, like SFT
    packed = pack_rows([r["input_ids"] for r in rows], [r["labels"] for r in rows], max_len=12)
    packed_rows = [{k: v[i] for k, v in packed.items()} for i in range(len(packed["input_ids"]))]
    return {"unpacked": Collator(tokenizer.pad_token_id)(rows),
            "packed": Collator(tokenizer.pad_token_id)(packed_rows),
            "flattened": Collator(tokenizer.pad_token_id, flatten_packed=True)(packed_rows)}


def loss_and_grads(model, impl, batch):
    return tests_support.loss_and_grads(model, impl, batch)[:3]


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("layout", ["unpacked", "packed", "flattened"])
@pytest.mark.parametrize("engine", ["chunked", "trl"])  # ours, and TRL's fused head (the comparison's bar)
def test_chunked_loss_and_gradients_equal_the_plain_ones(engine, lora, layout, tiny_model_dir, tokenizer):
    spec = ModelSection(name_or_path=str(tiny_model_dir), dtype="float32")
    lora_spec = LoraSection(r=4, alpha=8, dropout=0.0, target_modules=["q_proj", "v_proj"]) if lora else None
    torch.manual_seed(0)
    plain_model = load_model(spec, lora_spec)
    chunked_model = copy.deepcopy(plain_model)
    batch = batches(tokenizer)[layout]
    plain = loss_and_grads(plain_model, "plain", batch)
    chunked = loss_and_grads(chunked_model, engine, batch)
    tests_support.assert_same_loss_and_grads(chunked, plain, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(chunked[2], plain[2], rtol=1e-5, atol=1e-6)  # evaluation's per-token losses
    # the checkpoint/export path is untouched: same parameter names, plain logits when no targets are set
    assert chunked_model.state_dict().keys() == plain_model.state_dict().keys()
    inputs = {"input_ids": batch["input_ids"][:1]}
    torch.testing.assert_close(chunked_model(**inputs).logits, plain_model(**inputs).logits)


@pytest.mark.parametrize("engine", ["chunked", "trl"])
def test_bf16_autocast_stays_close_to_plain(engine, tiny_model_dir, tokenizer):
    spec = ModelSection(name_or_path=str(tiny_model_dir), dtype="float32")
    model = load_model(spec, None)
    batch = batches(tokenizer)["packed"]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain = TokenLoss(copy.deepcopy(model), "plain").training_loss(model, batch, count_targets(batch).float())
        token_loss = TokenLoss(model, engine)
        chunked = token_loss.training_loss(model, batch, count_targets(batch).float())
    assert chunked.dtype == torch.float32
    torch.testing.assert_close(chunked, plain, rtol=2e-2, atol=2e-2)


def test_no_target_in_a_micro_batch_still_gives_every_parameter_a_gradient(tiny_model_dir, tokenizer):
    """DDP needs a gradient (zero) for every parameter even when a micro-batch has nothing to learn."""
    model = load_model(ModelSection(name_or_path=str(tiny_model_dir), dtype="float32"), None)
    batch = Collator(tokenizer.pad_token_id)([{"input_ids": [5, 6, 7], "labels": [-100, -100, -100]}])
    loss = TokenLoss(model, "chunked").training_loss(model, batch, torch.tensor(1.0))
    loss.backward()
    assert float(loss) == 0.0
    assert model.lm_head.weight.grad is not None and float(model.lm_head.weight.grad.abs().sum()) == 0.0


@pytest.mark.parametrize("layout", ["unpacked", "flattened"])
@pytest.mark.parametrize("engine", ["chunked", "plain", "trl"])
def test_pre_shifted_labels_give_the_same_loss_gradients_and_evaluation(engine, layout, tiny_model_dir, tokenizer):
    """A batch that carries `shift_labels` (position t's target, set before a sequence is split across ranks
    under context parallelism) trains and evaluates exactly like the same batch shifted inside the loss."""
    model = load_model(ModelSection(name_or_path=str(tiny_model_dir), dtype="float32"), None)
    batch = batches(tokenizer)[layout]
    shifted = with_shift_labels(batch)
    assert int(count_targets(shifted)) == int(count_targets(batch)) > 0
    models = copy.deepcopy(model), copy.deepcopy(model)
    inside = tests_support.loss_and_grads(models[0], engine, batch)
    before = tests_support.loss_and_grads(models[1], engine, shifted)
    tests_support.assert_same_loss_and_grads(before, inside, rtol=1e-6, atol=1e-7)
    assert before[2].shape == shifted["shift_labels"].shape  # one loss per position
    torch.testing.assert_close(before[2][:, :-1], inside[2], rtol=1e-6, atol=1e-7)
    assert float(before[2][:, -1].abs().sum()) == 0.0
    torch.testing.assert_close(before[3].eval_rows(models[1], shifted), inside[3].eval_rows(models[0], batch))


def test_a_sequence_split_after_shifting_keeps_every_target(tiny_model_dir, tokenizer):
    """Context parallelism splits each sequence across ranks. Shifted before the split, the shards' losses
    add up to the whole sequence's; shifted inside each shard (the control), the target at every shard
    boundary is lost -- exactly that token's loss is missing."""
    model = load_model(ModelSection(name_or_path=str(tiny_model_dir), dtype="float32"), None)
    batch = batches(tokenizer)["unpacked"]
    with torch.no_grad():
        hidden = model.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
    head, labels = model.lm_head, batch["labels"]
    shift = with_shift_labels(batch)["shift_labels"]
    whole = loss_module.chunked_loss_sum(hidden, head, labels)
    cuts = [0, 3, 5, labels.shape[1]]  # three shards of unequal length
    shards = list(zip(cuts, cuts[1:]))
    before = sum(loss_module.chunked_loss_sum(hidden[:, a:b], head, shift[:, a:b], shifted=True) for a, b in shards)
    after = sum(loss_module.chunked_loss_sum(hidden[:, a:b], head, labels[:, a:b]) for a, b in shards)
    torch.testing.assert_close(before, whole, rtol=1e-6, atol=1e-6)
    per_token = loss_module.chunked_token_losses(hidden, head, labels)
    lost = sum(per_token[:, b - 1].sum() for _, b in shards[:-1])  # position b-1 predicts labels[:, b]
    assert float(lost) > 0
    torch.testing.assert_close(after, whole - lost, rtol=1e-6, atol=1e-6)
