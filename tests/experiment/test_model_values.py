"""A model setting refused for its value is named as such, not as a key the model lacks; a data
folder that does not exist gets no advice about downloading what cannot be downloaded."""

from __future__ import annotations

import pytest
from cli_helpers import one_line_error, run_cli

from cl_streamkl.experiment.model import build_model


@pytest.mark.parametrize(("model", "kwargs", "message"), [
    ("vit_tiny_patch16_224", {"depth": "abc"}, "--model-kwargs depth: 'abc' is not an int (VisionTransformer"),
    ("vit_tiny_patch16_224", {"depth": 1.5}, "--model-kwargs depth: 1.5 is not an int"),
    ("deit_tiny_patch16_224", {"depth": "abc"}, "--model-kwargs depth: 'abc' is not an int"),
    ("vit_tiny_patch16_224", {"depth": 1, "mlp_ratio": "big"}, "--model-kwargs mlp_ratio: 'big' is not a number"),
    # a key the model lacks
    ("vit_tiny_patch16_224", {"depth": 1, "colour": 3}, "--model-kwargs colour: timm model 'vit_tiny_patch16_224' "
                                                        "takes no argument 'colour'"),
])
def test_a_wrong_model_kwargs_value_is_named(model, kwargs, message):
    with pytest.raises(ValueError) as refused:
        build_model(model, image_size=16, patch_size=8, in_chans=3, num_classes=10, model_kwargs=kwargs)
    assert message in str(refused.value)
    if "takes no" not in message:
        assert "takes no" not in str(refused.value) and "ViT-family" not in str(refused.value)


def test_a_model_that_is_no_vit_is_named_with_the_argument_it_refused():
    with pytest.raises(ValueError, match=r"^timm model 'resnet18' takes no 'img_size': cl-streamkl runs ViT-family"):
        build_model("resnet18", image_size=16, patch_size=8, in_chans=3, num_classes=10)


def test_the_command_line_names_the_wrong_value(tmp_path, capsys):
    rc, out = run_cli(tmp_path, "run", "--model-kwargs", "depth=abc")
    assert rc == 2 and not out.exists()
    assert "--model-kwargs depth: 'abc' is not an int" in one_line_error(capsys)


def test_a_missing_image_folder_is_not_offered_a_download(tmp_path, capsys):
    rc, out = run_cli(tmp_path, "run", "--dataset", "imagefolder", "--data-root", str(tmp_path / "missing"))
    line = one_line_error(capsys)
    assert rc == 2 and not out.exists()
    assert f"data root '{tmp_path / 'missing'}' does not exist" in line and "download" not in line


def test_values_the_model_refuses_by_assertion_are_one_line(tmp_path, capsys):
    rc, out = run_cli(tmp_path, "run", "--model-kwargs", "depth=1", "embed_dim=16", "num_heads=3")
    assert rc == 2 and not out.exists()
    assert ("timm model 'vit_tiny_patch16_224' cannot be built with --model-kwargs depth=1 embed_dim=16 num_heads=3: "
            "AssertionError: dim should be divisible by num_heads") in one_line_error(capsys)
