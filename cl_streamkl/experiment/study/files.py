"""The study's files: plan files read strictly, reports read with one-line errors, archives
written in parts and unpacked only after every member is checked.

Names that come from a file a user is handed (a report's record names, an archive's members)
never leave the study's folder: each is checked before anything is written.
"""

from __future__ import annotations

import io
import json
import re
import tarfile
from pathlib import Path, PurePosixPath
from typing import Any

# A part of an archive stays below what a machine may return per file (16 MiB).
ARCHIVE_PART_BYTES = 15 * 2**20
# What an archive may hold: the plan, finished units' records, unfinished units' runs, shared
# first experiences.
ARCHIVE_ROOTS = ("plan.json", "units", "runs", "first")
# A unit's name as Unit.name makes it: letters, digits, '-', '+', '_', '.'; no separator.
SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+-]*")


class StudyFileError(ValueError):
    """A study file that cannot be used; the message is one line naming the file."""


def _yaml_loader() -> type:
    import yaml

    class StrictLoader(yaml.SafeLoader):
        """Safe YAML that refuses a key given twice and anchors/aliases (a few bytes of nested
        aliases can expand to gigabytes), and reads ``1e-3`` as a number as YAML 1.2 does."""

        def compose_node(self, parent: Any, index: Any) -> Any:
            if self.check_event(yaml.AliasEvent):
                event = self.peek_event()
                raise yaml.YAMLError(f"aliases (*{event.anchor}) are not read in plan files, line "
                                     f"{event.start_mark.line + 1}")
            return super().compose_node(parent, index)

        def construct_mapping(self, node: Any, deep: bool = False) -> Any:
            seen = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=deep)
                if key in seen:
                    raise yaml.YAMLError(f"key {key!r} is given twice, line {key_node.start_mark.line + 1}")
                seen.add(key)
            return super().construct_mapping(node, deep=deep)

    StrictLoader.add_implicit_resolver(
        "tag:yaml.org,2002:float", re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
        list("-+0123456789"))
    return StrictLoader


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [key for key, _ in pairs]
    twice = sorted({key for key in keys if keys.count(key) > 1})
    if twice:
        raise ValueError(f"key {twice[0]!r} is given twice")
    return dict(pairs)


def read_mapping(path: Path) -> dict[str, Any]:
    """A YAML (``.yaml``, ``.yml``), TOML (``.toml``) or JSON file holding a mapping.

    Raises:
        StudyFileError: the file is missing, unreadable, not of its format, repeats a key,
            uses YAML aliases, or holds no mapping; one line naming the file.
    """
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as err:
        raise StudyFileError(f"cannot read {path}: {getattr(err, 'strerror', None) or err}") from None
    suffix = path.suffix.lower()
    try:
        if suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.load(text, Loader=_yaml_loader())  # noqa: S506 - a SafeLoader
        elif suffix == ".toml":
            try:
                import tomllib
            except ModuleNotFoundError:  # Python 3.10
                import tomli as tomllib  # type: ignore[no-redef]
            data = tomllib.loads(text)  # TOML itself refuses a key given twice
        else:
            data = json.loads(text, object_pairs_hook=_no_duplicates)
    except Exception as err:  # each parser's own error type; all mean the same to the user
        kind = {".yaml": "YAML", ".yml": "YAML", ".toml": "TOML"}.get(suffix, "JSON")
        raise StudyFileError(f"{path} is not valid {kind} ({' '.join(str(err).split())})") from None
    if not isinstance(data, dict):
        raise StudyFileError(f"{path} does not hold a mapping of keys")
    return data


def read_json(path: Path, what: str) -> dict[str, Any]:
    """A JSON object from ``path``; ``what`` names the option in the one-line error."""
    try:
        data = json.loads(path.read_text())
    except OSError as err:
        raise StudyFileError(f"{what} {path}: {err.strerror or err}") from None
    except (ValueError, UnicodeDecodeError) as err:
        raise StudyFileError(f"{what} {path} is not JSON ({err})") from None
    if not isinstance(data, dict):
        raise StudyFileError(f"{what} {path} does not hold a JSON object")
    return data


