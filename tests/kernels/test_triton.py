"""Triton kernels vs the reference vs dense SDPA: compiled on CUDA where a GPU is present,
under the interpreter on the CPU otherwise (the ``triton_device`` fixture).

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
def test_decode_triton(triton_backend, triton_device, dtype, kv_heads, group, head_dim,
                       block_size, num_splits):
    gen = torch.Generator().manual_seed(block_size * 31 + group)
    lens = [1, block_size + 3, 2 * block_size, 150]
    case = make_case(lens, block_size=block_size, num_kv_heads=kv_heads, head_dim=head_dim,
                     dtype=dtype, gen=gen, device=triton_device)
    q = torch.randn(len(lens), kv_heads * group, head_dim, generator=gen).to(dtype)
    check_decode(triton_backend, case, q.to(triton_device), dtype, num_splits=num_splits)


def test_decode_triton_shared_prefix_split_k(triton_backend, triton_device):
    """Two tables share physical blocks; splits past a short sequence's end are empty."""
    gen = torch.Generator().manual_seed(8)
    lens = [2 * 16 + 5, 2 * 16 + 1, 200]
    case = make_case(lens, block_size=16, num_kv_heads=1, head_dim=64, share_prefix=2, gen=gen,
                     device=triton_device)
    q = torch.randn(len(lens), 3, 64, generator=gen)
    check_decode(triton_backend, case, q.to(triton_device), torch.float32, num_splits=4)


SPLIT_CASES = [
    # (head_dim, block_size, num_kv_heads, group, num_splits, lens)
    # head_dim 128 tiles 64 tokens: with 48-token blocks a split of 64 * k tokens ends in the
    # middle of a cache block unless 3 | k (here 128-token splits); the 40-token sequence is
    # shorter than one split.
    (128, 48, 2, 4, 5, [40, 300, 48 * 3 + 1]),
    # 49 splits of 64 tokens: more splits than one merge chunk (32), and sequences of 1, 63
    # and 65 tokens (shorter than one split, one split and a token).
    (64, 16, 1, 8, 60, [1, 63, 65, 48 * 64 - 7]),
    # A 24-token block size (not a power of two) against 64-token splits: splits end mid-block.
    (64, 24, 3, 1, 7, [24 * 5 + 11, 2, 400]),
    # head_dims that are not powers of two (Phi-3: 96) or below tl.dot's 16 lanes: padded
    # lanes are never loaded or stored.
    (96, 16, 2, 2, 3, [5, 150, 33]),
    (8, 16, 1, 4, 2, [70, 3]),
]


@pytest.mark.parametrize("head_dim,block_size,kv_heads,group,num_splits,lens", SPLIT_CASES)
def test_decode_triton_split_k_boundaries(triton_backend, triton_device, head_dim, block_size,
                                          kv_heads, group, num_splits, lens):
    """Split-K (flash decoding): splits that start and end inside a cache block, sequences
    shorter than one split (their later splits are empty and never merged), more splits than
    the merge kernel folds at once, GQA with both head dims."""
    gen = torch.Generator().manual_seed(head_dim + block_size + num_splits)
    case = make_case(lens, block_size=block_size, num_kv_heads=kv_heads, head_dim=head_dim,
                     gen=gen, device=triton_device)
    assert min(lens) < _plan(case, head_dim, num_splits).tokens_per_split
    q = torch.randn(len(lens), kv_heads * group, head_dim, generator=gen)
    check_decode(triton_backend, case, q.to(triton_device), torch.float32,
                 num_splits=num_splits)


def _plan(case, head_dim: int, num_splits: int):
    from radixkv.kernels.triton_attention import DECODE_CONFIG, plan_decode

    tile = DECODE_CONFIG[64 if head_dim <= 64 else 128]["BLOCK_N"]
    capacity = case.block_tables.shape[1] * case.block_size
    return plan_decode(1, 1, 1, head_dim, capacity, tile, torch.device("cpu"), num_splits)


def test_split_cases_cover_the_boundaries():
    """The SPLIT_CASES do what their comments say: some split ends inside a cache block, and
    one case has more splits than the merge kernel folds in one chunk (32)."""
    gen = torch.Generator().manual_seed(0)
    plans = []
    for head_dim, block_size, kv_heads, _, num_splits, lens in SPLIT_CASES:
        case = make_case(lens, block_size=block_size, num_kv_heads=kv_heads, head_dim=8,
                         gen=gen)
        plans.append((_plan(case, head_dim, num_splits), block_size))
    assert sum(p.tokens_per_split % bs != 0 for p, bs in plans) >= 2
    assert max(p.num_splits for p, _ in plans) > 32


