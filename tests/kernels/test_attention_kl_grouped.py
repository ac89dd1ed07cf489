"""attention_kl_grouped: L problems at once against the float64 reference and attention_kl.

The triton backend runs the grouped kernels on the CPU through Triton's interpreter (see
conftest.py), reading each problem's addresses from the int64 table as the GPU does.
"""

from __future__ import annotations

import pytest
import torch
from test_attention_kl import (
    DTYPE_IDS,
    DTYPES,
    assert_compiled_matches_eager,
    error_bound,
    low_precision_rows,
    rel_err,
)

from cl_streamkl import attention_kl, attention_kl_grouped, attention_kl_reference

# (L, B, H, Nq, Nk, Ds, Dt)
GROUPED_SHAPES = [
    (1, 2, 3, 17, 17, 64, 64),
    (3, 1, 2, 17, 40, 32, 80),
    (12, 1, 1, 1, 1, 32, 32),
    (12, 1, 2, 17, 17, 64, 64),
    (2, 1, 1, 197, 197, 64, 64),
]
ONE_KEY_ATOL = 1e-5


def assert_matches_single_kernels(grouped: torch.Tensor, single: torch.Tensor, device: str) -> None:
    """Grouped results equal the single-problem kernels': bit for bit under the interpreter (the same
    tiles and arithmetic, addresses from the table); on a GPU the grouped kernels run their own
    tiles (tuning.GROUPED_TILES), which sum in another order, so equal to rounding: float32 values
    within 1e-6, low-precision gradients within one unit in the last place of their dtype."""
    if device == "cpu":
        assert torch.equal(grouped, single)
        return
    bound = 1e-6 if grouped.dtype == torch.float32 else torch.finfo(grouped.dtype).eps
    assert rel_err(grouped, single) < bound


def shape_id(shape) -> str:
    count, batch, heads, n_q, n_k, d_s, d_t = shape
    return f"L{count}-B{batch}-H{heads}-Nq{n_q}-Nk{n_k}-Ds{d_s}-Dt{d_t}"


def make_problems(shape, dtype, device, teacher_grad=False):
    count, batch, heads, n_q, n_k, d_s, d_t = shape

    def rand(n, d, grad):
        return torch.randn(batch, heads, n, d, device=device).to(dtype).requires_grad_(grad)

    return [
        (rand(n_q, d_s, True), rand(n_k, d_s, True), rand(n_q, d_t, teacher_grad), rand(n_k, d_t, teacher_grad))
        for _ in range(count)
    ]


def timm_qk(batch, tokens, heads, dim, device, requires_grad=True):
    """q and k as timm makes them: views of one (3, B, H, N, D) permutation of a qkv tensor."""
    qkv = torch.randn(batch, tokens, 3 * heads * dim, device=device, requires_grad=requires_grad)
    q, k, _ = qkv.reshape(batch, tokens, 3, heads, dim).permute(2, 0, 3, 1, 4).unbind(0)
    return qkv, q, k


# Every dtype on every shape but the longest, which runs in bf16 only: fp16 and fp32 meet 197
# tokens in test_attention_kl's single-problem cases, whose kernels compute what the grouped ones
# do (bit for bit under the interpreter, to rounding on a GPU:
# test_backends_agree_and_match_the_single_problem_kernels_bit_for_bit), and each interpreted case
# at 197 tokens costs seconds.
PER_PROBLEM_CASES = [(dtype, shape) for shape in GROUPED_SHAPES for dtype in DTYPES
                     if shape[3] < 197 or dtype == torch.bfloat16]


@pytest.mark.parametrize(("dtype", "shape"), PER_PROBLEM_CASES,
                         ids=[f"{DTYPE_IDS[dtype]}-{shape_id(shape)}" for dtype, shape in PER_PROBLEM_CASES])
