"""Context parallelism on the CPU: two gloo processes, each holding all queries and one key shard.

One pair of processes runs every case (starting one costs seconds: each imports torch), then
sends its results back; the tests compare them with ``attention_kl`` on the unsharded keys and
with the float64 reference. The process group has a timeout and the wait for the processes a
deadline, so a case that hangs fails instead of blocking the run. The triton backend runs under
Triton's interpreter in the processes too (TRITON_INTERPRET=1 is inherited from conftest.py,
which the processes also import, for NaN-filled ``torch.empty``).
"""

from __future__ import annotations

import io
import json
import multiprocessing
import os
import queue
import socket
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from cl_streamkl import attention_kl, attention_kl_reference
from cl_streamkl.distributed import attention_kl_key_sharded
from cl_streamkl.kernels.validation import refuse_double_backward

pytestmark = pytest.mark.distributed

WORLD_SIZE = 2
GROUP_TIMEOUT_S = 30
# Starting both processes, the cases under the interpreter, and one group timeout to spare.
RESULTS_DEADLINE_S = 150
REPOSITORY = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Case:
    """One sharded problem: B=1, H=2, Nq queries, the keys split as ``split`` says, rank by rank."""

    name: str
    backend: str
    split: tuple[int, int]
    n_q: int = 37
    d_student: int = 16
    d_teacher: int = 16
    dtype: torch.dtype = torch.float32
    mutual: bool = False
    temperature: float = 1.0
    scale: float | None = None
    reduction: str = "none"
    strided: bool = False


# The processes compute on the CPU: the triton backend needs the interpreter (set unless the
# suite runs on CUDA, CL_STREAMKL_TEST_GPU=1; benchmarks/context_parallel_gpu.py covers CUDA).
BACKENDS = ("torch", "triton") if os.environ.get("TRITON_INTERPRET") == "1" else ("torch",)
ALL_CASES = [
    Case("torch-19+19", "torch", (19, 19)),
    Case("torch-10+27-mutual-T2-Dt8", "torch", (10, 27), d_teacher=8, mutual=True, temperature=2.0, scale=0.3),
    Case("torch-19+19-mean", "torch", (19, 19), reduction="mean"),
    Case("triton-19+19", "triton", (19, 19)),
    Case("triton-10+27-mutual-T2-Dt8", "triton", (10, 27), d_teacher=8, mutual=True, temperature=2.0, scale=0.3),
    # q and k as views of one permuted qkv tensor, as timm hands them over (Nq = Nk = 37).
    Case("triton-27+10-bf16-strided", "triton", (27, 10), dtype=torch.bfloat16, strided=True),
]
CASES = [case for case in ALL_CASES if case.backend in BACKENDS]
CASE_IDS = [case.name for case in CASES]
# One plain case per backend for the group of one rank.
SINGLE_RANK_CASES = [next(case for case in CASES if case.backend == backend) for backend in BACKENDS]


def make_inputs(case: Case) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The unsharded (q, k, q_teacher, k_teacher), leaves that require grad, and the row weights."""
    generator = torch.Generator().manual_seed(sum(map(ord, case.name)))
    batch, heads, n_k = 1, 2, sum(case.split)

    def rand(*shape: int) -> torch.Tensor:
        # Spread 2: peaked attention rows, so the shards carry unequal mass.
        return (torch.randn(*shape, generator=generator) * 2.0).to(case.dtype)

    if case.strided:
        assert case.n_q == n_k and case.d_student == case.d_teacher
        qkv = rand(batch, n_k, 2, heads, case.d_student).permute(2, 0, 3, 1, 4).requires_grad_()
        teacher_qkv = rand(batch, n_k, 2, heads, case.d_teacher).permute(2, 0, 3, 1, 4).requires_grad_(case.mutual)
        tensors = [qkv[0], qkv[1], teacher_qkv[0], teacher_qkv[1]]
    else:
        tensors = [
            rand(batch, heads, case.n_q, case.d_student).requires_grad_(),
            rand(batch, heads, n_k, case.d_student).requires_grad_(),
            rand(batch, heads, case.n_q, case.d_teacher).requires_grad_(case.mutual),
            rand(batch, heads, n_k, case.d_teacher).requires_grad_(case.mutual),
        ]
    weight = torch.rand(batch, heads, case.n_q, generator=generator) + 0.5
    return tensors, weight


def options(case: Case) -> dict:
    return dict(scale=case.scale, temperature=case.temperature, reduction=case.reduction, backend=case.backend)


def value_and_grads(case: Case, kl_fn, q, k, q_teacher, k_teacher, weight) -> dict[str, torch.Tensor]:
    """``kl_fn``'s value and the gradients of Σ weight·KL (or of the reduced scalar · 1.7)."""
    value = kl_fn(q, k, q_teacher, k_teacher, **options(case))
    loss = (value * weight).sum() if case.reduction == "none" else value * 1.7
    inputs = [q, k, q_teacher, k_teacher] if case.mutual else [q, k]
    grads = torch.autograd.grad(loss, inputs)
    names = ["q", "k", "q_teacher", "k_teacher"]
    return {"value": value.detach(), **{f"d{name}": grad for name, grad in zip(names, grads)}}


