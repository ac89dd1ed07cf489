"""LoRA students (``peft``) on timm and Hugging Face ViTs: the capture reads the adapted Q/K, the
penalty's gradient reaches the adapters, and the teacher snapshot is a frozen copy that behaves as
the student did."""

from __future__ import annotations

import pytest
import timm
import torch
from torch import nn

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from cl_streamkl import attention_kl  # noqa: E402
from cl_streamkl.capture import QKCapture, find_attention_modules  # noqa: E402
from cl_streamkl.strategies import AttentionDistiller, frozen_copy  # noqa: E402
from cl_streamkl.strategies.teacher import named_tensors, restore_frozen_copy  # noqa: E402

KINDS = ["timm", "hf-eager", "hf-sdpa"]


def base_model(kind: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    if kind == "timm":
        return timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=2, embed_dim=32,
                                 num_heads=2, num_classes=3)
    config = transformers.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                                    image_size=32, patch_size=8, num_labels=3)
    return transformers.ViTForImageClassification._from_config(config, attn_implementation=kind.removeprefix("hf-"))


def qk_projections(model: nn.Module) -> list[str]:
    """LoRA targets: timm's fused ``qkv``; transformers' query and key projections (5.x and 4.x names)."""
    attention = find_attention_modules(model)[0]
    names = [name for name in ("qkv", "q_proj", "k_proj", "query", "key") if hasattr(attention, name)]
    return ["qkv"] if "qkv" in names else names


def lora_student(kind: str, seed: int = 0) -> nn.Module:
    """A LoRA student whose adapters start non-zero (``init_lora_weights=False``), so they change Q/K."""
    model = base_model(kind, seed)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=qk_projections(model), init_lora_weights=False)
    return peft.get_peft_model(model, config).eval()


def images(seed: int = 1) -> torch.Tensor:
    return torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(seed))


def lora_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    return {name: p for name, p in model.named_parameters() if "lora_A" in name or "lora_B" in name}


@pytest.mark.parametrize("kind", KINDS)
def test_the_capture_reads_the_adapted_qk(kind: str) -> None:
    student, x = lora_student(kind), images()
    attention = find_attention_modules(student)[-1]
    seen: dict[str, object] = {}
    handle = attention.register_forward_hook(lambda _m, args, out: seen.update(x=args[0], out=out))
    try:
        with QKCapture(student) as adapted:
            student(x)
    finally:
        handle.remove()
    with student.disable_adapter(), QKCapture(student) as plain:
        student(x)
    q, k = adapted.qk[-1]
    assert (q - plain.qk[-1][0]).abs().max() > 1e-3 and (k - plain.qk[-1][1]).abs().max() > 1e-3
    # The block's own output from the captured q, k, scale and its value projection.
    hidden = seen["x"]
    if kind == "timm":
        value = attention.qkv(hidden).reshape(2, -1, 3, 2, 16)[:, :, 2].transpose(1, 2)
        output, project = seen["out"], attention.proj
    else:  # transformers 5 projects the output inside the module; 4.x's ViTSelfAttention returns it unprojected
        value = (getattr(attention, "v_proj", None) or attention.value)(hidden).view(2, -1, 2, 16).transpose(1, 2)
        output, project = seen["out"][0], getattr(attention, "o_proj", None) or nn.Identity()
    maps = torch.softmax(q.double() @ k.double().transpose(-2, -1) * adapted.scales[-1], dim=-1)
    expected = project((maps @ value.double()).float().transpose(1, 2).reshape(2, -1, 32))
    torch.testing.assert_close(output, expected, rtol=1e-5, atol=1e-5)


def test_the_capture_matches_the_adapted_hf_models_attention_maps() -> None:
    student, x = lora_student("hf-eager"), images()
    with QKCapture(student) as capture:
        maps = student(pixel_values=x, output_attentions=True).attentions
    for (q, k), scale, attention in zip(capture.qk, capture.scales, maps):
        expected = torch.softmax(q.double() @ k.double().transpose(-2, -1) * scale, dim=-1)
        torch.testing.assert_close(attention.double(), expected, rtol=0, atol=2e-6)


