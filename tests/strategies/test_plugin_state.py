"""StreamKLPlugin's state: round trips through weights-only loads, refused states, the GPU smoke script's dry run."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import timm
import torch
from strategy_helpers import (
    IMAGE,
    count_hooks,
    make_strategy,
    perturb,
    tensor_benchmark,
    tiny_model,
)
from torch import nn

from cl_streamkl.strategies import (
    StreamKLPlugin,
)


def run_iteration(plugin: StreamKLPlugin, model: nn.Module, x: torch.Tensor) -> float:
    strategy = SimpleNamespace(model=model, mb_x=x, loss=torch.zeros(()))
    plugin.before_forward(strategy)
    model(x)
    plugin.after_forward(strategy)
    plugin.before_backward(strategy)
    return plugin.last_penalty


@pytest.mark.parametrize("arch", ["vit", "eva"])
def test_state_dict_round_trip_through_weights_only_load(tmp_path, arch: str) -> None:
    model = tiny_model(arch)
    plugin = StreamKLPlugin(alpha=1.5, layers=[-1, 0], temperature=2.0, backend="torch")
    strategy = make_strategy("naive", model, [plugin])
    strategy.train(tensor_benchmark(experiences=1).train_stream[0], num_workers=0)
    perturb(model, size=0.02)
    x = torch.randn(3, *IMAGE)
    run_iteration(plugin, model, x)

    torch.save({"plugin": plugin.state_dict(), "model": model.state_dict()}, tmp_path / "ckpt.pt")
    checkpoint = torch.load(tmp_path / "ckpt.pt", weights_only=True)

    restored_model = tiny_model(arch, seed=123)
    restored_model.load_state_dict(checkpoint["model"])
    restored = StreamKLPlugin(alpha=1.5, layers=[-1, 0], temperature=2.0, backend="torch")
    restored.load_state_dict(checkpoint["plugin"])
    assert restored.teacher is None and restored.distiller.restore_pending
    # Each rank of a data-parallel run has its own last penalty: it is no state, so every rank saves the same.
    assert "last_penalty" not in checkpoint["plugin"] and restored.last_penalty == 0.0
    assert restored.distiller.teacher_updates == 1
    # The teacher is rebuilt when the plugin first sees the strategy's model.
    restored.before_training(SimpleNamespace(model=restored_model))
    original_tensors = dict(plugin.teacher.named_parameters()) | dict(plugin.teacher.named_buffers())
    restored_tensors = dict(restored.teacher.named_parameters()) | dict(restored.teacher.named_buffers())
    assert original_tensors.keys() == restored_tensors.keys()
    for name, value in original_tensors.items():
        assert torch.equal(value, restored_tensors[name]), name
    assert not restored.teacher.training and count_hooks(restored.teacher) == 0
    assert all(not p.requires_grad for p in restored.teacher.parameters())
    assert run_iteration(restored, restored_model, x) == run_iteration(plugin, model, x)
    assert restored.last_penalty > 0


def test_state_without_teacher_and_rejected_states(tmp_path) -> None:
    plugin = StreamKLPlugin(alpha=1.0, backend="torch")
    torch.save(plugin.state_dict(), tmp_path / "empty.pt")
    fresh = StreamKLPlugin(alpha=1.0, backend="torch")
    fresh.load_state_dict(torch.load(tmp_path / "empty.pt", weights_only=True))
    assert fresh.teacher is None and not fresh.distiller.restore_pending

    other = StreamKLPlugin(alpha=2.0, backend="torch")
    with pytest.raises(ValueError, match="saved with"):
        other.load_state_dict(plugin.state_dict())
    with pytest.raises(ValueError, match="not a StreamKLPlugin state"):
        fresh.load_state_dict({"format": "something else"})
    with pytest.raises(TypeError, match="dict"):
        fresh.load_state_dict([1, 2])
    # The previous format also held the last penalty; it loads without it.
    fresh.load_state_dict({"format": "cl_streamkl.StreamKLPlugin/1", "distiller": plugin.distiller.state_dict(),
                           "last_penalty": 0.25})
    assert fresh.last_penalty == 0.0

    plugin.distiller.update_teacher(tiny_model(depth=2))
    pending = StreamKLPlugin(alpha=1.0, backend="torch")
    pending.load_state_dict(plugin.state_dict())
    with pytest.raises(RuntimeError, match="attach"):
        pending.distiller.penalty(torch.randn(1, *IMAGE), [])
    with pytest.raises(ValueError, match="does not fit this model"):
        pending.attach(tiny_model(depth=3))


def test_state_from_a_model_with_another_head_count_is_refused(tmp_path) -> None:
    plugin = StreamKLPlugin(alpha=1.0, backend="torch")
    plugin.distiller.update_teacher(tiny_model())
    torch.save(plugin.state_dict(), tmp_path / "plugin.pt")
    state = torch.load(tmp_path / "plugin.pt", weights_only=True)
    assert state["distiller"]["teacher_heads"] == [2, 2]
    four_heads = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8,
                                   num_classes=4, depth=2, embed_dim=64, num_heads=4)
    # Same tensor names and shapes: only the head count tells the two apart.
    assert {k: v.shape for k, v in four_heads.state_dict().items()} == {
        k: v.shape for k, v in tiny_model().state_dict().items()}
    restored = StreamKLPlugin(alpha=1.0, backend="torch")
    restored.load_state_dict(state)
    with pytest.raises(ValueError, match=r"\[2, 2\] attention heads per block but this model has \[4, 4\]"):
        restored.attach(four_heads)
    restored.attach(tiny_model(seed=3))
    assert restored.teacher is not None


# ---------------------------------------------------------------- GPU smoke script, CPU dry run


@pytest.mark.parametrize("mode", ["avalanche", "plain"])
def test_gpu_smoke_script_dry_run_on_cpu(tmp_path, monkeypatch, mode: str) -> None:
    import importlib.util
    import json
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "plugin_gpu_smoke.py"
    spec = importlib.util.spec_from_file_location("plugin_gpu_smoke", path)
    smoke = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, smoke)  # dataclasses look their module up there
    spec.loader.exec_module(smoke)
    args = [
        "--device", "cpu", "--img-size", "32", "--patch-size", "8", "--depth", "2", "--embed-dim", "64",
        "--heads", "2", "--batch", "2", "--iters", "2", "--backend", "torch", "--lr", "1e-2",
        "--json", str(tmp_path / "smoke.json"),
    ]
    assert smoke.main(args + (["--no-avalanche"] if mode == "plain" else [])) == 0
    result = json.loads((tmp_path / "smoke.json").read_text())
    assert result["summary"]["mode"] == mode and result["summary"]["all_checks_passed"]
    rows = result["rows"]
    assert [(r["experience"], r["iteration"]) for r in rows] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert rows[3]["penalty"] > 0 and rows[3]["reference"] is not None
