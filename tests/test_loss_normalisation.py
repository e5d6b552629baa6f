"""The 2024 gradient-accumulation bug: grad_accum=4 x micro_batch=1 must equal micro_batch=4 exactly (fp32),
on sequences of unequal length. Uses the real loop with SGD (Adam would hide a wrong loss scale)."""

import pytest
import torch

from conftest import base_recipe, write_recipe
from disttrain import data
from disttrain.data.feed import LoaderSteps, steps_per_epoch
from disttrain.training import loop
from disttrain.training.hooks import MetricsLine
from disttrain.model import loading as modeling
from disttrain.recipe.schema import load_recipe
from disttrain.objectives.token_loss import TokenLoss
from disttrain.metrics.log import MetricsLogger


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    from accelerate.state import AcceleratorState, GradientState

    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def run(tmp_path, model_dir, micro_batch_size, grad_accum, steps=3, name="run", **training):
    from accelerate.utils import set_seed

    from disttrain.runtime.backends import build_accelerator

    recipe = load_recipe(write_recipe(tmp_path / f"{name}.yaml", base_recipe(
        model_dir, tmp_path / name, data={"shuffle": False},
        training={"micro_batch_size": micro_batch_size, "grad_accum": grad_accum, "max_steps": steps, **training})))
    accelerator = build_accelerator(recipe)
    set_seed(0)
    tokenizer = modeling.load_tokenizer(recipe.model)
    train_set, _, _ = data.build_datasets(recipe.data, tokenizer, 0, accelerator.main_process_first)
    model = modeling.load_model(recipe.model, None)
    token_loss = TokenLoss(model, recipe.training.loss_impl)  # the default: chunked
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    loader = data.make_loader(train_set, micro_batch_size, data.Collator(tokenizer.pad_token_id), False, True)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    (tmp_path / name).mkdir(exist_ok=True)
    records = []
    metrics = MetricsLogger(accelerator, tmp_path / name, steps)
    per_epoch = steps_per_epoch(len(train_set), micro_batch_size, 1, grad_accum)
    run = loop.Run(accelerator, loop.Trainable(model, optimizer, scheduler), token_loss,
                   LoaderSteps(loader, per_epoch, steps), recipe)
    loop.train(run, loop.TrainState(), [MetricsLine(accelerator, token_loss, scheduler, 1, None)],
               lambda rec, step: records.append(rec))
    metrics.close()
    params = {k: v.detach().clone() for k, v in accelerator.unwrap_model(model).named_parameters()}
    return params, [r["loss"] for r in records], train_set


def test_grad_accum_equals_big_batch_on_unequal_lengths(tmp_path, tiny_model_dir):
    big, big_losses, train_set = run(tmp_path, tiny_model_dir, micro_batch_size=4, grad_accum=1, name="big")
    from accelerate.state import AcceleratorState, GradientState
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    accum, accum_losses, _ = run(tmp_path, tiny_model_dir, micro_batch_size=1, grad_accum=4, name="accum")

    lengths = [sum(1 for t in train_set[i]["labels"] if t != -100) for i in range(12)]
    assert len(set(lengths)) > 2, "the test needs unequal target lengths"
    # fp32; the only differences are summation order and padding in the big batch -> 1e-5 relative
    assert accum_losses == pytest.approx(big_losses, rel=1e-5)
    for name, value in big.items():
        torch.testing.assert_close(accum[name], value, rtol=1e-5, atol=1e-6, msg=name)
    assert big_losses[-1] < big_losses[0]


def test_the_test_would_catch_a_mean_of_means(tiny_model_dir, tokenizer):
    """Negative control: on this data, averaging per-micro-batch means gives a clearly different gradient."""
    from transformers import AutoModelForCausalLM

    from disttrain.recipe.schema import DataSection
    from tests_support import alpaca_rows

    section = DataSection(path="x.jsonl", format="alpaca", max_seq_len=64)
    rows = [data.tokenize_record(r, tokenizer, section) for r in alpaca_rows(4)]
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)

    def grads(loss_fn):
        model.zero_grad()
        loss_fn().backward()
        return torch.cat([p.grad.flatten() for p in model.parameters()])

    collate = data.Collator(tokenizer.pad_token_id)
    singles = [collate([r]) for r in rows]
    for b in singles:
        b.pop("num_tokens")
    mean_of_means = grads(lambda: sum(model(**b, use_cache=False).loss for b in singles) / 4)
    total = sum(int(data.count_targets(b)) for b in singles)
    token_mean = grads(lambda: sum(model(**b, use_cache=False, num_items_in_batch=total).loss for b in singles))
    assert (mean_of_means - token_mean).norm() / token_mean.norm() > 1e-2


def test_offloaded_activations_and_plain_loss_give_the_same_steps(tmp_path, tiny_model_dir):
    """training.offload_activations keeps saved activations in host memory: the same steps, bit for bit on
    CPU; training.loss_impl=plain (full logits) the same steps as the default chunked loss, to fp32 rounding."""
    from accelerate.state import AcceleratorState, GradientState

    runs = {}
    for name, training in (("chunked", {}), ("offload", {"offload_activations": True}),
                           ("plain", {"loss_impl": "plain"})):
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
        runs[name] = run(tmp_path, tiny_model_dir, micro_batch_size=2, grad_accum=2, name=name, **training)
    assert runs["offload"][1] == runs["chunked"][1]
    assert runs["plain"][1] == pytest.approx(runs["chunked"][1], rel=1e-5)
    for key, value in runs["chunked"][0].items():
        torch.testing.assert_close(runs["plain"][0][key], value, rtol=1e-4, atol=1e-6, msg=key)
