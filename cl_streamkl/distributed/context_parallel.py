"""Context parallelism: StreamKL over keys sharded across the ranks of a process group.

Every rank holds all query rows and one contiguous shard of the keys, rank order being key
order. Each rank runs the single-device forward on its shard, which gives per row the
shard's KL_r and log-sum-exps lse_s,r and lse_t,r; two all-reduces over the group merge them
exactly, by the chain rule of the KL divergence:

    lse_t = log Σ_r exp(lse_t,r)     w_r = exp(lse_t,r − lse_t)   (teacher mass of shard r)
    lse_s = log Σ_r exp(lse_s,r)     v_r = exp(lse_s,r − lse_s)   (student mass of shard r)
    KL    = Σ_r w_r·KL_r + Σ_r w_r·log(w_r / v_r).

The merge runs in float64 on (B, H, Nq) row statistics: first the maxima of the lse values
(MAX all-reduce), then Σ w̃_r, Σ ṽ_r and Σ w̃_r·(KL_r + log w̃_r − log ṽ_r) with the
maxima factored out (SUM all-reduce). The backward needs only the merged row statistics and
the local keys, dS_s = g·(P_s − P_t) and dS_t = g·P_t·(log P_t − log P_s − KL) with P from
the merged log-sum-exps, so dk and dk_teacher stay local and dq, dq_teacher are sums over
the shards (one SUM all-reduce each).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist

from cl_streamkl.attention_kl import _resolve_backend
from cl_streamkl.kernels.backward_inputs import BackwardInputs
from cl_streamkl.kernels.torch_streaming import (
    DEFAULT_CHUNK_SIZE,
    in_input_dtypes,
    streaming_backward,
    streaming_forward,
)
from cl_streamkl.kernels.validation import (
    REDUCTIONS,
    SUPPORTED_DTYPES,
    AttentionKLOptions,
    AttentionKLProblem,
    check_inputs,
    reduce_rows,
    refuse_double_backward,
)

_LN_2 = math.log(2.0)

# What every rank sends to the others before any work: a status flag, then these fields
# (label, length, how to print the values). The key count is sent last and may differ.
_FIELDS: tuple[tuple[str, int, Callable[[list[float]], str]], ...] = (
    ("q's (B, H, Nq, Ds)", 4, lambda values: str(tuple(int(v) for v in values))),
    ("q_teacher's head dim Dt", 1, lambda values: str(int(values[0]))),
    ("the dtype", 1, lambda values: str(SUPPORTED_DTYPES[int(values[0])])),
    (
        "(scale, teacher_scale) / temperature",
        2,
        lambda values: f"({values[0]:.6g}, {values[1]:.6g})",
    ),
    ("the reduction", 1, lambda values: repr(REDUCTIONS[int(values[0])])),
    (
        "which of (q, k, teacher) require grad",
        3,
        lambda values: str(tuple(bool(v) for v in values)),
    ),
)
_METADATA_LENGTH = 1 + sum(length for _, length, _ in _FIELDS) + 1


def _checked_group(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """This process's rank in ``group`` and the group's size; errors when there is no group."""
    if not dist.is_available():
        raise RuntimeError("attention_kl_key_sharded needs torch.distributed, which this PyTorch build lacks")
    if not dist.is_initialized():
        raise RuntimeError(
            "attention_kl_key_sharded needs an initialised process group: call "
            "torch.distributed.init_process_group(...) first (torchrun sets up its environment)"
        )
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError(
            f"this process (global rank {dist.get_rank()}) is not a member of the group passed as `group`"
        )
    return rank, dist.get_world_size(group)


def _metadata(
    problem: AttentionKLProblem | None,
    dtype: torch.dtype | None,
    reduction: str,
    requires_grad: tuple[bool, bool, bool],
) -> list[float]:
    if problem is None:
        return [0.0] * _METADATA_LENGTH
    return [
        1.0,
        problem.batch,
        problem.heads,
        problem.n_q,
        problem.d_student,
        problem.d_teacher,
        SUPPORTED_DTYPES.index(dtype),
        problem.student_scale,
        problem.teacher_scale,
        REDUCTIONS.index(reduction),
        *requires_grad,
        problem.n_k,
    ]


def _agree_across_ranks(
    local: list[float],
    local_error: Exception | None,
    device: torch.device,
    group: dist.ProcessGroup | None,
    rank: int,
    world_size: int,
) -> None:
    """All-gather every rank's metadata; raise on every rank if any rank's input is bad.

    A rank that rejected its own input still joins the all-gather, so its peers raise too
    instead of waiting in the next collective until the group's timeout.
    """
    gathered = [torch.empty(_METADATA_LENGTH, dtype=torch.float64, device=device) for _ in range(world_size)]
    dist.all_gather(gathered, torch.tensor(local, dtype=torch.float64, device=device), group=group)
    rows = torch.stack(gathered).tolist()
    if local_error is not None:
        raise local_error
    rejected = [peer for peer, row in enumerate(rows) if row[0] != 1.0]
    if rejected:
        raise ValueError(
            f"rank(s) {rejected} of the process group rejected their inputs (their own error says "
            "why); attention_kl_key_sharded needs valid inputs on every rank"
        )
    start = 1
    for label, length, describe in _FIELDS:
        values = [tuple(row[start : start + length]) for row in rows]
        if len(set(values)) > 1:
            holdings = ", ".join(f"rank {peer} has {describe(list(value))}" for peer, value in enumerate(values))
            raise ValueError(
                f"the ranks of the process group disagree on {label}: {holdings} (this is rank "
                f"{rank}); every rank must pass the same queries, options and dtype, only its "
                "number of keys may differ"
            )
        start += length


def _shard_statistics(
    backend: str,
    q: torch.Tensor,
    k: torch.Tensor,
    q_teacher: torch.Tensor,
    k_teacher: torch.Tensor,
    problem: AttentionKLProblem,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
    """KL over this rank's keys, both log-sum-exps (backend units) and the units' size in nats."""
    if backend == "triton":
        from cl_streamkl.kernels.triton import launch_forward

        row_kl, lse_student, lse_teacher = launch_forward(
            q, k, q_teacher, k_teacher, problem.student_scale, problem.teacher_scale, False
        )
        return row_kl, lse_student, lse_teacher, _LN_2
    return (*streaming_forward(q, k, q_teacher, k_teacher, problem, DEFAULT_CHUNK_SIZE), 1.0)


def _merge_shards(
    row_kl: torch.Tensor,
    lse_student: torch.Tensor,
    lse_teacher: torch.Tensor,
    unit: float,
    group: dist.ProcessGroup | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The full key set's KL and log-sum-exps (float32, lse in ``unit``) from every rank's shard."""
    lse = torch.stack((lse_teacher, lse_student)).double() * unit
    peak = lse.clone()
    dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
    log_mass = lse - peak
    mass = log_mass.exp()
    sums = torch.stack((mass[0], mass[1], mass[0] * (row_kl.double() + log_mass[0] - log_mass[1])))
    dist.all_reduce(sums, group=group)
    log_total_teacher, log_total_student = sums[0].log(), sums[1].log()
    merged_kl = sums[2] / sums[0] - log_total_teacher + log_total_student
    merged_lse_teacher = (peak[0] + log_total_teacher) / unit
    merged_lse_student = (peak[1] + log_total_student) / unit
    return merged_kl.float(), merged_lse_student.float(), merged_lse_teacher.float()


