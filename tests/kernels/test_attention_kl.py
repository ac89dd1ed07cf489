"""attention_kl against the float64 reference: both backends, every dtype, odd shapes, gradients.

The triton backend runs the real kernels on the CPU through Triton's
interpreter (see conftest.py); outputs the library allocates with torch.empty
are NaN-poisoned, so an unwritten element fails.
"""

from __future__ import annotations

import pytest
import torch

from cl_streamkl import AttentionKLDivLoss, attention_kl, attention_kl_reference
from cl_streamkl.kernels import eager_attention_kl
from cl_streamkl.kernels.torch_streaming import attention_kl_rows_torch
from cl_streamkl.kernels.validation import AttentionKLOptions, check_inputs

BACKENDS = ["triton", "torch"]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DTYPE_IDS = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}

# (B, H, Nq, Nk, Ds, Dt, causal)
SHAPES = [
    (1, 1, 1, 1, 32, 32, False),
    (2, 3, 17, 17, 64, 64, False),
    (1, 2, 17, 40, 32, 80, False),
    (1, 1, 197, 197, 80, 80, False),
    (2, 2, 33, 33, 64, 32, True),
    (1, 1, 1, 1, 128, 128, True),
]


def shape_id(shape) -> str:
    batch, heads, n_q, n_k, d_s, d_t, causal = shape
    return f"B{batch}-H{heads}-Nq{n_q}-Nk{n_k}-Ds{d_s}-Dt{d_t}" + ("-causal" if causal else "")


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    assert torch.isfinite(out).all(), "output holds NaN or Inf"
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def make_inputs(shape, dtype, device, requires_grad=True, teacher_grad=False, spread=1.0):
    batch, heads, n_q, n_k, d_s, d_t, _ = shape

    def rand(n, d, grad):
        return (torch.randn(batch, heads, n, d, device=device) * spread).to(dtype).requires_grad_(grad)

    return (
        rand(n_q, d_s, requires_grad),
        rand(n_k, d_s, requires_grad),
        rand(n_q, d_t, teacher_grad),
        rand(n_k, d_t, teacher_grad),
    )


def low_precision_rows(q, k, q_teacher, k_teacher, causal, temperature=1.0):
    """The usual materialising distillation math done entirely in the inputs' dtype."""
    scores_s = (q @ k.transpose(-1, -2)) * (q.size(-1) ** -0.5 / temperature)
    scores_t = (q_teacher @ k_teacher.transpose(-1, -2)) * (q_teacher.size(-1) ** -0.5 / temperature)
    if causal:
        mask = torch.ones(q.size(2), k.size(2), dtype=torch.bool, device=q.device).tril()
        scores_s = scores_s.masked_fill(~mask, -1e4)
        scores_t = scores_t.masked_fill(~mask, -1e4)
    log_p_s = torch.log_softmax(scores_s, dim=-1)
    log_p_t = torch.log_softmax(scores_t, dim=-1)
    return (log_p_t.exp() * (log_p_t - log_p_s)).sum(-1)


def error_bound(dtype, baseline_error: float) -> float:
    """No worse than 2x the same PyTorch math done in the low-precision dtype."""
    floor = 2e-5 if dtype == torch.float32 else 1e-3
    return max(2.0 * baseline_error, floor)


@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("backend", BACKENDS)
def test_matches_reference_values_and_student_grads(backend, dtype, shape, device):
    check_against_reference(shape, dtype, backend, device)


def check_against_reference(shape, dtype, backend, device, given_lse=None, atol=0.0):
    """attention_kl's rows and student gradients on seeded inputs of ``shape`` against float64.

    ``given_lse(q, k, q_t, k_t, causal)``, if given, returns the log-sum-exp keywords to pass;
    ``atol`` as in :func:`assert_values_and_student_grads`.
    """
    torch.manual_seed(0)
    causal = shape[-1]
    inputs = make_inputs(shape, dtype, device)
    ref = attention_kl_reference(*inputs, causal=causal, reduction="none")
    lse = given_lse(*inputs, causal) if given_lse is not None else {}
    out = attention_kl(*inputs, causal=causal, reduction="none", backend=backend, **lse)
    assert_values_and_student_grads(out, ref, inputs, causal, atol=atol)


