"""Bad input raises a clear ValueError/TypeError naming the argument, before any kernel launch.

For attention_kl, its module form and attention_kl_grouped (whose messages also name the problem).
"""

from __future__ import annotations

import pytest
import torch

from cl_streamkl import AttentionKLDivLoss, attention_kl, attention_kl_grouped


def good(**overrides):
    tensors = {
        "q": torch.randn(2, 3, 8, 16),
        "k": torch.randn(2, 3, 10, 16),
        "q_teacher": torch.randn(2, 3, 8, 32),
        "k_teacher": torch.randn(2, 3, 10, 32),
    }
    tensors.update(overrides)
    return tensors


def call(options=None, **overrides):
    tensors = good(**overrides)
    return attention_kl(
        tensors["q"], tensors["k"], tensors["q_teacher"], tensors["k_teacher"], **(options or {})
    )


TENSOR_CASES = [
    ("q", [[1.0]], TypeError, "q must be a torch.Tensor"),
    ("k", torch.randn(2, 3, 10), ValueError, "k must have 4 dimensions"),
    ("q_teacher", torch.randn(2, 3, 8, 32, dtype=torch.float64), TypeError, "q_teacher must be float32"),
    ("k_teacher", torch.randn(2, 3, 10, 32).half(), TypeError, "k_teacher has dtype"),
    ("k", torch.randn(2, 4, 10, 16), ValueError, "k has \\(B, H\\)"),
    ("q_teacher", torch.randn(1, 3, 8, 32), ValueError, "q_teacher has \\(B, H\\)"),
    ("k", torch.randn(2, 3, 10, 24), ValueError, "k head dim 24 differs from q head dim 16"),
    ("k_teacher", torch.randn(2, 3, 10, 16), ValueError, "k_teacher head dim"),
    ("q_teacher", torch.randn(2, 3, 9, 32), ValueError, "q_teacher has 9 query rows"),
    ("k_teacher", torch.randn(2, 3, 11, 32), ValueError, "k_teacher has 11 keys"),
    ("q", torch.randn(2, 3, 0, 16), ValueError, "q must not be empty"),
    ("k", torch.randn(2, 3, 0, 16), ValueError, "k must not be empty"),
    ("q", torch.randn(2, 3, 16, 8).transpose(-1, -2), ValueError, "q must have a unit stride"),
    ("k_teacher", torch.randn(2, 3, 32, 10).transpose(-1, -2), ValueError, "k_teacher must have a unit stride"),
    ("k", torch.randn(2, 3, 10, 16, device="meta"), ValueError, "k is on meta"),
]


@pytest.mark.parametrize("name,value,error,message", TENSOR_CASES, ids=[c[3] for c in TENSOR_CASES])
def test_bad_tensors(name, value, error, message):
    with pytest.raises(error, match=message):
        call(**{name: value})


def test_head_dim_over_256():
    q, k = torch.randn(1, 1, 4, 320), torch.randn(1, 1, 4, 320)
    with pytest.raises(ValueError, match="q head dim must be at most 256"):
        attention_kl(q, k, torch.randn(1, 1, 4, 8), torch.randn(1, 1, 4, 8))
    with pytest.raises(ValueError, match="q_teacher head dim must be at most 256"):
        attention_kl(torch.randn(1, 1, 4, 8), torch.randn(1, 1, 4, 8), q, k)


OPTION_CASES = [
    ({"reduction": "avg"}, ValueError, "reduction must be one of"),
    ({"backend": "cuda"}, ValueError, "backend must be one of"),
    ({"temperature": 0.0}, ValueError, "temperature must be a finite number > 0"),
    ({"temperature": -1.0}, ValueError, "temperature must be a finite number > 0"),
    ({"temperature": float("nan")}, ValueError, "temperature must be a finite number > 0"),
    ({"temperature": "2"}, TypeError, "temperature must be a real number"),
    ({"scale": 0.0}, ValueError, "scale must be a finite number > 0"),
    ({"teacher_scale": float("inf")}, ValueError, "teacher_scale must be a finite number > 0"),
    ({"temperature": 1e-40}, ValueError, "scale / temperature .* exceeds"),
    ({"scale": 1e38}, ValueError, "scale / temperature .* exceeds"),
    ({"teacher_scale": 1e30, "temperature": 1e-3}, ValueError, "teacher_scale / temperature .* exceeds"),
    ({"causal": 1}, TypeError, "causal must be a bool"),
    ({"causal": True}, ValueError, "causal=True needs as many queries as keys"),
]


