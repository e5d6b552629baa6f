"""The LR schedules equal transformers' get_scheduler step for step (disttrain builds them without importing
transformers.optimization, which pulls in peft at every rank's start-up), including after a state round trip."""

import pytest
import torch

from disttrain.recipe.schema import TrainingSection
from disttrain.training.optim import SCHEDULES, build_scheduler


def lrs(scheduler, optimizer, steps):
    out = []
    for _ in range(steps):
        optimizer.step()
        scheduler.step()
        out.append(scheduler.get_last_lr()[0])
    return out


@pytest.mark.parametrize("name", sorted(SCHEDULES))
@pytest.mark.parametrize("warmup, total", [(0, 10), (3, 12), (5, 5), (2, 40)])
def test_schedule_equals_transformers(name, warmup, total):
    from transformers import get_scheduler

    cfg = TrainingSection(lr_scheduler=name, warmup_steps=warmup, lr=3e-3)
    ours_opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=3e-3)
    theirs_opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=3e-3)
    ours = build_scheduler(ours_opt, cfg, total)
    theirs = get_scheduler(name, theirs_opt, num_warmup_steps=warmup, num_training_steps=total)
    assert ours.get_last_lr() == pytest.approx(theirs.get_last_lr(), abs=1e-15)
    assert lrs(ours, ours_opt, total + 3) == pytest.approx(lrs(theirs, theirs_opt, total + 3), abs=1e-15)


def test_schedule_state_round_trips():
    cfg = TrainingSection(lr_scheduler="cosine", warmup_steps=2, lr=1e-3)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
    first = build_scheduler(opt, cfg, 10)
    lrs(first, opt, 4)
    opt2 = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
    second = build_scheduler(opt2, cfg, 10)
    second.load_state_dict(first.state_dict())
    opt2.load_state_dict(opt.state_dict())
    assert lrs(second, opt2, 6) == pytest.approx(lrs(first, opt, 6), abs=1e-15)