def assert_values_and_student_grads(out, ref, inputs, causal, atol=0.0):
    """KL rows within 1e-4 of float64 and the student's gradients under a random upstream within
    :func:`error_bound`; where the reference is exactly 0 (one key), within ``atol`` of it."""
    q, k, q_t, k_t = inputs
    dtype = q.dtype
    assert out.dtype == torch.float32 and out.shape == ref.shape
    assert rel_err(out, ref) < 1e-4 or (out - ref).abs().max() <= atol
    upstream = torch.randn_like(ref)
    ref_grads = torch.autograd.grad((ref * upstream).sum(), (q, k))
    grads = torch.autograd.grad((out * upstream.float()).sum(), (q, k))
    q_low, k_low = q.detach().requires_grad_(), k.detach().requires_grad_()
    baseline = low_precision_rows(q_low, k_low, q_t, k_t, causal)
    baseline_grads = torch.autograd.grad((baseline * upstream.to(dtype)).sum(), (q_low, k_low))
    for name, grad, ref_grad, base_grad in zip("qk", grads, ref_grads, baseline_grads):
        assert grad.dtype == dtype and grad.shape == ref_grad.shape
        if atol and ref_grad.norm() == 0:
            assert grad.abs().max() <= atol, f"grad of {name}"
            continue
        bound = error_bound(dtype, rel_err(base_grad, ref_grad))
        assert rel_err(grad, ref_grad) < bound, f"grad of {name}"


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("causal", [False, True])
def test_teacher_gradients_for_mutual_distillation(backend, dtype, causal, device):
    torch.manual_seed(1)
    shape = (1, 2, 21, 21, 32, 48, causal)
    q, k, q_t, k_t = make_inputs(shape, dtype, device, teacher_grad=True)
    ref = attention_kl_reference(q, k, q_t, k_t, causal=causal, reduction="none")
    out = attention_kl(q, k, q_t, k_t, causal=causal, reduction="none", backend=backend)
    upstream = torch.randn_like(ref)
    ref_grads = torch.autograd.grad((ref * upstream).sum(), (q, k, q_t, k_t))
    grads = torch.autograd.grad((out * upstream.float()).sum(), (q, k, q_t, k_t))
    bound = 2e-5 if dtype == torch.float32 else 2e-2
    for name, grad, ref_grad in zip(("q", "k", "q_teacher", "k_teacher"), grads, ref_grads):
        assert rel_err(grad, ref_grad) < bound, f"grad of {name}"


@pytest.mark.parametrize("backend", BACKENDS)
def test_frozen_teacher_gets_no_gradient(backend, device):
    q, k, q_t, k_t = make_inputs((1, 1, 9, 9, 32, 32, False), torch.float32, device)
    attention_kl(q, k, q_t, k_t, backend=backend).backward()
    assert q.grad is not None and k.grad is not None
    assert q_t.grad is None and k_t.grad is None