@pytest.mark.parametrize("options,error,message", OPTION_CASES, ids=[c[2] for c in OPTION_CASES])
def test_bad_options(options, error, message):
    with pytest.raises(error, match=message):
        call(options)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_large_but_representable_scales_give_finite_rows(backend, device):
    # The limit on scale / temperature leaves ordinary sharp attention alone.
    tensors = {name: tensor.to(device) for name, tensor in good().items()}
    out = attention_kl(tensors["q"], tensors["k"], tensors["q_teacher"], tensors["k_teacher"], temperature=1e-3,
                       backend=backend, reduction="none")
    assert torch.isfinite(out).all()


def test_module_validates_options_at_construction():
    with pytest.raises(ValueError, match="temperature"):
        AttentionKLDivLoss(temperature=0)
    with pytest.raises(ValueError, match="reduction"):
        AttentionKLDivLoss(reduction="avg")


def test_triton_backend_on_a_device_it_cannot_run(monkeypatch):
    import cl_streamkl.kernels.triton as triton_kernels

    # attention_kl reads the package's INTERPRETING when it resolves the backend.
    monkeypatch.setattr(triton_kernels, "INTERPRETING", False)
    with pytest.raises(ValueError, match="backend='triton' needs CUDA tensors"):
        call({"backend": "triton"})


def good_problem(**overrides):
    return tuple(good(**overrides).values())


GROUPED_CASES = [
    ([], {}, ValueError, "problems must hold at least one"),
    (torch.randn(2, 4, 2, 3, 8, 16), {}, TypeError, "problems must be a sequence of"),
    ([good_problem()[:3]], {}, ValueError, r"problems\[0\] must hold 4 tensors"),
    ([good_problem(), torch.randn(2, 3, 8, 16)], {}, TypeError, r"problems\[1\] must be a \(q, k"),
    ([good_problem(), good_problem(k=torch.randn(2, 3, 10))], {}, ValueError, r"problems\[1\]: k must have 4 dimensions"),
    ([good_problem(), good_problem(k=torch.randn(2, 3, 12, 16), k_teacher=torch.randn(2, 3, 12, 32))], {},
     ValueError, r"problems\[1\]: k has shape \(2, 3, 12, 16\) but problems\[0\]'s has"),
    ([good_problem(), tuple(t.half() for t in good_problem())], {}, TypeError, r"problems\[1\]: q has dtype"),
    ([good_problem(), tuple(t.to("meta") for t in good_problem())], {}, ValueError, r"problems\[1\]: q is on meta"),
    ([good_problem()] * 2, {"scales": [0.1]}, ValueError, "scales has 1 entries but there are 2 problems"),
    ([good_problem()] * 2, {"teacher_scales": "0.1"}, TypeError, "teacher_scales must be None, a number"),
    ([good_problem()] * 2, {"scales": [0.1, -1.0]}, ValueError, r"problems\[1\]: scale must be a finite number > 0"),
    ([good_problem()], {"reduction": "avg"}, ValueError, "reduction must be one of"),
    ([good_problem()], {"causal": True}, ValueError, r"problems\[0\]: causal=True needs as many queries as keys"),
]


@pytest.mark.parametrize("problems,options,error,message", GROUPED_CASES, ids=[c[3] for c in GROUPED_CASES])
def test_bad_grouped_input(problems, options, error, message):
    with pytest.raises(error, match=message):
        attention_kl_grouped(problems, **options)
