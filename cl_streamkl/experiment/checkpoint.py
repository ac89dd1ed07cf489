"""Checkpoint files that check themselves, and the RNG state they carry (all weights_only-loadable).

A checkpoint records which run it belongs to (strategy, seed and a fingerprint of the
configuration, see :meth:`~cl_streamkl.experiment.config.ExperimentConfig.fingerprint`)
and a SHA-256 checksum of its whole content. :func:`load_checkpoint` refuses a file that
cannot be read, was changed after it was written, or belongs to another run, with a
:class:`CheckpointError` whose one-line message names the file and what to do.
"""

from __future__ import annotations

import hashlib
import json
import random
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from cl_streamkl.experiment.files import write_atomically

CHECKPOINT_FORMAT = "cl_streamkl.run-checkpoint/2"
_REQUIRED_KEYS = ("strategy", "seed", "config", "config_fingerprint", "experiences_done", "finished", "model",
                  "optimizer", "scaler", "plugins", "clock", "rng", "result")


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: unreadable, changed after writing, or of another run."""


@dataclass(frozen=True)
class RunIdentity:
    """What a checkpoint must belong to: one (strategy, seed) run of one configuration.

    Attributes:
        strategy: strategy name, e.g. ``"replay+streamkl"``.
        seed: run seed.
        config: the configuration's fingerprinted fields as canonical JSON
            (:meth:`~cl_streamkl.experiment.config.ExperimentConfig.fingerprint_json`).
    """

    strategy: str
    seed: int
    config: str

    @property
    def fingerprint(self) -> str:
        return hashlib.sha256(self.config.encode()).hexdigest()

    def describe(self) -> str:
        return f"{self.strategy} seed {self.seed}"


def _tensor_bytes(tensor: torch.Tensor) -> Any:
    """A tensor's bytes in row-major order, on the CPU (a NumPy uint8 array)."""
    return tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()


def _feed(digest: Any, value: Any) -> None:
    """Hash ``value`` (nested dicts, lists, tuples, tensors, plain scalars) in a canonical order."""
    if isinstance(value, torch.Tensor):
        digest.update(f"T{value.dtype}{tuple(value.shape)}:".encode())
        digest.update(_tensor_bytes(value))
    elif isinstance(value, dict):
        digest.update(f"D{len(value)}:".encode())
        for key in sorted(value, key=lambda k: (type(k).__name__, repr(k))):
            _feed(digest, key)
            _feed(digest, value[key])
    elif isinstance(value, (list, tuple)):
        digest.update(f"{type(value).__name__[0]}{len(value)}:".encode())
        for item in value:
            _feed(digest, item)
    elif value is None or isinstance(value, (bool, int, float, str)):
        digest.update(f"{type(value).__name__}:{value!r};".encode())
    else:
        raise TypeError(f"cannot checksum a {type(value).__name__} in a checkpoint")


def checksum(state: dict[str, Any]) -> str:
    """SHA-256 over every tensor's bytes, dtype and shape and every other value of ``state``."""
    digest = hashlib.sha256()
    _feed(digest, {key: value for key, value in state.items() if key != "checksum"})
    return digest.hexdigest()


def save_checkpoint(path: str | Path, state: dict[str, Any], identity: RunIdentity) -> None:
    """Write ``state`` with its identity and checksum, replacing ``path`` atomically.

    A failure (read-only folder, full disk) leaves the previous checkpoint intact and no
    temporary file behind.

    Raises:
        OutputWriteError: the file cannot be written.
    """
    stamped = {**state, "format": CHECKPOINT_FORMAT, "strategy": identity.strategy, "seed": identity.seed,
               "config": identity.config, "config_fingerprint": identity.fingerprint}
    stamped["checksum"] = checksum(stamped)
    shared = _share_equal_tensors(stamped)
    write_atomically(path, lambda handle: torch.save(shared, handle))


def _tensor_key(tensor: torch.Tensor) -> tuple[Any, ...]:
    return tensor.dtype, tuple(tensor.shape), hashlib.sha256(_tensor_bytes(tensor)).digest()


