"""Small helpers shared by tests (not fixtures)."""

import json

from conftest import REPO


def alpaca_rows(n: int) -> list[dict]:
    lines = (REPO / "data/tiny_alpaca.jsonl").read_text().splitlines()[:n]
    return [json.loads(line) for line in lines]


def target_runs(tokenizer, ids, labels) -> list[str]:
    """The targets as runs of consecutive tokens, each decoded: one run per assistant turn (a target's label
    is its token)."""
    from disttrain.data import IGNORE_INDEX

    runs, current = [], []
    for token, label in zip(ids, labels):
        if label != IGNORE_INDEX:
            assert label == token
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    return [tokenizer.decode(r) for r in runs + ([current] if current else [])]


def loss_and_grads(model, impl, batch):
    """(loss, gradients by name, evaluation's per-token losses, the TokenLoss) of one micro-batch."""
    from disttrain.data import count_targets
    from disttrain.objectives.token_loss import TokenLoss

    token_loss = TokenLoss(model, impl)
    model.zero_grad()
    loss = token_loss.training_loss(model, batch, count_targets(batch).float())
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, token_loss.token_losses(model, batch).detach(), token_loss


def assert_same_loss_and_grads(chunked, plain, rtol: float, atol: float, grad_rtol: float | None = None) -> None:
    """loss_and_grads of the chunked and the plain loss: the same loss, the same gradient of every parameter."""
    import torch

    torch.testing.assert_close(chunked[0], plain[0], rtol=rtol, atol=atol)
    assert plain[1].keys() == chunked[1].keys() and len(plain[1]) > 0
    for name, grad in plain[1].items():
        torch.testing.assert_close(chunked[1][name], grad, rtol=grad_rtol or rtol, atol=atol, msg=name)
