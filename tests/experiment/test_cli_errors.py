"""What `cl-streamkl run` refuses, in one line and before anything is written, and failed writes."""

from __future__ import annotations

import socket
import sys

import pytest
import torch
from cli_helpers import one_line_error, run_cli

from cl_streamkl.experiment import cli, runner


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--strategies", "naive", "gem"], "unknown strategy component 'gem'"),
        (["--scenario", "task", "--strategies", "wa"], "needs scenario 'class'"),
        (["--scenario", "domain", "--first-experience-classes", "4"], "first_experience_classes needs scenario"),
        # Named as the user wrote it (the flag, or the key of a configuration file), not as the data layer's
        # n_experiences.
        (["--experiences", "3"], "error: experiences must divide the 10 classes; got 3"),
        (["--dataset", "mnist"], "got 'mnist' (did you mean 'mnist5k'"),
        (["--model", "vit_tinyy_patch16_224"], "unknown timm model 'vit_tinyy_patch16_224'; did you mean"),
        (["--model", "resnet18"], "ViT-family"),
        (["--dataset", "cifar10"], "needs --data-root"),
        (["--dataset", "cifar10", "--data-root", "/nonexistent/cifar"], "does not exist"),
        (["--image-size", "30", "--patch-size", "4"], "not divisible by patch size"),
        (["--streamkl-layers", "first"], "expected 'all', an integer"),
        (["--eval-split", "val", "--val-fraction", "0"], "val_fraction > 0"),
        (["--pretrained-file", "/nonexistent/w.pth"], "does not exist"),
        (["--strategies", "naive", "joint+lwf"], "joint trains once on every experience's data together"),
        (["--model-kwargs", "pretrained=True"], "would download weights, and nothing is downloaded here: pass a "
                                                "local weights file with --pretrained-file"),
        # Found by building the model and running the penalty before anything is written:
        # The blocks against the model's, named by option and key (the plugin's argument is layers=).
        (["--streamkl-layers", "7"], "error: layers (--streamkl-layers): layers=7 selects the last n blocks and "
                                     "needs 1 <= n <= 4"),
        (["--streamkl-layers", "0"], "error: layers (--streamkl-layers): layers=0 selects the last n blocks"),
        (["--streamkl-layers", "0,9"], "error: layers (--streamkl-layers): layer index 9 is out of range for a "
                                       "model with 4 blocks"),
        (["--strategies", "pad", "--streamkl-layers", "0,-5"], "error: layers (--streamkl-layers): layer index -5"),
        (["--streamkl-temperature", "1e-40"], "scale / temperature"),
        (["--scenario", "domain", "--experiences", "200"],
         "training samples, fewer than the 200 experiences (domains) each needs one of; set fewer experiences"),
    ],
)
def test_errors_exit_nonzero_with_message(tmp_path, capsys, args, message):
    out = tmp_path / "x"
    rc = cli.main(["run", "--no-progress", "--epochs", "1", "--out", str(out), *args])
    assert rc == 2
    printed = capsys.readouterr()
    err = printed.err
    assert message in err and "Traceback" not in err
    assert err.startswith("cl-streamkl: error: ") and err.count("\n") == 1
    assert printed.out == ""  # the run's header only once its data and model are built
    # Checked before the folder is claimed: the same --out takes a corrected run (and --resume has nothing).
    assert not out.exists()


def test_image_folder_whose_classes_the_experiences_do_not_divide_names_the_setting(tmp_path, capsys):
    from PIL import Image

    for name in ("a", "b", "c"):  # three classes: counted only once the folder is read
        (tmp_path / "images" / name).mkdir(parents=True)
        for k in range(4):
            Image.new("L", (8, 8), 40 * k).save(tmp_path / "images" / name / f"{k}.png")
    rc, out = run_cli(tmp_path, "folder", "--dataset", "imagefolder", "--data-root", str(tmp_path / "images"),
                      "--scenario", "class", "--experiences", "2")
    assert rc == 2
    assert "error: experiences must divide the 3 classes; got 2" in one_line_error(capsys)
    assert not out.exists()


