"""How the kernels are tiled: autotuning candidates and their pruning, or fixed heuristic tiles.

:func:`tuned` wraps a kernel in ``triton.autotune`` over :func:`autotune_configs`, keyed on
:data:`AUTOTUNE_KEY` (length buckets, head dims, causal) and pruned per input by
:func:`prune_configs`; :func:`launch_options` gives the tiles to pass at launch when
autotuning is off. :func:`autotuning` says which, from the ``autotune`` switch of
:mod:`cl_streamkl.kernels.config` (always off under the CPU interpreter).
"""

from __future__ import annotations

import functools
import inspect

import torch
import triton
import triton.testing

from cl_streamkl.kernels.config import get_kernel_options
from cl_streamkl.kernels.triton.common import INTERPRETING


# Host-side helpers are plain Python: triton.next_power_of_2 is a constexpr
# function whose wrapper costs microseconds per call, and at ViT sizes
# (197 tokens) the kernels themselves run for only tens of microseconds.
def _next_power_of_2(value: int) -> int:
    return 1 << (value - 1).bit_length()


def block_dim(head_dim: int) -> int:
    """The BLOCK_DS / BLOCK_DT tile width that covers ``head_dim``."""
    # tl.dot needs every operand dimension to be at least 16.
    return max(16, _next_power_of_2(head_dim))


def length_bucket(length: int) -> int:
    """The N_Q_BUCKET / N_K_BUCKET autotuning key of a sequence length."""
    return _next_power_of_2(length)


_TILE_SHAPES = {
    "fwd": [(128, 64), (128, 128), (64, 64), (64, 128), (128, 32), (64, 32)],
    "bwd": [(64, 64), (128, 64), (64, 128), (32, 64), (64, 32), (128, 128)],
}
# The fused forward (the key-side backward kernel adding up the KL too) tiles as the backward does.
_TILE_SHAPES["fused"] = _TILE_SHAPES["bwd"]
# At ViT lengths (both length buckets at most 2048) only these (BLOCK_M, BLOCK_N, warps,
# stages) are tried: every tile the CUDA-graph-timed autotuner picked on the H200 at 197,
# 577 and 1025 tokens, and their neighbours, plus the fastest dq and dk tiles of a sweep of
# all 24 at 16x12x1025x64 (docs/tuning-log.md, attempt 15). A third to 40 % of the configs
# means that much of the compiling on the first call, which there costs far more than the
# kernels themselves.
SHORT_SEQUENCE_BUCKET = 2048
SHORT_SEQUENCE_CANDIDATES = {
    "fwd": {(128, 64, w, s) for w in (4, 8) for s in (2, 3)}
    | {(64, 64, 4, 2), (64, 64, 4, 3), (128, 128, 8, 2), (64, 32, 4, 2)},
    "bwd": {(64, 64, w, s) for w in (4, 8) for s in (2, 3)}
    | {(128, 64, 8, 2), (64, 128, 8, 2), (32, 64, 4, 2), (128, 128, 8, 2), (64, 32, 4, 3), (128, 64, 4, 2)},
}
SHORT_SEQUENCE_CANDIDATES["fused"] = SHORT_SEQUENCE_CANDIDATES["bwd"] | {(64, 128, 4, 3)}


def autotune_configs(kind: str) -> list[triton.Config]:
    """Candidate tile shapes for the GPU; the interpreter uses one fixed small config."""
    return [
        triton.Config({"BLOCK_M": block_m, "BLOCK_N": block_n}, num_warps=warps, num_stages=stages)
        for block_m, block_n in _TILE_SHAPES[kind]
        for warps in (4, 8)
        for stages in (2, 3)
    ]


