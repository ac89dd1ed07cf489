"""Gradients stay right when the autotuner zeroes its reset arguments before a launch.

On the GPU, the first launch of each tuning key runs through ``triton.autotune``, which zeroes
the arguments :func:`~cl_streamkl.kernels.triton.tuning.zeroed_arguments` names (the one-pass
backward's dq sums, the fused forward's row sums) before timing each candidate and again before
the chosen one runs. The
interpreter never autotunes, so each backward launcher here is wrapped to do that zeroing
first: a launcher that passes a live tensor (the log-sum-exps) where the sums go fails.
"""

from __future__ import annotations

import pytest
import torch
from test_attention_kl import make_inputs, rel_err

from cl_streamkl import attention_kl, attention_kl_grouped, attention_kl_reference
from cl_streamkl.kernels.config import kernel_options
from cl_streamkl.kernels.triton import launch
from cl_streamkl.kernels.triton.tuning import zeroed_arguments

BACKWARD_LAUNCHERS = ("BACKWARD_DQ_LAUNCHER", "BACKWARD_DK_LAUNCHER", "FUSED_LAUNCHER",
                      "GROUPED_BACKWARD_DQ_LAUNCHER", "GROUPED_BACKWARD_DK_LAUNCHER", "GROUPED_FUSED_LAUNCHER")


def zeroing_first(launcher):
    """``launcher`` that first zeroes the arguments its autotuner resets, as Triton does."""
    kernel = launcher.untuned
    positions = [kernel.arg_names.index(name) for name in zeroed_arguments(kernel)]

    def run(args, *rest, **kwargs):
        for position in positions:
            args[position].zero_()
        return launcher(args, *rest, **kwargs)

    return run


@pytest.fixture
def autotuner_zeroing(monkeypatch: pytest.MonkeyPatch) -> None:
    # The split dq kernel takes no sums; the key-side and grouped ones do.
    assert zeroed_arguments(launch.BACKWARD_DK_LAUNCHER.untuned) == ["DQ_SUM", "DQT_SUM", "ROW_SUMS"]
    for name in BACKWARD_LAUNCHERS:
        monkeypatch.setattr(launch, name, zeroing_first(getattr(launch, name)))


@pytest.mark.parametrize("backward", ["split", "onepass"])
@pytest.mark.parametrize("teacher_grad", [False, True], ids=["student", "mutual"])
def test_single_problem(backward, teacher_grad, autotuner_zeroing, device):
    torch.manual_seed(50)
    inputs = make_inputs((1, 2, 19, 23, 32, 32, False), torch.float32, device, teacher_grad=teacher_grad)
    wanted = [tensor for tensor in inputs if tensor.requires_grad]
    ref = attention_kl_reference(*inputs, reduction="none")
    upstream = torch.randn_like(ref)
    ref_grads = torch.autograd.grad((ref * upstream).sum(), wanted)
    with kernel_options(backward=backward):
        out = attention_kl(*inputs, reduction="none", backend="triton")
        grads = torch.autograd.grad((out * upstream.float()).sum(), wanted)
    for index, (grad, ref_grad) in enumerate(zip(grads, ref_grads)):
        assert rel_err(grad, ref_grad) < 2e-5, f"gradient {index}"


@pytest.mark.parametrize("backward", ["split", "onepass"])
def test_grouped_problems(backward, autotuner_zeroing, device):
    torch.manual_seed(51)
    problems = [make_inputs((1, 2, 21, 21, 16, 16, False), torch.float32, device) for _ in range(2)]
    flat = [tensor for problem in problems for tensor in problem[:2]]
    with kernel_options(backward=backward):
        out = attention_kl_grouped(problems, reduction="none", backend="triton")
        upstream = torch.randn_like(out)
        grads = torch.autograd.grad((out * upstream).sum(), flat)
    for index, problem in enumerate(problems):
        ref = attention_kl_reference(*problem, reduction="none")
        ref_grads = torch.autograd.grad((ref * upstream[index].double()).sum(), problem[:2])
        for grad, ref_grad in zip(grads[2 * index:2 * index + 2], ref_grads):
            assert rel_err(grad, ref_grad) < 2e-5, f"problem {index}"


def test_fused_forward(autotuner_zeroing, device):
    """The fused forward's dq and row sums, zeroed before its launch, single and grouped."""
    from test_known_lse import given_lse

    torch.manual_seed(52)
    problems = [make_inputs((1, 2, 19, 19, 32, 32, False), torch.float32, device) for _ in range(2)]
    lse = [given_lse(*problem) for problem in problems]
    with kernel_options(fused_gradients="on"):
        single = attention_kl(*problems[0], backend="triton", **lse[0])
        grouped = attention_kl_grouped(problems, backend="triton", lse=[g["lse"] for g in lse],
                                       lse_teacher=[g["lse_teacher"] for g in lse])
    for value, inputs in ((single, problems[0][:2]), (grouped.sum(), [t for p in problems for t in p[:2]])):
        grads = torch.autograd.grad(value, inputs)
        reference = sum(attention_kl_reference(*problem) for problem in problems[:len(inputs) // 2])
        ref_grads = torch.autograd.grad(reference, inputs)
        assert rel_err(value, reference) < 1e-5
        for grad, ref_grad in zip(grads, ref_grads):
            assert rel_err(grad, ref_grad) < 2e-5
