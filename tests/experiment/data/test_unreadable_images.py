"""ImageFolder files that cannot be read: a dangling link refused before anything is written, a corrupt
image named in one line (exit status 2, not the write-failure status 1)."""

from __future__ import annotations

from pathlib import Path

import pytest
from PIL import Image

from cl_streamkl.experiment import cli
from cl_streamkl.experiment.data import load_splits
from cl_streamkl.experiment.data.errors import DataError


def _image_folder(root: Path, classes: int = 4, per_class: int = 5) -> Path:
    for c in range(classes):
        (root / f"class{c}").mkdir(parents=True)
        for i in range(per_class):
            Image.new("RGB", (8, 8), (40 * c, 10 * i, 0)).save(root / f"class{c}" / f"{i}.png")
    return root


def test_a_dangling_link_is_refused_before_anything_is_written(tmp_path, capsys):
    root = _image_folder(tmp_path / "images")
    (root / "class1" / "gone.png").symlink_to(tmp_path / "deleted.png")
    with pytest.raises(DataError, match="gone.png is a link to a missing file"):
        load_splits("imagefolder", data_root=root, image_size=8)
    out = tmp_path / "out"
    assert cli.main(["run", "--dataset", "imagefolder", "--data-root", str(root), "--out", str(out),
                     "--experiences", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "gone.png is a link to a missing file" in err
    assert not out.exists()


def test_a_corrupt_image_is_one_line_naming_it_with_status_2(tmp_path, capsys):
    root = _image_folder(tmp_path / "images")
    for c in range(4):  # wherever the split puts them, a training image of every class is corrupt
        (root / f"class{c}" / "1.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"not an image" * 20)
    splits = load_splits("imagefolder", data_root=root, image_size=8)
    corrupt = next(i for i, path in enumerate(splits.train.paths) if path.name == "1.png")
    with pytest.raises(DataError, match=f"cannot read image {splits.train.paths[corrupt]}: "):
        splits.train[corrupt]
    out = tmp_path / "out"
    rc = cli.main(["run", "--dataset", "imagefolder", "--data-root", str(root), "--out", str(out), "--experiences",
                   "2", "--strategies", "naive", "--epochs", "1", "--image-size", "8", "--patch-size", "4",
                   "--model-kwargs", "depth=1", "embed_dim=16", "num_heads=2", "--no-progress"])
    assert rc == 2
    err = capsys.readouterr().err
    assert err.startswith("cl-streamkl: error: cannot read image ") and err.count("\n") == 1, err
    assert "1.png" in err and "replace or remove it" in err
