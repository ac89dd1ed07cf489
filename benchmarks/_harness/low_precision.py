"""A float8 frozen teacher: its linear layers through torchao's float8 inference path (Hopper).

The teacher only runs forward, so its linear layers can take float8 weights and activations
(per-row scales, computed on the fly for the activations): ``torchao.quantization.quantize_``
with ``Float8DynamicActivationFloat8WeightConfig``. What that costs the penalty's accuracy is
measured against the float64 penalty of the unquantised teacher.
"""

from __future__ import annotations

import torch
from torch import nn


def float8_teacher(teacher: nn.Module) -> nn.Module:
    """Quantise ``teacher``'s linear layers to float8 in place (torchao); returns it.

    The teacher is cast to bfloat16 first (torchao's per-row float8 takes bfloat16 weights).

    Raises:
        ImportError: torchao is not installed (``pip install torchao``).
    """
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, quantize_

    teacher.to(torch.bfloat16)
    quantize_(teacher, Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()))
    return teacher