def test_decode_triton_plan_is_made_once_per_step(triton_backend, triton_device):
    """With a plan dict (the engine keeps one per step), the split plan and its partial
    buffers are made on the first call and reused by the next layers' calls."""
    from radixkv.kernels import paged_decode_attention

    gen = torch.Generator().manual_seed(5)
    case = make_case([90, 33], block_size=16, num_kv_heads=2, head_dim=64, gen=gen,
                     device=triton_device)
    q = torch.randn(2, 4, 64, generator=gen).to(triton_device)
    plan: dict = {}
    first = paged_decode_attention(q, case.k_cache, case.v_cache, case.block_tables,
                                   case.seq_lens, plan=plan, num_splits=3)
    made = plan["triton_decode"]
    assert made.num_splits > 1 and made.part_out is not None
    again = paged_decode_attention(q, case.k_cache, case.v_cache, case.block_tables,
                                   case.seq_lens, plan=plan, num_splits=3)
    assert plan["triton_decode"] is made
    torch.testing.assert_close(first, again, atol=0, rtol=0)


PREFILL_CASES = [
    # (dtype, num_kv_heads, group, head_dim, block_size)
    (torch.float32, 2, 1, 64, 16),
    (torch.float32, 1, 3, 128, 8),
    (torch.float16, 1, 8, 64, 32),
    (torch.bfloat16, 3, 3, 64, 16),
    (torch.float32, 2, 2, 96, 16),     # padded head_dim (Phi-3's 96)
    (torch.float16, 1, 4, 16, 8),      # the tiny test models' head_dim
]


@pytest.mark.parametrize("dtype,kv_heads,group,head_dim,block_size", PREFILL_CASES)
def test_prefill_triton(triton_backend, triton_device, dtype, kv_heads, group, head_dim,
                        block_size):
    gen = torch.Generator().manual_seed(block_size * 7 + group)
    # cached prefix: none, partial block, whole blocks; chunk lengths 1 and > one query tile
    cached = [0, 5, 2 * block_size]
    q_lens = [20, 1, 70]
    lens = [c + n for c, n in zip(cached, q_lens)]
    case = make_case(lens, block_size=block_size, num_kv_heads=kv_heads, head_dim=head_dim,
                     dtype=dtype, share_prefix=0, gen=gen, device=triton_device)
    check_prefill(triton_backend, case, q_lens, kv_heads * group, dtype, gen)
    # The caller's host-side max_q_len sizes the grid the same way.
    check_prefill(triton_backend, case, q_lens, kv_heads * group, dtype,
                  torch.Generator().manual_seed(1), max_q_len=max(q_lens))


def test_prefill_triton_reads_the_longest_chunk_once_per_plan(triton_backend, triton_device):
    """With a plan dict, the grid's size (the longest chunk) is read from the device on the
    first call only; later calls (the other layers) reuse it."""
    from radixkv.kernels import paged_prefill_attention

    gen = torch.Generator().manual_seed(6)
    case = make_case([9, 30], block_size=8, num_kv_heads=1, head_dim=64, gen=gen,
                     device=triton_device)
    q = torch.randn(9 + 20, 2, 64, generator=gen).to(triton_device)
    cu = torch.tensor([0, 9, 29], dtype=torch.int32, device=triton_device)
    plan: dict = {}
    first = paged_prefill_attention(q, case.k_cache, case.v_cache, case.block_tables, cu,
                                    case.seq_lens, plan=plan)
    assert plan["triton_max_q"] == 20
    again = paged_prefill_attention(q, case.k_cache, case.v_cache, case.block_tables, cu,
                                    case.seq_lens, plan=plan)
    torch.testing.assert_close(first, again, atol=0, rtol=0)
    # The kept value (not the device's) sizes the grid: a (wrong) 16 leaves the second
    # chunk's rows 16..19 unwritten.
    plan["triton_max_q"] = 16
    out = torch.full_like(q, float("nan"))
    paged_prefill_attention(q, case.k_cache, case.v_cache, case.block_tables, cu,
                            case.seq_lens, plan=plan, out=out)
    assert torch.isnan(out[9 + 16:]).all() and not torch.isnan(out[:9 + 16]).any()


