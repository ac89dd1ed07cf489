"""The float64 reference takes float64 inputs (gradcheck), and attention_kl still refuses them."""

from __future__ import annotations

import pytest
import torch

from cl_streamkl import attention_kl, attention_kl_reference


def test_the_reference_takes_float64_inputs_and_passes_gradcheck():
    generator = torch.Generator().manual_seed(0)
    q, k, q_teacher, k_teacher = (torch.randn(1, 2, 5, 4, dtype=torch.float64, generator=generator,
                                              requires_grad=True) for _ in range(4))
    assert torch.autograd.gradcheck(
        lambda *tensors: attention_kl_reference(*tensors, temperature=2.0, reduction="none"),
        (q, k, q_teacher, k_teacher))
    from_float32 = attention_kl_reference(*(t.detach().float() for t in (q, k, q_teacher, k_teacher)))
    torch.testing.assert_close(attention_kl_reference(q, k, q_teacher, k_teacher), from_float32, rtol=1e-6, atol=0)


def test_the_reference_names_float64_among_the_dtypes_it_takes():
    q = torch.ones(1, 2, 5, 4, dtype=torch.int64)
    with pytest.raises(TypeError, match=r"^q must be float32, float16, bfloat16 or float64, got torch.int64$"):
        attention_kl_reference(q, q, q, q)


def test_attention_kl_still_refuses_float64():
    q = torch.randn(1, 2, 5, 4, dtype=torch.float64)
    with pytest.raises(TypeError, match=r"^q must be float32, float16 or bfloat16, got torch.float64$"):
        attention_kl(q, q, q, q)
