"""Attention over quantized caches (rows of head_dim int8 or float8_e4m3fn values + the row's
fp16 scale, as radixkv/engine/kv_quant.py writes them): the Triton kernels read them in place
(compiled on CUDA where a GPU is present, under the interpreter otherwise) and must equal the
float32 reference run on the dequantized caches.

Rows the contract says are never read (unused blocks, the tail of a ragged last block) get a
NaN scale, so a kernel that reads one produces NaN and fails. The kernels' e4m3 decoding (integer
operations, no fp8 cast) is checked against torch's on all 256 codes.
"""

from __future__ import annotations

import copy

import pytest
import torch

from kernel_cases import PagedCase, assert_close, make_case, poisoned_like
from radixkv.errors import InvalidRequestError
from radixkv.kernels import paged_decode_attention, paged_prefill_attention
from radixkv.kernels.ops import dequantize_int8_rows


#: The quantized cache dtypes and the largest magnitude of their grids.
FORMATS = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}


def _quantize(x: torch.Tensor, storage: torch.dtype = torch.int8) -> torch.Tensor:
    """float [..., d] -> int8 / float8_e4m3fn [..., d + 2]; NaN rows (never to be read) get
    a NaN scale."""
    qmax = FORMATS[storage]
    bad = torch.isnan(x).any(-1, keepdim=True)
    x = torch.where(bad, torch.zeros_like(x), x).float()
    scale = (x.abs().amax(-1, keepdim=True) / qmax).to(torch.float16)
    scale = torch.where(bad, torch.full_like(scale, float("nan")), scale)
    s = torch.where(bad | (scale == 0), torch.ones_like(scale), scale).float()
    y = x / s
    if storage == torch.int8:
        y = torch.round(y)
    q = y.clamp(-qmax, qmax).to(storage)
    return torch.cat([q.view(torch.int8), scale.view(torch.int8)], dim=-1).view(storage)


def _int8(case: PagedCase, storage: torch.dtype = torch.int8) -> tuple[PagedCase, PagedCase]:
    """(the quantized case, the same case dequantized to float32: the reference's input)."""
    k, v = _quantize(case.k_cache, storage), _quantize(case.v_cache, storage)
    q8 = PagedCase(k, v, case.block_tables, case.seq_lens)
    return q8, PagedCase(dequantize_int8_rows(k, torch.float32),
                         dequantize_int8_rows(v, torch.float32), case.block_tables,
                         case.seq_lens)


def _decode_kernel():
    """A one-program kernel that decodes N e4m3 bytes with the attention kernels' helper.
    (Built on first use: the interpreter resolves a kernel's names in its module's globals.)"""
    global _E4M3_TO_F32, _decode
    if "_decode" not in globals():
        import triton
        import triton.language as tl

        from radixkv.kernels.triton_attention import _e4m3_to_f32 as _E4M3_TO_F32

        @triton.jit
        def _decode(src, dst, N: tl.constexpr):
            i = tl.arange(0, N)
            tl.store(dst + i, _E4M3_TO_F32(tl.load(src + i)))
    return _decode


STORAGE = pytest.mark.parametrize("storage", list(FORMATS), ids=["int8", "fp8_e4m3"])


DECODE = [
    # (query dtype, num_kv_heads, group, head_dim, block_size, num_splits)
    (torch.float32, 2, 1, 64, 16, 1),
    (torch.float32, 1, 3, 64, 8, 3),
    (torch.bfloat16, 1, 8, 128, 32, None),
]


@STORAGE
@pytest.mark.parametrize("dtype,kv_heads,group,head_dim,block_size,num_splits", DECODE)
def test_decode_triton_reads_quantized_blocks_in_place(triton_backend, triton_device, storage,
                                                       dtype, kv_heads, group, head_dim,
                                                       block_size, num_splits):
    gen = torch.Generator().manual_seed(block_size * 13 + group)
    lens = [1, block_size + 3, 150]
    q8, dq = _int8(make_case(lens, block_size=block_size, num_kv_heads=kv_heads,
                             head_dim=head_dim, share_prefix=0, gen=gen), storage)
    q = torch.randn(len(lens), kv_heads * group, head_dim, generator=gen).to(dtype)
    d8 = q8.to(triton_device)
    out = poisoned_like(q).to(triton_device)
    got = paged_decode_attention(q.to(triton_device), d8.k_cache, d8.v_cache, d8.block_tables,
                                 d8.seq_lens, out=out, backend="triton", num_splits=num_splits)
    assert got is out and got.dtype == dtype
    got = got.cpu()
    ref = paged_decode_attention(q.float(), dq.k_cache, dq.v_cache, dq.block_tables,
                                 dq.seq_lens, backend="reference")
    assert_close(got, ref, dtype, f"triton {storage} vs reference on the dequantized cache")
    torch_q = paged_decode_attention(q, q8.k_cache, q8.v_cache, q8.block_tables, q8.seq_lens,
                                     backend="torch")
    assert_close(torch_q, ref, dtype, f"torch backend on the {storage} cache")


