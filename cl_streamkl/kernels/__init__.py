"""StreamKL kernels: the fused Triton primitive, the PyTorch streaming backend, the reference and the eager baseline."""

from cl_streamkl.kernels.reference import attention_kl_reference, eager_attention_kl
from cl_streamkl.kernels.torch_streaming import attention_kl_rows_torch
from cl_streamkl.kernels.validation import AttentionKLProblem, check_inputs, reduce_rows

__all__ = [
    "AttentionKLProblem",
    "attention_kl_reference",
    "attention_kl_rows_torch",
    "check_inputs",
    "eager_attention_kl",
    "reduce_rows",
]
