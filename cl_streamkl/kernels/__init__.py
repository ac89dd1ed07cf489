"""StreamKL kernels: the fused Triton primitive, the PyTorch streaming backend, the reference and the eager baseline.

The Triton kernels' global switches live in :mod:`cl_streamkl.kernels.config`.
"""

from cl_streamkl.kernels.config import KernelOptions, get_kernel_options, kernel_options, set_kernel_options
from cl_streamkl.kernels.reference import attention_kl_reference, eager_attention_kl
from cl_streamkl.kernels.torch_streaming import attention_kl_rows_torch
from cl_streamkl.kernels.validation import AttentionKLOptions, AttentionKLProblem, check_inputs, reduce_rows

__all__ = [
    "AttentionKLOptions",
    "AttentionKLProblem",
    "KernelOptions",
    "attention_kl_reference",
    "attention_kl_rows_torch",
    "check_inputs",
    "eager_attention_kl",
    "get_kernel_options",
    "kernel_options",
    "reduce_rows",
    "set_kernel_options",
]
