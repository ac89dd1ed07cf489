"""Fused Triton attention KL: KL(softmax(s_t) ‖ softmax(s_s)) per query row, never materialised.

Modules, read in this order: ``common`` (Triton helpers the kernels share), ``forward`` and
``backward`` (the kernels), ``tuning`` (autotuning candidates and heuristic tiles),
``launch_cache`` (replays compiled kernels), ``variants`` (the constants of the arithmetic
variants :mod:`cl_streamkl.kernels.config` selects), ``launch`` (the launchers), ``fused`` (the KL
and its gradients in one pass, when both log-sum-exps are given) and ``ops``
(``torch.library`` custom ops, so ``torch.compile(fullgraph=True)`` traces through, with
their autograd formula, and the entry point used by :func:`cl_streamkl.attention_kl`).

The math is stated at the top of ``forward`` and ``backward``.

``INTERPRETING`` says whether Triton runs the kernels on its CPU interpreter
(TRITON_INTERPRET=1 set before triton was imported).
"""

from cl_streamkl.kernels.triton.common import INTERPRETING
from cl_streamkl.kernels.triton.fused import attention_kl_fused_triton, attention_kl_fused_triton_grouped
from cl_streamkl.kernels.triton.launch import KERNEL_LAUNCHERS, launch_backward, launch_forward
from cl_streamkl.kernels.triton.ops import attention_kl_rows_triton, attention_kl_rows_triton_grouped

__all__ = [
    "INTERPRETING",
    "KERNEL_LAUNCHERS",
    "attention_kl_fused_triton",
    "attention_kl_fused_triton_grouped",
    "attention_kl_rows_triton",
    "attention_kl_rows_triton_grouped",
    "launch_backward",
    "launch_forward",
]