@pytest.mark.parametrize("kind", KINDS)
def test_the_penalty_gradient_reaches_the_adapters(kind: str) -> None:
    student, x = lora_student(kind), images()
    distiller = AttentionDistiller(layers="all", compile_teacher=False)
    distiller.update_teacher(student)
    adapters = lora_parameters(student)
    assert adapters and all(p.requires_grad for p in adapters.values())
    assert not any(p.requires_grad for name, p in student.named_parameters() if name not in adapters)
    # One step of the task away from the snapshot, so that the penalty is not at its minimum.
    optimizer = torch.optim.SGD(adapters.values(), lr=0.5)
    logits = student(x) if kind == "timm" else student(pixel_values=x).logits
    nn.functional.cross_entropy(logits, torch.tensor([0, 1])).backward()
    optimizer.step()
    optimizer.zero_grad()
    teacher = distiller.teacher_qk(x)
    with distiller.student_capture(student) as capture:
        student(x)
    penalty = sum(attention_kl(q, k, q_t, k_t, scale=s, teacher_scale=s_t).sum()
                  for (q, k), (q_t, k_t), s, s_t in zip(capture.qk, teacher.qk, capture.scales, teacher.scales))
    assert float(penalty) > 0
    penalty.backward()
    for name, parameter in adapters.items():
        assert parameter.grad is not None and parameter.grad.abs().sum() > 0, name


def forward(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    output = model(x)
    return output if isinstance(output, torch.Tensor) else output.logits


def captured(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    with torch.no_grad(), QKCapture(model) as capture:
        model(x)
    return [tensor.clone() for pair in capture.qk for tensor in pair]


def train_step(student: nn.Module, x: torch.Tensor) -> None:
    student.train()
    optimizer = torch.optim.SGD(lora_parameters(student).values(), lr=0.5)
    nn.functional.cross_entropy(forward(student, x), torch.tensor([0, 1])).backward()
    optimizer.step()
    optimizer.zero_grad()
    student.eval()


@pytest.mark.parametrize("kind", KINDS)
def test_the_snapshot_is_a_frozen_copy_that_behaves_as_the_student_did(kind: str) -> None:
    student, x = lora_student(kind), images()
    with torch.no_grad():
        output, qk = forward(student, x), captured(student, x)
    teacher = frozen_copy(student)
    assert isinstance(teacher, peft.PeftModel) and not teacher.training
    assert not any(p.requires_grad for p in teacher.parameters())
    assert lora_parameters(teacher).keys() == lora_parameters(student).keys()
    # Its own tensors, none shared with the student.
    student_storage = {p.data_ptr() for p in student.parameters()}
    assert not any(p.data_ptr() in student_storage for p in teacher.parameters())
    with torch.no_grad():
        torch.testing.assert_close(forward(teacher, x), output, rtol=0, atol=0)
    for ours, theirs in zip(captured(teacher, x), qk):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)

    train_step(student, x)
    with torch.no_grad():
        assert (forward(student, x) - output).abs().max() > 1e-4  # the student moved
        torch.testing.assert_close(forward(teacher, x), output, rtol=0, atol=0)  # the teacher did not
    for ours, theirs in zip(captured(teacher, x), qk):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    assert all(p.grad is None for p in teacher.parameters())


@pytest.mark.parametrize("kind", ["timm", "hf-sdpa"])
def test_merging_the_students_adapters_leaves_the_snapshot_alone(kind: str) -> None:
    student, x = lora_student(kind), images()
    teacher = frozen_copy(student)
    with torch.no_grad():
        before = forward(teacher, x)
    train_step(student, x)
    student.merge_adapter()  # writes the adapters into the student's base weights, in place
    with torch.no_grad():
        torch.testing.assert_close(forward(teacher, x), before, rtol=0, atol=0)


def test_the_distillers_teacher_of_a_peft_student_is_saved_and_restored() -> None:
    student, x = lora_student("hf-sdpa"), images()
    distiller = AttentionDistiller(compile_teacher=False)
    distiller.update_teacher(student)
    expected = distiller.teacher_qk(x)
    train_step(student, x)
    restored = restore_frozen_copy(student, named_tensors(distiller.teacher))
    assert not any(p.requires_grad for p in restored.parameters())
    for ours, theirs in zip(captured(restored, x), [t for pair in expected.qk for t in pair]):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