def config_tuple(config: triton.Config) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, warps, stages), the form of :data:`SHORT_SEQUENCE_CANDIDATES`."""
    return config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"], config.num_warps, config.num_stages


def _element_size(named_args, kwargs) -> int:
    if "Q" in named_args:
        return named_args["Q"].element_size()
    # The grouped kernels take the inputs' dtype as the constexpr ELEMENT instead of a tensor.
    return named_args.get("ELEMENT", kwargs.get("ELEMENT")).primitive_bitwidth // 8


def prune_configs(configs, named_args, kind: str, **kwargs):
    """Drop tile shapes that cannot run well for these inputs before autotuning compiles them.

    Past :data:`SHORT_SEQUENCE_BUCKET` only the heuristic tiles are left. There, the tiles the
    autotuner picked made a whole forward+backward slower than the heuristic ones on the H200
    (bf16, commit 71776a9: 2x12x4096x64 1.83 against 1.24 ms, 1x16x8192x128 6.36 against
    4.93 ms): a candidate's inputs stay in the 50 MB L2 cache across its CUDA-graph replays,
    while a training step's tensors do not.
    """
    widest = max(named_args["d_s"], named_args["d_t"])
    element_size = _element_size(named_args, kwargs)
    four_byte = element_size == 4
    kept = configs
    if max(named_args["N_Q_BUCKET"], named_args["N_K_BUCKET"]) > SHORT_SEQUENCE_BUCKET:
        heuristic = _gpu_heuristic(kind, widest, element_size)
        wanted = (heuristic["BLOCK_M"], heuristic["BLOCK_N"], heuristic["num_warps"], heuristic["num_stages"])
        return [c for c in configs if config_tuple(c) == wanted] or configs[:1]
    kept = [c for c in kept if config_tuple(c) in SHORT_SEQUENCE_CANDIDATES[kind]]
    if widest > 128 or four_byte:
        # Wide heads and float32 operands need small tiles: larger ones exceed the
        # register file and shared memory, spill, and take minutes each to compile
        # (an fp32 autotuning pass over every config did not finish in 4 minutes on an H200).
        kept = [c for c in kept if c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] <= 64 * 64]
    if four_byte:
        kept = [c for c in kept if c.num_stages <= 2]
    return kept or configs[:1]


AUTOTUNE_KEY = ["N_Q_BUCKET", "N_K_BUCKET", "d_s", "d_t", "CAUSAL"]


def autotuning() -> bool:
    """Whether launches now autotune their tiles (never under the interpreter: timing it is meaningless)."""
    return not INTERPRETING and get_kernel_options().autotune


def _heuristic_options(kind: str, widest_head_dim: int, element_size: int) -> dict:
    if INTERPRETING:
        return {"BLOCK_M": 16, "BLOCK_N": 16}
    return _gpu_heuristic(kind, widest_head_dim, element_size)


# The fused forward's tiles past ViT lengths, (BLOCK_M queries streamed, BLOCK_N keys held, warps,
# stages): the fastest of benchmarks/fused_tiles_gpu.py's sweep (docs/tuning-log.md, "The fused forward").
FUSED_TILES = (64, 128, 4, 3)


def _gpu_heuristic(kind: str, widest_head_dim: int, element_size: int) -> dict:
    # Shared memory holds the pipelined K tiles: 4-byte inputs and wide heads need smaller tiles.
    if widest_head_dim > 128 or element_size == 4:
        return {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2}
    if kind == "fwd":
        return {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3}
    if kind == "fused":
        block_m, block_n, warps, stages = FUSED_TILES
        return {"BLOCK_M": block_m, "BLOCK_N": block_n, "num_warps": warps, "num_stages": stages}
    return {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2}


def launch_options(kind: str, d_s: int, d_t: int, dtype: torch.dtype) -> dict:
    """Tiles, warps and stages to pass at launch: none when autotuned, else the heuristic ones."""
    return {} if autotuning() else _heuristic_options(kind, max(d_s, d_t), dtype.itemsize)


# The grouped kernels at ViT lengths (every distilled block in one launch) run fixed tiles per
# length bucket, (BLOCK_M, BLOCK_N, warps, stages) for the forward, the dq and the dk kernel,
# not the autotuner's: its candidates are timed with their inputs warm in the L2 cache, which
# 12 blocks' inputs are not (at 16x12x1025x64 its grouped forward ran slower than 12 separate
# calls). Each is the fastest of a sweep of 12 blocks on the H200 at 197, 577 and 1025 tokens
# (docs/tuning-log.md, "Grouped kernels: tiles per length bucket"); the fused forward's ("fused",
# which runs at these lengths only with fused_gradients="on") of benchmarks/fused_tiles_gpu.py on an H100.
GROUPED_TILES: dict[int, dict[str, tuple[int, int, int, int]]] = {
    256: {"fwd": (64, 32, 4, 2), "dq": (64, 32, 4, 3), "dk": (64, 64, 4, 2), "fused": (128, 128, 8, 2)},
    SHORT_SEQUENCE_BUCKET: {"fwd": (64, 32, 4, 2), "dq": (64, 32, 4, 3), "dk": (128, 64, 4, 2),
                            "fused": (64, 64, 4, 3)},
}


def grouped_launch_options(kind: str, n_q: int, n_k: int, d_s: int, d_t: int, dtype: torch.dtype) -> dict:
    """Tiles of a grouped kernel ("fwd", "dq", "dk" or "fused"): :data:`GROUPED_TILES` for 2-byte inputs
    with head dims up to 128 at ViT lengths, else those of :func:`launch_options`."""
    bucket = max(length_bucket(n_q), length_bucket(n_k))
    if INTERPRETING or dtype.itemsize != 2 or max(d_s, d_t) > 128 or bucket > SHORT_SEQUENCE_BUCKET:
        return launch_options(kind if kind in ("fwd", "fused") else "bwd", d_s, d_t, dtype)
    block_m, block_n, warps, stages = GROUPED_TILES[256 if bucket <= 256 else SHORT_SEQUENCE_BUCKET][kind]
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "num_warps": warps, "num_stages": stages}


def bench_in_cuda_graph(kernel_call, quantiles):
    """GPU time of one autotuning candidate, replayed from a CUDA graph.

    Triton's default benchmarker launches every call from Python. A kernel that runs
    for tens of microseconds (ViT lengths) finishes before the next launch arrives, so
    every candidate measures the same host latency and the pick is arbitrary: on the
    H200 it chose backward tiles 1.6x slower than the heuristic ones at 16x12x577x64.

    Triton captures and replays on a stream of its own, which does not wait for work
    queued on the launching stream; the grouped kernels' address table is copied there
    asynchronously, so the device is synchronised first (without it, a candidate read a
    half-copied table at 16x12x1025x64 on the H200: an illegal memory access).
    """
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(kernel_call, rep=20, quantiles=quantiles)


_AUTOTUNE_PARAMETERS = inspect.signature(triton.autotune).parameters
_AUTOTUNE_OPTIONS = {
    # Triton keeps autotuning results on disk (keyed by GPU, Triton version, kernel source and
    # tuning key), so only the first process on a machine pays the benchmarking; every later
    # one compiles just the chosen tiles. Tritons before 3.4 lack the option and tune every process.
    **({"cache_results": True} if "cache_results" in _AUTOTUNE_PARAMETERS else {}),
    **({"do_bench": bench_in_cuda_graph} if "do_bench" in _AUTOTUNE_PARAMETERS else {}),
}


def zeroed_arguments(kernel) -> list[str]:
    """Arguments of ``kernel`` that its autotuner zeroes before timing each candidate and again
    before the chosen one runs: the one-pass backward adds dq into these float32 sums.

    Whatever tensor a launcher passes there is overwritten with zeros on the first launch of
    each tuning key, so it must be a buffer of its own, never a tensor the kernel also reads.
    """
    return [name for name in ("DQ_SUM", "DQT_SUM", "ROW_SUMS") if name in getattr(kernel, "arg_names", ())]


def tuned(kernel, kind: str, extra_keys: tuple[str, ...] = ()):
    """``kernel`` autotuned over the ``kind`` candidates ("fwd" or "bwd"); as is under the interpreter.

    The autotuner runs only for launches without tiles (:func:`launch_options`); with the
    ``autotune`` switch off, launches pass the heuristic tiles to ``kernel`` itself.

    Args:
        kernel: a ``triton.jit`` kernel taking N_Q_BUCKET, N_K_BUCKET, d_s, d_t and CAUSAL.
        kind: which candidate list and pruning rules apply.
        extra_keys: further arguments whose values need their own tuning (TEACHER_GRAD).
    """
    if INTERPRETING:
        return kernel
    key = AUTOTUNE_KEY + list(extra_keys)
    sums = zeroed_arguments(kernel)
    return triton.autotune(
        configs=autotune_configs(kind),
        key=key,
        prune_configs_by={"early_config_prune": functools.partial(prune_configs, kind=kind)},
        reset_to_zero=sums or None,
        **_AUTOTUNE_OPTIONS,
    )(kernel)
