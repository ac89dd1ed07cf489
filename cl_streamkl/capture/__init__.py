"""Capture the queries and keys that a vision transformer's attention blocks multiply.

One job per module:

* :mod:`~cl_streamkl.capture.context`: :class:`QKCapture`, the context manager that
  records the Q/K of selected blocks during a forward.
* :mod:`~cl_streamkl.capture.extractors`: how one attention class is read (the extractor
  registry, the product watcher, the defaults).
* :mod:`~cl_streamkl.capture.multihead`: ``nn.MultiheadAttention`` (torchvision's ViT).
* :mod:`~cl_streamkl.capture.hf_extractors`: Hugging Face ``transformers`` ViT, DeiT, DINOv2,
  CLIP and SigLIP vision (eager and SDPA attention), and the attention refused (Swin, BEiT's
  relative-position bias).
* :mod:`~cl_streamkl.capture.layers`: layer selections and each block's attention module.
* :mod:`~cl_streamkl.capture.graph_reads`: reading the product back from the autograd
  graph, so that verified modules need not be watched; :func:`graph_reads_disabled`
  turns that off for a ``with`` block.
* :mod:`~cl_streamkl.capture.compiled`: :class:`CompiledQK`, a frozen teacher's Q/K from
  one ``torch.compile``'d forward.
* :mod:`~cl_streamkl.capture.compiled_model`: :func:`compile_model`, a whole ViT compiled
  for training, its Q/K still captured.
* :mod:`~cl_streamkl.capture.recording`: what those two share (the recording mode traced
  into the graph, the check against eager).

Needs timm (``pip install "cl-streamkl[capture]"``): its attention classes are the ones read;
``transformers`` models need the ``[hf]`` extra.
"""

from cl_streamkl._extras import require_extra

require_extra(__name__, "capture", {"timm": "timm"})

from cl_streamkl.capture.compiled import CompiledQK, TeacherQK  # noqa: E402 (after the check)
from cl_streamkl.capture.compiled_model import compile_model  # noqa: E402
from cl_streamkl.capture.context import QKCapture  # noqa: E402
from cl_streamkl.capture.extractors import (  # noqa: E402
    QKExtractor,
    RecordQK,
    attention_product_extractor,
    qk_extractor_for,
    register_qk_extractor,
)
from cl_streamkl.capture.graph_reads import graph_reads_disabled  # noqa: E402
from cl_streamkl.capture.layers import LayerSpec, find_attention_modules, resolve_layer_indices  # noqa: E402

__all__ = [
    "CompiledQK",
    "LayerSpec",
    "QKCapture",
    "QKExtractor",
    "RecordQK",
    "TeacherQK",
    "attention_product_extractor",
    "compile_model",
    "find_attention_modules",
    "graph_reads_disabled",
    "qk_extractor_for",
    "register_qk_extractor",
    "resolve_layer_indices",
]
