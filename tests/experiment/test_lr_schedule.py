"""Learning-rate schedules: the factor per step, and the plugin restarting them every experience."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from cl_streamkl.experiment.lr_schedule import LRSchedulePlugin, lr_factor


def test_constant_stays_and_cosine_falls_to_near_zero():
    assert [lr_factor("constant", step, 10) for step in range(10)] == [1.0] * 10
    cosine = [lr_factor("cosine", step, 10) for step in range(10)]
    assert cosine[0] == 1.0 and cosine[5] == pytest.approx(0.5)
    assert all(a > b for a, b in zip(cosine, cosine[1:])) and 0 < cosine[-1] < 0.03


def test_warmup_rises_linearly_then_the_schedule_runs_over_the_rest():
    assert [lr_factor("constant", step, 8, warmup_steps=4) for step in range(8)] == [
        0.25, 0.5, 0.75, 1.0, 1.0, 1.0, 1.0, 1.0]
    after = [lr_factor("cosine", step, 8, warmup_steps=4) for step in range(4, 8)]
    assert after == pytest.approx([0.5 * (1 + math.cos(math.pi * i / 4)) for i in range(4)])


@pytest.mark.parametrize("args, match", [
    (("linear", 0, 10), "must be one of"),
    (("cosine", 10, 10), "within 10 steps"),
    (("cosine", 0, 10, 11), "within 10 steps"),
])
def test_bad_schedule_arguments(args, match):
    with pytest.raises(ValueError, match=match):
        lr_factor(*args)


def test_plugin_sets_the_rate_per_iteration_and_restarts_each_experience():
    parameter = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.Adam([parameter], lr=1.0)
    strategy = SimpleNamespace(dataloader=[None] * 3, train_epochs=2, optimizer=optimizer,
                               clock=SimpleNamespace(train_exp_iterations=0))
    plugin = LRSchedulePlugin("cosine", base_lr=0.1, warmup_epochs=1)
    for _ in range(2):  # two experiences
        plugin.before_training_exp(strategy)
        rates = []
        for step in range(6):
            strategy.clock.train_exp_iterations = step
            plugin.before_training_iteration(strategy)
            rates.append(optimizer.param_groups[0]["lr"])
        assert rates[:3] == pytest.approx([0.1 / 3, 0.2 / 3, 0.1])
        assert rates[3:] == pytest.approx([0.1 * lr_factor("cosine", step, 6, 3) for step in range(3, 6)])