def _map_tensors(value: Any, function: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``value`` (nested dicts, lists, tuples) with each tensor replaced by ``function(tensor)``, in order."""
    if isinstance(value, torch.Tensor):
        return function(value)
    if isinstance(value, dict):
        return {key: _map_tensors(item, function) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_map_tensors(item, function) for item in value)
    return value


def _share_equal_tensors(value: Any) -> Any:
    """``value`` with every tensor equal in dtype, shape and bytes to an earlier one replaced by it.

    ``torch.save`` writes a storage once however many tensors use it. Between experiences a
    teacher's weights (LwF, StreamKL, PAD) and EWC's newest anchors are copies of the model's,
    so a checkpoint holding each once is a fraction of the size; :func:`load_checkpoint` gives
    every tensor its own storage again.
    """
    seen: dict[tuple[Any, ...], torch.Tensor] = {}
    return _map_tensors(value, lambda tensor: seen.setdefault(_tensor_key(tensor), tensor))


def _unshare(value: Any) -> Any:
    """``value`` with every tensor that appeared before (the same object) replaced by a copy."""
    seen: set[int] = set()

    def own(tensor: torch.Tensor) -> torch.Tensor:
        if id(tensor) in seen:
            return tensor.clone()
        seen.add(id(tensor))
        return tensor

    return _map_tensors(value, own)


def _unreadable(path: Path) -> str:
    """Why ``torch.load`` failed, in words (its own message may suggest loading unsafely)."""
    try:
        with open(path, "rb") as handle:
            empty = not handle.read(1)
    except OSError as error:
        return f"cannot be read ({error.strerror or error})"
    return "is empty" if empty else "is truncated or not a checkpoint file"


def _differing_fields(saved: str, expected: str) -> list[str]:
    try:
        old, new = json.loads(saved), json.loads(expected)
    except (TypeError, ValueError):
        return []
    return sorted(key for key in old.keys() | new.keys() if old.get(key) != new.get(key))


def load_checkpoint(path: str | Path, identity: RunIdentity) -> dict[str, Any]:
    """Load a checkpoint of :func:`save_checkpoint` onto the CPU and check it belongs to ``identity``.

    Args:
        path: the checkpoint file.
        identity: the run that is about to continue from it.

    Returns:
        The state as saved.

    Raises:
        CheckpointError: the file cannot be read (empty, truncated, garbage), its checksum
            does not match its content, or it belongs to another strategy, seed or
            configuration. The message is one line naming the file and what to do.
    """
    path = Path(path)
    restart = f"delete it to restart {identity.describe()} from its first experience"
    try:
        with warnings.catch_warnings():
            # A damaged file may also draw a warning about its pickle protocol: the error says it all.
            warnings.filterwarnings("ignore", category=UserWarning, module=r"torch\._weights_only_unpickler")
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception:  # noqa: BLE001 - whatever torch.load raises, the file is unusable
        raise CheckpointError(f"checkpoint {path} {_unreadable(path)}; {restart}") from None
    if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT or "checksum" not in state:
        raise CheckpointError(f"{path} is not a checkpoint of this cl-streamkl version; {restart}")
    # Equal tensors were saved once (see save_checkpoint); a caller may change one in place.
    state = _unshare(state)
    missing = [key for key in _REQUIRED_KEYS if key not in state]
    if missing:
        raise CheckpointError(f"checkpoint {path} lacks {missing}; {restart}")
    try:
        intact = checksum(state) == state["checksum"]
    except TypeError:
        intact = False
    if not intact:
        raise CheckpointError(f"checkpoint {path} fails its checksum: it was changed or damaged after it was "
                              f"written; {restart}")
    if state["strategy"] != identity.strategy or state["seed"] != identity.seed:
        raise CheckpointError(f"checkpoint {path} belongs to {state['strategy']} seed {state['seed']}, not "
                              f"{identity.describe()}; {restart}")
    if state["config_fingerprint"] != identity.fingerprint:
        fields = _differing_fields(state["config"], identity.config)
        differ = f" ({', '.join(fields)} differ)" if fields else ""
        raise CheckpointError(f"checkpoint {path} was written under another configuration than config.json"
                              f"{differ}; restore config.json, or {restart}")
    return state


def rng_state() -> dict[str, Any]:
    """Python, NumPy, torch CPU and CUDA generator states as tensors and plain values."""
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {"name": np_name, "keys": torch.from_numpy(np_keys.astype(np.int64)),
                  "pos": int(np_pos), "has_gauss": int(np_has_gauss), "gauss": float(np_gauss)},
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` captured."""
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))
    np_state = state["numpy"]
    np.random.set_state((np_state["name"], np_state["keys"].numpy().astype(np.uint32),
                         np_state["pos"], np_state["has_gauss"], np_state["gauss"]))
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (CPU and CUDA) generators."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
