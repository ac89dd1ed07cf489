"""Launching the kernels: the compiled-kernel replay cache (keys, first launch, replays,
fallback) and the autotuning candidates kept per input kind."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from cl_streamkl.kernels.config import kernel_options
from cl_streamkl.kernels.triton import tuning
from cl_streamkl.kernels.triton.launch_cache import KernelLauncher, signature_key


def test_signature_key_tracks_integers_dtypes_and_alignment():
    storage = torch.zeros(64, dtype=torch.bfloat16)
    aligned, misaligned = storage[:32], storage[1:33]
    base = signature_key((aligned, 197, 64, 0.125), ("fwd",))
    assert base == signature_key((storage[8:40], 197, 64, 0.5), ("fwd",))  # floats never specialise
    assert base != signature_key((misaligned, 197, 64, 0.125), ("fwd",))
    assert base != signature_key((aligned.float(), 197, 64, 0.125), ("fwd",))
    assert base != signature_key((aligned, 198, 64, 0.125), ("fwd",))
    assert base != signature_key((aligned, 197, 64, 0.125), ("bwd",))


def test_signature_key_rejects_unknown_argument_types():
    with pytest.raises(TypeError, match="str"):
        signature_key(("not a kernel argument",), ())


class FakeCompiled:
    """Stands in for triton's CompiledKernel: compiled[grid](*args) launches."""

    def __init__(self, launches: list):
        self.launches = launches

    def __getitem__(self, grid):
        return lambda *args: self.launches.append(("replay", grid, args))


class FakeAutotunedKernel:
    """Stands in for triton.autotune(triton.jit(f)): kernel[grid_fn](*args, **kwargs)."""

    arg_names = ["X", "n", "scale", "CAUSAL", "BLOCK_M", "BLOCK_N"]

    def __init__(self, compiled_factory=FakeCompiled):
        self.launches: list = []
        self.best_config = SimpleNamespace(kwargs={"BLOCK_M": 64, "BLOCK_N": 32})
        self.compiled = compiled_factory(self.launches)

    def __getitem__(self, grid_fn):
        def launch(*args, **kwargs):
            meta = {**kwargs, **self.best_config.kwargs}
            self.launches.append(("jit", grid_fn(meta), args, kwargs))
            return self.compiled

        return launch


def launch(launcher: KernelLauncher, n: int, block: str = "BLOCK_M") -> None:
    x = torch.ones(4)
    launcher((x, n, 0.5), {"CAUSAL": False}, {}, length=n, batch_heads=3, block=block)


def test_first_launch_goes_through_triton_then_replays_with_the_tuned_tile():
    kernel = FakeAutotunedKernel()
    launcher = KernelLauncher(kernel, replay=True)
    launch(launcher, 197)
    launch(launcher, 197)
    launch(launcher, 197, block="BLOCK_N")
    jit_launch, replay_m, _ = kernel.launches
    assert jit_launch[0] == "jit" and jit_launch[1] == (4 * 3,)  # cdiv(197, 64) tiles × 3
    kind, grid, args = replay_m
    assert kind == "replay" and grid == (4 * 3, 1, 1)
    assert args[1:] == (197, 0.5, False, 64, 32)  # runtime args, then constants in signature order
    # A different tiled axis is a different launch signature: it goes through Triton once more.
    assert kernel.launches[2][0] == "jit" and kernel.launches[2][1] == (7 * 3,)


def test_a_new_integer_value_is_a_new_entry():
    kernel = FakeAutotunedKernel()
    launcher = KernelLauncher(kernel, replay=True)
    for n in (197, 577, 197, 577):
        launch(launcher, n)
    assert [entry[0] for entry in kernel.launches] == ["jit", "jit", "replay", "replay"]
    assert kernel.launches[3][1] == (10 * 3, 1, 1)  # cdiv(577, 64) tiles × 3


def test_replay_off_always_launches_through_triton():
    kernel = FakeAutotunedKernel()
    launcher = KernelLauncher(kernel, replay=False)
    for _ in range(3):
        launch(launcher, 17)
    assert [entry[0] for entry in kernel.launches] == ["jit"] * 3


