"""cl-streamkl: streaming attention-KL distillation for continual learning with vision transformers."""

from cl_streamkl.attention_kl import AttentionKLDivLoss, attention_kl, attention_kl_grouped
from cl_streamkl.capture import QKCapture, register_qk_extractor
from cl_streamkl.compiled_capture import CompiledQK, TeacherQK
from cl_streamkl.kernels.reference import attention_kl_reference

__version__ = "0.1.0"

__all__ = [
    "AttentionKLDivLoss",
    "CompiledQK",
    "QKCapture",
    "TeacherQK",
    "__version__",
    "attention_kl",
    "attention_kl_grouped",
    "attention_kl_reference",
    "register_qk_extractor",
]