def test_matches_reference_per_problem(dtype, shape, device):
    torch.manual_seed(20)
    problems = make_problems(shape, dtype, device)
    out = attention_kl_grouped(problems, reduction="none", backend="triton")
    assert out.dtype == torch.float32 and out.shape == (shape[0], *shape[1:4])
    upstream = torch.randn_like(out)
    inputs = [tensor for problem in problems for tensor in problem[:2]]
    grads = torch.autograd.grad((out * upstream).sum(), inputs)
    # With one key the KL and its gradients are exactly 0, so no relative error exists: on a GPU the
    # log-sum-exp's rounding leaves about 1e-7 (as in test_known_lse.py), which atol bounds.
    atol = ONE_KEY_ATOL if shape[4] == 1 else 0.0
    for index, (q, k, q_t, k_t) in enumerate(problems):
        ref = attention_kl_reference(q, k, q_t, k_t, reduction="none")
        assert rel_err(out[index], ref) < 1e-4 or (out[index] - ref).abs().max() <= atol, f"problem {index}"
        ref_grads = torch.autograd.grad((ref * upstream[index]).sum(), (q, k))
        q_low, k_low = q.detach().requires_grad_(), k.detach().requires_grad_()
        baseline = low_precision_rows(q_low, k_low, q_t, k_t, causal=False)
        baseline_grads = torch.autograd.grad((baseline * upstream[index].to(dtype)).sum(), (q_low, k_low))
        for name, grad, ref_grad, base_grad in zip("qk", grads[2 * index:2 * index + 2], ref_grads, baseline_grads):
            assert grad.dtype == dtype and grad.shape == ref_grad.shape
            if atol:
                assert ref_grad.norm() == 0 and grad.abs().max() <= atol, f"grad of {name} in problem {index}"
                continue
            bound = error_bound(dtype, rel_err(base_grad, ref_grad))
            assert rel_err(grad, ref_grad) < bound, f"grad of {name} in problem {index}"


@pytest.mark.parametrize("reduction", ["none", "sum", "mean", "batchmean"])
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_each_entry_equals_attention_kl(backend, reduction, device):
    torch.manual_seed(21)
    problems = make_problems((3, 2, 2, 19, 23, 32, 48), torch.float32, device)
    options = dict(temperature=1.7, reduction=reduction, backend=backend)
    scales, teacher_scales = [0.3, None, 0.2], 0.1
    out = attention_kl_grouped(problems, scales=scales, teacher_scales=teacher_scales, **options)
    expected = torch.stack(
        [attention_kl(*problem, scale=scale, teacher_scale=teacher_scales, **options) for problem, scale in zip(problems, scales)]
    )
    assert out.shape == expected.shape == ((3, 2, 2, 19) if reduction == "none" else (3,))
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-7)
    weights = torch.randn_like(out)
    inputs = [tensor for problem in problems for tensor in problem[:2]]
    grads = torch.autograd.grad((out * weights).sum(), inputs)
    expected_grads = torch.autograd.grad((expected * weights).sum(), inputs)
    for grad, expected_grad in zip(grads, expected_grads):
        torch.testing.assert_close(grad, expected_grad, rtol=1e-5, atol=1e-8)


def test_layouts_that_differ_between_problems_share_one_launch(launch_counter, device):
    """timm views of separate qkv tensors, a contiguous problem and a (B, N, H, D) transpose."""
    torch.manual_seed(22)
    batch, tokens, heads, dim = 2, 29, 3, 32
    student = [timm_qk(batch, tokens, heads, dim, device) for _ in range(2)]
    problems = []
    for qkv, q, k in student:
        _, q_t, k_t = timm_qk(batch, tokens, heads, dim, device, requires_grad=False)
        problems.append((q, k, q_t, k_t))
    contiguous = [torch.randn(batch, heads, tokens, dim, device=device, requires_grad=True) for _ in range(2)]
    problems.append((*contiguous, *(torch.randn(batch, heads, tokens, dim, device=device) for _ in range(2))))
    transposed = [torch.randn(batch, tokens, heads, dim, device=device).transpose(1, 2) for _ in range(4)]
    transposed[0].requires_grad_()
    problems.append(tuple(transposed))
    assert len({problem[0].stride() for problem in problems}) == 3

    counter = launch_counter
    out = attention_kl_grouped(problems, reduction="none", backend="triton")
    leaves = [qkv for qkv, _, _ in student] + contiguous + [transposed[0]]
    upstream = torch.randn_like(out)
    grads = torch.autograd.grad((out * upstream).sum(), leaves)
    assert counter.counts["grouped_forward"] == counter.counts["grouped_backward_dq"] == 1
    assert counter.counts["grouped_backward_dk"] == 1
    assert counter.counts["forward"] == counter.counts["backward_dq"] == counter.counts["backward_dk"] == 0

    ref = torch.stack([attention_kl_reference(*problem, reduction="none") for problem in problems])
    assert rel_err(out, ref) < 1e-5
    ref_grads = torch.autograd.grad((ref * upstream).sum(), leaves)
    for grad, ref_grad in zip(grads, ref_grads):
        assert rel_err(grad, ref_grad) < 1e-5


