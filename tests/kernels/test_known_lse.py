"""attention_kl with the log-sum-exps given (``lse``, ``lse_teacher``): float64 checks, wrong inputs.

The given log-sum-exps are computed here as the models' attention computes them: in float32
(natural log) from the very q and k, or deliberately wrong (stale, shifted, other inputs'), to
show which errors the kernels absorb (the teacher's, renormalised by σ) and which a float64
check catches (the student's).
"""

from __future__ import annotations

import pytest
import torch
from test_attention_kl import DTYPE_IDS, SHAPES, check_against_reference, make_inputs, rel_err, shape_id

from cl_streamkl import AttentionKLDivLoss, attention_kl, attention_kl_grouped, attention_kl_reference

BACKENDS = ["triton", "torch"]
LOG2_E = 1.4426950408889634


def log_sum_exp(q: torch.Tensor, k: torch.Tensor, causal: bool = False, scale: float | None = None) -> torch.Tensor:
    """The natural log-sum-exp of softmax(q kᵀ · scale) rows, float32, as fused attention returns it."""
    scale = q.size(-1) ** -0.5 if scale is None else scale
    scores = (q.detach().float() @ k.detach().float().transpose(-1, -2)) * scale
    if causal:
        keep = torch.ones(q.size(2), k.size(2), dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    return torch.logsumexp(scores, dim=-1)


def given_lse(q, k, q_t, k_t, causal=False) -> dict[str, torch.Tensor]:
    return {"lse": log_sum_exp(q, k, causal), "lse_teacher": log_sum_exp(q_t, k_t, causal)}


@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=DTYPE_IDS.get)
@pytest.mark.parametrize("backend", BACKENDS)
def test_given_lse_matches_reference_values_and_grads(backend, dtype, shape, device):
    # At N = 1 every KL is 0; the given LSEs' rounding leaves about 1e-7.
    check_against_reference(shape, dtype, backend, device, given_lse=given_lse, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("causal", [False, True])
def test_given_lse_teacher_gradients(backend, causal, device):
    torch.manual_seed(1)
    q, k, q_t, k_t = make_inputs((1, 2, 21, 21, 32, 48, causal), torch.float32, device, teacher_grad=True)
    ref = attention_kl_reference(q, k, q_t, k_t, causal=causal, reduction="none")
    out = attention_kl(q, k, q_t, k_t, causal=causal, reduction="none", backend=backend,
                       **given_lse(q, k, q_t, k_t, causal))
    upstream = torch.randn_like(ref)
    ref_grads = torch.autograd.grad((ref * upstream).sum(), (q, k, q_t, k_t))
    grads = torch.autograd.grad((out * upstream.float()).sum(), (q, k, q_t, k_t))
    for name, grad, ref_grad in zip(("q", "k", "q_teacher", "k_teacher"), grads, ref_grads):
        assert rel_err(grad, ref_grad) < 2e-5, f"grad of {name}"


@pytest.mark.parametrize("backend", BACKENDS)
def test_wrong_teacher_lse_is_renormalised_but_a_stale_student_lse_is_caught(backend, device):
    """σ absorbs an lse_teacher off by a constant; an lse of other inputs fails the float64 check."""
    torch.manual_seed(2)
    shape = (2, 2, 17, 23, 32, 32, False)
    q, k, q_t, k_t = make_inputs(shape, torch.float32, device)
    ref = attention_kl_reference(q, k, q_t, k_t, reduction="none")
    right = given_lse(q, k, q_t, k_t)
    shifted = attention_kl(q, k, q_t, k_t, reduction="none", backend=backend,
                           lse=right["lse"], lse_teacher=right["lse_teacher"] + 3.0)
    assert rel_err(shifted, ref) < 1e-4
    stale_q, stale_k, _, _ = make_inputs(shape, torch.float32, device)
    for stale in (log_sum_exp(stale_q, stale_k), right["lse"] + 0.1, log_sum_exp(q, k, scale=0.5 * 32**-0.5)):
        wrong = attention_kl(q, k, q_t, k_t, reduction="none", backend=backend,
                             lse=stale, lse_teacher=right["lse_teacher"])
        assert rel_err(wrong, ref) > 1e-2


def test_kernel_reports_how_far_the_teacher_lse_was_off(device):
    """The stored teacher log-sum-exp is lse_t + log2 σ: log2 σ is 0 for the right lse_t, the shift otherwise."""
    from cl_streamkl.kernels.triton.launch import launch_forward

    torch.manual_seed(3)
    q, k, q_t, k_t = make_inputs((1, 2, 19, 19, 32, 32, False), torch.float32, device, requires_grad=False)
    right = given_lse(q, k, q_t, k_t)
    for shift in (0.0, -2.0, 5.0):
        _, lse_student, lse_teacher = launch_forward(
            q, k, q_t, k_t, 32**-0.5, 32**-0.5, False, right["lse"], right["lse_teacher"] + shift
        )
        log2_sigma = lse_teacher - (right["lse_teacher"] + shift) * LOG2_E
        torch.testing.assert_close(log2_sigma, torch.full_like(log2_sigma, -shift * LOG2_E), atol=1e-5, rtol=0)
        torch.testing.assert_close(lse_student, right["lse"] * LOG2_E)


@pytest.mark.parametrize("backend", BACKENDS)
def test_strided_lse_views_are_read_in_place(backend, device):
    """cuDNN's (B, H, N, 1) and the efficient backend's row-padded LSEs, as views."""
    torch.manual_seed(4)
    q, k, q_t, k_t = make_inputs((2, 3, 17, 17, 32, 32, False), torch.float32, device, requires_grad=False)
    right = given_lse(q, k, q_t, k_t)
    padded = torch.zeros(2, 3, 32, device=device)
    padded[..., :17] = right["lse"]
    expected = attention_kl(q, k, q_t, k_t, reduction="none", backend=backend, **right)
    out = attention_kl(q, k, q_t, k_t, reduction="none", backend=backend,
                       lse=padded[..., :17], lse_teacher=right["lse_teacher"][..., None].squeeze(-1))
    torch.testing.assert_close(out, expected)


@pytest.mark.parametrize("backend", BACKENDS)
def test_identical_models_give_nearly_zero(backend, device):
    torch.manual_seed(5)
    q, k, _, _ = make_inputs((1, 2, 33, 33, 32, 32, False), torch.float32, device, requires_grad=False)
    lse = log_sum_exp(q, k)
    out = attention_kl(q, k, q, k, reduction="none", backend=backend, lse=lse, lse_teacher=lse)
    assert out.abs().max() < 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
def test_grouped_given_lse_matches_single_calls(backend, device):
    torch.manual_seed(6)
    shape = (2, 2, 17, 17, 32, 32, False)
    problems = [make_inputs(shape, torch.float32, device) for _ in range(3)]
    lse = [log_sum_exp(q, k) for q, k, _, _ in problems]
    lse_teacher = [log_sum_exp(q_t, k_t) for _, _, q_t, k_t in problems]
    weights = torch.randn(3, device=device)
    grouped = attention_kl_grouped(problems, backend=backend, lse=lse, lse_teacher=lse_teacher)
    inputs = [tensor for problem in problems for tensor in problem[:2]]
    grads = torch.autograd.grad((grouped * weights).sum(), inputs)
    reference = torch.stack([attention_kl_reference(*problem) for problem in problems])
    ref_grads = torch.autograd.grad((reference * weights.double()).sum(), inputs)
    assert rel_err(grouped, reference) < 1e-4
    for grad, ref_grad in zip(grads, ref_grads):
        assert rel_err(grad, ref_grad) < 2e-5


def test_lse_is_validated_with_one_line_errors(device):
    q, k, q_t, k_t = make_inputs((2, 3, 17, 17, 32, 32, False), torch.float32, device, requires_grad=False)
    lse = log_sum_exp(q, k)
    cases = [
        (dict(lse=lse), TypeError, "lse and lse_teacher go together"),
        (dict(lse=lse, lse_teacher=lse.double()), TypeError, "lse_teacher must be float32"),
        (dict(lse=lse[..., None], lse_teacher=lse), ValueError, r"lse must have shape \(B, H, Nq\) = \(2, 3, 17\)"),
        (dict(lse=lse, lse_teacher=lse[:1]), ValueError, "lse_teacher must have shape"),
        (dict(lse=lse.tolist(), lse_teacher=lse), TypeError, "lse must be a torch.Tensor"),
        (dict(lse=lse, lse_teacher=torch.zeros(2, 3, 17, device="meta")), ValueError, "lse_teacher is on meta"),
    ]
    for backend in BACKENDS:
        for kwargs, error, message in cases:
            with pytest.raises(error, match=message) as raised:
                attention_kl(q, k, q_t, k_t, backend=backend, **kwargs)
            assert "\n" not in str(raised.value)
    with pytest.raises(TypeError, match="lse must be float32"):
        attention_kl_reference(q, k, q_t, k_t, lse=lse.half(), lse_teacher=lse)
    with pytest.raises(ValueError, match="lse has 1 entries but there are 2 problems"):
        attention_kl_grouped([(q, k, q_t, k_t)] * 2, lse=[lse], lse_teacher=[lse, lse])
    with pytest.raises(TypeError, match=r"problems\[1\]: lse and lse_teacher must hold a tensor"):
        attention_kl_grouped([(q, k, q_t, k_t)] * 2, lse=[lse, None], lse_teacher=[lse, lse])
    with pytest.raises(ValueError, match=r"problems\[0\]: lse must have shape"):
        attention_kl_grouped([(q, k, q_t, k_t)] * 2, lse=[lse[0], lse], lse_teacher=[lse, lse])


def test_module_takes_the_lse(device):
    q, k, q_t, k_t = make_inputs((1, 2, 9, 9, 32, 32, False), torch.float32, device, requires_grad=False)
    lse = given_lse(q, k, q_t, k_t)
    loss_fn = AttentionKLDivLoss(reduction="sum", backend="torch")
    torch.testing.assert_close(loss_fn(q, k, q_t, k_t, **lse),
                               attention_kl(q, k, q_t, k_t, reduction="sum", backend="torch", **lse))


@pytest.mark.parametrize("grouped", [False, True])
def test_torch_compile_traces_the_given_lse(grouped, device):
    """fullgraph tracing through the forward ops with their optional log-sum-exp arguments."""
    from test_attention_kl import assert_compiled_matches_eager

    torch.manual_seed(7)
    q, k, q_t, k_t = make_inputs((1, 2, 20, 20, 32, 32, False), torch.float32, device)
    lse = given_lse(q, k, q_t, k_t)

    def loss(q, k, q_t, k_t):
        if grouped:
            problems = [(q, k, q_t, k_t), (q * 0.5, k, q_t, k_t)]
            lse_half = log_sum_exp(q * 0.5, k)
            return attention_kl_grouped(problems, backend="triton", lse=[lse["lse"], lse_half],
                                        lse_teacher=[lse["lse_teacher"]] * 2).sum() * 3.0
        return attention_kl(q, k, q_t, k_t, backend="triton", **lse) * 3.0

    assert_compiled_matches_eager(loss, (q, k, q_t, k_t), (q, k), backend="aot_eager")
