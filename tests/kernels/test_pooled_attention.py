"""pooled_attention against the float64 reference: both backends and variants, every dtype, odd shapes, gradients.

The triton backend runs the real kernels on the CPU through Triton's interpreter (16×16 tiles,
so N = 17 and 197 leave ragged tails and Nq != Nk splits the two sides' tiles differently).
"""

from __future__ import annotations

import pytest
import torch
from test_attention_kl import DTYPE_IDS, DTYPES, assert_compiled_matches_eager, error_bound, rel_err

from cl_streamkl import PooledAttention, pooled_attention, pooled_attention_reference
from cl_streamkl.kernels.pooled_torch import pooled_attention_torch

BACKENDS = ["triton", "torch"]
VARIANTS = {"squared": True, "plain": False}
# (B, H, Nq, Nk, D)
SHAPES = [(1, 1, 1, 1, 64), (2, 3, 17, 17, 64), (1, 2, 17, 40, 80), (1, 1, 197, 197, 80)]


def shape_id(shape) -> str:
    return "B{}-H{}-Nq{}-Nk{}-D{}".format(*shape)


def make_inputs(shape, dtype, device):
    batch, heads, n_q, n_k, dim = shape
    q = torch.randn(batch, heads, n_q, dim, device=device).to(dtype).requires_grad_()
    k = torch.randn(batch, heads, n_k, dim, device=device).to(dtype).requires_grad_()
    return q, k


def low_precision_pooled(q, k, squared: bool) -> PooledAttention:
    """The materialised math done entirely in the inputs' dtype: the baseline the error bounds scale with."""
    attention = torch.softmax(q @ k.transpose(-1, -2) * q.size(-1) ** -0.5, dim=-1)
    if squared:
        attention = attention * attention
    return PooledAttention(attention.sum(dim=-2), attention.sum(dim=-1))


def weighted_sum(pooled: PooledAttention, weights: PooledAttention) -> torch.Tensor:
    """Σ w·pooled over both vectors: its gradient has grad_output != 1 on every element."""
    return sum((vector * weight.to(vector.dtype)).sum() for vector, weight in zip(pooled, weights))


@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_matches_reference_values_and_grads(backend, variant, dtype, shape, device):
    torch.manual_seed(0)
    squared = VARIANTS[variant]
    q, k = make_inputs(shape, dtype, device)
    ref = pooled_attention_reference(q, k, squared=squared)
    out = pooled_attention(q, k, squared=squared, backend=backend)
    for vector, ref_vector in zip(out, ref):
        assert vector.dtype == torch.float32 and vector.shape == ref_vector.shape
        assert rel_err(vector, ref_vector) < 1e-4
    weights = PooledAttention(*(torch.randn_like(vector) for vector in ref))
    ref_grads = torch.autograd.grad(weighted_sum(ref, weights), (q, k))
    grads = torch.autograd.grad(weighted_sum(out, weights), (q, k))
    q_low, k_low = q.detach().requires_grad_(), k.detach().requires_grad_()
    baseline_grads = torch.autograd.grad(weighted_sum(low_precision_pooled(q_low, k_low, squared), weights),
                                         (q_low, k_low))
    for name, grad, ref_grad, base_grad in zip("qk", grads, ref_grads, baseline_grads):
        assert grad.dtype == dtype and grad.shape == ref_grad.shape
        if ref_grad.norm() == 0:  # one key: P = 1 whatever the scores
            assert grad.abs().max() == 0, f"grad of {name}"
        else:
            assert rel_err(grad, ref_grad) < error_bound(dtype, rel_err(base_grad, ref_grad)), f"grad of {name}"


@pytest.mark.parametrize("backend", BACKENDS)
def test_plain_rows_sum_to_one_and_squared_rows_do_not(backend, device):
    torch.manual_seed(1)
    q, k = make_inputs((1, 2, 19, 23, 32), torch.float32, device)
    plain = pooled_attention(q, k, squared=False, backend=backend)
    squared = pooled_attention(q, k, backend=backend)
    torch.testing.assert_close(plain.per_row, torch.ones_like(plain.per_row))
    torch.testing.assert_close(plain.per_key.sum(-1), torch.full((1, 2), 19.0, device=device))
    assert (squared.per_row < 1).all() and (squared.per_row >= 1 / 23 - 1e-6).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_output_used_and_expanded_gradients(backend, device):
    """A loss on per_key alone (no gradient for per_row), and a sum's stride-0 gradient."""
    torch.manual_seed(2)
    q, k = make_inputs((2, 2, 21, 18, 32), torch.float32, device)
    ref = pooled_attention_reference(q, k, scale=0.2)
    out = pooled_attention(q, k, scale=0.2, backend=backend)
    for loss, ref_loss in ((out.per_key.square().sum(), ref.per_key.square().sum()),
                           (out.per_key.sum() + 3 * out.per_row.sum(), ref.per_key.sum() + 3 * ref.per_row.sum())):
        grads = torch.autograd.grad(loss, (q, k), retain_graph=True)
        ref_grads = torch.autograd.grad(ref_loss, (q, k), retain_graph=True)
        for grad, ref_grad in zip(grads, ref_grads):
            assert rel_err(grad, ref_grad) < 1e-5