def safe_name(name: Any, what: str) -> str:
    """``name`` if it is a plain file name (no folder, no '..'); else a one-line error."""
    if not isinstance(name, str) or not SAFE_NAME.fullmatch(name) or name in (".", ".."):
        raise StudyFileError(f"{what}: {name!r} is not a unit name; nothing was written")
    return name


def archive_parts(path: Path) -> list[Path]:
    """An archive's files: ``path``, then ``path.1``, ``path.2``, ... as they exist."""
    parts = [path]
    while parts[-1].with_name(f"{path.name}.{len(parts)}").is_file():
        parts.append(path.with_name(f"{path.name}.{len(parts)}"))
    return parts


def write_archive(root: Path, path: Path) -> list[Path]:
    """The study folder's plan, records, unfinished runs and shared first experiences, as a
    .tar.gz in parts of at most :data:`ARCHIVE_PART_BYTES` (``path``, ``path.1``, ...)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    for stale in archive_parts(path)[1:]:
        stale.unlink()
    whole = io.BytesIO()
    with tarfile.open(fileobj=whole, mode="w:gz") as archive:
        for name in ARCHIVE_ROOTS:
            if (root / name).exists():
                archive.add(root / name, arcname=name)
    data = whole.getvalue()
    parts = [path if i == 0 else path.with_name(f"{path.name}.{i}")
             for i in range(max(1, -(-len(data) // ARCHIVE_PART_BYTES)))]
    for i, part in enumerate(parts):
        part.write_bytes(data[i * ARCHIVE_PART_BYTES:(i + 1) * ARCHIVE_PART_BYTES])
    return parts


def open_archive(path: Path) -> tuple[tarfile.TarFile, dict[str, Any] | None]:
    """An archive of :func:`write_archive`, every member checked, and the plan it holds.

    Raises:
        StudyFileError: a part is unreadable, the data is no gzip tar or is truncated, or a
            member is a link, a device, an absolute path, climbs out with '..', or lies
            outside :data:`ARCHIVE_ROOTS`; nothing has been unpacked.
    """
    try:
        data = b"".join(part.read_bytes() for part in archive_parts(path))
    except OSError as err:
        raise StudyFileError(f"--from-archive {path}: {err.strerror or err}") from None
    try:
        archive = tarfile.open(fileobj=io.BytesIO(data), mode="r:gz")
        members = archive.getmembers()
    except (tarfile.TarError, EOFError, OSError, ValueError) as err:
        raise StudyFileError(f"--from-archive {path} is not a complete .tar.gz ({err})") from None
    plan = None
    for member in members:
        parts = PurePosixPath(member.name).parts
        if (PurePosixPath(member.name).is_absolute() or ".." in parts or not parts
                or parts[0] not in ARCHIVE_ROOTS):
            raise StudyFileError(f"--from-archive {path}: member {member.name!r} lies outside a study folder")
        if not (member.isfile() or member.isdir()):
            raise StudyFileError(f"--from-archive {path}: member {member.name!r} is a link or device, not a file")
        if member.name == "plan.json":
            try:
                plan = json.loads(archive.extractfile(member).read())
            except (ValueError, tarfile.TarError, EOFError, OSError) as err:
                raise StudyFileError(f"--from-archive {path}: its plan.json is damaged ({err})") from None
    return archive, plan


def unpack_archive(archive: tarfile.TarFile, root: Path) -> None:
    """Unpack a checked archive (:func:`open_archive`) into ``root``."""
    root.mkdir(parents=True, exist_ok=True)
    try:
        archive.extractall(root, filter="data")
    except TypeError:  # Python without extraction filters: the members were checked above
        archive.extractall(root)
    except (tarfile.TarError, EOFError, OSError) as err:
        raise StudyFileError(f"--from-archive: unpacking failed ({err})") from None
