"""One call for the framework-free penalty (the capture whole, both log-sum-exps by default), and a
penalty a user sees: its share of the loss, the metric, the warning when it barely acts."""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import pytest
import torch
from strategy_helpers import IMAGE, perturb, tiny_model

from cl_streamkl.strategies import AttentionDistiller, StreamKLPlugin, streamkl_penalty_metrics
from cl_streamkl.strategies import distiller as distiller_module


def test_forward_returns_the_output_and_the_penalty_with_the_captures_lse(monkeypatch) -> None:
    model = tiny_model(depth=2)
    distiller = AttentionDistiller(alpha=0.5, backend="torch")
    distiller.update_teacher(model)
    perturb(model)
    x = torch.randn(2, *IMAGE)
    handed = []
    known = distiller_module.known_lse
    monkeypatch.setattr(distiller_module, "known_lse",
                        lambda t, problems, student, teacher: handed.append(student) or known(t, problems, student,
                                                                                               teacher))
    output, penalty = distiller.forward(model, x)
    torch.testing.assert_close(output, model(x))
    assert penalty.item() > 0 and penalty.requires_grad
    assert handed and all(lse is not None for lse in handed[0])  # the student's LSEs reach the choice
    with distiller.student_capture(model) as capture:
        model(x)
    torch.testing.assert_close(distiller.penalty(x, capture), penalty)


def test_penalty_refuses_the_old_parallel_lists_in_one_line() -> None:
    model = tiny_model(depth=2)
    distiller = AttentionDistiller(backend="torch")
    distiller.update_teacher(model)
    x = torch.randn(1, *IMAGE)
    with distiller.student_capture(model) as capture:
        model(x)
    with pytest.raises(TypeError, match="capture must be the QKCapture of student_capture"):
        distiller.penalty(x, capture.qk)


def plugin_step(alpha: float, loss: float) -> tuple[StreamKLPlugin, SimpleNamespace]:
    """A plugin with a teacher, one forward of a perturbed student and its penalty added to ``loss``."""
    model = tiny_model(depth=2)
    plugin = StreamKLPlugin(alpha=alpha, backend="torch")
    strategy = SimpleNamespace(model=model, mb_x=torch.randn(2, *IMAGE), loss=torch.tensor(loss),
                               experience=SimpleNamespace(current_experience=1))
    plugin.before_training(strategy)
    plugin.after_training_exp(strategy)  # the teacher
    perturb(model)
    plugin.before_training_exp(strategy)
    plugin.before_forward(strategy)
    model(strategy.mb_x)
    plugin.after_forward(strategy)
    plugin.before_backward(strategy)
    return plugin, strategy


def test_last_share_is_the_penalty_over_the_loss_it_was_added_to() -> None:
    plugin, strategy = plugin_step(alpha=3.0, loss=2.0)
    assert plugin.last_penalty > 0
    assert plugin.last_share == pytest.approx(plugin.last_penalty / 2.0)
    assert float(strategy.loss) == pytest.approx(2.0 + plugin.last_penalty)


def test_a_penalty_below_one_percent_of_the_loss_all_experience_warns_once() -> None:
    plugin, strategy = plugin_step(alpha=1e-6, loss=2.0)
    # The stream's second experience, numbered as Avalanche numbers it (the command line shows "exp 2/3").
    quiet = r"alpha × penalty stayed below 1% of the loss through experience 1 \(counted from 0, .* alpha=1e-06"
    with pytest.warns(RuntimeWarning, match=quiet) as caught:
        plugin.after_training_exp(strategy)
    assert len(caught) == 1 and "\n" not in str(caught[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plugin.before_training_exp(strategy)
        plugin.before_forward(strategy)
        strategy.model(strategy.mb_x)
        plugin.after_forward(strategy)
        plugin.before_backward(strategy)
        plugin.after_training_exp(strategy)  # once per plugin
    loud, strategy = plugin_step(alpha=1e4, loss=2.0)
    assert loud.last_share > 0.01
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loud.after_training_exp(strategy)


def test_the_metrics_report_the_share_next_to_the_penalty() -> None:
    names = [str(metric) for metric in streamkl_penalty_metrics(minibatch=True, epoch=True)]
    assert names == ["StreamKL_Penalty_MB", "StreamKL_Penalty_Epoch", "StreamKL_PenaltyShare_MB",
                     "StreamKL_PenaltyShare_Epoch"]
    assert [str(m) for m in streamkl_penalty_metrics(share=False)] == ["StreamKL_Penalty_Epoch"]
