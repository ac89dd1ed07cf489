"""The fused forward: a scalar KL and its gradients in one pass (both log-sum-exps given).

Float64 checks of the value and the student's gradients under an upstream gradient other than
1, every reduction and dtype, odd shapes, causal; the loss used twice; ``retain_graph``; the
grouped form; torch.compile through the custom ops; and where it does not run (``reduction=
"none"``, a teacher needing gradients, no gradient asked, ``deterministic``, the switch off).
The switch is "on" here: "auto" fuses from 4096 tokens, far longer than the interpreter's problems.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from test_attention_kl import DTYPE_IDS, DTYPES, SHAPES, error_bound, low_precision_rows, make_inputs, rel_err, shape_id
from test_known_lse import given_lse

from cl_streamkl import attention_kl, attention_kl_grouped, attention_kl_reference
from cl_streamkl.kernels.config import FUSED_MAX_HEAD_DIM, kernel_options, set_kernel_options

REDUCTIONS = {"sum": lambda rows: rows.sum(), "mean": lambda rows: rows.mean(),
              "batchmean": lambda rows: rows.sum() / rows.size(0)}
FUSED_NODES = ("_FusedFunctionBackward", "_GroupedFusedFunctionBackward")


@pytest.fixture(autouse=True)
def _fused_at_any_length():
    set_kernel_options(fused_gradients="on")  # conftest puts the options back after each test


def _node(value: torch.Tensor) -> str:
    return type(value.grad_fn).__name__


def test_auto_fuses_from_its_minimum_length(monkeypatch, device):
    inputs, lse = _float32_problem(device)
    set_kernel_options(fused_gradients="auto")
    assert _node(attention_kl(*inputs, backend="triton", **lse)) not in FUSED_NODES
    # The package exports the function under the module's name: patch the module itself.
    monkeypatch.setattr(importlib.import_module("cl_streamkl.attention_kl"), "FUSED_MIN_LENGTH", inputs[0].size(2))
    assert _node(attention_kl(*inputs, backend="triton", **lse)) in FUSED_NODES


# Every shape and dtype with a mean; the other reductions (a different weight only) on two shapes.
CASES = ([("mean", dtype, shape) for shape in SHAPES for dtype in DTYPES]
         + [(reduction, torch.bfloat16, shape) for reduction in ("sum", "batchmean") for shape in SHAPES[1:5:3]])


@pytest.mark.parametrize("reduction, dtype, shape", CASES,
                         ids=[f"{r}-{DTYPE_IDS[d]}-{shape_id(s)}" for r, d, s in CASES])
def test_value_and_gradients_match_float64(reduction, dtype, shape, device):
    torch.manual_seed(0)
    causal = shape[-1]
    inputs = make_inputs(shape, dtype, device)
    q, k, q_t, k_t = inputs
    factor = 3.7  # an upstream gradient other than 1
    value = attention_kl(*inputs, causal=causal, reduction=reduction, backend="triton", **given_lse(*inputs, causal))
    # Wider heads keep the forward and backward kernels, even with fused_gradients="on".
    fused = max(shape[4], shape[5]) <= FUSED_MAX_HEAD_DIM
    assert (_node(value) in FUSED_NODES) == fused and value.dtype == torch.float32 and value.shape == ()
    reference = REDUCTIONS[reduction](attention_kl_reference(*inputs, causal=causal, reduction="none"))
    assert rel_err(value, reference) < 1e-4 or (value - reference).abs() < 1e-5
    grads = torch.autograd.grad(value * factor, (q, k))
    ref_grads = torch.autograd.grad(reference * factor, (q, k))
    q_low, k_low = q.detach().requires_grad_(), k.detach().requires_grad_()
    baseline = REDUCTIONS[reduction](low_precision_rows(q_low, k_low, q_t, k_t, causal)) * factor
    baseline_grads = torch.autograd.grad(baseline, (q_low, k_low))
    for name, grad, ref_grad, base_grad in zip("qk", grads, ref_grads, baseline_grads):
        assert grad.dtype == dtype and grad.shape == ref_grad.shape
        if ref_grad.norm() == 0:  # one key: the KL is 0 whatever q and k are
            assert grad.abs().max() <= 1e-6, f"grad of {name}"
            continue
        assert rel_err(grad, ref_grad) < error_bound(dtype, rel_err(base_grad, ref_grad)), f"grad of {name}"


def _float32_problem(device, shape=(2, 3, 29, 29, 32, 48, False), seed=1):
    torch.manual_seed(seed)
    inputs = make_inputs(shape, torch.float32, device)
    return inputs, given_lse(*inputs)


def test_equals_the_forward_then_backward_kernels(device):
    inputs, lse = _float32_problem(device)
    fused = attention_kl(*inputs, backend="triton", **lse)
    fused_grads = torch.autograd.grad(fused * -2.0, inputs[:2])
    with kernel_options(fused_gradients="off"):
        landed = attention_kl(*inputs, backend="triton", **lse)
    assert _node(landed) not in FUSED_NODES
    landed_grads = torch.autograd.grad(landed * -2.0, inputs[:2])
    torch.testing.assert_close(fused, landed, rtol=1e-6, atol=1e-7)
    for grad, reference in zip(fused_grads, landed_grads):
        assert rel_err(grad, reference) < 1e-5


def test_the_loss_used_twice_and_retain_graph(device):
    inputs, lse = _float32_problem(device)
    q, k = inputs[:2]
    value = attention_kl(*inputs, backend="triton", **lse)
    once = torch.autograd.grad(value, (q, k), retain_graph=True)
    twice = torch.autograd.grad(value * 2.0 + value, (q, k), retain_graph=True)
    for single, combined in zip(once, twice):
        torch.testing.assert_close(combined, 3.0 * single)
    (value * 0.5).backward(retain_graph=True)
    (value * 0.5).backward()  # the saved gradients are scaled afresh, not in place
    torch.testing.assert_close(q.grad, once[0])
    torch.testing.assert_close(k.grad, once[1])


def test_grouped_problems_each_scaled_by_their_own_upstream(device):
    torch.manual_seed(2)
    shape = (2, 2, 23, 23, 32, 32, False)
    problems = [make_inputs(shape, torch.float32, device) for _ in range(3)]
    lse = [given_lse(*problem) for problem in problems]
    values = attention_kl_grouped(problems, reduction="batchmean", backend="triton",
                                  lse=[g["lse"] for g in lse], lse_teacher=[g["lse_teacher"] for g in lse])
    assert _node(values) in FUSED_NODES and values.shape == (3,)
    weights = torch.tensor([1.5, -2.0, 0.0], device=device)
    inputs = [tensor for problem in problems for tensor in problem[:2]]
    grads = torch.autograd.grad((values * weights).sum(), inputs)
    reference = torch.stack([attention_kl_reference(*problem, reduction="batchmean") for problem in problems])
    ref_grads = torch.autograd.grad((reference * weights.double()).sum(), inputs)
    assert rel_err(values, reference) < 1e-5
    for index, (grad, ref_grad) in enumerate(zip(grads, ref_grads)):
        if index >= 4:  # the third problem's upstream is 0
            assert grad.abs().max() == 0
        else:
            assert rel_err(grad, ref_grad) < 2e-5


def test_gradients_keep_the_inputs_layout(device):
    """timm's q and k are views of one permuted qkv tensor: the gradients are laid out alike."""
    torch.manual_seed(3)
    qkv = torch.randn(2, 19, 3 * 2 * 32, device=device, requires_grad=True)
    q, k, _ = qkv.reshape(2, 19, 3, 2, 32).permute(2, 0, 3, 1, 4).unbind(0)
    q_t, k_t = (torch.randn(2, 2, 19, 32, device=device) for _ in range(2))
    value = attention_kl(q, k, q_t, k_t, backend="triton", **given_lse(q, k, q_t, k_t))
    grad_q, grad_k = torch.autograd.grad(value, (q, k))
    assert grad_q.stride() == torch.empty_like(q).stride() and grad_k.stride() == torch.empty_like(k).stride()


