"""The log-sum-exps the capture records beside Q/K: read from SDPA's node, asked of the backend
op without gradients, and None (fall back) wherever there is none."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from test_graph_reads import tiny_model

from cl_streamkl.capture import QKCapture, attention_lse, graph_reads
from cl_streamkl.capture.attention_lse import attention_with_lse, lse_from_node
from cl_streamkl.capture.graph_reads import GraphReadRegistry


@pytest.fixture(autouse=True)
def fresh_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(graph_reads, "GRAPH_READS", GraphReadRegistry())


def reference_lse(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.logsumexp(q.detach().double() @ k.detach().double().transpose(-1, -2) * scale, dim=-1)


def test_lse_from_node_reads_each_backends_layout() -> None:
    """cuDNN's (B, H, N, 1), flash's (B, H, N), efficient's rows padded to 32; other dtypes refused."""
    rows = torch.randn(2, 3, 17)
    padded = torch.zeros(2, 3, 32)
    padded[..., :17] = rows
    cudnn = SimpleNamespace(_saved_logsumexp=rows[..., None].clone())
    flash = SimpleNamespace(_saved_logsumexp=rows.clone())
    efficient = SimpleNamespace(_saved_log_sumexp=padded)
    for node in (cudnn, flash, efficient):
        torch.testing.assert_close(lse_from_node(node, 17), rows)
    assert lse_from_node(efficient, 17).data_ptr() == padded.data_ptr()  # a view, no copy
    assert lse_from_node(SimpleNamespace(_saved_logsumexp=rows.half()), 17) is None
    assert lse_from_node(SimpleNamespace(_saved_logsumexp=rows), 18) is None
    assert lse_from_node(SimpleNamespace(), 17) is None  # the math backend saves none


def test_no_backend_op_runs_with_gradients_or_off_cuda() -> None:
    q = torch.randn(1, 2, 9, 16)
    assert attention_with_lse(q, q, q) is None  # CPU
    with torch.no_grad():
        assert attention_with_lse(q, q, q) is None
    assert attention_lse._run_backend(0, q, q, q, 0.0, None) is None  # math: no LSE
    meta = q[..., :12].to("meta")  # CUDA's flash op would see a head dim SDPA pads
    assert attention_lse._run_backend(1, meta, meta, meta, 0.0, None) is None


def test_the_cpu_flash_op_runs_in_sdpas_place_with_its_lse() -> None:
    """lse_backend picks CPU flash for plain CPU inputs; run_with_lse gives SDPA's output and the LSE."""
    q, k, v = (torch.randn(2, 3, 17, 12) for _ in range(3))
    backend = attention_lse.lse_backend(q, k, v, 0.3)
    assert backend == 1
    out, lse = attention_lse.run_with_lse(backend, q, k, v, 0.0, 0.3)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, scale=0.3))
    torch.testing.assert_close(lse.double(), reference_lse(q, k, 0.3), rtol=1e-5, atol=1e-5)
    assert attention_lse.lse_backend(q[0], k[0], v[0]) is None  # not (B, H, N, D)
    with pytest.raises(ValueError, match="backend 0 has no log-sum-exp op"):
        attention_lse.run_with_lse(0, q, k, v, 0.0, None)


@pytest.mark.parametrize("from_graph", [False, True], ids=["watched", "graph-read"])
def test_student_capture_records_the_saved_lse(from_graph: bool) -> None:
    model, x = tiny_model(), torch.randn(2, 3, 32, 32)
    for _ in range(2 if from_graph else 1):  # the second forward is read from the graph
        with QKCapture(model) as capture:
            model(x)
    for (q, k), scale, lse in zip(capture.qk, capture.scales, capture.lse, strict=True):
        assert lse.shape == q.shape[:3] and lse.dtype == torch.float32 and not lse.requires_grad
        torch.testing.assert_close(lse.double(), reference_lse(q, k, scale), rtol=1e-5, atol=1e-5)


def test_capture_without_a_fused_lse_records_none() -> None:
    model, x = tiny_model(), torch.randn(2, 3, 32, 32)
    with torch.no_grad(), QKCapture(model) as capture:  # the CPU: no backend op is asked
        model(x)
    assert capture.lse == [None] * len(capture.qk)
    for block in model.blocks:
        block.attn.fused_attn = False  # timm's manual path: no SDPA at all
    with QKCapture(model) as capture:
        model(x)
    assert capture.lse == [None] * len(capture.qk)


class _Plain(torch.nn.Module):
    def forward(self, x):
        return F.scaled_dot_product_attention(x, x, x)


def test_an_extractor_that_passes_no_lse_records_none() -> None:
    """Extractors written for ``record(q, k, scale)`` keep working; their blocks have no LSE."""
    from cl_streamkl.capture import register_qk_extractor

    def extractor(module, record):
        return [module.register_forward_hook(lambda _module, args, _out: record(args[0], args[0], 0.5))]

    register_qk_extractor(_Plain, extractor)
    model = torch.nn.Sequential(_Plain())
    with QKCapture(model) as capture:
        model(torch.randn(1, 2, 3, 8))
    assert capture.scales == [0.5] and capture.lse == [None]
