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
from collections.abc import Collection
from pathlib import Path, PurePosixPath
from typing import Any

# A part of an archive stays below what a machine may return per file (16 MiB).
ARCHIVE_PART_BYTES = 15 * 2**20
# What an archive may hold: the plan, finished units' records, unfinished units' runs, shared
# first experiences still needed (:func:`~cl_streamkl.experiment.study.spent.spent_files`).
ARCHIVE_ROOTS = ("plan.json", "units", "runs", "first")
# A unit's name as Unit.name makes it: letters, digits, '-', '+', '_', '.'; no separator.
SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+-]*")


class StudyFileError(ValueError):
    """A study file that cannot be used; the message is one line naming the file."""


def read_mapping(path: Path) -> dict[str, Any]:
    """A YAML (``.yaml``, ``.yml``), TOML (``.toml``) or JSON file holding a mapping.

    Raises:
        StudyFileError: the file is missing, unreadable, not of its format, repeats a key,
            uses YAML aliases, or holds no mapping; one line naming the file.
    """
    from cl_streamkl.experiment.config_file import read_data

    try:
        if path.suffix.lower() == ".toml":
            data = _read_toml(path)
        else:
            data = read_data(path)  # YAML (by its suffix) or JSON: no key twice, no aliases
    except OSError as err:
        raise StudyFileError(f"cannot read {path}: {err.strerror or err}") from None
    except ValueError as err:  # one line naming the file
        raise StudyFileError(str(err)) from None
    if not isinstance(data, dict):
        raise StudyFileError(f"{path} does not hold a mapping of keys")
    return data


def _read_toml(path: Path) -> Any:
    """A TOML file's data (TOML itself refuses a key given twice); ValueError naming the file."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib  # type: ignore[no-redef]
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not UTF-8 text") from None
    except tomllib.TOMLDecodeError as err:
        raise ValueError(f"{path} is not valid TOML ({' '.join(str(err).split())})") from None


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


def write_archive(root: Path, path: Path, leave_out: Collection[str] = ()) -> list[Path]:
    """The study folder's plan, records, unfinished runs and shared first experiences, as a
    .tar.gz in parts of at most :data:`ARCHIVE_PART_BYTES` (``path``, ``path.1``, ...).

    Args:
        root: the study folder.
        path: the archive's first part.
        leave_out: paths under ``root`` not packed, with all they hold, relative to it as
            archive members are named (``runs/<unit>``, ``first/<unit>.pt``).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    for stale in archive_parts(path)[1:]:
        stale.unlink()
    whole = io.BytesIO()
    with tarfile.open(fileobj=whole, mode="w:gz") as archive:
        for name in ARCHIVE_ROOTS:
            if (root / name).exists():
                archive.add(root / name, arcname=name,
                            filter=lambda member: None if member.name in leave_out else member)
    data = whole.getvalue()
    parts = [path if i == 0 else path.with_name(f"{path.name}.{i}")
             for i in range(max(1, -(-len(data) // ARCHIVE_PART_BYTES)))]
    for i, part in enumerate(parts):
        part.write_bytes(data[i * ARCHIVE_PART_BYTES:(i + 1) * ARCHIVE_PART_BYTES])
    return parts


def open_archive(path: Path) -> tuple[tarfile.TarFile, dict[str, Any] | None]:
    """An archive of :func:`write_archive`, every member checked, and the plan it holds (None if none).

    Members are known by their names without leading ``./`` (:func:`normal_member_name`),
    and unpacked under those names.

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
        # `tar czf x.tgz -C folder ./plan.json ./units` names members ./plan.json, ./units/...:
        # the same files as write_archive's, checked and unpacked under their plain names.
        member.name = normal_member_name(member.name)
    archive.members = members = [member for member in members if member.name]  # not the folder itself
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


def normal_member_name(name: str) -> str:
    """An archive member's name without ``.`` parts (``""`` for the archived folder itself)."""
    path = PurePosixPath(name)
    return path.as_posix() if path.parts else ""


def unpack_archive(archive: tarfile.TarFile, root: Path) -> None:
    """Unpack a checked archive (:func:`open_archive`) into ``root``."""
    root.mkdir(parents=True, exist_ok=True)
    try:
        archive.extractall(root, filter="data")
    except TypeError:  # Python without extraction filters: the members were checked above
        archive.extractall(root)
    except (tarfile.TarError, EOFError, OSError) as err:
        raise StudyFileError(f"--from-archive: unpacking failed ({err})") from None