def test_fast_launch_switch_off_launches_through_triton_until_switched_on():
    kernel = FakeAutotunedKernel()
    launcher = KernelLauncher(kernel, replay=True)
    with kernel_options(fast_launch=False):
        for _ in range(2):
            launch(launcher, 17)
    launch(launcher, 17)
    launch(launcher, 17)
    assert [entry[0] for entry in kernel.launches] == ["jit", "jit", "jit", "replay"]


def test_launches_with_their_own_tiles_skip_the_autotuner():
    untuned, autotuner = FakeAutotunedKernel(), FakeAutotunedKernel()
    launcher = KernelLauncher(autotuner, replay=False)
    launcher.untuned = untuned  # what KernelLauncher takes from a real triton.autotune wrapper's ``fn``
    x = torch.ones(4)
    launcher((x, 17, 0.5), {"CAUSAL": False}, {"BLOCK_M": 16}, length=17, batch_heads=1, block="BLOCK_M")
    launcher((x, 17, 0.5), {"CAUSAL": False}, {}, length=17, batch_heads=1, block="BLOCK_M")
    assert len(untuned.launches) == 1 and len(autotuner.launches) == 1


def test_unfamiliar_compiled_kernel_falls_back_to_triton_with_a_warning():
    kernel = FakeAutotunedKernel(compiled_factory=lambda launches: object())
    launcher = KernelLauncher(kernel, replay=True)
    with pytest.warns(RuntimeWarning, match="cannot replay"):
        launch(launcher, 17)
    launch(launcher, 17)
    assert [entry[0] for entry in kernel.launches] == ["jit", "jit"]
    assert not launcher.replay


@pytest.mark.skipif(not torch.cuda.is_available(), reason="replays compiled kernels on CUDA only")
@pytest.mark.parametrize(
    "shape, dtype, causal, teacher_grad",
    [
        ((3, 4, 197, 64), torch.bfloat16, False, False),
        ((2, 3, 17, 80), torch.float32, True, False),
        ((2, 2, 577, 32), torch.float16, False, True),
    ],
)
def test_replayed_kernels_match_launches_through_triton(monkeypatch, shape, dtype, causal, teacher_grad):
    from cl_streamkl import attention_kl
    from cl_streamkl.kernels.triton import KERNEL_LAUNCHERS

    torch.manual_seed(0)
    student = [torch.randn(shape, device="cuda", dtype=dtype, requires_grad=True) for _ in range(2)]
    teacher = [torch.randn(shape, device="cuda", dtype=dtype, requires_grad=teacher_grad) for _ in range(2)]
    inputs = student + teacher
    upstream = torch.randn(shape[:3], device="cuda")

    def run():
        out = attention_kl(*inputs, causal=causal, reduction="none", backend="triton")
        wanted = [tensor for tensor in inputs if tensor.requires_grad]
        return [out, *torch.autograd.grad((out * upstream).sum(), wanted)]

    first, replayed = run(), run()  # the second call replays the compiled kernels
    for name in ("forward", "backward_dq", "backward_dk"):
        launcher = KERNEL_LAUNCHERS[name]
        assert launcher._compiled, "the GPU path should have cached a compiled kernel"
        monkeypatch.setattr(launcher, "replay", False)
    through_triton = run()
    assert len(first) == (5 if teacher_grad else 3)
    for a, b, c in zip(first, replayed, through_triton):
        assert torch.isfinite(a).all()
        assert torch.equal(a, b) and torch.equal(a, c)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="replays compiled kernels on CUDA only")
@pytest.mark.parametrize("teacher_grad", [False, True])
def test_replayed_grouped_kernels_match_launches_through_triton(monkeypatch, teacher_grad):
    from cl_streamkl import attention_kl_grouped
    from cl_streamkl.kernels.triton import KERNEL_LAUNCHERS

    torch.manual_seed(0)
    shape = (3, 4, 197, 64)
    problems = [
        [torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=grad) for grad in (True, True, teacher_grad, teacher_grad)]
        for _ in range(4)
    ]
    wanted = [tensor for problem in problems for tensor in problem if tensor.requires_grad]
    upstream = torch.randn(4, *shape[:3], device="cuda")

    def run():
        out = attention_kl_grouped(problems, reduction="none", backend="triton")
        return [out, *torch.autograd.grad((out * upstream).sum(), wanted)]

    first, replayed = run(), run()
    for name in ("grouped_forward", "grouped_backward_dq", "grouped_backward_dk"):
        assert KERNEL_LAUNCHERS[name]._compiled, "the GPU path should have cached a compiled kernel"
        monkeypatch.setattr(KERNEL_LAUNCHERS[name], "replay", False)
    through_triton = run()
    for a, b, c in zip(first, replayed, through_triton):
        assert torch.isfinite(a).all()
        assert torch.equal(a, b) and torch.equal(a, c)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need CUDA")