def test_backend_that_cannot_run_is_refused_before_anything_is_written(tmp_path, capsys, monkeypatch):
    import cl_streamkl.kernels.triton as triton_kernels

    monkeypatch.setattr(triton_kernels, "INTERPRETING", False)  # a CPU without Triton's interpreter
    rc, out = run_cli(tmp_path, "triton", "--kl-backend", "triton", "--strategies", "streamkl")
    assert rc == 2
    assert "backend='triton' needs CUDA tensors" in capsys.readouterr().err
    assert not out.exists()


def test_registered_attention_whose_scores_cannot_be_read_is_refused_before_training(tmp_path, capsys, monkeypatch):
    import torch.nn.functional as F
    from timm.layers import Attention

    def einsum_forward(self, x, attn_mask=None, **kwargs):
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        weights = F.softmax(torch.einsum("bhqd,bhkd->bhqk", q, k) * self.scale, dim=-1)
        return self.proj(torch.einsum("bhqk,bhkd->bhqd", weights, v).transpose(1, 2).reshape(b, n, c))

    # timm's Attention stays registered, but its scores are now formed in a way QKCapture cannot read.
    monkeypatch.setattr(Attention, "forward", einsum_forward)
    rc, out = run_cli(tmp_path, "einsum", "--strategies", "naive", "lwf+streamkl")
    assert rc == 2
    err = capsys.readouterr().err
    assert "strategy 'lwf+streamkl': streamkl cannot distil" in err and "cannot read the attention scores" in err
    assert not out.exists()


@pytest.mark.parametrize("variable, text", [("CL_STREAMKL_BACKWARD", "banana"), ("CL_STREAMKL_AUTOTUNE", "banana")])
def test_misspelt_kernel_switch_is_one_line_naming_it(tmp_path, capsys, monkeypatch, variable, text):
    from cl_streamkl.kernels import config as kernel_config

    monkeypatch.setattr(kernel_config, "_current", None)  # read again from the environment on first use
    monkeypatch.setenv(variable, text)
    assert cli.main(["run", "--help"]) == 0 and "--resume" in capsys.readouterr().out
    rc, out = run_cli(tmp_path, "switch")
    assert rc == 2
    assert f"environment variable {variable} must be" in one_line_error(capsys)
    assert not out.exists()


def test_missing_wandb_is_a_clear_error(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)
    rc, out = run_cli(tmp_path, "wandb", "--log", "wandb")
    assert rc == 2
    assert "--log wandb needs the wandb package: pip install wandb" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize("failure", ["read-only checkpoints", "full disk"])
def test_failed_checkpoint_write_is_one_line_and_keeps_the_previous_checkpoint(tmp_path, capsys, monkeypatch,
                                                                                failure):
    from test_checkpoints import disk_full_after, read_only

    from cl_streamkl.experiment.checkpoint import RunIdentity, load_checkpoint

    real_save = runner.save_checkpoint

    def save_then_fail_next(path, state, identity):
        real_save(path, state, identity)
        monkeypatch.setattr(runner, "save_checkpoint", real_save)
        if failure == "full disk":
            disk_full_after(monkeypatch, 1 << 16)
        else:
            read_only(monkeypatch, path.parent)

    monkeypatch.setattr(runner, "save_checkpoint", save_then_fail_next)
    rc, out = run_cli(tmp_path, "run", "--strategies", "naive", "--experiences", "2")
    monkeypatch.undo()
    assert rc == 1
    err = one_line_error(capsys)
    ckpt = out / "checkpoints" / "naive-seed0.pt"
    reason = "No space left on device" if failure == "full disk" else "Permission denied"
    assert f"cannot write {ckpt}: {reason}; the previous version is kept" in err
    assert f"continue with: cl-streamkl run --resume {out}" in err
    assert [p.name for p in ckpt.parent.iterdir()] == [ckpt.name]
    from cl_streamkl.experiment.config_file import read_config

    config = read_config(out).resolved()
    assert load_checkpoint(ckpt, RunIdentity("naive", 0, config.fingerprint_json()))["experiences_done"] == 1
    assert cli.main(["run", "--resume", str(out), "--no-progress"]) == 0


