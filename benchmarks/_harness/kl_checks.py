"""The kernel benchmark's check before timing: each KL implementation against float64."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from _harness.kl_workloads import FUSED, KNOWN_LSE, ONE_PASS, Problem, given_lse, make_inputs
from _harness.measure import relative_error
from _harness.options import KL_IMPLEMENTATIONS
from cl_streamkl import attention_kl, attention_kl_reference
from cl_streamkl.kernels import eager_attention_kl
from cl_streamkl.kernels.config import kernel_options

CHECK_MAX_HEADS = 2
# The check keeps the problem's length, so the Triton kernels run with the tiles tuned for
# its length bucket and with its ragged tail (a check clipped to 1024 tokens once hid a
# tail-tile bug at 4097). Past 16384 tokens the float64 reference's (N, N) matrices would
# need far more than 20 GiB.
CHECK_MAX_SEQ = 16384
CHECK_ONE_HEAD_FROM_SEQ = 2049
# Loose sanity bounds for the pre-timing check: a kernel bug gives O(1) errors, while
# bfloat16 rounding of the scores (eager) or of dQ/dK (every implementation) stays near 1e-2.
CHECK_BOUNDS = {torch.float32: 1e-3, torch.float16: 2e-2, torch.bfloat16: 5e-2}


@dataclass
class CheckResult:
    """Relative RMS errors of one implementation against the float64 reference."""

    impl: str
    shape: str
    dtype: str
    causal: bool
    checked_shape: str
    kl: float
    dq: float
    dk: float
    bound: float
    passed: bool = field(init=False)

    def __post_init__(self) -> None:
        self.passed = max(self.kl, self.dq, self.dk) <= self.bound


def checked_problem(problem: Problem) -> Problem:
    """The smaller problem :func:`check_problem` compares with float64 (see there)."""
    heads = 1 if problem.seq >= CHECK_ONE_HEAD_FROM_SEQ else min(problem.heads, CHECK_MAX_HEADS)
    return Problem(1, heads, min(problem.seq, CHECK_MAX_SEQ), problem.head_dim, problem.dtype, problem.causal)


def _check_fused(checked: Problem, problem: Problem, inputs: dict, reference_rows: torch.Tensor) -> CheckResult:
    """The fused forward against float64: it takes a scalar reduction, so a mean times a random factor."""
    q, k, q_teacher, k_teacher = (inputs[name] for name in ("q", "k", "q_teacher", "k_teacher"))
    factor = float(torch.empty(()).uniform_(0.5, 3.0))
    reference = reference_rows.mean() * factor
    reference_dq, reference_dk = torch.autograd.grad(reference, (q, k), retain_graph=True)
    with kernel_options(fused_gradients="on"):
        value = attention_kl(q, k, q_teacher, k_teacher, causal=problem.causal, backend="triton",
                             **given_lse(inputs, problem.causal)) * factor
    dq, dk = torch.autograd.grad(value, (q, k))
    return CheckResult(FUSED, problem.label, problem.dtype_name, problem.causal, checked.label,
                       kl=relative_error(value, reference), dq=relative_error(dq, reference_dq),
                       dk=relative_error(dk, reference_dk), bound=CHECK_BOUNDS[problem.dtype])


def check_problem(problem: Problem, impls: Sequence[str], device: torch.device) -> list[CheckResult]:
    """Compare the KL implementations in ``impls`` with the float64 reference on a small problem.

    The checked problem keeps N (up to :data:`CHECK_MAX_SEQ`), D, dtype and causality but
    has B = 1 and H ≤ 2 (one head from :data:`CHECK_ONE_HEAD_FROM_SEQ` tokens), so the
    reference's (N, N) float64 matrices stay a few GiB. ``compiled`` is skipped (it is the
    eager code, and compiling an extra shape costs more than the check is worth).
    """
    checked = checked_problem(problem)
    inputs = make_inputs(checked, device, seed=1)
    q, k, q_teacher, k_teacher = (inputs[name] for name in ("q", "k", "q_teacher", "k_teacher"))
    weight = torch.rand(checked.shape[:3], device=device, dtype=torch.float64)
    reference_rows = attention_kl_reference(
        q, k, q_teacher, k_teacher, causal=problem.causal, reduction="none"
    )
    reference_dq, reference_dk = torch.autograd.grad((reference_rows * weight).sum(), (q, k), retain_graph=True)
    results = []
    for impl in impls:
        if impl == FUSED:
            results.append(_check_fused(checked, problem, inputs, reference_rows))
            continue
        if impl in KL_IMPLEMENTATIONS or impl == ONE_PASS or impl in KNOWN_LSE:
            backend = impl if impl in KL_IMPLEMENTATIONS else "triton"
            lse = given_lse(inputs, problem.causal) if impl in KNOWN_LSE else {}
            rows = attention_kl(q, k, q_teacher, k_teacher, causal=problem.causal, reduction="none", backend=backend,
                                **lse)
        elif impl == "eager":
            rows = eager_attention_kl(q, k, q_teacher, k_teacher, causal=problem.causal, reduction="none")
        else:
            continue
        with kernel_options(backward="onepass" if impl.endswith("onepass") else "split"):
            dq, dk = torch.autograd.grad((rows * weight).sum(), (q, k))
        results.append(
            CheckResult(
                impl=impl,
                shape=problem.label,
                dtype=problem.dtype_name,
                causal=problem.causal,
                checked_shape=checked.label,
                kl=relative_error(rows, reference_rows),
                dq=relative_error(dq, reference_dq),
                dk=relative_error(dk, reference_dk),
                bound=CHECK_BOUNDS[problem.dtype],
            )
        )
    return results