def test_grouped_forward_replays_from_a_cuda_graph():
    """The address table's host copy outlives the capture, so replays read the graph's inputs."""
    from cl_streamkl import attention_kl_grouped

    torch.manual_seed(0)
    problems = [[torch.randn(2, 3, 197, 64, device="cuda", dtype=torch.bfloat16) for _ in range(4)] for _ in range(3)]
    with torch.no_grad():
        attention_kl_grouped(problems, reduction="none", backend="triton")  # compile before capturing
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = attention_kl_grouped(problems, reduction="none", backend="triton")
        for problem in problems:
            for tensor in problem:
                tensor.copy_(torch.randn_like(tensor))
        graph.replay()
        expected = attention_kl_grouped(problems, reduction="none", backend="triton")
    torch.cuda.synchronize()
    assert torch.equal(captured, expected)


@pytest.mark.parametrize("kind", ["fwd", "bwd"])
@pytest.mark.parametrize(
    "dtype, head_dim, small_only, two_stages",
    [
        (torch.bfloat16, 64, False, False),
        (torch.bfloat16, 256, True, False),
        (torch.float32, 64, True, True),
    ],
)
def test_autotune_pruning_keeps_small_tiles_for_wide_heads_and_fp32(kind, dtype, head_dim, small_only, two_stages):
    configs = tuning.autotune_configs(kind)
    named_args = {
        "Q": torch.empty(1, 1, 1, head_dim, dtype=dtype),
        "d_s": head_dim,
        "d_t": 32,
        "N_Q_BUCKET": 1024,
        "N_K_BUCKET": 1024,
    }
    kept = tuning.prune_configs(configs, named_args, kind=kind)
    assert kept and all(config in configs for config in kept)
    tiles = [config.kwargs["BLOCK_M"] * config.kwargs["BLOCK_N"] for config in kept]
    assert (max(tiles) <= 64 * 64) == small_only
    assert all(config.num_stages <= 2 for config in kept) == two_stages
    if not small_only:
        assert {tuning.config_tuple(c) for c in kept} == tuning.SHORT_SEQUENCE_CANDIDATES[kind]


def test_grouped_kernels_prune_by_their_element_constexpr():
    import triton.language as tl

    configs = tuning.autotune_configs("fwd")
    named_args = {"d_s": 64, "d_t": 64, "N_Q_BUCKET": 1024, "N_K_BUCKET": 1024}
    kept_fp32 = tuning.prune_configs(configs, named_args, kind="fwd", ELEMENT=tl.float32)
    assert max(c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] for c in kept_fp32) <= 64 * 64
    kept_bf16 = tuning.prune_configs(configs, named_args, kind="fwd", ELEMENT=tl.bfloat16)
    assert {tuning.config_tuple(c) for c in kept_bf16} == tuning.SHORT_SEQUENCE_CANDIDATES["fwd"]


@pytest.mark.parametrize("kind", ["fwd", "bwd"])
def test_vit_lengths_autotune_over_the_short_sequence_candidates_only(kind):
    configs = tuning.autotune_configs(kind)
    assert len(configs) == 24

    def kept(n_q_bucket, n_k_bucket):
        named_args = {
            "Q": torch.empty(1, 1, 1, 64, dtype=torch.bfloat16),
            "d_s": 64,
            "d_t": 64,
            "N_Q_BUCKET": n_q_bucket,
            "N_K_BUCKET": n_k_bucket,
        }
        return tuning.prune_configs(configs, named_args, kind=kind)

    short = kept(256, 2048)
    assert len(short) == {"fwd": 8, "bwd": 10}[kind]
    assert {tuning.config_tuple(c) for c in short} == tuning.SHORT_SEQUENCE_CANDIDATES[kind]
    # one long side is enough for the long-sequence rule: the heuristic tile alone
    assert [tuning.config_tuple(c) for c in kept(2048, 4096)] == [
        {"fwd": (128, 64, 8, 3), "bwd": (64, 64, 4, 2)}[kind]]