@STORAGE
@pytest.mark.parametrize("dtype,kv_heads,group,head_dim,block_size", [
    (torch.float32, 2, 1, 64, 16),
    (torch.bfloat16, 1, 3, 64, 8),
])
def test_prefill_triton_reads_quantized_blocks_in_place(triton_backend, triton_device, storage,
                                                        dtype, kv_heads, group, head_dim,
                                                        block_size):
    gen = torch.Generator().manual_seed(block_size * 5 + group)
    cached, q_lens = [0, 5, 2 * block_size], [20, 1, 70]
    lens = [c + n for c, n in zip(cached, q_lens)]
    q8, dq = _int8(make_case(lens, block_size=block_size, num_kv_heads=kv_heads,
                             head_dim=head_dim, share_prefix=0, gen=gen), storage)
    q = torch.randn(sum(q_lens), kv_heads * group, head_dim, generator=gen).to(dtype)
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    d8, dev = q8.to(triton_device), triton_device
    out = poisoned_like(q).to(dev)
    got = paged_prefill_attention(q.to(dev), d8.k_cache, d8.v_cache, d8.block_tables,
                                  cu.to(dev), d8.seq_lens, out=out, backend="triton")
    assert got is out
    got = got.cpu()
    ref = paged_prefill_attention(q.float(), dq.k_cache, dq.v_cache, dq.block_tables, cu,
                                  dq.seq_lens, backend="reference")
    assert_close(got, ref, dtype,
                 f"triton {storage} prefill vs reference on the dequantized cache")


def test_e4m3_decoding_in_the_kernel_is_exact_for_every_code(triton_backend, triton_device):
    """The kernels' integer decoding of e4m3 bytes equals torch's cast on all 256 codes
    (normals, subnormals, both zeros, NaN)."""
    decode = _decode_kernel()
    codes = torch.arange(256, dtype=torch.uint8)
    got = torch.empty(256, device=triton_device)
    decode[(1,)](codes.to(triton_device), got, N=256)
    got = got.cpu()
    want = codes.view(torch.float8_e4m3fn).float()
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    ok = ~torch.isnan(want)
    assert torch.equal(got[ok], want[ok]) and torch.equal(got[ok].signbit(), want[ok].signbit())