def key_shard(tensor: torch.Tensor, split: tuple[int, int], rank: int) -> torch.Tensor:
    start = sum(split[:rank])
    return tensor[:, :, start : start + split[rank]]


# ---------------------------------------------------------------- in the spawned processes


def _sharded_case(case: Case, rank: int) -> dict[str, torch.Tensor]:
    (q, k, q_teacher, k_teacher), weight = make_inputs(case)
    return value_and_grads(
        case, attention_kl_key_sharded, q, key_shard(k, case.split, rank), q_teacher,
        key_shard(k_teacher, case.split, rank), weight,
    )


def _error_of(call) -> tuple[str, str] | None:
    try:
        call()
    except Exception as error:  # noqa: BLE001 - the test inspects type and message
        return type(error).__name__, str(error)
    return None


def _error_cases(rank: int) -> dict[str, tuple[str, str] | None]:
    """Inputs that only one rank gets wrong (rank 1), or both; each must raise on both ranks."""

    def inputs(n_q=8, n_k=5, dtype=torch.float32, requires_grad=True):
        q = torch.randn(1, 2, n_q, 8, dtype=dtype, requires_grad=requires_grad)
        return q, torch.randn(1, 2, n_k, 8, dtype=dtype), torch.randn(1, 2, n_q, 8, dtype=dtype), torch.randn(
            1, 2, n_k, 8, dtype=dtype
        )

    odd = rank == 1
    return {
        "query rows differ": _error_of(lambda: attention_kl_key_sharded(*inputs(n_q=7 if odd else 8))),
        "dtype differs": _error_of(
            lambda: attention_kl_key_sharded(*inputs(dtype=torch.bfloat16 if odd else torch.float32))
        ),
        "temperature differs": _error_of(
            lambda: attention_kl_key_sharded(*inputs(), temperature=2.0 if odd else 1.0)
        ),
        "requires_grad differs": _error_of(lambda: attention_kl_key_sharded(*inputs(requires_grad=not odd))),
        "invalid on one rank": _error_of(
            lambda: attention_kl_key_sharded(*inputs()[:3], torch.randn(2, 5, 8) if odd else inputs()[3])
        ),
        "causal": _error_of(lambda: attention_kl_key_sharded(*inputs(n_k=8), causal=True)),
    }


def _double_backward() -> tuple[str, str] | None:
    """A gradient of the sharded KL taken with create_graph=True (each rank its own inputs)."""
    q = torch.randn(1, 2, 8, 8, requires_grad=True)
    k, q_teacher, k_teacher = torch.randn(1, 2, 5, 8), torch.randn(1, 2, 8, 8), torch.randn(1, 2, 5, 8)

    def gradient_of_gradient() -> None:
        (dq,) = torch.autograd.grad(attention_kl_key_sharded(q, k, q_teacher, k_teacher, reduction="mean"), q,
                                    create_graph=True)
        dq.sum().backward()

    return _error_of(gradient_of_gradient)


