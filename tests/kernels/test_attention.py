"""Paged decode and prefill attention: each backend vs the reference vs dense SDPA.

The Triton cases run under the Triton interpreter on the CPU, so they are few and small; the
torch path (the engine's CPU hot path) gets the wide grid. Outputs are poisoned with NaN before
each call, caches hold NaN wherever the contract says "never read".
"""

from __future__ import annotations

import pytest
import torch

from kernel_cases import (GARBAGE_BLOCK_ID, assert_close, check_decode, check_prefill,
                          dense_sdpa, gathered_kv, make_case)
from radixkv.errors import InvalidRequestError
from radixkv.kernels import paged_decode_attention, paged_prefill_attention

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
GQA = [(2, 1), (3, 3), (1, 8)]  # (num_kv_heads, q heads per kv head)


# ---------------------------------------------------------------- torch path: the wide grid


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gqa", GQA)
@pytest.mark.parametrize("head_dim,block_size", [(64, 16), (128, 8), (64, 64)])
def test_decode_torch(dtype, gqa, head_dim, block_size):
    gen = torch.Generator().manual_seed(hash((str(dtype), gqa, head_dim, block_size)) % 2**31)
    kv_heads, group = gqa
    # length 1, ragged, exactly one block, several blocks + ragged, long-ish
    lens = [1, 5, block_size, 3 * block_size + 7, 300]
    case = make_case(lens, block_size=block_size, num_kv_heads=kv_heads, head_dim=head_dim,
                     dtype=dtype, gen=gen)
    q = torch.randn(len(lens), kv_heads * group, head_dim, generator=gen).to(dtype)
    check_decode("torch", case, q, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_torch_shared_prefix_and_grouping(dtype):
    """Two tables naming the same physical blocks; lengths far apart (several SDPA groups)."""
    gen = torch.Generator().manual_seed(7)
    lens = [2 * 16 + 1, 2 * 16 + 9, 40 * 16 + 3, 2 * 16, 300 * 16 + 5]
    case = make_case(lens, block_size=16, num_kv_heads=3, head_dim=64, dtype=dtype,
                     share_prefix=2, gen=gen)
    assert torch.equal(case.block_tables[0, :2], case.block_tables[1, :2])
    q = torch.randn(len(lens), 9, 64, generator=gen).to(dtype)
    check_decode("torch", case, q, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gqa", GQA)
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_prefill_torch(dtype, gqa, block_size):
    gen = torch.Generator().manual_seed(hash((str(dtype), gqa, block_size)) % 2**31)
    kv_heads, group = gqa
    # cached prefix: 0, partial block, whole blocks, whole + partial; q_len 1 included
    cached = [0, 3, 2 * block_size, block_size + 5, 0]
    q_lens = [9, 1, block_size + 3, 2, 1]
    lens = [c + n for c, n in zip(cached, q_lens)]
    case = make_case(lens, block_size=block_size, num_kv_heads=kv_heads, head_dim=64,
                     dtype=dtype, gen=gen)
    check_prefill("torch", case, q_lens, kv_heads * group, dtype, gen)


def test_prefill_torch_shared_prefix_head_dim_128():
    gen = torch.Generator().manual_seed(11)
    q_lens, cached = [5, 40, 1], [32, 32, 200]
    lens = [c + n for c, n in zip(cached, q_lens)]
    case = make_case(lens, block_size=16, num_kv_heads=1, head_dim=128, share_prefix=2,
                     gen=gen)
    check_prefill("torch", case, q_lens, 8, torch.float32, gen)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES)
def test_torch_long_context(dtype):
    gen = torch.Generator().manual_seed(3)
    lens = [6000, 4097, 1]
    case = make_case(lens, block_size=16, num_kv_heads=3, head_dim=64, dtype=dtype, gen=gen)
    q = torch.randn(len(lens), 9, 64, generator=gen).to(dtype)
    check_decode("torch", case, q, dtype)
    check_prefill("torch", case, [700, 97, 1], 9, dtype, gen)


# ---------------------------------------------------------------- default backend, scale


def test_auto_on_cpu_uses_torch_path_and_custom_scale(monkeypatch):
    monkeypatch.delenv("RADIXKV_KERNEL_BACKEND", raising=False)
    gen = torch.Generator().manual_seed(5)
    case = make_case([20, 3], num_kv_heads=3, gen=gen)
    q = torch.randn(2, 9, 64, generator=gen)
    got = paged_decode_attention(q, case.k_cache, case.v_cache, case.block_tables,
                                 case.seq_lens, scale=0.3)
    for s in range(2):
        k, v = gathered_kv(case, s)
        assert_close(got[s:s + 1], dense_sdpa(q[s:s + 1], k, v, k.shape[0] - 1, scale=0.3),
                     torch.float32, f"seq {s}")


# ---------------------------------------------------------------- bad input


def _decode_args(gen):
    case = make_case([20, 3], num_kv_heads=2, gen=gen)
    q = torch.randn(2, 4, 64, generator=gen)
    return q, case


@pytest.mark.parametrize("mutate,match", [
    (lambda a: a.update(q=a["q"].double()), "dtype"),
    (lambda a: a.update(q=a["q"][:, :3].contiguous()), "multiple of num_kv_heads"),
    (lambda a: a.update(q=a["q"][:, :, :32].contiguous()), "head_dim"),
    (lambda a: a.update(q=a["q"].transpose(0, 1).contiguous().transpose(0, 1)), "contiguous"),
    (lambda a: a.update(block_tables=a["block_tables"].long()), "block_tables must have dtype"),
    (lambda a: a.update(seq_lens=a["seq_lens"][:1]), "one row per sequence"),
    (lambda a: a.update(seq_lens=torch.tensor([0, 3], dtype=torch.int32)), "seq_lens must lie"),
    (lambda a: a.update(seq_lens=torch.tensor([10**5, 3], dtype=torch.int32)),
     "seq_lens must lie"),
    (lambda a: a.update(v_cache=a["v_cache"][:, :8].contiguous()), "must match"),
    (lambda a: a.update(out=torch.empty(2, 4, 32)), "out must be"),
    (lambda a: a.update(scale=-1.0), "scale"),
])
def test_decode_bad_input(mutate, match):
    q, case = _decode_args(torch.Generator().manual_seed(1))
    args = dict(q=q, k_cache=case.k_cache, v_cache=case.v_cache,
                block_tables=case.block_tables, seq_lens=case.seq_lens)
    mutate(args)
    with pytest.raises(InvalidRequestError, match=match):
        paged_decode_attention(**args)


def test_decode_rejects_used_block_id_out_of_range():
    q, case = _decode_args(torch.Generator().manual_seed(2))
    case.block_tables[1, 0] = GARBAGE_BLOCK_ID
    with pytest.raises(InvalidRequestError, match="block_tables"):
        paged_decode_attention(q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens)


def test_prefill_bad_input():
    gen = torch.Generator().manual_seed(4)
    case = make_case([10, 6], num_kv_heads=2, gen=gen)
    q = torch.randn(8, 4, 64, generator=gen)
    args = (q, case.k_cache, case.v_cache, case.block_tables)
    good_cu = torch.tensor([0, 4, 8], dtype=torch.int32)
    with pytest.raises(InvalidRequestError, match="cu_seqlens_q"):
        paged_prefill_attention(*args, torch.tensor([0, 4, 7], dtype=torch.int32),
                                case.seq_lens)
    with pytest.raises(InvalidRequestError, match="num_seqs \\+ 1"):
        paged_prefill_attention(*args, good_cu[:2], case.seq_lens)
    with pytest.raises(InvalidRequestError, match="seq_len >= q_len"):
        paged_prefill_attention(*args, good_cu, torch.tensor([10, 3], dtype=torch.int32))
    with pytest.raises(Exception, match="backend"):
        paged_prefill_attention(*args, good_cu, case.seq_lens, backend="cuda-magic")
