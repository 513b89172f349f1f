"""Builders of paged KV caches for the kernel tests, and the dense SDPA oracle.

Every cache is filled with fresh random values; every slot that the contract says must not be read
(unused blocks, the tail of a ragged last block) holds NaN, and every block-table entry past a
sequence's length holds an out-of-range id, so a kernel that reads either fails loudly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from radixkv.kernels import paged_decode_attention, paged_prefill_attention

# Stated tolerances (absolute and relative) of a kernel against the float32 reference.
TOLERANCES = {
    torch.float32: dict(atol=2e-5, rtol=2e-5),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}
GARBAGE_BLOCK_ID = 1 << 30  # past any pool: reading it would fault or fail a range check


@dataclass
class PagedCase:
    k_cache: torch.Tensor        # [num_blocks, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor
    block_tables: torch.Tensor   # int32 [num_seqs, max_blocks]
    seq_lens: torch.Tensor       # int32 [num_seqs]

    @property
    def block_size(self) -> int:
        return self.k_cache.shape[1]

    def to(self, device: torch.device | str) -> PagedCase:
        return PagedCase(self.k_cache.to(device), self.v_cache.to(device),
                         self.block_tables.to(device), self.seq_lens.to(device))


def make_case(lens: list[int], *, block_size: int = 16, num_kv_heads: int = 2,
              head_dim: int = 64, dtype: torch.dtype = torch.float32, share_prefix: int = 0,
              spare_blocks: int = 3, gen: torch.Generator,
              device: torch.device | str = "cpu") -> PagedCase:
    """Sequences of the given lengths over shuffled, non-contiguous physical blocks (built on
    the CPU from ``gen``, then moved to ``device``: the same case on every device).

    share_prefix: the first ``share_prefix`` whole blocks of every sequence are the same physical
    blocks (a shared cached prefix); every length must cover them.
    """
    own = [-(-n // block_size) - share_prefix for n in lens]
    assert min(own) >= 0, (lens, share_prefix)
    num_blocks = share_prefix + sum(own) + spare_blocks
    perm = torch.randperm(num_blocks, generator=gen)
    shared, rest = perm[:share_prefix], perm[share_prefix:]
    max_blocks = max(share_prefix + o for o in own) + 2
    bt = torch.full((len(lens), max_blocks), GARBAGE_BLOCK_ID, dtype=torch.int32)
    pos = 0
    for s, o in enumerate(own):
        bt[s, :share_prefix] = shared.int()
        bt[s, share_prefix:share_prefix + o] = rest[pos:pos + o].int()
        pos += o
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k = torch.randn(shape, generator=gen).to(dtype)
    v = torch.randn(shape, generator=gen).to(dtype)
    used = torch.zeros(num_blocks, block_size, dtype=torch.bool)
    for s, n in enumerate(lens):
        for p in range(n):
            used[bt[s, p // block_size], p % block_size] = True
    k[~used] = float("nan")
    v[~used] = float("nan")
    return PagedCase(k, v, bt, torch.tensor(lens, dtype=torch.int32)).to(device)


def gathered_kv(case: PagedCase, s: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V of sequence s as dense [seq_len, kv_heads, head_dim] (plain indexing)."""
    n = int(case.seq_lens[s])
    nb = -(-n // case.block_size)
    ids = case.block_tables[s, :nb].long()
    k = case.k_cache[ids].reshape(-1, *case.k_cache.shape[2:])[:n]
    v = case.v_cache[ids].reshape(-1, *case.v_cache.shape[2:])[:n]
    return k, v


def dense_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cached_len: int,
               scale: float | None = None) -> torch.Tensor:
    """Oracle in float32: q [q_len, Hq, D] vs dense k, v [seq_len, Hkv, D], bottom-right causal."""
    q_len, seq_len = q.shape[0], k.shape[0]
    arange = torch.arange   # the mask on q's device: SDPA rejects a CPU mask for CUDA tensors
    allowed = arange(seq_len, device=q.device)[None, :] <= \
        arange(q_len, device=q.device)[:, None] + cached_len
    o = F.scaled_dot_product_attention(
        q.float().transpose(0, 1), k.float().transpose(0, 1), v.float().transpose(0, 1),
        attn_mask=allowed, scale=scale, enable_gqa=True)
    return o.transpose(0, 1)


def poisoned_like(t: torch.Tensor) -> torch.Tensor:
    return torch.full_like(t, float("nan"))


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype,
                 what: str) -> None:
    assert not torch.isnan(actual).any(), f"{what}: {int(torch.isnan(actual).sum())} NaN"
    torch.testing.assert_close(actual.float(), expected.float(), **TOLERANCES[dtype],
                               msg=lambda m: f"{what}: {m}")


def check_decode(backend: str, case, q: torch.Tensor, dtype: torch.dtype, **kw) -> None:
    """backend (on the case's device) vs the reference, and both vs dense SDPA per sequence;
    output poisoned first. The reference and SDPA run on CPU copies (the reference's
    per-token loops would sync a GPU thousands of times)."""
    out = poisoned_like(q)
    got = paged_decode_attention(q, case.k_cache, case.v_cache, case.block_tables,
                                 case.seq_lens, out=out, backend=backend, **kw)
    assert got is out
    got, case, q = got.cpu(), case.to("cpu"), q.cpu()
    ref = paged_decode_attention(q, case.k_cache, case.v_cache, case.block_tables,
                                 case.seq_lens, backend="reference")
    assert_close(got, ref, dtype, f"{backend} vs reference")
    for s in range(q.shape[0]):
        k, v = gathered_kv(case, s)
        dense = dense_sdpa(q[s:s + 1], k, v, cached_len=k.shape[0] - 1)
        assert_close(ref[s:s + 1], dense, dtype, f"reference vs dense SDPA, seq {s}")
        assert_close(got[s:s + 1], dense, dtype, f"{backend} vs dense SDPA, seq {s}")


def check_prefill(backend: str, case, q_lens: list[int], num_q_heads: int,
                  dtype: torch.dtype, gen: torch.Generator, **kw) -> None:
    """Fresh random queries for the given chunk lengths (on the case's device); checked as in
    check_decode."""
    head_dim = case.k_cache.shape[3]
    device = case.k_cache.device
    q = torch.randn(sum(q_lens), num_q_heads, head_dim, generator=gen).to(dtype)
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    out = poisoned_like(q).to(device)
    got = paged_prefill_attention(q.to(device), case.k_cache, case.v_cache, case.block_tables,
                                  cu.to(device), case.seq_lens, out=out, backend=backend, **kw)
    assert got is out
    got, case = got.cpu(), case.to("cpu")
    ref = paged_prefill_attention(q, case.k_cache, case.v_cache, case.block_tables, cu,
                                  case.seq_lens, backend="reference")
    assert_close(got, ref, dtype, f"{backend} vs reference")
    for s, q_len in enumerate(q_lens):
        k, v = gathered_kv(case, s)
        rows = slice(int(cu[s]), int(cu[s + 1]))
        dense = dense_sdpa(q[rows], k, v, cached_len=k.shape[0] - q_len)
        assert_close(ref[rows], dense, dtype, f"reference vs dense SDPA, seq {s}")
        assert_close(got[rows], dense, dtype, f"{backend} vs dense SDPA, seq {s}")