def test_triton_reads_timm_views_in_place_and_answers_in_their_layout(device):
    torch.manual_seed(3)
    batch, tokens, heads, dim = 2, 29, 3, 32
    qkv = torch.randn(batch, tokens, 3 * heads * dim, device=device, requires_grad=True)
    q, k, _ = qkv.reshape(batch, tokens, 3, heads, dim).permute(2, 0, 3, 1, 4).unbind(0)
    assert not q.is_contiguous()
    out = pooled_attention(q, k, backend="triton")
    ref = pooled_attention_reference(q, k)
    weights = PooledAttention(*(torch.randn_like(vector) for vector in ref))
    grads = torch.autograd.grad(weighted_sum(out, weights), (q, k))
    ref_grads = torch.autograd.grad(weighted_sum(ref, weights), (q, k))
    for tensor, grad, ref_grad in zip((q, k), grads, ref_grads):
        assert grad.stride() == torch.empty_like(tensor).stride()
        assert rel_err(grad, ref_grad) < 1e-5


def test_torch_chunks_give_the_same_answer(device):
    torch.manual_seed(4)
    q, k = make_inputs((1, 2, 23, 19, 16), torch.float32, device)
    whole = pooled_attention_torch(q, k, 0.25, True, chunk_size=64)
    for chunk_size in (1, 5):
        torch.testing.assert_close(pooled_attention_torch(q, k, 0.25, True, chunk_size=chunk_size), whole)
    with pytest.raises(ValueError, match="chunk_size must be a positive int"):
        pooled_attention_torch(q, k, 0.25, True, chunk_size=0)


@pytest.mark.parametrize("variant", VARIANTS)
def test_torch_compile_traces_the_custom_ops(variant, device):
    """The squared variant's loss uses both vectors; the plain one's per_key alone (no gradient for per_row)."""
    torch.manual_seed(5)
    q, k = make_inputs((1, 2, 20, 20, 32), torch.float32, device)

    def loss(q, k):
        per_key, per_row = pooled_attention(q, k, squared=VARIANTS[variant], backend="triton")
        return per_key.square().sum() + 2.0 * per_row.sum() if variant == "squared" else per_key.square().sum()

    assert_compiled_matches_eager(loss, (q, k), (q, k), backend="aot_eager")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA and the inductor GPU backend")
def test_torch_compile_inductor_fullgraph_on_gpu():
    torch.manual_seed(6)
    q, k = make_inputs((2, 4, 257, 257, 64), torch.bfloat16, "cuda")

    def loss(q, k):
        per_key, per_row = pooled_attention(q, k, backend="triton")
        return per_key.square().sum() + per_row.sum()

    assert_compiled_matches_eager(loss, (q, k), (q, k))


NON_FINITE = [("q", 1, float("inf")), ("q", 2, -float("inf")), ("k", 3, float("inf")), ("q", 0, float("nan"))]


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the interpreter's NumPy
@pytest.mark.parametrize("tensor, row, value", NON_FINITE, ids=[f"{t}{r}={v}" for t, r, v in NON_FINITE])
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_non_finite_inputs_give_the_references_nans(backend, variant, tensor, row, value, device):
    torch.manual_seed(2)
    q, k = (x.detach() for x in make_inputs((1, 2, 6, 7, 16), torch.float32, device))
    {"q": q, "k": k}[tensor][0, 1, row, 3] = value
    ref = pooled_attention_reference(q, k, squared=VARIANTS[variant])
    out = pooled_attention(q, k, squared=VARIANTS[variant], backend=backend)
    for vector, ref_vector in zip(out, ref):
        assert torch.equal(vector.isnan(), ref_vector.isnan())
        assert ref_vector.isnan().any()
        finite = ~ref_vector.isnan()
        assert rel_err(vector[finite], ref_vector[finite]) < 1e-4


def test_no_double_backward(device):
    q, k = make_inputs((1, 1, 5, 5, 16), torch.float32, device)
    for backend in BACKENDS:
        loss = pooled_attention(q, k, backend=backend).per_key.square().sum()
        with pytest.raises(RuntimeError, match="no double backward"):
            torch.autograd.grad(loss, q, create_graph=True)


_Q = torch.randn(1, 2, 5, 8)
BAD_INPUTS = [
    (dict(q=_Q[0]), ValueError, "q must have 4 dimensions"),
    (dict(k="keys"), TypeError, "k must be a torch.Tensor"),
    (dict(q=_Q.double()), TypeError, "q must be float32, float16 or bfloat16"),
    (dict(k=_Q.half()), TypeError, "k has dtype torch.float16 but q has torch.float32"),
    (dict(k=torch.randn(1, 3, 5, 8)), ValueError, "B, H and D must match"),
    (dict(k=torch.randn(1, 2, 5, 4)), ValueError, "B, H and D must match"),
    (dict(q=torch.randn(1, 2, 0, 8)), ValueError, "q must not be empty"),
    (dict(q=torch.randn(1, 2, 8, 5).transpose(-1, -2)), ValueError, "unit stride"),
    (dict(q=torch.randn(1, 1, 2, 300), k=torch.randn(1, 1, 2, 300)), ValueError, "at most 256"),
    (dict(scale=0.0), ValueError, "scale must be a finite number > 0"),
    (dict(scale="1"), TypeError, "scale must be a real number"),
    (dict(squared=1), TypeError, "squared must be a bool"),
    (dict(backend="cuda"), ValueError, "backend must be one of"),
]


@pytest.mark.parametrize("change, error, message", BAD_INPUTS, ids=[case[2] for case in BAD_INPUTS])
def test_bad_inputs_are_refused_in_one_line(change, error, message):
    arguments = {"q": _Q, "k": _Q, **change}
    with pytest.raises(error, match=message) as raised:
        pooled_attention(arguments.pop("q"), arguments.pop("k"), **arguments)
    assert "\n" not in str(raised.value)
