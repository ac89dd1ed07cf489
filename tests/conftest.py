"""Test-session setup.

* Triton kernels run on the CPU through its interpreter, which must be chosen
  before triton is first imported (set CL_STREAMKL_TEST_GPU=1 to test on CUDA, with the
  heuristic tiles unless CL_STREAMKL_AUTOTUNE says otherwise).
* benchmarks/ is on sys.path, as for a script run from it.
* Every float tensor that ``torch.empty``/``torch.empty_like`` returns is filled
  with NaN, so an output element a kernel forgets to write fails the test
  instead of passing on whatever memory happened to hold.
* The kernels' switches (``cl_streamkl.kernels.config``) are put back after every
  test, so a benchmark's ``main`` run in-process leaves none changed.
* Under the interpreter, a ``@triton.jit`` helper called inside a running kernel does not
  patch ``triton.language`` again when the kernel's own patch covers it (see
  ``_patch_language_once``): the repeats set the same attributes to equivalent wrappers and
  took about 40 % of the interpreted kernels' time.
"""

import dataclasses
import inspect
import os
import sys
from pathlib import Path

if os.environ.get("CL_STREAMKL_TEST_GPU") != "1":
    os.environ.setdefault("TRITON_INTERPRET", "1")
else:
    # On CUDA the suite runs the heuristic tiles: autotuning compiles and times every candidate
    # tile per shape, minutes for the suite's many small shapes. benchmarks/check_gpu.py checks
    # the autotuned configuration users get.
    os.environ.setdefault("CL_STREAMKL_AUTOTUNE", "0")

# The benchmark scripts run as files (``python benchmarks/<script>.py``), which puts their
# folder on sys.path; their smoke tests import them, and ``_harness``, the same way.
BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))

import pytest  # noqa: E402
import torch  # noqa: E402

_real_empty = torch.empty
_real_empty_like = torch.empty_like


def _poison(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.is_floating_point() and tensor.numel() and not tensor.is_meta:
        with torch.no_grad():
            tensor.fill_(float("nan"))
    return tensor


def _poisoned_empty(*args, **kwargs):
    return _poison(_real_empty(*args, **kwargs))


def _poisoned_empty_like(*args, **kwargs):
    return _poison(_real_empty_like(*args, **kwargs))


torch.empty = _poisoned_empty
torch.empty_like = _poisoned_empty_like


class _Patched:
    """The scope of a kernel's patch of ``triton.language``; restoring it ends the kernel's run."""

    def __init__(self, scope, languages: set[int], active: list[set[int]]) -> None:
        self.scope, self.languages, self.active = scope, languages, active

    def restore(self) -> None:
        self.active.remove(self.languages)
        self.scope.restore()


def _patch_language_once() -> None:
    """Triton's interpreter patches the language modules a function sees on every call of a helper.

    A kernel's run (``GridExecutor``) patches the ``triton.language`` modules in its function's
    globals and restores them when it ends; each ``@triton.jit`` helper it calls patches those
    its own globals hold again, and never restores them. Where the running kernel's patch covers
    a helper's modules, the repeat only sets the same attributes to equivalent wrappers, so it
    is skipped; any other call patches as Triton does. A Triton without these internals is left
    as it is.
    """
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    real = getattr(interpreter, "_patch_lang", None)
    if real is None or not hasattr(interpreter, "GridExecutor") or not hasattr(interpreter, "InterpretedFunction"):
        return
    active: list[set[int]] = []  # per running kernel: ids of the language modules patched for it

    def languages(fn) -> set[int]:
        return {id(value) for value in fn.__globals__.values() if inspect.ismodule(value) and value in (tl, tl.core)}

    def patch(fn):
        seen = languages(fn)
        caller = inspect.currentframe().f_back.f_code
        if caller is interpreter.GridExecutor.__call__.__code__:  # a kernel starts: restored when it ends
            patched = _Patched(real(fn), seen, active)
            active.append(seen)
            return patched
        if active and seen <= set().union(*active):
            return None  # a helper inside a kernel whose patch covers it (Triton drops this scope)
        return real(fn)

    interpreter._patch_lang = patch


if os.environ.get("TRITON_INTERPRET") == "1":
    _patch_language_once()

DEVICE = "cuda" if os.environ.get("CL_STREAMKL_TEST_GPU") == "1" else "cpu"


@pytest.fixture(autouse=True)
def _kernel_options_put_back():
    from cl_streamkl.kernels.config import get_kernel_options, set_kernel_options

    before = get_kernel_options()
    yield
    set_kernel_options(**dataclasses.asdict(before))


@pytest.fixture
def device() -> str:
    return DEVICE


class LaunchCounter:
    """Counts the launches of every kernel launcher of ``kernels.triton.launch`` (patched by monkeypatch)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from cl_streamkl.kernels.triton import launch

        self.counts = {name: 0 for name in launch.KERNEL_LAUNCHERS}
        for name, launcher in launch.KERNEL_LAUNCHERS.items():
            attribute = next(key for key, value in vars(launch).items()
                             if value is launcher and key.isupper() and key != "KERNEL_LAUNCHERS")
            monkeypatch.setattr(launch, attribute, self._counting(name, launcher))

    def _counting(self, name, launcher):
        def run(*args, **kwargs):
            self.counts[name] += 1
            return launcher(*args, **kwargs)

        return run


@pytest.fixture
def launch_counter(monkeypatch: pytest.MonkeyPatch) -> LaunchCounter:
    """Launch counts per kernel launcher for the rest of the test."""
    return LaunchCounter(monkeypatch)


@pytest.fixture
def traced_not_generated(monkeypatch: pytest.MonkeyPatch) -> None:
    """The library's compiled pieces (``compile_layers``, ``compile_model``) traced by Dynamo and
    AOT autograd as on a GPU, with no C++ generated (CI may have no compiler)."""
    import functools

    from cl_streamkl.capture import compiled_model
    from cl_streamkl.experiment import compiled_layers

    traced = functools.cache(lambda fn: torch.compile(fn, backend="aot_eager"))
    for module in (compiled_model, compiled_layers):
        monkeypatch.setattr(module, "_compiled", traced)
