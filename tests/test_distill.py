"""Distillation (training.objective: distill): the chunked generalised JSD against TRL's generalized_jsd_loss (loss
and gradients), the teacher's checks before any weight loads, the recipe's refusals."""

from __future__ import annotations

import os

import pytest
import torch

from disttrain.objectives import distill
from disttrain.objectives.token_loss import LogitTransform

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")


def trl_jsd():
    from trl.experimental.gkd import GKDTrainer

    return GKDTrainer.generalized_jsd_loss


def _inputs(vocab=37, teacher_vocab=None, hidden=8, rows=3, seq=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    student_hidden = torch.randn(rows, seq, hidden, generator=g, dtype=torch.float64).float()
    teacher_hidden = torch.randn(rows, seq, hidden + 4, generator=g).float()
    weight = torch.randn(vocab, hidden, generator=g) * 0.7
    teacher_weight = torch.randn(teacher_vocab or vocab, hidden + 4, generator=g) * 0.9
    labels = torch.randint(0, vocab, (rows, seq), generator=g)
    labels[0, :3] = -100  # a prompt
    labels[2, 5:] = -100  # padding
    return student_hidden, teacher_hidden, weight, teacher_weight, labels


def _ours(student_hidden, teacher_hidden, weight, teacher_weight, labels, beta, temperature, vocab):
    hidden = student_hidden.clone().requires_grad_()
    head = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    head.weight.data.copy_(weight)
    stats = torch.zeros(2)
    transforms = (LogitTransform(temperature=temperature), LogitTransform(temperature=temperature))
    total = distill.divergence_sum(hidden, head, teacher_hidden, (teacher_weight, None), labels, beta, transforms,
                                   vocab, stats)
    tokens = (labels[:, 1:] != -100).sum()
    (total / tokens).backward()
    return total / tokens, hidden.grad, head.weight.grad, stats


def _theirs(student_hidden, teacher_hidden, weight, teacher_weight, labels, beta, temperature, vocab):
    hidden = student_hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    student_logits = (hidden @ w.t())[:, :-1, :vocab]
    teacher_logits = (teacher_hidden @ teacher_weight.t())[:, :-1, :vocab]
    loss = trl_jsd()(student_logits, teacher_logits, labels=labels[:, 1:], beta=beta, temperature=temperature)
    loss.backward()
    return loss, hidden.grad, w.grad


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0, 0.2])
@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_the_chunked_divergence_equals_trls_generalised_jsd_loss_and_gradients(beta, temperature, monkeypatch):
    monkeypatch.setattr(distill, "CHUNK_LOGITS", 6 * 37 * 5)  # 5 tokens a chunk: several chunks and a partial one
    inputs = _inputs()
    loss, grad_hidden, grad_weight, _ = _ours(*inputs, beta, temperature, 37)
    ref_loss, ref_hidden, ref_weight = _theirs(*inputs, beta, temperature, 37)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad_hidden, ref_hidden, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(grad_weight, ref_weight, rtol=1e-4, atol=1e-6)


def test_vocabularies_of_different_widths_are_compared_over_their_common_columns():
    """A teacher whose embedding is padded wider (Qwen2.5-7B's 152,064 rows beside 0.5B's 151,936): the
    divergence over the first columns, as TRL's on logits cut to them."""
    inputs = _inputs(vocab=40, teacher_vocab=48)
    loss, grad_hidden, _, _ = _ours(*inputs, 0.5, 1.0, 37)
    ref_loss, ref_hidden, _ = _theirs(*inputs, 0.5, 1.0, 37)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad_hidden, ref_hidden, rtol=1e-4, atol=1e-6)


def test_the_logged_log_probs_are_each_models_log_probs_of_the_tokens_trained_on():
    student_hidden, teacher_hidden, weight, teacher_weight, labels = _inputs()
    _, _, _, stats = _ours(student_hidden, teacher_hidden, weight, teacher_weight, labels, 0.5, 1.0, 37)
    targets = labels[:, 1:]
    mask = targets != -100
    for logits, total in ((student_hidden @ weight.t(), stats[0]), (teacher_hidden @ teacher_weight.t(), stats[1])):
        logps = torch.log_softmax(logits[:, :-1], -1).gather(-1, targets.clamp(min=0)[..., None])[..., 0]
        torch.testing.assert_close(total, logps[mask].sum(), rtol=1e-5, atol=1e-5)


def test_identical_models_have_no_divergence_and_no_gradient():
    student_hidden, _, weight, _, labels = _inputs()
    loss, grad_hidden, _, _ = _ours(student_hidden, student_hidden, weight, weight, labels, 0.5, 1.0, 37)
    assert abs(float(loss.detach())) < 1e-6
    assert float(grad_hidden.abs().max()) < 1e-6


# ---- before anything loads ----

def _recipe(tmp_path, tiny_model_dir, *overrides):
    from conftest import REPO, base_recipe, write_recipe
    from disttrain.recipe.schema import load_recipe

    recipe = base_recipe(tiny_model_dir, tmp_path / "out", training={"objective": "distill"},
                         distill={"teacher": str(tiny_model_dir)},
                         data={"path": str(REPO / "data/tiny_prompts.jsonl"), "format": "prompt"})
    return load_recipe(str(write_recipe(tmp_path / "r.yaml", recipe)), list(overrides))


