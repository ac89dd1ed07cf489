"""GPU checks of the fused forward (the KL and its gradients in one pass) against float64.

The fused forward runs where both log-sum-exps are given, the reduction is a scalar and the
teacher is frozen: the plugin's path. Each check takes a mean over rows, multiplies it by a
random scalar (an upstream gradient other than 1) and compares the value and the student's
gradients with the float64 reference; it also confirms the fused kernel ran (its autograd node).
"""

from __future__ import annotations

import torch

from _harness.kl_workloads import log_sum_exps
from _harness.measure import relative_error
from cl_streamkl import attention_kl, attention_kl_grouped, attention_kl_reference
from cl_streamkl.kernels.config import kernel_options

FUSED_NODES = ("_FusedFunctionBackward", "_GroupedFusedFunctionBackward")


def _problem(batch: int, heads: int, n: int, dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    q, k, q_t, k_t = (torch.randn(batch, heads, n, dim, device="cuda", dtype=dtype) * 1.5 for _ in range(4))
    return q.requires_grad_(), k.requires_grad_(), q_t, k_t


def _reference(problem: tuple[torch.Tensor, ...], causal: bool, factor: float) -> tuple[torch.Tensor, ...]:
    q, k, q_t, k_t = problem
    rows = attention_kl_reference(q, k, q_t, k_t, causal=causal, reduction="none")
    value = rows.mean() * factor
    return (value.detach(), *torch.autograd.grad(value, (q, k)))


def check_fused(batch: int, heads: int, n: int, dim: int, dtype: torch.dtype, causal: bool = False) -> dict:
    """One problem through :func:`attention_kl` (mean, both log-sum-exps given) against float64."""
    problem = _problem(batch, heads, n, dim, dtype)
    q, k, q_t, k_t = problem
    factor = float(torch.empty(()).uniform_(0.5, 3.0))
    lse = {"lse": log_sum_exps(q, k, causal), "lse_teacher": log_sum_exps(q_t, k_t, causal)}
    with kernel_options(fused_gradients="on"):  # at every length, not only where "auto" fuses
        value = attention_kl(q, k, q_t, k_t, causal=causal, backend="triton", **lse) * factor
    fused = type(value.grad_fn.next_functions[0][0]).__name__ in FUSED_NODES
    grads = torch.autograd.grad(value, (q, k))
    ref_value, *ref_grads = _reference(problem, causal, factor)
    return {"fwd": relative_error(value, ref_value) if fused else float("inf"),
            "grads": max(relative_error(g, r) for g, r in zip(grads, ref_grads))}


def check_fused_grouped(blocks: int, batch: int, heads: int, n: int, dim: int) -> dict:
    """``blocks`` bf16 problems through :func:`attention_kl_grouped` (mean, log-sum-exps given), each
    problem's value scaled by its own random factor, against float64 per problem."""
    problems = [_problem(batch, heads, n, dim, torch.bfloat16) for _ in range(blocks)]
    lse = [log_sum_exps(q, k) for q, k, _, _ in problems]
    lse_teacher = [log_sum_exps(q_t, k_t) for _, _, q_t, k_t in problems]
    factors = torch.empty(blocks, device="cuda").uniform_(0.5, 3.0)
    with kernel_options(fused_gradients="on"):
        values = attention_kl_grouped(problems, backend="triton", lse=lse, lse_teacher=lse_teacher)
    fused = type(values.grad_fn).__name__ in FUSED_NODES
    inputs = [tensor for problem in problems for tensor in problem[:2]]
    grads = torch.autograd.grad((values * factors).sum(), inputs)
    fwd_err, grad_err = 0.0 if fused else float("inf"), 0.0
    for index, problem in enumerate(problems):
        ref_value, *ref_grads = _reference(problem, False, float(factors[index]))
        fwd_err = max(fwd_err, relative_error(values[index] * factors[index], ref_value))
        grad_err = max(grad_err, *(relative_error(g, r) for g, r in zip(grads[2 * index:2 * index + 2], ref_grads)))
        torch.cuda.empty_cache()
    return {"fwd": fwd_err, "grads": grad_err}
