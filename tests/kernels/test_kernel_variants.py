"""The opt-in kernel variants (kernels/triton/variants.py) against float64 at the usual tolerances.

Each exp2 variant moves part of the teacher's exponentials to a polynomial on the FMA units;
``grad_after_dot`` multiplies by the upstream gradient after the dot products. They must keep the
accuracy the default kernels are tested to (tests/kernels/test_attention_kl.py); which is faster is
measured on the GPU (benchmarks/grouped_and_exp_gpu.py).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import triton
import triton.language as tl
from test_attention_kl import DTYPE_IDS, DTYPES, error_bound, low_precision_rows, make_inputs, rel_err
from test_attention_kl_grouped import assert_matches_single_kernels

from cl_streamkl import attention_kl, attention_kl_grouped, attention_kl_reference
from cl_streamkl.kernels.config import (
    EXP2_VARIANTS,
    KernelOptions,
    get_kernel_options,
    kernel_options,
    set_kernel_options,
)
from cl_streamkl.kernels.triton import INTERPRETING
from cl_streamkl.kernels.triton.common import exp2_polynomial, teacher_exp2
from cl_streamkl.kernels.triton.variants import exp2_constants

POLY_VARIANTS = [name for name in EXP2_VARIANTS if name != "hardware"]
# The two unit tests of the exponentials run their tiny kernels on CPU tensors through the
# interpreter, whose hardware exp2 is numpy's (the GPU's is ex2.approx).
interpreter_only = pytest.mark.skipif(not INTERPRETING, reason="runs CPU tensors through Triton's interpreter")


@triton.jit
def _exp2_tile_kernel(X, OUT, POLY_DEGREE: tl.constexpr, POLY_SPLITS: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr):
    offsets = tl.arange(0, ROWS)[:, None] * COLS + tl.arange(0, COLS)[None, :]
    tl.store(OUT + offsets, teacher_exp2(tl.load(X + offsets), POLY_DEGREE, POLY_SPLITS))


@triton.jit
def _exp2_polynomial_kernel(X, OUT, DEGREE: tl.constexpr, SIZE: tl.constexpr):
    offsets = tl.arange(0, SIZE)
    tl.store(OUT + offsets, exp2_polynomial(tl.load(X + offsets), DEGREE))


@interpreter_only
@pytest.mark.parametrize("degree, bound", [(3, 7.6e-5), (5, 2.5e-7)])
def test_exp2_polynomial_accuracy(degree, bound):
    x = torch.cat([torch.linspace(-125.0, 20.0, 4093), torch.tensor([0.0, -0.5, 0.5])])
    out = torch.empty_like(x)
    _exp2_polynomial_kernel[(1,)](x, out, degree, x.numel())
    assert (out.double() / torch.exp2(x.double()) - 1).abs().max() < bound
    masked = torch.tensor([float("-inf"), -1e30, -126.5, -126.0] * 4)
    tiny = torch.empty_like(masked)
    _exp2_polynomial_kernel[(1,)](masked, tiny, degree, masked.numel())
    assert ((tiny >= 0) & (tiny < 2.0**-125)).all()


@interpreter_only
@pytest.mark.parametrize("variant", list(EXP2_VARIANTS))
def test_teacher_exp2_takes_the_polynomial_on_the_last_columns(variant):
    degree, splits = EXP2_VARIANTS[variant]
    x = -torch.rand(16, 32) * 30
    out = torch.empty_like(x)
    _exp2_tile_kernel[(1,)](x, out, degree, splits, 16, 32)
    hardware = np.exp2(x.numpy())
    first_polynomial = 32 if degree == 0 else 32 - 32 // 2**splits
    assert np.array_equal(out.numpy()[:, :first_polynomial], hardware[:, :first_polynomial])
    tail = out[:, first_polynomial:].double() / torch.exp2(x[:, first_polynomial:].double()) - 1
    if degree:
        assert 0 < tail.abs().max() < 7.6e-5
        assert not np.array_equal(out.numpy()[:, first_polynomial:], hardware[:, first_polynomial:])


VARIANT_SHAPES = [(1, 2, 17, 40, 32, 80, False), (2, 2, 33, 33, 64, 32, True)]


@pytest.mark.parametrize("shape", VARIANT_SHAPES, ids=lambda s: f"Nq{s[2]}-Nk{s[3]}" + ("-causal" if s[-1] else ""))
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("variant", POLY_VARIANTS + ["grad-after-dot"])
def test_variant_keeps_the_tested_accuracy(variant, dtype, shape, device):
    """Values, student gradients (as in test_attention_kl) and teacher gradients (mutual)."""
    torch.manual_seed(30)
    causal = shape[-1]
    q, k, q_t, k_t = make_inputs(shape, dtype, device, teacher_grad=True)
    fields = {"grad_after_dot": True} if variant == "grad-after-dot" else {"forward_exp2": variant, "backward_exp2": variant}
    with kernel_options(**fields):
        out = attention_kl(q, k, q_t, k_t, causal=causal, reduction="none", backend="triton")
        upstream = torch.randn_like(out)
        grads = torch.autograd.grad((out * upstream).sum(), (q, k, q_t, k_t))
    ref = attention_kl_reference(q, k, q_t, k_t, causal=causal, reduction="none")
    assert rel_err(out, ref) < 1e-4
    ref_grads = torch.autograd.grad((ref * upstream).sum(), (q, k, q_t, k_t))
    q_low, k_low = q.detach().requires_grad_(), k.detach().requires_grad_()
    baseline = low_precision_rows(q_low, k_low, q_t.detach(), k_t.detach(), causal)
    baseline_grads = torch.autograd.grad((baseline * upstream.to(dtype)).sum(), (q_low, k_low))
    for name, grad, ref_grad, base_grad in zip("qk", grads, ref_grads, baseline_grads):
        assert rel_err(grad, ref_grad) < error_bound(dtype, rel_err(base_grad, ref_grad)), f"grad of {name}"
    teacher_bound = 2e-5 if dtype == torch.float32 else 2e-2
    for name, grad, ref_grad in zip(("q_teacher", "k_teacher"), grads[2:], ref_grads[2:]):
        assert rel_err(grad, ref_grad) < teacher_bound, f"grad of {name}"


@pytest.mark.parametrize("reduction", ["mean", "sum", "batchmean"])
def test_reductions_hand_the_backward_an_expanded_gradient(reduction, monkeypatch, device):
    """No (B, H, Nq) gradient is materialised for a reduced KL (4 bytes a query row saved)."""
    from cl_streamkl.kernels.triton import launch, ops

    seen = []
    real = launch.launch_backward

    def spy(grad_rows, *args, **kwargs):
        seen.append(grad_rows.stride())
        return real(grad_rows, *args, **kwargs)

    monkeypatch.setattr(ops, "launch_backward", spy)
    q, k, q_t, k_t = make_inputs((2, 2, 17, 17, 32, 32, False), torch.float32, device, teacher_grad=False)
    value = attention_kl(q, k, q_t, k_t, reduction=reduction, backend="triton")
    value.backward()
    assert seen == [(0, 0, 0)]
    expected = attention_kl_reference(q, k, q_t, k_t, reduction=reduction)
    assert float(value) == pytest.approx(float(expected), rel=1e-5)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
def test_grad_after_dot_with_a_gradient_constant_along_rows(dtype, reduction, device):
    """An expanded gradient (row stride 0) lets the dk kernels multiply after the dot too."""
    torch.manual_seed(33)
    problems = [make_inputs((2, 2, 33, 33, 64, 32, True), dtype, device, teacher_grad=True) for _ in range(2)]
    inputs = [tensor for problem in problems for tensor in problem]
    weights = torch.tensor([0.7, -1.3], device=device)
    with kernel_options(grad_after_dot=True):
        single = sum(w * attention_kl(*p, causal=True, reduction=reduction, backend="triton") for w, p in zip(weights, problems))
        grads = torch.autograd.grad(single, inputs)
        grouped = attention_kl_grouped(problems, causal=True, reduction=reduction, backend="triton")
        grouped_grads = torch.autograd.grad((grouped * weights).sum(), inputs)
    ref = sum(w * attention_kl_reference(*p, causal=True, reduction=reduction) for w, p in zip(weights, problems))
    ref_grads = torch.autograd.grad(ref, inputs)
    bound = 2e-5 if dtype == torch.float32 else 2e-2
    for index, (grad, grouped_grad, ref_grad) in enumerate(zip(grads, grouped_grads, ref_grads)):
        assert rel_err(grad, ref_grad) < bound and rel_err(grouped_grad, ref_grad) < bound, f"grad {index}"
        assert torch.allclose(grad, grouped_grad, rtol=1e-6, atol=0), f"grad {index}"


@pytest.mark.parametrize("variant", ["poly3-half", "poly5-eighth"])
def test_variant_with_large_logits_stays_finite(variant, device):
    torch.manual_seed(31)
    q, k, q_t, k_t = make_inputs((1, 2, 33, 33, 64, 64, True), torch.bfloat16, device, spread=12.0)
    with kernel_options(forward_exp2=variant, backward_exp2=variant):
        out = attention_kl(q, k, q_t, k_t, causal=True, reduction="none", backend="triton")
        grads = torch.autograd.grad(out.sum(), (q, k))
    ref = attention_kl_reference(q, k, q_t, k_t, causal=True, reduction="none")
    assert ref.abs().max() > 100, "test needs huge logits"
    assert rel_err(out, ref) < 1e-3
    assert all(torch.isfinite(grad).all() for grad in grads)


@pytest.mark.parametrize("variant, value_floor", [("poly3-half", 1e-4), ("poly5-half", 1e-6)])
def test_identical_distributions_give_almost_zero(variant, value_floor, device):
    """The polynomial weighs exact score gaps with approximate probabilities: an offset of ~1e-4·KL-scale at degree 3."""
    torch.manual_seed(6)
    q, k, _, _ = make_inputs((2, 2, 37, 37, 64, 64, False), torch.bfloat16, device)
    with kernel_options(forward_exp2=variant, backward_exp2=variant):
        out = attention_kl(q, k, q.detach(), k.detach(), reduction="none", backend="triton")
        grad = torch.autograd.grad(out.sum(), q)[0]
    assert out.abs().max().item() < value_floor
    assert grad.abs().max().item() < value_floor


def test_grouped_kernels_take_the_variants(device):
    torch.manual_seed(32)
    problems = [make_inputs((1, 2, 17, 17, 64, 64, False), torch.bfloat16, device) for _ in range(3)]
    with kernel_options(forward_exp2="poly3-quarter", backward_exp2="poly3-eighth", grad_after_dot=True):
        out = attention_kl_grouped(problems, reduction="none", backend="triton")
        single = torch.stack([attention_kl(*problem, reduction="none", backend="triton") for problem in problems])
        inputs = [tensor for problem in problems for tensor in problem[:2]]
        grads = torch.autograd.grad(out.sum(), inputs)
        single_grads = torch.autograd.grad(single.sum(), inputs)
    for grad, single_grad in zip(grads, single_grads):
        assert_matches_single_kernels(grad, single_grad, device)
    if device == "cpu":
        assert torch.equal(out, single)
    else:
        # On a GPU the grouped kernels run their own tiles, so the exponentials a variant
        # approximates are not all the same ones as in the single kernels: the values differ by
        # about 5e-6 on an H100, while a variant moves them by about 2e-5 under the interpreter.
        # What tells the variants reached the grouped kernels is that they change the grouped
        # kernels' own (deterministic) result.
        plain = attention_kl_grouped(problems, reduction="none", backend="triton")
        assert rel_err(out, plain) > 1e-6
        assert rel_err(out, single) < 1e-4
    ref = torch.stack([attention_kl_reference(*problem, reduction="none") for problem in problems])
    assert rel_err(out, ref) < 1e-4


def test_defaults_environment_and_context():
    assert KernelOptions() == KernelOptions(True, True, "hardware", "hardware", True)
    assert get_kernel_options() == KernelOptions.from_environment()
    before = get_kernel_options()
    with kernel_options(backward_exp2="poly5-quarter", autotune=False) as inside:
        assert get_kernel_options() is inside
        assert inside == dataclasses.replace(before, backward_exp2="poly5-quarter", autotune=False)
    assert get_kernel_options() == before
    with pytest.raises(ValueError, match="forward_exp2 must be one of"):
        KernelOptions(forward_exp2="poly4")
    with pytest.raises(TypeError, match="grad_after_dot must be a bool"):
        KernelOptions(grad_after_dot=1)
    with pytest.raises(TypeError, match="fast_launch must be a bool"):
        set_kernel_options(fast_launch="0")
    assert get_kernel_options() == before


def test_set_kernel_options_lasts_until_set_back():
    before = set_kernel_options(fast_launch=False)
    try:
        assert get_kernel_options() == dataclasses.replace(before, fast_launch=False)
    finally:
        set_kernel_options(**dataclasses.asdict(before))
    assert get_kernel_options() == before


def test_environment_gives_the_defaults():
    assert KernelOptions.from_environment({}) == KernelOptions()
    off = {name: "0" for name in ("CL_STREAMKL_AUTOTUNE", "CL_STREAMKL_FAST_LAUNCH", "CL_STREAMKL_GRAD_AFTER_DOT")}
    assert KernelOptions.from_environment(off) == KernelOptions(autotune=False, fast_launch=False, grad_after_dot=False)
    variants = {"CL_STREAMKL_FORWARD_EXP2": "poly3-eighth", "CL_STREAMKL_BACKWARD_EXP2": "poly5-half"}
    assert KernelOptions.from_environment(variants) == KernelOptions(forward_exp2="poly3-eighth",
                                                                      backward_exp2="poly5-half")
    with pytest.raises(ValueError, match="CL_STREAMKL_BACKWARD_EXP2 must be one of"):
        KernelOptions.from_environment({"CL_STREAMKL_BACKWARD_EXP2": "fast"})


def test_float32_inputs_raise_degree_3_to_5():
    options = KernelOptions(forward_exp2="poly3-quarter")
    assert exp2_constants(options, backward=False, dtype=torch.bfloat16) == {"POLY_EXP2_DEGREE": 3,
                                                                             "POLY_EXP2_SPLITS": 1}
    assert exp2_constants(options, backward=False, dtype=torch.float32) == {"POLY_EXP2_DEGREE": 5,
                                                                            "POLY_EXP2_SPLITS": 1}
    assert exp2_constants(options, backward=True, dtype=torch.float32) == {"POLY_EXP2_DEGREE": 0,
                                                                           "POLY_EXP2_SPLITS": 0}
