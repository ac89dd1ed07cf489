"""Split Tiny-ImageNet (200 classes, 64×64) from the official directory layout.

Layout (``root`` may be the folder that contains ``tiny-imagenet-200`` or that folder)::

    tiny-imagenet-200/wnids.txt                      one WordNet id per line (class order)
    tiny-imagenet-200/words.txt                      optional "wnid<TAB>name" lines
    tiny-imagenet-200/train/<wnid>/images/*.JPEG
    tiny-imagenet-200/val/images/*.JPEG
    tiny-imagenet-200/val/val_annotations.txt        "file<TAB>wnid<TAB>x0<TAB>y0<TAB>x1<TAB>y1"

The official test labels are not public, so the labelled ``val`` split serves as test set.
Annotation lines name plain files inside ``val/images``; any other path (``../x.png``, an
absolute path) is refused. ``--download`` fetches the official archive over HTTPS and checks
its MD5 before unpacking it.
"""

from __future__ import annotations

from pathlib import Path

from cl_streamkl.experiment.data.images import FileImages
from cl_streamkl.experiment.data.stream import LabeledSplits

URL = "https://cs231n.stanford.edu/tiny-imagenet-200.zip"
MD5 = "90528d7ca1a48142e341f4ef8d21d0de"
FOLDER = "tiny-imagenet-200"
_EXTENSIONS = {".jpeg", ".jpg", ".png"}


def _find_folder(root: Path) -> Path | None:
    for candidate in (root / FOLDER, root):
        if (candidate / "wnids.txt").is_file():
            return candidate
    return None


def _images_in(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.suffix.lower() in _EXTENSIONS)


def load_tiny_imagenet(
    root: str | Path, *, image_size: int, download: bool = False
) -> LabeledSplits:
    """Read Tiny-ImageNet from ``root`` (see the module docstring for the layout).

    Args:
        root: data root.
        image_size: side length of the returned RGB images (64 keeps the original size).
        download: fetch and unzip the official archive into ``root`` if it is missing.

    Returns:
        Splits over the classes listed in ``wnids.txt`` (200 in the full release);
        images are decoded lazily.

    Raises:
        ValueError: the layout is missing or inconsistent and ``download`` is False,
            or an annotation names a file outside ``val/images``.
    """
    root = Path(root).expanduser()
    folder = _find_folder(root)
    if folder is None and download:
        from torchvision.datasets.utils import download_and_extract_archive

        download_and_extract_archive(URL, download_root=str(root), md5=MD5)
        folder = _find_folder(root)
    if folder is None:
        raise ValueError(
            f"tiny-imagenet: no {FOLDER}/wnids.txt under data root {str(root)!r}; "
            f"unzip {URL} there or pass --download"
        )
    wnids = [line.strip() for line in (folder / "wnids.txt").read_text().splitlines() if line.strip()]
    label_of = {wnid: i for i, wnid in enumerate(wnids)}

    train_paths, train_targets = [], []
    for wnid in wnids:
        class_dir = folder / "train" / wnid / "images"
        if not class_dir.is_dir():
            raise ValueError(f"tiny-imagenet: missing training folder {class_dir}")
        paths = _images_in(class_dir)
        train_paths += paths
        train_targets += [label_of[wnid]] * len(paths)

    annotations = folder / "val" / "val_annotations.txt"
    if not annotations.is_file():
        raise ValueError(f"tiny-imagenet: missing {annotations}")
    test_paths, test_targets = [], []
    for line_no, line in enumerate(annotations.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        fields = line.split("\t")
        if len(fields) < 2 or fields[1] not in label_of:
            raise ValueError(f"tiny-imagenet: {annotations}:{line_no}: unknown class in {line!r}")
        name = fields[0]
        if name in ("", ".", "..") or Path(name).name != name or "\\" in name:
            raise ValueError(f"tiny-imagenet: {annotations}:{line_no}: {name!r} is not a file name inside "
                             f"{folder / 'val' / 'images'}")
        test_paths.append(folder / "val" / "images" / name)
        test_targets.append(label_of[fields[1]])

    names = dict.fromkeys(wnids)
    words = folder / "words.txt"
    if words.is_file():
        for line in words.read_text().splitlines():
            wnid, _, name = line.partition("\t")
            if wnid in names:
                names[wnid] = name.strip()
    return LabeledSplits(
        name="tiny-imagenet",
        train=FileImages(train_paths, train_targets, image_size, in_chans=3),
        test=FileImages(test_paths, test_targets, image_size, in_chans=3),
        num_classes=len(wnids), in_chans=3,
        class_names=[names[w] or w for w in wnids],
    )
