"""The one-pass backward (``kernel_options(backward="onepass")``) against float64 and the split kernels.

Shapes that are not tile multiples on purpose (the interpreter's tiles are 16 wide), head dim
80, causal, teacher gradients, grouped problems, and an upstream gradient that differs per row
as well as one that is the same along rows (the dk kernel then multiplies by it after its loop,
and so does the dq conversion).
"""

from __future__ import annotations

import pytest
import torch
from test_attention_kl import DTYPE_IDS, DTYPES, error_bound, low_precision_rows, make_inputs, rel_err, shape_id

from cl_streamkl import attention_kl, attention_kl_grouped, attention_kl_reference
from cl_streamkl.kernels.config import KernelOptions, kernel_options
from cl_streamkl.kernels.triton.launch import one_pass_backward

# (B, H, Nq, Nk, Ds, Dt, causal)
SHAPES = [
    (2, 2, 37, 37, 64, 64, False),
    (1, 2, 17, 40, 32, 80, False),
    (1, 1, 50, 50, 80, 80, True),
]


def gradients(inputs, causal, upstream, backward):
    with kernel_options(backward=backward):
        out = attention_kl(*inputs, causal=causal, reduction="none", backend="triton")
        wanted = [tensor for tensor in inputs if tensor.requires_grad]
        return torch.autograd.grad((out * upstream).sum(), wanted)


@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
def test_student_gradients_match_reference(dtype, shape, device):
    torch.manual_seed(40)
    causal = shape[-1]
    inputs = make_inputs(shape, dtype, device)
    ref = attention_kl_reference(*inputs, causal=causal, reduction="none")
    upstream = torch.randn_like(ref)
    ref_grads = torch.autograd.grad((ref * upstream).sum(), inputs[:2])
    grads = gradients(inputs, causal, upstream.float(), "onepass")
    low = [tensor.detach().requires_grad_() for tensor in inputs[:2]]
    baseline = low_precision_rows(*low, *inputs[2:], causal)
    baseline_grads = torch.autograd.grad((baseline * upstream.to(dtype)).sum(), low)
    for name, grad, ref_grad, base_grad, tensor in zip("qk", grads, ref_grads, baseline_grads, inputs):
        assert grad.dtype == dtype and grad.stride() == tensor.stride()
        assert rel_err(grad, ref_grad) < error_bound(dtype, rel_err(base_grad, ref_grad)), f"grad of {name}"
    split = gradients(inputs, causal, upstream.float(), "split")
    for grad, split_grad in zip(grads, split):
        assert rel_err(grad, split_grad) < (1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("causal", [False, True])
def test_teacher_gradients_and_a_gradient_constant_along_rows(causal, device):
    torch.manual_seed(41)
    inputs = make_inputs((1, 2, 21, 21, 32, 48, causal), torch.float32, device, teacher_grad=True)
    ref_grads = torch.autograd.grad(attention_kl_reference(*inputs, causal=causal, reduction="sum"), inputs)
    with kernel_options(backward="onepass"):
        # reduction="sum" hands the backward an expanded gradient: dk and dq take g after the loop.
        grads = torch.autograd.grad(attention_kl(*inputs, causal=causal, reduction="sum", backend="triton"), inputs)
    for name, grad, ref_grad in zip(("q", "k", "q_teacher", "k_teacher"), grads, ref_grads):
        assert rel_err(grad, ref_grad) < 2e-5, f"grad of {name}"


def test_grouped_problems(launch_counter, device):
    torch.manual_seed(42)
    problems = [make_inputs((1, 2, 23, 23, 64, 64, False), torch.bfloat16, device, teacher_grad=True)
                for _ in range(3)]
    flat = [tensor for problem in problems for tensor in problem]
    with kernel_options(backward="onepass"):
        out = attention_kl_grouped(problems, reduction="none", backend="triton")
        upstream = torch.randn_like(out)
        grads = torch.autograd.grad((out * upstream).sum(), flat)
    assert launch_counter.counts["grouped_backward_dq"] == 0 and launch_counter.counts["grouped_backward_dk"] == 1
    for index, problem in enumerate(problems):
        ref = attention_kl_reference(*problem, reduction="none")
        ref_grads = torch.autograd.grad((ref * upstream[index].double()).sum(), problem)
        for role, ref_grad in enumerate(ref_grads):
            assert rel_err(grads[4 * index + role], ref_grad) < 2e-2, f"problem {index}, input {role}"


def test_deterministic_forces_the_split_kernels(launch_counter, device):
    inputs = make_inputs((1, 1, 17, 17, 32, 32, False), torch.float32, device)
    with kernel_options(backward="onepass", deterministic=True):
        assert not one_pass_backward(8192, 8192, 64, False)
        attention_kl(*inputs, backend="triton").backward()
    assert launch_counter.counts["backward_dq"] == 1 and launch_counter.counts["backward_dk"] == 1
    with kernel_options(backward="onepass"):
        attention_kl(*inputs, backend="triton").backward()
    assert launch_counter.counts["backward_dq"] == 1 and launch_counter.counts["backward_dk"] == 2


@pytest.mark.parametrize(
    "n_q, n_k, head_dim, causal, chosen",
    [(4096, 4096, 64, False, True), (32768, 32768, 32, False, True), (4095, 8192, 64, False, False),
     (8192, 8192, 128, False, False), (8192, 8192, 64, True, False), (1025, 1025, 64, False, False)],
)
def test_auto_takes_the_one_pass_backward_where_it_measured_faster(n_q, n_k, head_dim, causal, chosen):
    """Long, unmasked, head dims up to 64; the split kernels elsewhere and always when deterministic."""
    assert one_pass_backward(n_q, n_k, head_dim, causal) == chosen  # "auto" is the default
    with kernel_options(deterministic=True):
        assert not one_pass_backward(n_q, n_k, head_dim, causal)
    with kernel_options(backward="split"):
        assert not one_pass_backward(n_q, n_k, head_dim, causal)
    with kernel_options(backward="onepass"):
        assert one_pass_backward(n_q, n_k, head_dim, causal)


def test_options_and_environment():
    assert KernelOptions().backward == "auto" and not KernelOptions().deterministic
    chosen = KernelOptions.from_environment({"CL_STREAMKL_BACKWARD": "onepass", "CL_STREAMKL_DETERMINISTIC": "1"})
    assert chosen == KernelOptions(backward="onepass", deterministic=True)
    with pytest.raises(ValueError, match="backward must be one of"):
        KernelOptions(backward="fused")
    with pytest.raises(TypeError, match="deterministic must be a bool"):
        KernelOptions(deterministic=1)
