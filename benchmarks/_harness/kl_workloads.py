"""What the kernel benchmark times: problems, the implementations bound to their inputs, and
the extra memory of one call.

Implementations: ``triton`` and ``torch`` (``attention_kl`` with that backend; ``triton`` with the
split backward, ``kernel_options(backward="split")``), ``triton_onepass`` (the triton backend with
the one-pass backward, ``kernel_options(backward="onepass")``),
``triton_lse`` and ``triton_lse_onepass`` (the same handed both log-sum-exps, as the models'
attention computes them: :func:`log_sum_exps`, outside the timed call; forward, then backward
kernels: ``kernel_options(fused_gradients="off")``), ``triton_fused`` (handed both log-sum-exps,
the gradients computed in the forward pass, the backward scaling them: ``fused_gradients="on"``,
at every length), ``eager`` (both
maps materialised, ``cl_streamkl.kernels.eager_attention_kl``), ``compiled`` (its
``torch.compile``), ``sdpa`` (SDPA's default backend, named per row) and ``sdpa_fa2`` (SDPA
pinned to FlashAttention-2).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from _harness.measure import PeakMemory
from _harness.options import DTYPES, Shape, shape_label
from cl_streamkl import attention_kl
from cl_streamkl.kernels import eager_attention_kl
from cl_streamkl.kernels.config import kernel_options

ONE_PASS = "triton_onepass"
KNOWN_LSE = ("triton_lse", "triton_lse_onepass")
FUSED = "triton_fused"
IMPLEMENTATIONS = ("triton", ONE_PASS, *KNOWN_LSE, FUSED, "torch", "eager", "compiled", "sdpa", "sdpa_fa2")
SDPA_IMPLEMENTATIONS = ("sdpa", "sdpa_fa2")

# torch._fused_sdp_choice's answer → the backend's name (torch.nn.attention.SDPBackend order).
_SDPA_CHOICES = {int(b): name.lower().removesuffix("_attention") for name, b in SDPBackend.__members__.items()
                 if name not in ("ERROR", "OVERRIDEABLE")}
MODES = ("fwd", "bwd", "fwd+bwd")

# Matrix products (each 2·B·H·N²·D FLOP) per call behind the TFLOP/s-equivalent column. Every
# KL implementation gets the KL count (fwd: QKᵀ of student and teacher; bwd: both recomputed,
# dQ = dS·K, dK = dSᵀ·Q), whatever it actually computes; SDPA gets FlashAttention's.
KL_FLOP_PRODUCTS = {"fwd": 2, "bwd": 4, "fwd+bwd": 6}
SDPA_FLOP_PRODUCTS = {"fwd": 2, "bwd": 5, "fwd+bwd": 7}


@dataclass(frozen=True)
class Problem:
    """One benchmark problem: q, k, v, teacher q, k all of shape (batch, heads, seq, head_dim)."""

    batch: int
    heads: int
    seq: int
    head_dim: int
    dtype: torch.dtype
    causal: bool = False

    @property
    def shape(self) -> Shape:
        return (self.batch, self.heads, self.seq, self.head_dim)

    @property
    def label(self) -> str:
        return shape_label(self.shape)

    @property
    def dtype_name(self) -> str:
        return next(name for name, dtype in DTYPES.items() if dtype == self.dtype)

    def flops(self, impl: str, mode: str) -> float:
        """FLOP-equivalent of one call, per the product counts above (halved for causal)."""
        products = (SDPA_FLOP_PRODUCTS if impl in SDPA_IMPLEMENTATIONS else KL_FLOP_PRODUCTS)[mode]
        flops = 2.0 * products * self.batch * self.heads * self.seq**2 * self.head_dim
        return flops / 2 if self.causal else flops


@dataclass
class Workload:
    """Inputs and the forward/backward closures of one implementation on one problem.

    Attributes:
        leaves: tensors whose gradients the backward produces (cleared between calls).
        forward: runs the forward and returns its output (a scalar loss, or SDPA's
            (B, H, N, D) output).
        backward: ``backward(output, retain_graph)`` back-propagates from ``output``.
        backend: which kernel family runs (only SDPA chooses one).
    """

    leaves: list[torch.Tensor]
    forward: Callable[[], torch.Tensor]
    backward: Callable[[torch.Tensor, bool], None]
    backend: str = ""

    def clear_grads(self) -> None:
        for tensor in self.leaves:
            tensor.grad = None

    def grad_bytes(self) -> int:
        return sum(t.grad.nbytes for t in self.leaves if t.grad is not None)


def log_sum_exps(q: torch.Tensor, k: torch.Tensor, causal: bool = False, rows: int = 1024) -> torch.Tensor:
    """The natural log-sum-exp of each row of q kᵀ · D^-½ in float32, (B, H, N): what fused SDPA
    hands back with ``compute_log_sumexp``; ``rows`` query rows at a time, so no (N, N) matrix."""
    scale = q.size(-1) ** -0.5
    pieces = []
    with torch.no_grad():
        for start in range(0, q.size(2), rows):
            scores = q[:, :, start:start + rows].float() @ k.float().transpose(-1, -2) * scale
            if causal:
                index = torch.arange(start, start + scores.size(2), device=q.device)[:, None]
                scores = scores.masked_fill(torch.arange(k.size(2), device=q.device)[None, :] > index, float("-inf"))
            pieces.append(torch.logsumexp(scores, dim=-1))
    return torch.cat(pieces, dim=-1)


def make_inputs(problem: Problem, device: torch.device, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random student/teacher q, k, SDPA's v and upstream gradient, all (B, H, N, D); ``lse`` and
    ``lse_teacher`` (B, H, N) float32 are made on first use by :func:`given_lse`."""
    generator = torch.Generator(device=device).manual_seed(seed)

    def tensor(requires_grad: bool) -> torch.Tensor:
        values = torch.randn(problem.shape, generator=generator, device=device, dtype=problem.dtype)
        return values.requires_grad_(requires_grad)

    return {
        "q": tensor(True),
        "k": tensor(True),
        "v": tensor(True),
        "q_teacher": tensor(False),
        "k_teacher": tensor(False),
        "grad_out": tensor(False),
    }