def _single_rank_group(rank: int) -> dict[str, object]:
    """A group of rank 0 alone: its result is attention_kl's, bit for bit; rank 1 is no member."""
    solo = dist.new_group([0])
    if rank == 1:
        return {"not a member": _error_of(lambda: attention_kl_key_sharded(*make_inputs(CASES[0])[0], group=solo))}
    results = {}
    for case in SINGLE_RANK_CASES:
        tensors, weight = make_inputs(case)
        sharded = value_and_grads(
            case, lambda *args, **kw: attention_kl_key_sharded(*args, group=solo, **kw), *tensors, weight
        )
        unsharded = value_and_grads(case, attention_kl, *tensors, weight)
        results[case.name] = all(torch.equal(sharded[name], unsharded[name]) for name in sharded)
    return results


def _run_rank(rank: int, port: int, results: multiprocessing.Queue) -> None:
    import conftest  # noqa: F401 - NaN-filled torch.empty here too

    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD_SIZE,
            timeout=timedelta(seconds=GROUP_TIMEOUT_S),
        )
        outcome = {
            "errors": _error_cases(rank),
            "double backward": _double_backward(),
            "cases": {case.name: _sharded_case(case, rank) for case in CASES},
            "single rank group": _single_rank_group(rank),
        }
        dist.destroy_process_group()
        buffer = io.BytesIO()
        torch.save(outcome, buffer)
        results.put((rank, "ok", buffer.getvalue()))
    except BaseException:  # noqa: BLE001 - reported to the test, which fails with it
        results.put((rank, "failed", traceback.format_exc()))


# ---------------------------------------------------------------- in the test process


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def rank_results() -> list[dict]:
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    port = free_port()
    processes = [context.Process(target=_run_rank, args=(rank, port, results), daemon=True) for rank in range(2)]
    for process in processes:
        process.start()
    received: dict[int, dict] = {}
    deadline = time.monotonic() + RESULTS_DEADLINE_S
    try:
        while len(received) < WORLD_SIZE:
            try:
                rank, status, payload = results.get(timeout=max(deadline - time.monotonic(), 0.1))
            except queue.Empty:
                pytest.fail(f"the ranks did not report within {RESULTS_DEADLINE_S} s (got {sorted(received)})")
            if status != "ok":
                pytest.fail(f"rank {rank} failed:\n{payload}")
            received[rank] = torch.load(io.BytesIO(payload), weights_only=False)
    finally:
        for process in processes:
            process.join(timeout=10)
            if process.is_alive():
                process.terminate()
    return [received[rank] for rank in range(WORLD_SIZE)]


@pytest.fixture(scope="module")
def unsharded_results() -> dict[str, dict[str, torch.Tensor]]:
    """attention_kl of every case's unsharded problem, computed once for the tests that use it."""
    results = {}
    for case in CASES:
        tensors, weight = make_inputs(case)
        results[case.name] = value_and_grads(case, attention_kl, *tensors, weight)
    return results


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    assert torch.isfinite(out).all(), "output holds NaN or Inf"
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def gathered(case: Case, ranks: list[dict]) -> dict[str, torch.Tensor]:
    """Rank 0's value and query gradients with every rank's key gradients concatenated."""
    result = dict(ranks[0]["cases"][case.name])
    for name in ("dk", "dk_teacher"):
        if name in result:
            result[name] = torch.cat([rank["cases"][case.name][name] for rank in ranks], dim=2)
    return result


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_ranks_agree_on_value_and_query_gradients(rank_results, case):
    first, second = (rank["cases"][case.name] for rank in rank_results)
    for name in ("value", "dq", "dq_teacher"):
        if name in first:
            assert torch.equal(first[name], second[name]), name


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_sharded_matches_unsharded_attention_kl(rank_results, unsharded_results, case):
    unsharded = unsharded_results[case.name]
    sharded = gathered(case, rank_results)
    assert sharded.keys() == unsharded.keys()
    # The same float32 math summed in another order; gradients are rounded to the inputs' dtype.
    bound = 1e-5 if case.dtype == torch.float32 else 1e-2
    for name in unsharded:
        assert sharded[name].dtype == unsharded[name].dtype, name
        assert sharded[name].shape == unsharded[name].shape, name
        assert rel_err(sharded[name], unsharded[name]) <= (1e-5 if name == "value" else bound), name


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_sharded_matches_float64_reference(rank_results, unsharded_results, case):
    tensors, weight = make_inputs(case)
    ref_value = attention_kl_reference(
        *tensors, scale=case.scale, temperature=case.temperature, reduction=case.reduction
    )
    loss = (ref_value * weight.double()).sum() if case.reduction == "none" else ref_value * 1.7
    ref_grads = torch.autograd.grad(loss, tensors if case.mutual else tensors[:2])
    unsharded = unsharded_results[case.name]
    sharded = gathered(case, rank_results)
    for name, ref in zip(["value", "dq", "dk", "dq_teacher", "dk_teacher"], [ref_value, *ref_grads]):
        # No worse than twice the unsharded kernels' own error (plus a float32 floor).
        bound = 2 * rel_err(unsharded[name], ref) + 1e-6
        assert rel_err(sharded[name], ref) <= bound, name


