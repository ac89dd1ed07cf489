"""What the sm_90 compile tests share: compile every case in fresh processes, one line per kernel.

Each test file runs itself as a script (without ``TRITON_INTERPRET``, which the other tests
set) and reads back one line per case: ``ok   LABEL | key=value ...`` counts of its PTX. The
cases are dealt out to one script process per CPU core (``SHARD`` in the environment names a
process's share), since Triton compiles a kernel on one core and the test waits for them all.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
SHARD = "CL_STREAMKL_TEST_SHARD"  # "i/n": compile cases i, i + n, i + 2n, ... of the list
MOST_SHARDS = 8  # each process imports triton and torch (about 0.5 GiB); a file has 10 to 40 cases
# 16-byte asynchronous global-to-shared copies: how tiles should be loaded on Hopper.
COPY16 = re.compile(r"cp\.async\.cg\.shared\.global \[[^]]*\], \[[^]]*\], 0x10\b")


def compile_sm90(kernel: Any, constants: dict[str, Any], pointer_type: Callable[[str], str | None],
                 odd_integers: set[str], options: dict[str, int]) -> Any:
    """Compile a Triton kernel for sm_90, its arguments specialised as a launcher's would be.

    Args:
        kernel: the ``@triton.jit`` function.
        constants: its ``constexpr`` arguments.
        pointer_type: a tensor argument's pointer type (``"*bf16"``, ...), None for the others.
        odd_integers: integer arguments not divisible by 16 at the shapes in mind; every other
            integer and every pointer is marked divisible by 16, ``scale*`` arguments are fp32.
        options: ``num_warps`` and ``num_stages``.
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature, attrs = {}, {}
    for index, arg in enumerate(kernel.arg_names):
        if arg in constants:
            signature[arg] = "constexpr"
            continue
        pointer = pointer_type(arg)
        if pointer is not None:
            signature[arg] = pointer
        elif arg.startswith("scale"):
            signature[arg] = "fp32"
            continue
        else:
            signature[arg] = "i32"
            if arg in odd_integers:
                continue
        attrs[(index,)] = [["tt.divisibility", 16]]
    source = ASTSource(fn=kernel, signature=signature, attrs=attrs,
                       constexprs={(kernel.arg_names.index(arg),): value for arg, value in constants.items()})
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


def print_counts(cases: Sequence[Any], counts: Callable[[Any], dict[str, int]]) -> int:
    """The script's body: ``ok   LABEL | key=value ...`` per case, ``FAIL ...`` for a case that fails.

    Only this process's share of ``cases`` when ``SHARD`` is set (every case otherwise).

    Returns:
        The exit status: 1 if any case failed, else 0.
    """
    index, count = map(int, os.environ.get(SHARD, "0/1").split("/"))
    failures = 0
    for case in cases[index::count]:
        try:
            values = counts(case)
            print(f"ok   {case.label()} | " + " ".join(f"{key}={value}" for key, value in values.items()), flush=True)
        except Exception as error:  # report every kernel, then fail
            failures += 1
            print(f"FAIL {case.label()}: {type(error).__name__}: {error}", flush=True)
    return 1 if failures else 0


def compiled_counts(script: str, timeout: float) -> dict[str, dict[str, int]]:
    """Run ``script`` in fresh processes without the interpreter, one per CPU core (at most MOST_SHARDS); its counts
    by case label.

    Raises:
        AssertionError: a script process failed (its output is the message).
    """
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    shards = min(len(os.sched_getaffinity(0)), MOST_SHARDS)
    processes = [subprocess.Popen([sys.executable, script], env={**env, SHARD: f"{index}/{shards}"},
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
                 for index in range(shards)]
    try:
        outputs = [process.communicate(timeout=timeout) for process in processes]
    finally:  # a timeout or an interrupt leaves no compiler running
        for process in processes:
            if process.poll() is None:
                process.kill()
    for process, (stdout, stderr) in zip(processes, outputs):
        assert process.returncode == 0, stdout + stderr
    counts = {}
    for line in "".join(stdout for stdout, _ in outputs).splitlines():
        label, _, values = line.removeprefix("ok   ").partition(" | ")
        counts[label] = {key: int(value) for key, value in (item.split("=") for item in values.split())}
    return counts