def _shard_gradients(
    backend: str, grad_rows: torch.Tensor, saved: BackwardInputs, problem: AttentionKLProblem
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """This shard's share of dq (and dq_teacher) and its exact dk (and dk_teacher).

    ``saved`` holds the merged statistics of every rank (natural-log log-sum-exps on the
    torch backend, base 2 on the triton one).
    """
    if backend == "triton":
        from cl_streamkl.kernels.triton import launch_backward

        grads = launch_backward(grad_rows, saved)
        return grads[0], grads[1], *((grads[2], grads[3]) if saved.teacher_grad else (None, None))
    # Float32 partial sums: the all-reduce adds them before the cast to the inputs' dtype.
    return streaming_backward(
        grad_rows, saved.q, saved.k, saved.q_teacher, saved.k_teacher, saved.lse_student, saved.lse_teacher,
        saved.row_kl, problem, DEFAULT_CHUNK_SIZE, saved.teacher_grad,
    )


def _summed_over_ranks(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """``tensor`` all-reduced (SUM), made contiguous first: NCCL refuses other layouts, and a
    gradient laid out like a strided input (timm's q/k views of one qkv tensor) is not contiguous."""
    tensor = tensor.contiguous()
    dist.all_reduce(tensor, group=group)
    return tensor


class _KeyShardedAttentionKL(torch.autograd.Function):
    """Per-row KL over the keys of every rank: forward merges row statistics, backward sums dq."""

    @staticmethod
    def forward(ctx, q, k, q_teacher, k_teacher, problem, backend, group):
        row_kl, lse_student, lse_teacher = _merge_shards(
            *_shard_statistics(backend, q, k, q_teacher, k_teacher, problem), group
        )
        teacher_grad = ctx.needs_input_grad[2] or ctx.needs_input_grad[3]
        # The merged KL enters only the teacher's gradient.
        ctx.save_for_backward(q, k, q_teacher, k_teacher, lse_student, lse_teacher, row_kl if teacher_grad else None)
        ctx.problem, ctx.backend, ctx.group, ctx.teacher_grad = problem, backend, group, teacher_grad
        return row_kl

    @staticmethod
    def backward(ctx, grad_rows):
        refuse_double_backward()
        q, k, q_teacher, k_teacher, lse_student, lse_teacher, row_kl = ctx.saved_tensors
        problem = ctx.problem
        saved = BackwardInputs(
            q, k, q_teacher, k_teacher, lse_student if row_kl is None else row_kl, lse_student, lse_teacher,
            problem.student_scale, problem.teacher_scale, False, ctx.teacher_grad,
        )
        grad_q, grad_k, grad_q_teacher, grad_k_teacher = _shard_gradients(ctx.backend, grad_rows, saved, problem)
        # Every rank agreed on which inputs require grad, so all of them run the same collectives.
        if ctx.needs_input_grad[0]:
            grad_q = _summed_over_ranks(grad_q, ctx.group)
        if ctx.teacher_grad:
            grad_q_teacher = _summed_over_ranks(grad_q_teacher, ctx.group)
        grads = (grad_q, grad_k, grad_q_teacher, grad_k_teacher)
        return *in_input_dtypes(grads, (q, k, q_teacher, k_teacher)), None, None, None


def _collective_device(tensors: tuple[object, ...]) -> torch.device:
    for tensor in tensors:
        if isinstance(tensor, torch.Tensor):
            return tensor.device
    return torch.device("cpu")


def attention_kl_key_sharded(
    q: torch.Tensor,
    k: torch.Tensor,
    q_teacher: torch.Tensor,
    k_teacher: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    scale: float | None = None,
    teacher_scale: float | None = None,
    temperature: float = 1.0,
    causal: bool = False,
    reduction: str = "mean",
    backend: str = "auto",
) -> torch.Tensor:
    """:func:`cl_streamkl.attention_kl` over a key set split across the ranks of a process group.

    Every rank of ``group`` calls this with the same queries and its own contiguous shard of
    the keys, shards in rank order: rank r holds keys [o_r, o_r + Nk_r) of the full set,
    o_r = Nk_0 + … + Nk_{r−1}. Every rank gets the KL over all Σ_r Nk_r keys, equal to
    ``attention_kl`` of the concatenated keys up to float rounding. Each rank's extra memory
    is that of ``attention_kl`` on its shard plus a few float64 values per query row.

    It is a collective call: every rank of the group must call it, in the same order as
    its other collectives, and must run the backward (``loss.backward()`` on the same loss,
    so the upstream gradient is the same everywhere). Before any work, one all-gather of a
    few numbers per rank checks that the ranks agree on shapes, dtype and options; a bad
    input on any rank then raises on every rank rather than leaving the others waiting.
    A rank that fails later (out of memory, a killed process) leaves its peers blocked in
    the next collective until the group's timeout (``init_process_group(timeout=...)``)
    ends it. Nothing is written to disk.

    Args:
        q: student queries, (B, H, Nq, Ds), the same on every rank.
        k: this rank's student keys, (B, H, Nk_r, Ds), Nk_r ≥ 1.
        q_teacher: teacher queries, (B, H, Nq, Dt), the same on every rank.
        k_teacher: this rank's teacher keys, (B, H, Nk_r, Dt).
            Dtypes, devices, strides and head dims as in :func:`cl_streamkl.attention_kl`;
            the tensors live on the device the group's backend communicates from (CUDA
            for NCCL, CPU for gloo).
        group: the process group; None is the default (world) group.
        scale, teacher_scale, temperature, reduction, backend: as in
            :func:`cl_streamkl.attention_kl`; the same on every rank.
        causal: must be False: a causal mask needs each shard's key offset inside the
            kernels, which they do not take.

    Returns:
        A float32 tensor, the same on every rank: (B, H, Nq) for reduction="none", else a
        scalar. Gradients: dq and dq_teacher are all-reduced, so every rank holds the full
        gradient of its queries; dk and dk_teacher are this rank's shard's. The teacher's
        gradients are computed when q_teacher or k_teacher require grad (mutual distillation).

    Raises:
        RuntimeError: torch.distributed is unavailable or no process group is initialised.
        TypeError: as :func:`cl_streamkl.attention_kl`, for this rank's input.
        ValueError: this rank is not in ``group``, ``causal`` is set, an input is invalid on
            this or another rank, or the ranks disagree on the queries' shape, the teacher's
            head dim, dtype, scales, temperature, reduction or which inputs require grad.

    Example:
        >>> # torchrun --nproc_per_node 2 ...; each rank holds the queries and half the keys
        >>> rank, world = dist.get_rank(), dist.get_world_size()
        >>> k_shard, k_teacher_shard = k.chunk(world, dim=2)[rank], k_teacher.chunk(world, dim=2)[rank]
        >>> loss = attention_kl_key_sharded(q, k_shard, q_teacher, k_teacher_shard)
        >>> loss.backward()   # q.grad: the full gradient; k_shard.grad: this shard's
    """
    rank, world_size = _checked_group(group)
    tensors = (q, k, q_teacher, k_teacher)
    problem, resolved_backend, local_error = None, None, None
    try:
        if causal is not False:
            raise ValueError(
                "causal=True is not supported for sharded keys: the kernels mask by key index "
                "within the shard and take no global key offset"
            )
        options = AttentionKLOptions(scale, teacher_scale, temperature, False, reduction, backend)
        problem = check_inputs(q, k, q_teacher, k_teacher, options)
        resolved_backend = _resolve_backend(backend, q.device)
    except (TypeError, ValueError) as error:
        problem, local_error = None, error
    grad_enabled = torch.is_grad_enabled()
    requires_grad = (
        (grad_enabled and q.requires_grad, grad_enabled and k.requires_grad,
         grad_enabled and (q_teacher.requires_grad or k_teacher.requires_grad))
        if problem is not None
        else (False, False, False)
    )
    _agree_across_ranks(
        _metadata(problem, q.dtype if problem is not None else None, reduction, requires_grad),
        local_error,
        _collective_device(tensors),
        group,
        rank,
        world_size,
    )
    # The torch backend promises float32 math, as in attention_kl; the merge is float64.
    with torch.autocast(q.device.type, enabled=False):
        row_kl = _KeyShardedAttentionKL.apply(q, k, q_teacher, k_teacher, problem, resolved_backend, group)
    return reduce_rows(row_kl, reduction)