@STORAGE
def test_quantized_caches_are_checked(storage):
    gen = torch.Generator().manual_seed(1)
    q8, _ = _int8(make_case([5], block_size=8, num_kv_heads=1, head_dim=64, gen=gen), storage)
    q = torch.randn(1, 1, 64, generator=gen)
    with pytest.raises(InvalidRequestError, match="head_dim"):      # rows must be d + 2
        paged_decode_attention(q, q8.k_cache[..., :-1].contiguous(),
                               q8.v_cache[..., :-1].contiguous(), q8.block_tables,
                               q8.seq_lens, backend="reference")
    with pytest.raises(InvalidRequestError, match="must match"):
        paged_decode_attention(q, q8.k_cache, q8.v_cache.float(), q8.block_tables,
                               q8.seq_lens, backend="reference")


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8_e4m3"])
def test_engine_attention_reads_quantized_blocks_in_place_on_triton(triton_backend, triton_device,
                                                                    monkeypatch, kv_dtype):
    """The model runner with int8 / fp8 KV: logits of a prefill and a decode step on the Triton
    path (in-place reads, rotated query and output) equal those of the torch path (dequantized
    scratch), and the in-place path really ran (no scratch tables were built)."""
    import transformers

    from radixkv.engine import attention
    from radixkv.engine.batch import SequenceChunk
    from radixkv.engine.model_runner import ModelRunner

    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256,
                                   num_hidden_layers=2, num_attention_heads=2,
                                   num_key_value_heads=1, max_position_embeddings=256)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    on_device = copy.deepcopy(model).to(triton_device)
    bs, prompts = 8, [list(range(3, 22)), list(range(40, 45))]

    def run(model) -> list[torch.Tensor]:
        runner = ModelRunner.for_model(model, 16, bs, kv_dtype)
        tables = [[0, 1, 2, 3], [4, 5]]
        pre = [SequenceChunk(p, 0, t, [t[i // bs] * bs + i % bs for i in range(len(p))])
               for p, t in zip(prompts, tables)]
        dec = [SequenceChunk([7], len(p), t, [t[len(p) // bs] * bs + len(p) % bs])
               for p, t in zip(prompts, tables)]
        return [runner.execute(runner.build_batch(pre)), runner.execute(runner.build_batch(dec))]

    scratch_calls = []
    real = attention.PagedAttentionContext.scratch_tables
    monkeypatch.setattr(attention.PagedAttentionContext, "scratch_tables",
                        lambda self: scratch_calls.append(1) or real(self))
    got = run(on_device)              # RADIXKV_KERNEL_BACKEND=triton (fixture), any device
    assert not scratch_calls
    monkeypatch.setenv("RADIXKV_KERNEL_BACKEND", "torch")
    monkeypatch.setenv("RADIXKV_NATIVE_KERNELS", "0")   # the CPU's in-place kernels off too
    want = run(model)                 # the torch path, on the CPU (where it is made to run)
    assert scratch_calls
    for g, w in zip(got, want):
        torch.testing.assert_close(g.cpu(), w, atol=1e-4, rtol=1e-4)


@STORAGE
def test_triton_copy_blocks_moves_quantized_bytes(triton_backend, triton_device, storage):
    """Copy-on-write of a quantized pool on Triton copies its bytes (as 8-byte words: a
    block is 8 x 3 x 66 = 1,584 bytes), from device ids and from host ids alike."""
    from radixkv.kernels import copy_blocks

    gen = torch.Generator().manual_seed(9)
    pool = torch.randint(-128, 128, (2, 2, 6, 8, 3, 66), dtype=torch.int8,
                         generator=gen).view(storage)
    before = pool.view(torch.int8).clone()
    pool = pool.to(triton_device)
    copy_blocks(pool, torch.tensor([1, 1, 5], device=triton_device),
                torch.tensor([0, 4, 2], device=triton_device), backend=triton_backend)
    copy_blocks(pool, torch.tensor([3]), torch.tensor([1]), backend=triton_backend)
    want = before.clone()
    want[:, :, [0, 4, 2]] = before[:, :, [1, 1, 5]]
    want[:, :, 1] = before[:, :, 3]
    assert torch.equal(pool.view(torch.int8).cpu(), want)


# -- CPU paths (torch / native): the quantized rows read in place equal the dequantized scratch

def _scratch(cache: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """What the dequantizing scratch holds for ``cache``: values times scale, in ``dtype``
    (NaN where the scale is NaN: rows never to be read)."""
    from radixkv.engine.kv_quant import dequantize_rows

    return dequantize_rows(cache, dtype, rotated=True)


@STORAGE
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window,softcap", [(None, 5.0), (8, None), (20, 5.0)])
def test_windowed_reads_quantized_blocks_in_place(storage, dtype, window, softcap):
    """``paged_attention_windowed`` over int8 / fp8 caches (only the window's blocks gathered
    and widened) gives exactly what it gives over the dequantized caches, for prefill chunks
    over a cached prefix and for decode rows; rows outside every window carry a NaN scale in
    the quantized cache *and* are poisoned, so reading one would show."""
    from radixkv.kernels import paged_attention_windowed

    gen = torch.Generator().manual_seed(11)
    lens, q_lens = [5, 40, 77, 33], [5, 7, 1, 16]
    case = make_case(lens, block_size=8, num_kv_heads=2, head_dim=32, gen=gen)
    k8, v8 = _quantize(case.k_cache, storage), _quantize(case.v_cache, storage)
    if window is not None:   # keys no query of its sequence can see: never to be read
        for s, (n, ql) in enumerate(zip(lens, q_lens)):
            first = max(0, n - ql - window + 1)
            for p in range(first - first % 8):
                blk, off = int(case.block_tables[s, p // 8]), p % 8
                for c in (k8, v8):
                    c.view(torch.int8)[blk, off, :, -2:] = -1   # fp16 0xffff: NaN scale
    cu = [0]
    for ql in q_lens:
        cu.append(cu[-1] + ql)
    q = torch.randn(cu[-1], 6, 32, generator=gen).to(dtype)
    got = paged_attention_windowed(q, k8, v8, case.block_tables, cu, lens, 0.3,
                                   torch.empty_like(q), window=window, softcap=softcap)
    want = paged_attention_windowed(q, _scratch(k8, dtype), _scratch(v8, dtype),
                                    case.block_tables, cu, lens, 0.3, torch.empty_like(q),
                                    window=window, softcap=softcap)
    assert not torch.isnan(got).any()
    assert torch.equal(got, want)


@STORAGE
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim,kv_heads,group", [(64, 2, 3), (32, 1, 4), (128, 2, 1)])
def test_native_prefill_reads_quantized_blocks_in_place(storage, dtype, head_dim, kv_heads,
                                                        group):
    """The native prefill / extend kernel over int8 / fp8 caches (K/V tiles packed straight
    from the quantized rows) equals the same kernel over the dequantized scratch bit for bit:
    chunks over a cached prefix, a whole prompt, a decode row in the same batch; rows past each
    sequence carry a NaN scale (poisoned), so reading one would show. Skips where the native
    prefill cannot run (no compiler, or a CPU without AVX512F or AVX2 + FMA / AVX512-BF16)."""
    from radixkv.kernels import native

    gen = torch.Generator().manual_seed(17)
    lens, q_lens = [40, 77, 9, 130], [7, 77, 1, 33]
    case = make_case(lens, block_size=16, num_kv_heads=kv_heads, head_dim=head_dim, gen=gen)
    k8, v8 = _quantize(case.k_cache, storage), _quantize(case.v_cache, storage)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(int(cu[-1]), kv_heads * group, head_dim, generator=gen).to(dtype)
    got = poisoned_like(q)
    if not native.paged_prefill_quantized(q, k8, v8, case.block_tables, cu, case.seq_lens,
                                          max(lens), 0.125, got):
        pytest.skip(f"native prefill not run here ({native._state.get('error')!r}, "
                    f"{dtype} needs "
                    f"{'AVX512-BF16' if dtype == torch.bfloat16 else 'AVX512F or AVX2 + FMA'})")
    want = poisoned_like(q)
    assert native.paged_prefill(q, _scratch(k8, dtype), _scratch(v8, dtype), case.block_tables,
                                cu, case.seq_lens, max(lens), 0.125, want)
    assert not torch.isnan(got).any()
    assert torch.equal(got, want)
    two = poisoned_like(q)                   # split in parts: the same rows, the same bits
    assert native.paged_prefill_quantized(q, k8, v8, case.block_tables, cu, case.seq_lens,
                                          max(lens), 0.125, two, parts=3)
    assert torch.equal(two, got)


def test_native_prefill_refuses_what_it_cannot_read():
    """A float cache, a head_dim without an instantiation, or a float64 query: not run (the
    caller falls back to the scratch), nothing written."""
    from radixkv.kernels import native

    gen = torch.Generator().manual_seed(3)
    case = make_case([20], block_size=16, num_kv_heads=1, head_dim=64, gen=gen)
    k8, v8 = _quantize(case.k_cache), _quantize(case.v_cache)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    q = torch.randn(4, 2, 64, generator=gen)
    out = poisoned_like(q)
    assert not native.paged_prefill_quantized(q, case.k_cache, case.v_cache, case.block_tables,
                                              cu, case.seq_lens, 20, 0.1, out)
    assert not native.paged_prefill_quantized(q.double(), k8, v8, case.block_tables, cu,
                                              case.seq_lens, 20, 0.1, out.double())
    k48 = _quantize(torch.randn(case.k_cache.shape[:3] + (48,), generator=gen))
    assert not native.paged_prefill_quantized(q[..., :48].contiguous(), k48, k48,
                                              case.block_tables, cu, case.seq_lens, 20, 0.1,
                                              out[..., :48].contiguous())
    assert torch.isnan(out).all()
