"""Triton kernels under the interpreter (CPU) vs the reference vs dense SDPA.

Interpreted Triton costs ~0.3-2 s per launch here, so each case is small and the grid covers the
contract's axes once each: GQA ratios 1/3/8, head dims 64/128, block sizes 8-64, three dtypes,
split-K on and off, ragged last blocks, length-1 sequences, shared physical blocks, shuffled block
ids. The long-context cases are marked slow (soak profile).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from triton_probe import triton_interpreted_here
from kernel_cases import check_decode, check_prefill, make_case
from radixkv.kernels import PAD_SLOT, copy_blocks, write_kv

DECODE_CASES = [
    # (dtype, num_kv_heads, group, head_dim, block_size, num_splits)
    (torch.float32, 2, 1, 64, 16, 1),
    (torch.float32, 1, 3, 64, 8, 3),
    (torch.float32, 1, 8, 128, 32, None),
    (torch.float16, 3, 3, 64, 16, 2),
    (torch.bfloat16, 1, 8, 64, 64, 1),
]


@pytest.mark.parametrize("dtype,kv_heads,group,head_dim,block_size,num_splits", DECODE_CASES)
def test_decode_triton(triton_backend, dtype, kv_heads, group, head_dim, block_size, num_splits):
    gen = torch.Generator().manual_seed(block_size * 31 + group)
    lens = [1, block_size + 3, 2 * block_size, 150]
    case = make_case(lens, block_size=block_size, num_kv_heads=kv_heads, head_dim=head_dim,
                     dtype=dtype, gen=gen)
    q = torch.randn(len(lens), kv_heads * group, head_dim, generator=gen).to(dtype)
    check_decode(triton_backend, case, q, dtype, num_splits=num_splits)


def test_decode_triton_shared_prefix_split_k(triton_backend):
    """Two tables share physical blocks; splits past a short sequence's end are empty."""
    gen = torch.Generator().manual_seed(8)
    lens = [2 * 16 + 5, 2 * 16 + 1, 200]
    case = make_case(lens, block_size=16, num_kv_heads=1, head_dim=64, share_prefix=2, gen=gen)
    q = torch.randn(len(lens), 3, 64, generator=gen)
    check_decode(triton_backend, case, q, torch.float32, num_splits=4)


PREFILL_CASES = [
    # (dtype, num_kv_heads, group, head_dim, block_size)
    (torch.float32, 2, 1, 64, 16),
    (torch.float32, 1, 3, 128, 8),
    (torch.float16, 1, 8, 64, 32),
    (torch.bfloat16, 3, 3, 64, 16),
]


@pytest.mark.parametrize("dtype,kv_heads,group,head_dim,block_size", PREFILL_CASES)
def test_prefill_triton(triton_backend, dtype, kv_heads, group, head_dim, block_size):
    gen = torch.Generator().manual_seed(block_size * 7 + group)
    # cached prefix: none, partial block, whole blocks; chunk lengths 1 and > one query tile
    cached = [0, 5, 2 * block_size]
    q_lens = [20, 1, 70]
    lens = [c + n for c, n in zip(cached, q_lens)]
    case = make_case(lens, block_size=block_size, num_kv_heads=kv_heads, head_dim=head_dim,
                     dtype=dtype, share_prefix=0, gen=gen)
    check_prefill(triton_backend, case, q_lens, kv_heads * group, dtype, gen)


def test_prefill_triton_shared_prefix(triton_backend):
    gen = torch.Generator().manual_seed(12)
    q_lens, cached = [3, 17], [32, 48]
    lens = [c + n for c, n in zip(cached, q_lens)]
    case = make_case(lens, block_size=16, num_kv_heads=1, head_dim=64, share_prefix=2, gen=gen)
    check_prefill(triton_backend, case, q_lens, 3, torch.float32, gen)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_long_context(triton_backend, dtype):
    gen = torch.Generator().manual_seed(21)
    lens = [5000, 3001]
    case = make_case(lens, block_size=16, num_kv_heads=1, head_dim=64, dtype=dtype, gen=gen)
    q = torch.randn(len(lens), 3, 64, generator=gen).to(dtype)
    check_decode(triton_backend, case, q, dtype, num_splits=None)
    check_decode(triton_backend, case, q, dtype, num_splits=1)
    check_prefill(triton_backend, case, [130, 1], 3, dtype, gen)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_triton(triton_backend, dtype):
    gen = torch.Generator().manual_seed(2)
    pool = torch.randn(2, 2, 6, 8, 3, 64, generator=gen).to(dtype)
    before = pool.clone()
    qkv = torch.randn(4, 9 * 64, generator=gen).to(dtype)   # token-strided K/V slices
    key, value = qkv[:, 3 * 64:6 * 64].view(4, 3, 64), qkv[:, 6 * 64:].view(4, 3, 64)
    slots = torch.tensor([13, PAD_SLOT, 0, 47])
    write_kv(key, value, pool[1, 0], pool[1, 1], slots)      # "auto" -> Triton via the env
    expected = before.clone()
    for t, s in enumerate(slots.tolist()):
        if s != PAD_SLOT:
            expected[1, 0, s // 8, s % 8] = key[t]
            expected[1, 1, s // 8, s % 8] = value[t]
    assert torch.equal(pool, expected)


def test_copy_blocks_triton(triton_backend):
    gen = torch.Generator().manual_seed(3)
    pool = torch.randn(3, 2, 7, 16, 2, 128, generator=gen).half()
    before = pool.clone()
    src, dst = torch.tensor([1, 1, 6]), torch.tensor([0, 4, 2])
    copy_blocks(pool, src, dst, backend=triton_backend)
    expected = before.clone()
    expected[:, :, dst] = before[:, :, src]
    assert torch.equal(pool, expected)


def test_triton_cases_in_subprocess():
    """Rerun this file in a fresh process with TRITON_INTERPRET=1 when triton was imported in
    compiled mode before tests/kernels/conftest.py could set it (the cases above then skip)."""
    pytest.importorskip("triton")
    if triton_interpreted_here():
        pytest.skip("the Triton cases ran in this process")
    env = dict(os.environ, TRITON_INTERPRET="1")
    env.pop("RADIXKV_KERNEL_BACKEND", None)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(Path(__file__))],
        env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and "was imported before TRITON_INTERPRET" not in proc.stdout


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_triton_matches_torch_path_on_cuda():
    if triton_interpreted_here():
        pytest.skip("triton imported in interpreter mode in this process")
    gen = torch.Generator().manual_seed(4)
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        case = make_case([1, 37, 4100, 300], block_size=16, num_kv_heads=2, head_dim=128,
                         dtype=dtype, gen=gen)
        for name in ("k_cache", "v_cache", "block_tables", "seq_lens"):
            setattr(case, name, getattr(case, name).cuda())
        q = torch.randn(4, 16, 128, generator=gen).to(dtype).cuda()
        check_decode("triton", case, q, dtype)
        check_prefill("triton", case, [1, 20, 700, 64], 16, dtype, gen)