@pytest.mark.parametrize("overrides, says", [
    (("distill.lmbda=1.5",), "distill.lmbda"),
    (("distill.lmbda=0.5",), "data.format: prompt has no completions to distil on: set distill.lmbda: 1"),
    (("distill.lmbda=1", "data.packing=true"), "data.packing, concat_and_chunk and streaming are not supported"),
    (("distill.lmbda=1", "distill.teacher=null"), "training.objective: distill needs distill.teacher"),
    (("distill.lmbda=1", "training.loss_impl=plain"), "computes its divergence with the chunked loss"),
])
def test_bad_distillation_recipes_stop_in_one_line(tmp_path, tiny_model_dir, overrides, says):
    from disttrain.errors import RecipeError

    with pytest.raises(RecipeError) as info:
        _recipe(tmp_path, tiny_model_dir, *overrides)
    assert says in str(info.value) and "\n" not in str(info.value)


def test_a_teacher_with_another_tokenizer_or_none_at_all_is_refused_before_any_weight_loads(tmp_path, tiny_model_dir,
                                                                                            tokenizer):
    import shutil

    from disttrain.errors import DisttrainError
    from disttrain.tools.tiny import build_tokenizer

    other = tmp_path / "other-teacher"
    other.mkdir()
    shutil.copy(tiny_model_dir / "config.json", other / "config.json")  # no weights: only read if the check passes
    build_tokenizer(["completely different words here", "and nothing else"]).save_pretrained(other)
    recipe = _recipe(tmp_path, tiny_model_dir, "distill.lmbda=1", f"distill.teacher={other}")
    with pytest.raises(DisttrainError) as info:
        distill.Distill(recipe).model_kwargs(tokenizer)
    said = str(info.value)
    assert f"{other}'s tokenizer" in said and str(tiny_model_dir) in said and "share one tokenizer" in said
    missing = _recipe(tmp_path, tiny_model_dir, "distill.lmbda=1", f"distill.teacher={tmp_path / 'nowhere'}")
    with pytest.raises(DisttrainError, match="cannot be loaded"):
        distill.Distill(missing).model_kwargs(tokenizer)
    assert distill.Distill(_recipe(tmp_path, tiny_model_dir, "distill.lmbda=1")).model_kwargs(tokenizer) == {}


@pytest.mark.parametrize("lmbda", [0.0, 0.3, 1.0])
def test_the_on_policy_steps_are_a_lmbda_share_drawn_from_the_seed(tmp_path, tiny_model_dir, lmbda):
    recipe = _recipe(tmp_path, tiny_model_dir, f"distill.lmbda={lmbda}", "distill.seq_kd=true")
    sources = [distill.Distill(recipe).source(step) for step in range(2000)]
    assert sources == [distill.Distill(recipe).source(step) for step in range(2000)]  # no process state
    assert sources.count("student") / 2000 == pytest.approx(lmbda, abs=0.03)
    assert set(sources) - {"student"} <= {"teacher"}  # seq_kd: the other steps sample from the teacher


# ---- through the objective's own pieces, on models of the families users bring ----

@pytest.mark.parametrize("teacher_family, student_family", [("gemma2", "granite"), ("granite", "cohere"),
                                                            ("qwen3_moe", "gemma2"), ("llama", "qwen2")])
@pytest.mark.parametrize("beta", [0.0, 0.5])
def test_the_objectives_loss_equals_trls_on_the_models_own_logits_across_families(teacher_family, student_family,
                                                                                   beta, monkeypatch):
    """The teacher's head returning its hidden states, the student's chunked head, each family's own logit
    transform (Gemma 2's softcapping, Granite's and Cohere's scaling) applied by the divergence: the loss and the
    student's gradients equal TRL's generalized_jsd_loss on the logits each model's own forward returns."""
    import contextlib
    import copy
    from types import SimpleNamespace

    from test_loss_families import batches, tiny

    monkeypatch.setattr(distill, "CHUNK_LOGITS", 6 * 128 * 5)  # 5 tokens a chunk
    teacher_model, student = tiny(teacher_family).eval(), tiny(student_family)
    with torch.no_grad():  # another teacher than the student's initialisation
        teacher_model.get_output_embeddings().weight.mul_(0.5)
    reference = copy.deepcopy(student)
    batch = batches()["unpacked"]
    cfg = SimpleNamespace(beta=beta, loss_temperature=1.0)
    teacher = distill.Teacher.__new__(distill.Teacher)
    teacher._temperature, teacher._capturing, teacher._hidden = 1.0, False, None
    teacher.accelerator, teacher.model = SimpleNamespace(autocast=contextlib.nullcontext), teacher_model
    teacher._install(teacher_model)
    loss = distill.DistillLoss(student, cfg)
    loss.attach_teacher(teacher, 128)
    tokens = (batch["labels"][:, 1:] != -100).sum()
    ours = loss.training_loss(student, {**batch, distill.SOURCE_KEY: torch.zeros(4, dtype=torch.long)}, tokens)
    ours.backward()

    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    teacher._capturing = False
    with torch.no_grad():
        teacher_logits = teacher_model(**inputs).logits  # its own forward: the head's plain projection, transformed
    theirs = trl_jsd()(reference(**inputs).logits[:, :-1], teacher_logits[:, :-1], labels=batch["labels"][:, 1:],
                       beta=beta)
    theirs.backward()
    torch.testing.assert_close(ours.detach(), theirs.detach(), rtol=1e-5, atol=1e-6)
    for (name, ours_p), theirs_p in zip(student.named_parameters(), reference.parameters()):
        torch.testing.assert_close(ours_p.grad, theirs_p.grad, rtol=1e-4, atol=1e-6, msg=name)
