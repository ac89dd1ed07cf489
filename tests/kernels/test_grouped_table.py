"""The grouped kernels' per-problem table: scales' bits, addresses, strides and the ALIGNED flag."""

from __future__ import annotations

import struct

import torch

from cl_streamkl.kernels.triton.launch_grouped import _table


def _bits(value: float) -> int:
    return struct.unpack("<i", struct.pack("<f", value))[0]


def test_rows_hold_scale_bits_then_address_and_strides_of_each_tensor_padded_with_zeros() -> None:
    storage = torch.zeros(4 * 3 * 32 * 16)
    first = storage[: 2 * 3 * 32 * 16].view(2, 3, 32, 16)
    # A size-1 batch: its stride is written as 0 (never multiplied by more than 0).
    second = storage[: 3 * 32 * 16].view(1, 3, 32, 16)
    scales = [(0.125 * 1.4426950408889634, 0.25, 0.125, 0.17), (1.0, 2.0, 3.0, 4.0)]
    table, aligned = _table([(first, first), (second, first)], scales, width=16)
    assert table.dtype == torch.int64 and table.shape == (2, 16)
    expected_first = [*map(_bits, scales[0]), first.data_ptr(), 1536, 512, 16, first.data_ptr(), 1536, 512, 16]
    expected_second = [*map(_bits, scales[1]), second.data_ptr(), 0, 512, 16, first.data_ptr(), 1536, 512, 16]
    assert table[0].tolist() == expected_first + [0, 0, 0, 0]
    assert table[1].tolist() == expected_second + [0, 0, 0, 0]
    assert aligned == (storage.data_ptr() % 16 == 0)


def test_aligned_is_false_for_one_misaligned_address_or_stride_anywhere() -> None:
    storage = torch.zeros(2 * 2 * 64 * 33)
    base = storage[: 2 * 2 * 64 * 32].view(2, 2, 64, 32)
    assert _table([(base, base)] * 3, [(1.0,) * 4] * 3, width=12)[1] == (storage.data_ptr() % 16 == 0)
    shifted = storage[1: 1 + 2 * 2 * 64 * 32].view(2, 2, 64, 32)  # 4 bytes off
    odd_stride = storage.view(2, 2, 64, 33)[..., :32]  # rows 33 elements apart
    for bad in (shifted, odd_stride):
        assert _table([(base, base), (base, bad), (base, base)], [(1.0,) * 4] * 3, width=12)[1] is False