@pytest.mark.parametrize("case_name", [case.name for case in SINGLE_RANK_CASES])
def test_group_of_one_rank_equals_attention_kl_bit_for_bit(rank_results, case_name):
    assert rank_results[0]["single rank group"][case_name] is True


def test_a_rank_outside_the_group_is_told_so(rank_results):
    kind, message = rank_results[1]["single rank group"]["not a member"]
    assert kind == "ValueError" and "not a member" in message


ERRORS = {
    "query rows differ": (
        "ValueError", "disagree on q's (B, H, Nq, Ds): rank 0 has (1, 2, 8, 8), rank 1 has (1, 2, 7, 8)"
    ),
    "dtype differs": ("ValueError", "disagree on the dtype"),
    "temperature differs": ("ValueError", "disagree on (scale, teacher_scale) / temperature"),
    "requires_grad differs": ("ValueError", "disagree on which of (q, k, teacher) require grad"),
    "causal": ("ValueError", "causal=True is not supported"),
}


@pytest.mark.parametrize("error", sorted(ERRORS))
def test_disagreeing_ranks_raise_on_every_rank(rank_results, error):
    kind, fragment = ERRORS[error]
    for rank in rank_results:
        assert rank["errors"][error] is not None and rank["errors"][error][0] == kind
        assert fragment in rank["errors"][error][1]


def test_an_input_invalid_on_one_rank_raises_there_and_on_its_peers(rank_results):
    peer, offender = (rank["errors"]["invalid on one rank"] for rank in rank_results)
    assert offender == ("ValueError", "k_teacher must have 4 dimensions (B, H, N, D), got shape (2, 5, 8)")
    assert peer[0] == "ValueError" and "rank(s) [1] of the process group rejected their inputs" in peer[1]


def test_double_backward_is_refused_on_every_rank(rank_results):
    with pytest.raises(RuntimeError) as refusal, torch.enable_grad():
        refuse_double_backward()
    for rank in rank_results:
        assert rank["double backward"] == ("RuntimeError", str(refusal.value))


def test_without_a_process_group_it_says_so():
    assert not dist.is_initialized()
    tensors = [torch.randn(1, 1, 4, 8) for _ in range(4)]
    with pytest.raises(RuntimeError, match="needs an initialised process group"):
        attention_kl_key_sharded(*tensors)


def test_gpu_script_runs_under_torchrun_on_the_cpu(tmp_path):
    out = tmp_path / "context_parallel.json"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={WORLD_SIZE}",
        "benchmarks/context_parallel_gpu.py", "--smoke", "--json", str(out),
    ]
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        command, cwd=REPOSITORY, capture_output=True, text=True, timeout=RESULTS_DEADLINE_S, env=environment
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["passed"] is True
    assert {row["run"] for row in report["rows"]} == {"single", "sharded"}
    assert result.stdout.rstrip().splitlines()[-1].split()[0].isdigit()  # the table comes last
