"""The fused backward (CL_STREAMKL_BACKWARD=fused): one kernel, dq summed with atomics.

Checked against the float64 reference and against the default split backward, on odd
shapes, every dtype, causal masks and strided views; plus when it must not run (teacher
gradients, deterministic mode) and the overflow guard for padded keys.
"""

from __future__ import annotations

import pytest
import torch

from cl_streamkl import attention_kl, attention_kl_reference
from cl_streamkl.kernels import triton_kl

from test_attention_kl import (
    DTYPE_IDS,
    DTYPES,
    SHAPES,
    error_bound,
    low_precision_rows,
    make_inputs,
    rel_err,
    shape_id,
)

@pytest.fixture
def fused(monkeypatch):
    monkeypatch.setenv("CL_STREAMKL_BACKWARD", "fused")


@pytest.fixture
def dq_kernel_calls(monkeypatch) -> list:
    calls: list = []
    real = triton_kl._backward_dq_kernel

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(triton_kl, "_backward_dq_kernel", counting)
    return calls


def grads_of(q, k, q_t, k_t, causal, upstream):
    out = attention_kl(q, k, q_t, k_t, causal=causal, reduction="none", backend="triton")
    wanted = [t for t in (q, k, q_t, k_t) if t.requires_grad]
    return torch.autograd.grad((out * upstream).sum(), wanted)


@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
def test_fused_gradients_match_reference_and_split(fused, dq_kernel_calls, dtype, shape, device):
    torch.manual_seed(1)
    causal = shape[-1]
    q, k, q_t, k_t = make_inputs(shape, dtype, device)
    ref = attention_kl_reference(q, k, q_t, k_t, causal=causal, reduction="none")
    upstream = torch.randn_like(ref)
    ref_grads = torch.autograd.grad((ref * upstream).sum(), (q, k))
    grads = grads_of(q, k, q_t, k_t, causal, upstream)
    assert dq_kernel_calls == [], "the fused backward must not launch the dq kernel"
    q_low, k_low = q.detach().requires_grad_(), k.detach().requires_grad_()
    baseline = low_precision_rows(q_low, k_low, q_t, k_t, causal)
    baseline_grads = torch.autograd.grad((baseline * upstream.to(dtype)).sum(), (q_low, k_low))
    for name, grad, ref_grad, base_grad in zip("qk", grads, ref_grads, baseline_grads):
        assert grad.dtype == dtype and grad.shape == ref_grad.shape
        assert rel_err(grad, ref_grad) < error_bound(dtype, rel_err(base_grad, ref_grad)), f"grad of {name}"


def test_fused_and_split_agree(monkeypatch, device):
    torch.manual_seed(2)
    shape = (2, 2, 50, 37, 64, 64, False)
    q, k, q_t, k_t = make_inputs(shape, torch.float32, device)
    upstream = torch.randn(2, 2, 50, device=device)
    split = grads_of(q, k, q_t, k_t, False, upstream)
    monkeypatch.setenv("CL_STREAMKL_BACKWARD", "fused")
    fused_grads = grads_of(q, k, q_t, k_t, False, upstream)
    for a, b in zip(split, fused_grads):
        assert rel_err(b, a) < 1e-5


def test_fused_reads_strided_views(fused, device):
    torch.manual_seed(3)
    batch, tokens, heads, dim = 2, 21, 3, 32
    qkv = torch.randn(batch, tokens, 3 * heads * dim, device=device, requires_grad=True)
    q, k, _ = qkv.reshape(batch, tokens, 3, heads, dim).permute(2, 0, 3, 1, 4).unbind(0)
    q_t, k_t = (torch.randn(batch, heads, tokens, dim, device=device) for _ in range(2))
    upstream = torch.randn(batch, heads, tokens, device=device)
    out = attention_kl(q, k, q_t, k_t, reduction="none", backend="triton")
    grad = torch.autograd.grad((out * upstream).sum(), qkv)[0]
    ref = attention_kl_reference(q, k, q_t, k_t, reduction="none")
    ref_grad = torch.autograd.grad((ref * upstream).sum(), qkv)[0]
    assert rel_err(grad, ref_grad) < 1e-5


def test_padded_keys_cannot_overflow_into_dq(fused, monkeypatch, device):
    # Every score of these rows is about -250 (natural units), so 2^(0 - lse) for the
    # zero-padded keys of the last key tile overflows float32; the guard keeps dq finite.
    torch.manual_seed(4)
    batch, heads, n, dim = 1, 1, 17, 32
    direction = torch.nn.functional.normalize(torch.randn(dim, device=device), dim=0)
    k = (direction * 40.0 + 0.05 * torch.randn(batch, heads, n, dim, device=device)).requires_grad_()
    q = (-direction * 250.0 * dim**0.5 / 40.0 + 0.05 * torch.randn(batch, heads, n, dim, device=device))
    q.requires_grad_()
    k_t = direction * 40.0 + 0.05 * torch.randn(batch, heads, n, dim, device=device)
    q_t = -direction * 250.0 * dim**0.5 / 40.0 + 0.05 * torch.randn(batch, heads, n, dim, device=device)
    upstream = torch.randn(batch, heads, n, device=device)
    grads = grads_of(q, k, q_t, k_t, False, upstream)  # rel_err fails on NaN or Inf
    ref = attention_kl_reference(q, k, q_t, k_t, reduction="none")
    ref_grads = torch.autograd.grad((ref * upstream).sum(), (q, k))
    monkeypatch.setenv("CL_STREAMKL_BACKWARD", "split")
    split_grads = grads_of(q, k, q_t, k_t, False, upstream)
    # Scores near -250 leave float32 rounding of ~1e-2 in both backwards alike.
    for grad, split_grad, ref_grad in zip(grads, split_grads, ref_grads):
        assert rel_err(grad, ref_grad) <= 2 * rel_err(split_grad, ref_grad) + 1e-6


def test_teacher_gradients_and_deterministic_mode_use_the_split_backward(fused, dq_kernel_calls, device):
    torch.manual_seed(5)
    shape = (1, 2, 17, 17, 32, 32, False)
    q, k, q_t, k_t = make_inputs(shape, torch.float32, device, teacher_grad=True)
    upstream = torch.randn(1, 2, 17, device=device)
    grads_of(q, k, q_t, k_t, False, upstream)
    assert len(dq_kernel_calls) == 1
    q_t, k_t = q_t.detach(), k_t.detach()
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        grads_of(q, k, q_t, k_t, False, upstream)
    finally:
        torch.use_deterministic_algorithms(previous)
    assert len(dq_kernel_calls) == 2


def test_unknown_backward_mode_is_refused(monkeypatch, device):
    monkeypatch.setenv("CL_STREAMKL_BACKWARD", "atomic")
    q, k, q_t, k_t = make_inputs((1, 1, 4, 4, 32, 32, False), torch.float32, device)
    out = attention_kl(q, k, q_t, k_t, backend="triton")
    with pytest.raises(ValueError, match="CL_STREAMKL_BACKWARD must be one of"):
        out.backward()
