"""cl-streamkl: streaming attention-KL distillation for continual learning with vision transformers."""

from cl_streamkl.attention_kl import AttentionKLDivLoss, attention_kl, attention_kl_grouped
from cl_streamkl.capture import CompiledQK, QKCapture, TeacherQK, register_qk_extractor
from cl_streamkl.kernels.reference import attention_kl_reference
from cl_streamkl.strategies.distiller import AttentionDistiller

__version__ = "0.1.0"

__all__ = [
    "AttentionDistiller",
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