def test_prefill_triton_shared_prefix(triton_backend, triton_device):
    gen = torch.Generator().manual_seed(12)
    q_lens, cached = [3, 17], [32, 48]
    lens = [c + n for c, n in zip(cached, q_lens)]
    case = make_case(lens, block_size=16, num_kv_heads=1, head_dim=64, share_prefix=2, gen=gen,
                     device=triton_device)
    check_prefill(triton_backend, case, q_lens, 3, torch.float32, gen)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_long_context(triton_backend, triton_device, dtype):
    gen = torch.Generator().manual_seed(21)
    lens = [5000, 3001]
    case = make_case(lens, block_size=16, num_kv_heads=1, head_dim=64, dtype=dtype, gen=gen,
                     device=triton_device)
    q = torch.randn(len(lens), 3, 64, generator=gen).to(dtype).to(triton_device)
    check_decode(triton_backend, case, q, dtype, num_splits=None)
    check_decode(triton_backend, case, q, dtype, num_splits=1)
    check_prefill(triton_backend, case, [130, 1], 3, dtype, gen)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_triton(triton_backend, triton_device, dtype):
    gen = torch.Generator().manual_seed(2)
    pool = torch.randn(2, 2, 6, 8, 3, 64, generator=gen).to(dtype)
    before = pool.clone()
    qkv = torch.randn(4, 9 * 64, generator=gen).to(dtype)   # token-strided K/V slices
    key, value = qkv[:, 3 * 64:6 * 64].view(4, 3, 64), qkv[:, 6 * 64:].view(4, 3, 64)
    slots = torch.tensor([13, PAD_SLOT, 0, 47])
    dev = pool.to(triton_device)
    dkey, dvalue = (qkv.to(triton_device)[:, a:b].view(4, 3, 64)
                    for a, b in ((3 * 64, 6 * 64), (6 * 64, 9 * 64)))
    write_kv(dkey, dvalue, dev[1, 0], dev[1, 1], slots.to(triton_device))   # "auto" -> Triton
    expected = before.clone()
    for t, s in enumerate(slots.tolist()):
        if s != PAD_SLOT:
            expected[1, 0, s // 8, s % 8] = key[t]
            expected[1, 1, s // 8, s % 8] = value[t]
    assert torch.equal(dev.cpu(), expected)


@pytest.mark.parametrize("shape,dtype", [
    ((3, 2, 7, 16, 2, 128), torch.float16),   # 8 KiB blocks: moved as 16-byte words
    ((2, 2, 9, 8, 3, 33), torch.float32),     # 3,168-byte blocks: 8-byte words
    ((2, 2, 9, 3, 1, 5), torch.float16),      # 30-byte blocks: 2-byte words
])
def test_copy_blocks_triton(triton_backend, triton_device, shape, dtype):
    """One launch copies every layer's K and V of each pair, whatever word size the block's
    byte count allows; nothing else changes."""
    gen = torch.Generator().manual_seed(3)
    pool = torch.randn(*shape, generator=gen).to(dtype)
    before = pool.clone()
    src, dst = torch.tensor([1, 1, 6]), torch.tensor([0, 4, 2])
    dev = pool.to(triton_device)
    copy_blocks(dev, src.to(triton_device), dst.to(triton_device), backend=triton_backend)
    expected = before.clone()
    expected[:, :, dst] = before[:, :, src]
    assert torch.equal(dev.cpu(), expected)


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
    """Compiled kernels on longer sequences than the cases above (4,100 tokens: split-K with
    the device's own plan), every float dtype, head_dim 128, GQA 8."""
    if triton_interpreted_here():
        pytest.skip("triton imported in interpreter mode in this process")
    gen = torch.Generator().manual_seed(4)
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        case = make_case([1, 37, 4100, 300], block_size=16, num_kv_heads=2, head_dim=128,
                         dtype=dtype, gen=gen, device="cuda")
        q = torch.randn(4, 16, 128, generator=gen).to(dtype).cuda()
        check_decode("triton", case, q, dtype)
        check_prefill("triton", case, [1, 20, 700, 64], 16, dtype, gen)


def test_kernels_compile_for_sm90_without_a_gpu():
    """Every Triton kernel variant the launchers use compiles for sm_90 (Triton's LLVM and the
    ptxas its wheel ships; no GPU needed), in a process where triton is not interpreted: the
    compiled-only code (the ``for`` token loops, constexpr branches, layouts) is checked on a
    CPU-only machine too. The float decode and prefill token loops are software-pipelined
    (cp.async), which a bandwidth-bound decode needs; the quantized ones are not (their
    head_dim + 2-byte rows are not 4-byte aligned: docs/kernels.md)."""
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items()
           if k not in ("TRITON_INTERPRET", "RADIXKV_KERNEL_BACKEND")}
    proc = subprocess.run([sys.executable, "-W", "ignore",
                           str(Path(__file__).with_name("triton_aot.py")), "90"],
                          env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode and "ptxas" in proc.stderr and "not found" in proc.stderr.lower():
        pytest.skip("this triton build ships no ptxas")
    assert proc.returncode == 0, proc.stderr[-4000:]
    import json
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == 15
    for r in rows:
        if r["kernel"] in ("_decode_kernel", "_prefill_kernel"):
            assert r["loops"] == 1
            assert r["pipelined"] == (r["QUANT"] == "0"), r
        assert r["shared_bytes"] <= 100 * 1024, r    # fits any sm_80+ SM with room to spare