@pytest.mark.parametrize("case", ["reduction none", "teacher grad", "no grad", "deterministic", "switch off"])
def test_other_calls_keep_the_forward_and_backward_kernels(case, device):
    inputs, lse = _float32_problem(device, seed=4)
    if case == "teacher grad":
        inputs = (*inputs[:2], inputs[2].detach().requires_grad_(), inputs[3])
    options = {"deterministic": {"deterministic": True}, "switch off": {"fused_gradients": "off"}}.get(case, {})
    reduction = "none" if case == "reduction none" else "mean"
    with kernel_options(**options), torch.set_grad_enabled(case != "no grad"):
        value = attention_kl(*inputs, reduction=reduction, backend="triton", **lse)
    assert value.grad_fn is None if case == "no grad" else _node(value) not in FUSED_NODES
    reference = attention_kl_reference(*inputs, reduction=reduction)
    assert rel_err(value, reference) < 1e-5


def test_torch_compile_traces_the_fused_ops(device):
    inputs, lse = _float32_problem(device, seed=5)
    problems = [inputs, _float32_problem(device, seed=6)[0]]
    stacked = [lse, given_lse(*problems[1])]

    def loss(problems):
        single = attention_kl(*problems[0], backend="triton", **stacked[0])
        grouped = attention_kl_grouped(problems, backend="triton", lse=[g["lse"] for g in stacked],
                                       lse_teacher=[g["lse_teacher"] for g in stacked])
        return single * 2.0 + (grouped * torch.tensor([1.0, 3.0], device=grouped.device)).sum()

    leaves = [tensor for problem in problems for tensor in problem[:2]]
    eager = loss(problems)
    eager_grads = torch.autograd.grad(eager, leaves)
    torch._dynamo.reset()
    compiled = torch.compile(loss, backend="aot_eager", fullgraph=True)(problems)
    compiled_grads = torch.autograd.grad(compiled, leaves)
    torch.testing.assert_close(compiled, eager)
    for grad, reference in zip(compiled_grads, eager_grads):
        torch.testing.assert_close(grad, reference)


def test_double_backward_is_refused(device):
    inputs, lse = _float32_problem(device, seed=7)
    value = attention_kl(*inputs, backend="triton", **lse)
    with pytest.raises(RuntimeError, match="no double backward"):
        torch.autograd.grad(value, inputs[:2], create_graph=True)