@pytest.mark.parametrize("kind", ["fwd", "bwd"])
@pytest.mark.parametrize("dtype, head_dim, expected", [
    (torch.bfloat16, 64, {"fwd": (128, 64, 8, 3), "bwd": (64, 64, 4, 2)}),
    (torch.bfloat16, 128, {"fwd": (128, 64, 8, 3), "bwd": (64, 64, 4, 2)}),
    (torch.bfloat16, 256, {"fwd": (64, 32, 4, 2), "bwd": (64, 32, 4, 2)}),
    (torch.float32, 64, {"fwd": (64, 32, 4, 2), "bwd": (64, 32, 4, 2)}),
])
def test_long_sequences_run_the_heuristic_tiles(kind, dtype, head_dim, expected):
    configs = tuning.autotune_configs(kind)
    named_args = {"Q": torch.empty(1, 1, 1, head_dim, dtype=dtype), "d_s": head_dim, "d_t": head_dim,
                  "N_Q_BUCKET": 8192, "N_K_BUCKET": 8192}
    kept = tuning.prune_configs(configs, named_args, kind=kind)
    assert [tuning.config_tuple(c) for c in kept] == [expected[kind]]


def test_autotuned_kernels_keep_results_on_disk_and_time_gpu_only(monkeypatch):
    import triton

    seen = {}

    def fake_autotune(**kwargs):
        seen.update(kwargs)
        return lambda kernel: ("tuned", kernel)

    monkeypatch.setattr(tuning, "INTERPRETING", False)
    monkeypatch.setattr(triton, "autotune", fake_autotune)
    assert tuning.tuned("kernel", "bwd", ("TEACHER_GRAD",)) == ("tuned", "kernel")
    assert seen["key"] == tuning.AUTOTUNE_KEY + ["TEACHER_GRAD"]
    assert seen.get("cache_results") is True  # triton >= 3.4 has the option
    # Candidates are timed on the GPU alone (CUDA-graph replay), not through Python launches.
    assert seen.get("do_bench") is tuning.bench_in_cuda_graph
    assert seen["reset_to_zero"] is None
    # The one-pass backward's dq sums (and the fused forward's row sums) start from zeros for every candidate.
    from cl_streamkl.kernels.triton.backward import _attention_kl_bwd_dk_kernel

    tuning.tuned(_attention_kl_bwd_dk_kernel, "bwd", ("TEACHER_GRAD", "ONE_PASS"))
    assert seen["reset_to_zero"] == ["DQ_SUM", "DQT_SUM", "ROW_SUMS"]  # and the fused forward's row sums


@pytest.mark.parametrize("tokens, kind, expected", [
    (197, "fwd", (64, 32, 4, 2)), (197, "dq", (64, 32, 4, 3)), (197, "dk", (64, 64, 4, 2)),
    (577, "fwd", (64, 32, 4, 2)), (1025, "dq", (64, 32, 4, 3)), (1025, "dk", (128, 64, 4, 2)),
])
def test_grouped_kernels_run_fixed_tiles_per_length_bucket(monkeypatch, tokens, kind, expected):
    monkeypatch.setattr(tuning, "INTERPRETING", False)
    options = tuning.grouped_launch_options(kind, tokens, tokens, 64, 64, torch.bfloat16)
    assert (options["BLOCK_M"], options["BLOCK_N"], options["num_warps"], options["num_stages"]) == expected


def test_grouped_kernels_past_vit_lengths_or_in_fp32_take_the_single_kernels_tiles(monkeypatch):
    monkeypatch.setattr(tuning, "INTERPRETING", False)
    for tokens, dtype, head_dim in ((4097, torch.bfloat16, 64), (197, torch.float32, 64), (197, torch.float16, 256)):
        assert tuning.grouped_launch_options("dq", tokens, tokens, head_dim, head_dim, dtype) == \
            tuning.launch_options("bwd", head_dim, head_dim, dtype)