def test_read_only_output_folder_is_one_line(tmp_path, capsys, monkeypatch):
    from test_checkpoints import read_only

    read_only(monkeypatch, tmp_path / "locked")
    rc, out = run_cli(tmp_path, "locked", "--strategies", "naive", "--experiences", "2")
    assert rc == 1
    # the run folder's lock is the first file a run writes
    assert f"cannot write {out / '.cl-streamkl.lock'}: Permission denied" in one_line_error(capsys)


def test_wandb_without_credentials_is_refused_before_anything_is_written(tmp_path, capsys, monkeypatch):
    for name in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_IDENTITY_TOKEN_FILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("NETRC", str(tmp_path / "home" / ".netrc"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "home" / "wandb"))
    rc, out = run_cli(tmp_path, "wandb", "--log", "wandb")
    assert rc == 2
    assert "--log wandb needs W&B credentials: run 'wandb login'" in one_line_error(capsys)
    assert not out.exists()
    # a key (not verified: nothing is contacted, here a server that would never answer) or offline mode is enough
    from cl_streamkl.experiment.loggers import check_loggers

    monkeypatch.setenv("WANDB_API_KEY", "0" * 40)
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{server.getsockname()[1]}")
        check_loggers(["wandb"])
        server.settimeout(0.2)
        with pytest.raises(TimeoutError):
            server.accept()
    monkeypatch.delenv("WANDB_BASE_URL")
    monkeypatch.delenv("WANDB_API_KEY")
    monkeypatch.setenv("WANDB_MODE", "offline")
    check_loggers(["wandb"])


def test_weights_of_another_architecture_are_one_line_naming_the_options_that_fit(tmp_path, capsys):
    from cl_streamkl.experiment.model import build_model, file_architecture

    source = build_model("vit_tiny_patch16_224", image_size=8, patch_size=2, in_chans=1, num_classes=10,
                         model_kwargs={"depth": 2, "embed_dim": 128, "num_heads": 2})
    weights = tmp_path / "w.pth"
    torch.save(source.state_dict(), weights)
    assert file_architecture(weights) == {"depth": 2, "embed_dim": 128, "patch_size": 2}
    rc, out = run_cli(tmp_path, "w", "--strategies", "naive", "--pretrained-file", str(weights))  # 1 block, 16 wide
    assert rc == 2
    err = one_line_error(capsys)
    assert (f"weights in {weights} do not fit 'vit_tiny_patch16_224' with --model-kwargs depth=1 embed_dim=16 "
            "num_heads=2: the file holds a 2-block, 128-wide ViT; pass --model-kwargs depth=2 embed_dim=128 "
            "num_heads=2 (64-wide heads") in err and err.rstrip().endswith("--patch-size 2")
    assert not out.exists()


@pytest.mark.parametrize("depth", [1, 3])
def test_weights_with_fewer_or_more_blocks_are_refused_not_loaded_in_part(tmp_path, capsys, depth):
    # timm loads leniently once it replaces the classifier: without the check the missing blocks
    # stayed at random init (or the file's extra blocks were dropped) and the run went on.
    from cl_streamkl.experiment.model import build_model

    source = build_model("vit_tiny_patch16_224", image_size=8, patch_size=4, in_chans=1, num_classes=0,
                         model_kwargs={"depth": 2, "embed_dim": 16, "num_heads": 2})
    weights = tmp_path / "w.pth"
    torch.save(source.state_dict(), weights)
    rc, out = run_cli(tmp_path, "w", "--strategies", "naive", "--pretrained-file", str(weights),
                      "--model-kwargs", f"depth={depth}", "embed_dim=16", "num_heads=2")
    assert rc == 2
    assert (f"weights in {weights} do not fit 'vit_tiny_patch16_224' with --model-kwargs depth={depth} embed_dim=16 "
            "num_heads=2: the file holds a 2-block, 16-wide ViT; pass --model-kwargs depth=2") in one_line_error(capsys)
    assert not out.exists()