@pytest.mark.parametrize("reduction", ["none", "sum", "mean", "batchmean"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_reductions(backend, reduction, device):
    torch.manual_seed(2)
    q, k, q_t, k_t = make_inputs((3, 2, 19, 23, 32, 32, False), torch.float32, device)
    ref = attention_kl_reference(q, k, q_t, k_t, reduction=reduction)
    out = attention_kl(q, k, q_t, k_t, reduction=reduction, backend=backend)
    assert out.shape == ref.shape
    assert rel_err(out, ref) < 1e-5
    rows = attention_kl_reference(q, k, q_t, k_t, reduction="none")
    expected = {"none": rows, "sum": rows.sum(), "mean": rows.mean(), "batchmean": rows.sum() / 3}
    assert rel_err(out, expected[reduction]) < 1e-5
    ref_grad = torch.autograd.grad(ref.sum(), q)[0]
    grad = torch.autograd.grad(out.sum(), q)[0]
    assert rel_err(grad, ref_grad) < 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
def test_temperature_and_custom_scales(backend, device):
    torch.manual_seed(3)
    q, k, q_t, k_t = make_inputs((1, 2, 17, 17, 32, 64, False), torch.float32, device)
    options = dict(scale=0.3, teacher_scale=0.05, temperature=2.5, reduction="none")
    ref = attention_kl_reference(q, k, q_t, k_t, **options)
    out = attention_kl(q, k, q_t, k_t, backend=backend, **options)
    assert rel_err(out, ref) < 1e-5
    # Temperature only divides the scores: T=2 equals halving both scales.
    halved = attention_kl(q, k, q_t, k_t, scale=32**-0.5 / 2, teacher_scale=64**-0.5 / 2, backend=backend)
    tempered = attention_kl(q, k, q_t, k_t, temperature=2.0, backend=backend)
    torch.testing.assert_close(tempered, halved, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("backend", BACKENDS)
def test_strided_timm_style_views_without_copy(backend, device):
    """q/k as timm makes them: views of one (3, B, H, N, D) permutation of a qkv tensor."""
    torch.manual_seed(4)
    batch, tokens, heads, dim = 2, 29, 3, 32
    qkv = torch.randn(batch, tokens, 3 * heads * dim, device=device, requires_grad=True)
    q, k, _ = qkv.reshape(batch, tokens, 3, heads, dim).permute(2, 0, 3, 1, 4).unbind(0)
    qkv_t = torch.randn(batch, tokens, 3 * heads * dim, device=device)
    q_t, k_t, _ = qkv_t.reshape(batch, tokens, 3, heads, dim).permute(2, 0, 3, 1, 4).unbind(0)
    assert not q.is_contiguous() and q.stride(-1) == 1
    out = attention_kl(q, k, q_t, k_t, reduction="none", backend=backend)
    ref = attention_kl_reference(q, k, q_t, k_t, reduction="none")
    assert rel_err(out, ref) < 1e-5
    upstream = torch.randn_like(ref)
    grad = torch.autograd.grad((out * upstream.float()).sum(), qkv)[0]
    ref_grad = torch.autograd.grad((ref * upstream).sum(), qkv)[0]
    assert rel_err(grad, ref_grad) < 1e-5


@pytest.mark.parametrize("teacher_grad", [False, True], ids=["frozen", "mutual"])
def test_triton_gradients_come_back_in_the_inputs_layout(teacher_grad, device):
    """dq/dk (and the teacher's) are laid out like their inputs, so autograd's add to SDPA's is contiguous."""
    torch.manual_seed(14)
    batch, tokens, heads, dim = 2, 21, 3, 32

    def timm_views(requires_grad):
        qkv = torch.randn(batch, tokens, 3 * heads * dim, device=device, requires_grad=requires_grad)
        q, k, _ = qkv.reshape(batch, tokens, 3, heads, dim).permute(2, 0, 3, 1, 4).unbind(0)
        return q, k

    q, k = timm_views(True)
    q_t, k_t = timm_views(teacher_grad)
    inputs = (q, k, q_t, k_t) if teacher_grad else (q, k)
    out = attention_kl(q, k, q_t, k_t, reduction="none", backend="triton")
    ref = attention_kl_reference(q, k, q_t, k_t, reduction="none")
    upstream = torch.randn_like(ref)
    grads = torch.autograd.grad((out * upstream.float()).sum(), inputs)
    ref_grads = torch.autograd.grad((ref * upstream).sum(), inputs)
    for tensor, grad, ref_grad in zip(inputs, grads, ref_grads):
        assert grad.stride() == torch.empty_like(tensor).stride() != tensor.contiguous().stride()
        assert rel_err(grad, ref_grad) < 1e-5


def test_gradient_buffer_falls_back_to_contiguous_without_unit_head_stride():
    from cl_streamkl.kernels.triton.launch import empty_gradient_for

    no_unit_stride = torch.empty(64).as_strided((3, 2, 1, 4), (8, 1, 8, 2))
    assert torch.empty_like(no_unit_stride).stride(-1) == 2
    assert empty_gradient_for(no_unit_stride).is_contiguous()
    permuted = torch.empty(2, 5, 3, 4).permute(0, 2, 1, 3)
    assert empty_gradient_for(permuted).stride() == permuted.stride()


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("backend", BACKENDS)
def test_large_logits_stay_finite(backend, dtype, device):
    torch.manual_seed(5)
    shape = (1, 2, 33, 33, 64, 64, True)
    q, k, q_t, k_t = make_inputs(shape, dtype, device, spread=12.0)
    ref = attention_kl_reference(q, k, q_t, k_t, causal=True, reduction="none")
    out = attention_kl(q, k, q_t, k_t, causal=True, reduction="none", backend=backend)
    assert ref.abs().max() > 100, "test needs huge logits"
    assert rel_err(out, ref) < 1e-3
    grads = torch.autograd.grad(out.sum(), (q, k))
    assert all(torch.isfinite(grad).all() for grad in grads)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("backend", BACKENDS)
def test_identical_distributions_give_zero(backend, dtype, device):
    torch.manual_seed(6)
    q, k, _, _ = make_inputs((2, 2, 37, 37, 64, 64, False), dtype, device)
    out = attention_kl(q, k, q.detach(), k.detach(), reduction="none", backend=backend)
    assert out.abs().max().item() < 1e-5
    grad = torch.autograd.grad(out.sum(), q)[0]
    assert grad.abs().max().item() < 1e-5


def test_single_key_gives_zero_and_backends_agree(device):
    q, k, q_t, k_t = make_inputs((1, 2, 5, 1, 32, 32, False), torch.float32, device)
    for backend in BACKENDS:
        out = attention_kl(q, k, q_t, k_t, reduction="none", backend=backend)
        assert out.abs().max().item() < 1e-6


@pytest.mark.parametrize("shape", [(1, 2, 17, 40, 16, 24, False), (1, 2, 33, 33, 16, 24, True)], ids=shape_id)
def test_eager_baseline_matches_reference_without_nan(shape, device):
    torch.manual_seed(8)
    causal = shape[-1]
    q, k, q_t, k_t = make_inputs(shape, torch.float32, device)
    ref = attention_kl_reference(q, k, q_t, k_t, causal=causal, reduction="none")
    rows = eager_attention_kl(q, k, q_t, k_t, causal=causal, reduction="none")
    assert rows.dtype == torch.float32 and torch.isfinite(rows).all()
    assert rel_err(rows, ref) < 1e-5
    upstream = torch.randn_like(ref)
    ref_grads = torch.autograd.grad((ref * upstream).sum(), (q, k))
    grads = torch.autograd.grad((rows * upstream.float()).sum(), (q, k))
    for grad, ref_grad in zip(grads, ref_grads):
        assert rel_err(grad, ref_grad) < 1e-4
    torch.testing.assert_close(eager_attention_kl(q, k, q_t, k_t, causal=causal), rows.mean())


def test_triton_is_deterministic(device):
    torch.manual_seed(7)
    q, k, q_t, k_t = make_inputs((1, 2, 40, 40, 32, 32, False), torch.bfloat16, device)
    runs = []
    for _ in range(2):
        out = attention_kl(q, k, q_t, k_t, reduction="sum", backend="triton")
        runs.append((out, *torch.autograd.grad(out, (q, k))))
    for first, second in zip(*runs):
        assert torch.equal(first, second)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("chunk_size", [1, 7, 64])
def test_torch_backend_streams_over_small_chunks(chunk_size, causal, device):
    torch.manual_seed(8)
    shape = (2, 1, 30, 30, 16, 24, causal)
    q, k, q_t, k_t = make_inputs(shape, torch.float32, device, teacher_grad=True)
    problem = check_inputs(q, k, q_t, k_t, AttentionKLOptions(causal=causal, reduction="none", backend="torch"))
    out = attention_kl_rows_torch(q, k, q_t, k_t, problem, chunk_size=chunk_size)
    ref = attention_kl_reference(q, k, q_t, k_t, causal=causal, reduction="none")
    assert rel_err(out, ref) < 1e-5
    upstream = torch.randn_like(ref)
    grads = torch.autograd.grad((out * upstream.float()).sum(), (q, k, q_t, k_t))
    ref_grads = torch.autograd.grad((ref * upstream).sum(), (q, k, q_t, k_t))
    for grad, ref_grad in zip(grads, ref_grads):
        assert rel_err(grad, ref_grad) < 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
def test_module_matches_function(backend, device):
    torch.manual_seed(9)
    q, k, q_t, k_t = make_inputs((2, 2, 11, 11, 32, 32, False), torch.float32, device)
    loss_fn = AttentionKLDivLoss(temperature=1.5, reduction="batchmean", backend=backend)
    expected = attention_kl(q, k, q_t, k_t, temperature=1.5, reduction="batchmean", backend=backend)
    torch.testing.assert_close(loss_fn(q, k, q_t, k_t), expected)
    assert "batchmean" in repr(loss_fn)


def assert_compiled_matches_eager(loss, args, inputs, backend="inductor"):
    """torch.compile(loss, fullgraph=True) gives eager's value and gradients with respect to inputs."""
    torch._dynamo.reset()
    compiled = torch.compile(loss, backend=backend, fullgraph=True)
    value = compiled(*args)
    grads = torch.autograd.grad(value, inputs)
    eager_value = loss(*args)
    eager_grads = torch.autograd.grad(eager_value, inputs)
    torch.testing.assert_close(value, eager_value)
    for grad, eager_grad in zip(grads, eager_grads):
        torch.testing.assert_close(grad, eager_grad)


@pytest.mark.parametrize("teacher_grad", [False, True])
def test_torch_compile_traces_the_custom_ops(teacher_grad, device):
    """fullgraph tracing through the registered ops, their fake kernels and autograd formula."""
    torch.manual_seed(10)
    q, k, q_t, k_t = make_inputs((1, 2, 20, 20, 32, 32, False), torch.float32, device, teacher_grad=teacher_grad)

    def loss(q, k, q_t, k_t):
        return attention_kl(q, k, q_t, k_t, temperature=2.0, backend="triton") * 3.0

    inputs = (q, k, q_t, k_t) if teacher_grad else (q, k)
    assert_compiled_matches_eager(loss, (q, k, q_t, k_t), inputs, backend="aot_eager")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA and the inductor GPU backend")
def test_torch_compile_inductor_fullgraph_on_gpu():
    torch.manual_seed(11)
    q, k, q_t, k_t = make_inputs((2, 4, 256, 256, 64, 64, False), torch.bfloat16, "cuda")

    def loss(q, k, q_t, k_t):
        return attention_kl(q, k, q_t, k_t, backend="triton")

    assert_compiled_matches_eager(loss, (q, k, q_t, k_t), (q,))


def test_torch_backend_keeps_float32_math_under_autocast(device):
    torch.manual_seed(12)
    q, k, q_t, k_t = make_inputs((1, 2, 40, 40, 64, 64, False), torch.bfloat16, device)
    ref = attention_kl_reference(q, k, q_t, k_t, reduction="none")
    with torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16):
        out = attention_kl(q, k, q_t, k_t, reduction="none", backend="torch")
        grad = torch.autograd.grad(out.sum(), q)[0]
    assert out.dtype == torch.float32
    assert rel_err(out, ref) < 1e-5
    ref_grad = torch.autograd.grad(ref.sum(), q)[0]
    assert rel_err(grad, ref_grad) < 1e-2


@pytest.mark.parametrize("backend", BACKENDS)
def test_double_backward_is_refused_clearly(backend, device):
    q, k, q_t, k_t = make_inputs((1, 1, 9, 9, 16, 16, False), torch.float32, device)
    out = attention_kl(q, k, q_t, k_t, backend=backend)
    # A first-order gradient that silently drops the second-order terms is refused outright.
    with pytest.raises(RuntimeError, match="supports no double backward"):
        torch.autograd.grad(out, q, create_graph=True)
    # The ordinary first-order gradient is unaffected.
    out = attention_kl(q, k, q_t, k_t, backend=backend)
    assert torch.isfinite(torch.autograd.grad(out, q)[0]).all()