@pytest.mark.parametrize("teacher_grad", [False, True], ids=["frozen", "mutual"])
def test_gradients_come_back_in_each_inputs_layout(teacher_grad, device):
    torch.manual_seed(23)
    views = [timm_qk(2, 21, 3, 32, device)[1:] for _ in range(2)]
    teachers = [timm_qk(2, 21, 3, 32, device, requires_grad=teacher_grad)[1:] for _ in range(2)]
    problems = [(*student, *teacher) for student, teacher in zip(views, teachers)]
    inputs = [tensor for problem in problems for tensor in (problem if teacher_grad else problem[:2])]
    out = attention_kl_grouped(problems, reduction="sum", backend="triton")
    grads = torch.autograd.grad(out.sum(), inputs)
    for tensor, grad in zip(inputs, grads):
        assert grad.stride() == torch.empty_like(tensor).stride() != tensor.contiguous().stride()


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("causal", [False, True])
def test_mutual_distillation_and_causal(causal, dtype, device):
    torch.manual_seed(24)
    problems = make_problems((3, 1, 2, 21, 21, 32, 48), dtype, device, teacher_grad=True)
    out = attention_kl_grouped(problems, causal=causal, reduction="none", backend="triton")
    ref = torch.stack([attention_kl_reference(*problem, causal=causal, reduction="none") for problem in problems])
    assert rel_err(out, ref) < 1e-4
    upstream = torch.randn_like(out)
    inputs = [tensor for problem in problems for tensor in problem]
    grads = torch.autograd.grad((out * upstream).sum(), inputs)
    ref_grads = torch.autograd.grad((ref * upstream).sum(), inputs)
    bound = 2e-5 if dtype == torch.float32 else 2e-2
    for index, (grad, ref_grad) in enumerate(zip(grads, ref_grads)):
        name = ("q", "k", "q_teacher", "k_teacher")[index % 4]
        assert rel_err(grad, ref_grad) < bound, f"grad of {name} in problem {index // 4}"


def test_one_launch_per_kernel_and_one_autograd_node(launch_counter, device):
    torch.manual_seed(25)
    problems = make_problems((12, 1, 2, 9, 9, 16, 16), torch.float32, device)
    counter = launch_counter
    loss = attention_kl_grouped(problems, backend="triton").sum()

    nodes, stack, seen = [], [loss.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        nodes.append(node.name())
        stack.extend(next_node for next_node, _ in node.next_functions)
    kl_nodes = [name for name in nodes if "AttentionKL" in name]
    assert kl_nodes == ["_GroupedAttentionKLFunctionBackward"]
    assert nodes.count("torch::autograd::AccumulateGrad") == 24  # q and k of 12 problems, all behind that node

    loss.backward()
    assert counter.counts == {
        "forward": 0,
        "backward_dq": 0,
        "backward_dk": 0,
        "grouped_forward": 1,
        "grouped_backward_dq": 1,
        "grouped_backward_dk": 1,
        "fused": 0,
        "grouped_fused": 0,
    }
    assert all(q.grad is not None and k.grad is not None and q_t.grad is None for q, k, q_t, _ in problems)


@pytest.mark.parametrize("teacher_grad", [False, True])
def test_torch_compile_traces_the_grouped_ops(teacher_grad, device):
    torch.manual_seed(26)
    problems = make_problems((3, 1, 2, 20, 20, 32, 32), torch.float32, device, teacher_grad=teacher_grad)

    def loss(problems):
        weights = torch.arange(1.0, 4.0, device=problems[0][0].device)
        return (attention_kl_grouped(problems, temperature=2.0, backend="triton") * weights).sum()

    inputs = [tensor for problem in problems for tensor in (problem if teacher_grad else problem[:2])]
    assert_compiled_matches_eager(loss, (problems,), inputs, backend="aot_eager")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA and the inductor GPU backend")
def test_torch_compile_inductor_fullgraph_on_gpu():
    torch.manual_seed(28)
    problems = make_problems((4, 2, 4, 197, 197, 64, 64), torch.bfloat16, "cuda")
    inputs = [tensor for problem in problems for tensor in problem[:2]]

    def loss(problems):
        return attention_kl_grouped(problems, backend="triton").sum()

    assert_compiled_matches_eager(loss, (problems,), inputs)


def test_backends_agree_and_match_the_single_problem_kernels_bit_for_bit(device):
    torch.manual_seed(27)
    problems = make_problems((4, 2, 2, 33, 33, 64, 64), torch.bfloat16, device)
    grouped = attention_kl_grouped(problems, reduction="none", backend="triton")
    single = torch.stack([attention_kl(*problem, reduction="none", backend="triton") for problem in problems])
    assert_matches_single_kernels(grouped, single, device)
    streamed = attention_kl_grouped(problems, reduction="none", backend="torch")
    assert rel_err(grouped, streamed) < 1e-5