def test_weights_of_a_network_that_is_no_vit_are_refused(tmp_path, capsys):
    weights = tmp_path / "resnet.pth"
    torch.save({"conv1.weight": torch.zeros(4, 1, 3, 3), "fc.weight": torch.zeros(10, 4)}, weights)
    rc, out = run_cli(tmp_path, "w", "--strategies", "naive", "--pretrained-file", str(weights),
                      "--model-kwargs", "depth=1", "embed_dim=16", "num_heads=2")
    assert rc == 2
    err = one_line_error(capsys)
    assert f"weights in {weights} do not fit 'vit_tiny_patch16_224': the model's " in err
    assert "not in the file; the file's conv1.weight (and 1 more) not in the model" in err
    assert not out.exists()


def test_weights_load_whatever_classifier_they_carry(tmp_path):
    from cl_streamkl.experiment.model import build_model

    kwargs = {"depth": 1, "embed_dim": 16, "num_heads": 2}
    source = build_model("vit_tiny_patch16_224", image_size=32, patch_size=8, in_chans=3, num_classes=1000,
                         model_kwargs=kwargs)
    weights = tmp_path / "w.pth"
    torch.save({"model": source.state_dict()}, weights)
    for head_sizes in (None, [2, 2]):
        model = build_model("vit_tiny_patch16_224", image_size=32, patch_size=8, in_chans=1, num_classes=4,
                            model_kwargs=kwargs, pretrained_file=weights, head_sizes=head_sizes)
        blocks = model.backbone.blocks if head_sizes else model.blocks
        assert torch.equal(blocks[0].attn.qkv.weight, source.blocks[0].attn.qkv.weight)


def test_a_weights_file_builds_the_architecture_the_model_names():
    from cl_streamkl.experiment.config import ExperimentConfig, describe_model

    # The small default kwargs are for random init only: timm's ViT-Ti weights load into ViT-Ti.
    config = ExperimentConfig(pretrained_file="vit_tiny.pth").resolved()
    assert config.model_kwargs == {}
    assert ExperimentConfig().resolved().model_kwargs == {"depth": 4, "embed_dim": 64, "num_heads": 2}
    assert describe_model(ExperimentConfig().resolved()) == (
        "vit_tiny_patch16_224 (depth=4 embed_dim=64 num_heads=2), 32 px, patch 8")


@pytest.mark.parametrize("content, message", [
    (b"", "is empty"),
    (b"hello world", "cannot be read as weights (KeyError: 101)"),
    (b"PK\x03\x04" + b"\0" * 64, "cannot be read as weights"),
    (None, "is not a file"),
])
def test_unreadable_weights_file_is_one_line(tmp_path, capsys, content, message):
    weights = tmp_path / "w.pth"
    if content is None:
        weights.mkdir()
    else:
        weights.write_bytes(content)
    rc, out = run_cli(tmp_path, "w", "--strategies", "naive", "--pretrained-file", str(weights))
    assert rc == 2
    assert f"pretrained file {str(weights)!r} {message}" in one_line_error(capsys)
    assert not out.exists()


def test_model_too_large_to_allocate_is_one_line(tmp_path, capsys):
    rc, out = run_cli(tmp_path, "huge", "--strategies", "naive", "--model-kwargs", "depth=1", f"embed_dim={2**40}",
                      "num_heads=2")
    assert rc == 2
    assert "timm model 'vit_tiny_patch16_224' cannot be built with --model-kwargs depth=1" in one_line_error(capsys)
    assert not out.exists()