def given_lse(inputs: dict[str, torch.Tensor], causal: bool) -> dict[str, torch.Tensor]:
    """``lse`` and ``lse_teacher`` of ``inputs`` (:func:`log_sum_exps`), made once and kept in ``inputs``."""
    if "lse" not in inputs:
        inputs["lse"] = log_sum_exps(inputs["q"], inputs["k"], causal)
        inputs["lse_teacher"] = log_sum_exps(inputs["q_teacher"], inputs["k_teacher"], causal)
    return {"lse": inputs["lse"], "lse_teacher": inputs["lse_teacher"]}


def _default_sdpa_backend(inputs: dict[str, torch.Tensor], causal: bool) -> str:
    """The backend F.scaled_dot_product_attention picks for these inputs when left alone."""
    choice = torch._fused_sdp_choice(inputs["q"], inputs["k"], inputs["v"], is_causal=causal)
    return _SDPA_CHOICES.get(int(choice), f"backend {int(choice)}")


def _pick_sdpa_backend(inputs: dict[str, torch.Tensor], causal: bool) -> SDPBackend:
    # Eligibility depends on dtype, head dim and device, not on N, so a tiny slice decides.
    q, k, v = (inputs[name][:1, :1, :16] for name in ("q", "k", "v"))
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
        try:
            with sdpa_kernel(backend):
                F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        except RuntimeError:
            continue
        return backend
    return SDPBackend.MATH


def _backward_scalar(output: torch.Tensor, retain_graph: bool) -> None:
    output.backward(retain_graph=retain_graph)


