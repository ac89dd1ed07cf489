"""Compiled layer norms and MLPs: the eager model's values and gradients, deep copies on their own parameters."""

from __future__ import annotations

import copy
import json
import shutil

import pytest
import timm
import torch
from torch import nn

from cl_streamkl.capture import QKCapture
from cl_streamkl.experiment import compiled_layers
from cl_streamkl.experiment.compiled_layers import CompiledLayerNorm, CompiledMlp, compile_layers

_INDUCTOR = compiled_layers._compiled


pytestmark = pytest.mark.usefixtures("traced_not_generated")


def _vit(depth: int = 2, drop_rate: float = 0.0) -> nn.Module:
    torch.manual_seed(0)
    return timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=16, patch_size=4, in_chans=1,
                             num_classes=5, depth=depth, embed_dim=16, num_heads=2, drop_rate=drop_rate,
                             proj_drop_rate=drop_rate).double()


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.skipif(
    shutil.which("cc") is None, reason="inductor's CPU code needs a C compiler"))])
def test_values_and_gradients_equal_the_eager_model(backend, monkeypatch):
    if backend == "inductor":
        monkeypatch.setattr(compiled_layers, "_compiled", _INDUCTOR)
    eager = _vit()
    compiled = copy.deepcopy(eager)
    # norm1, norm2 and the MLP of each block, and the final norm.
    assert compile_layers(compiled) == 2 * 3 + 1
    assert isinstance(compiled.blocks[0].norm1, CompiledLayerNorm) and isinstance(compiled.blocks[1].mlp, CompiledMlp)
    assert compiled.state_dict().keys() == eager.state_dict().keys()
    x = torch.randn(3, 1, 16, 16, dtype=torch.float64)
    out_eager, out_compiled = eager(x), compiled(x)
    assert _relative(out_compiled, out_eager) < 1e-12
    out_eager.square().sum().backward()
    out_compiled.square().sum().backward()
    for (name, p_eager), p_compiled in zip(eager.named_parameters(), compiled.parameters()):
        assert p_compiled.grad is not None, name
        assert _relative(p_compiled.grad, p_eager.grad) < 1e-10, name


def test_a_deep_copy_computes_with_its_own_parameters():
    student = _vit()
    compile_layers(student)
    teacher = copy.deepcopy(student)
    with torch.no_grad():
        teacher.blocks[0].norm1.weight.mul_(3.0)
        teacher.blocks[1].mlp.fc2.bias.add_(1.0)
    x = torch.randn(2, 1, 16, 16, dtype=torch.float64)
    reference = _vit()
    with torch.no_grad():
        reference.load_state_dict(teacher.state_dict())
        assert _relative(teacher(x), reference(x)) < 1e-12
        assert _relative(student(x), teacher(x)) > 1e-3


def test_q_and_k_are_captured_as_in_the_eager_model():
    eager = _vit()
    compiled = copy.deepcopy(eager)
    compile_layers(compiled)
    x = torch.randn(2, 1, 16, 16, dtype=torch.float64)
    with QKCapture(eager, layers="all") as cap_eager:
        eager(x)
    with QKCapture(compiled, layers="all") as cap_compiled:
        compiled(x)
    for (q_e, k_e), (q_c, k_c) in zip(cap_eager.qk, cap_compiled.qk):
        assert _relative(q_c, q_e) < 1e-12 and _relative(k_c, k_e) < 1e-12


def test_mlps_with_dropout_stay_eager_and_a_model_without_either_is_refused():
    model = _vit(drop_rate=0.1)
    assert compile_layers(model) == 2 * 2 + 1  # the norms only
    assert not any(isinstance(m, CompiledMlp) for m in model.modules())
    with pytest.raises(ValueError, match="compile_layers: Sequential has no nn.LayerNorm"):
        compile_layers(nn.Sequential(nn.Linear(2, 2), nn.ReLU()))


def test_a_run_with_compile_layers_distils_through_the_compiled_model(tmp_path, monkeypatch):
    from cli_helpers import run_cli

    from cl_streamkl.experiment import preflight

    compiled_models = []

    def counting(model):
        compiled_models.append(model)
        return compile_layers(model)

    monkeypatch.setattr(preflight, "compile_layers", counting)
    status, out = run_cli(tmp_path, "run", "--compile-layers", "--strategies", "lwf+streamkl", "--scenario", "task",
                          "--experiences", "2")
    assert status == 0 and compiled_models
    assert all(isinstance(m, CompiledMlp) for m in compiled_models[-1].modules() if type(m).__name__.endswith("Mlp"))
    results = json.loads((out / "results.json").read_text())
    assert results["config"]["compile_layers"] is True
    run = results["runs"][0]
    assert len(run["accuracy_matrix"]) == 2 and run["mean_penalty"] > 0