def _fused_kl(q, k, q_teacher, k_teacher, causal: bool, lse: dict) -> torch.Tensor:
    with kernel_options(fused_gradients="on"):
        return attention_kl(q, k, q_teacher, k_teacher, causal=causal, backend="triton", **lse)


def make_workload(impl: str, problem: Problem, inputs: dict[str, torch.Tensor]) -> Workload:
    """Bind one implementation to the problem's inputs.

    Raises:
        ValueError: ``impl`` is not one of :data:`IMPLEMENTATIONS`.
    """
    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    q_teacher, k_teacher = inputs["q_teacher"], inputs["k_teacher"]
    causal = problem.causal
    if impl == "torch":
        return Workload(
            leaves=[q, k],
            forward=lambda: attention_kl(q, k, q_teacher, k_teacher, causal=causal, backend=impl),
            backward=_backward_scalar,
        )
    if impl == FUSED:
        lse = given_lse(inputs, causal)
        return Workload(
            leaves=[q, k],
            forward=lambda: _fused_kl(q, k, q_teacher, k_teacher, causal, lse),
            backward=_backward_scalar,
        )
    if impl in ("triton", ONE_PASS, *KNOWN_LSE):
        lse = given_lse(inputs, causal) if impl in KNOWN_LSE else {}
        backward_kind = "onepass" if impl.endswith("onepass") else "split"

        def forward() -> torch.Tensor:
            with kernel_options(fused_gradients="off"):
                return attention_kl(q, k, q_teacher, k_teacher, causal=causal, backend="triton", **lse)

        def backward(output: torch.Tensor, retain_graph: bool) -> None:
            with kernel_options(backward=backward_kind):
                output.backward(retain_graph=retain_graph)

        return Workload(leaves=[q, k], forward=forward, backward=backward)
    if impl == "eager":
        return Workload(
            leaves=[q, k],
            forward=lambda: eager_attention_kl(q, k, q_teacher, k_teacher, causal=causal),
            backward=_backward_scalar,
        )
    if impl == "compiled":
        # A fresh static graph per problem; without the reset, the recompile limit would
        # silently send later shapes back to eager.
        torch._dynamo.reset()
        compiled = torch.compile(eager_attention_kl, dynamic=False)
        return Workload(
            leaves=[q, k],
            forward=lambda: compiled(q, k, q_teacher, k_teacher, causal=causal),
            backward=_backward_scalar,
        )
    if impl in SDPA_IMPLEMENTATIONS:
        pinned = _pick_sdpa_backend(inputs, causal) if impl == "sdpa_fa2" else None
        grad_out = inputs["grad_out"]

        def forward() -> torch.Tensor:
            if pinned is None:
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            with sdpa_kernel(pinned):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

        def backward(output: torch.Tensor, retain_graph: bool) -> None:
            output.backward(grad_out, retain_graph=retain_graph)

        return Workload(
            leaves=[q, k, v],
            forward=forward,
            backward=backward,
            backend=(_default_sdpa_backend(inputs, causal) if pinned is None
                     else pinned.name.lower().removesuffix("_attention")),
        )
    raise ValueError(f"impl must be one of {IMPLEMENTATIONS}, got {impl!r}")


def peak_extra_bytes(workload: Workload, mode: str, device: torch.device) -> int | None:
    """Peak memory of one call of ``mode`` beyond its inputs, outputs and gradients (CUDA only)."""
    if device.type != "cuda":
        return None
    workload.clear_grads()
    output = workload.forward() if mode == "bwd" else None
    kept = 0
    with PeakMemory(device) as memory:
        if mode == "bwd":
            workload.backward(output, False)
        else:
            output = workload.forward()
            kept += output.nbytes
            if mode == "fwd+bwd":
                workload.backward(output, False)
    kept += workload.grad_bytes()
    workload.clear_grads()
    return memory.extra_bytes - kept
