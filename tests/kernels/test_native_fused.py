"""The native norm and rope kernels (kernels/cpu_fused.c via kernels/native_fused.py).

Their contract is bit-identity with the torch references of kernels/fused.py (which compute
what transformers' modules compute), so every property compares bit patterns, not values:
random shapes, dtypes and magnitudes (subnormal squares to 1e12), residual or not, PAD slots;
plus what they decline (other dtypes, strided rows, a norm torch might split across threads),
bad slots refused before anything is written, the environment switch, the variant search's
power to tell ATen's summation orders apart, and the float environment left alone.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from radixkv.kernels import fused, native, native_fused
from radixkv.kernels.reference import PAD_SLOT

pytestmark = pytest.mark.skipif(
    not native.available() or native_fused._library() is None,
    reason=f"native kernels unavailable: {native._state.get('error')}")

DTYPES = [torch.float32, torch.bfloat16]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16 if t.dtype is torch.bfloat16 else torch.int32)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(bits(a), bits(b))


def rows(n: int, h: int, dtype: torch.dtype, gen: torch.Generator, log_scale: float
         ) -> torch.Tensor:
    spread = torch.exp(torch.empty(n, h).uniform_(-2.0, 2.0, generator=gen))
    return (torch.randn(n, h, generator=gen) * spread * 10.0 ** log_scale).to(dtype)


@given(h=st.sampled_from([1, 3, 7, 8, 15, 16, 17, 63, 64, 96, 576, 896, 1000, 2048, 4096]),
       n=st.integers(1, 6), dtype=st.sampled_from(DTYPES),
       log_scale=st.floats(-18.0, 6.0), eps=st.sampled_from([1e-5, 1e-6, 1e-12]),
       seed=st.integers(0, 2**31))
def test_norms_are_bit_identical_to_the_references(h, n, dtype, log_scale, eps, seed):
    gen = torch.Generator().manual_seed(seed)
    x, r = rows(n, h, dtype, gen, log_scale), rows(n, h, dtype, gen, log_scale)
    w = torch.randn(h, generator=gen).to(dtype)
    assert native_fused.norm_variant(x, w, r) is not None   # this machine's torch matched
    out, s = native_fused.add_rms_norm(x, r, w, eps)
    ref_out, ref_s = fused.add_rms_norm_ref(x, r, w, eps)
    assert same(s, ref_s) and same(out, ref_out)
    assert same(native_fused.rms_norm(x, w, eps), fused.rms_norm_ref(x, w, eps))
    # the op-level wrappers the lean forward calls give the same bits
    assert all(same(a, b) for a, b in zip(fused.add_rms_norm_cpu(x, r, w, eps), (out, s)))


def test_the_variant_search_tells_summation_orders_apart():
    """float32 rows of 576 elements: only one of ATen's candidate orders reproduces torch, so a
    kernel summing in another order is never taken for an exact one."""
    found = native_fused._matching(576, torch.float32, native_fused._NORM_VARIANTS)
    assert found is not None
    others = [v for v in native_fused._NORM_VARIANTS if v[0] != found[0] and v[0] < 576]
    assert others and all(native_fused._matching(576, torch.float32, (v,)) is None
                          for v in others)


def test_norm_declines_what_torch_might_compute_otherwise(monkeypatch):
    w = torch.ones(64)
    assert native_fused.rms_norm(torch.ones(4, 64, dtype=torch.float16),
                                 w.half(), 1e-5) is None                         # dtype
    assert native_fused.rms_norm(torch.ones(64, 4).t(), w, 1e-5) is None         # strided rows
    assert native_fused.add_rms_norm(torch.ones(4, 64), torch.ones(4, 64).bfloat16(), w,
                                     1e-5) is None                               # mixed dtypes
    big = torch.ones(600, 64)                                     # >= 32768 elements
    monkeypatch.setattr(native_fused, "_parallel_same", {})
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    # ATen reduces such a norm in parallel: the kernel runs only where a probe at this thread
    # count found torch's bits; here the probe is made to disagree
    monkeypatch.setattr(native_fused, "_parallel_matches", lambda h, dtype, variant: False)
    assert native_fused.rms_norm(big, w, 1e-5) is None
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert same(native_fused.rms_norm(big, w, 1e-5), fused.rms_norm_ref(big, w, 1e-5))
    monkeypatch.setenv(native.ENV_VAR, "0")
    assert native_fused.rms_norm(torch.ones(4, 64), w, 1e-5) is None
    # the wrapper then runs the reference
    assert same(fused.rms_norm_cpu(torch.ones(4, 64), w, 1e-5),
                fused.rms_norm_ref(torch.ones(4, 64), w, 1e-5))


def _qkv(t: int, hq: int, hkv: int, d: int, dtype: torch.dtype, gen: torch.Generator):
    qkv = (torch.randn(t, hq + 2 * hkv, d, generator=gen) * 4).to(dtype)
    return qkv[:, :hq], qkv[:, hq:hq + hkv], qkv[:, hq + hkv:]


@given(t=st.integers(1, 40), hkv=st.integers(1, 4), group=st.integers(1, 4),
       d=st.sampled_from([2, 16, 32, 64, 80, 128]), dtype=st.sampled_from(DTYPES),
       pad=st.booleans(), seed=st.integers(0, 2**31))
def test_rope_write_kv_is_bit_identical_to_the_reference(t, hkv, group, d, dtype, pad, seed):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = _qkv(t, group * hkv, hkv, d, dtype, gen)
    cos = torch.randn(t, d, generator=gen).to(dtype)
    sin = torch.randn(t, d, generator=gen).to(dtype)
    blocks, bs = 8, 8
    slots = torch.randperm(blocks * bs, generator=gen)[:t]
    if pad:
        slots[torch.rand(t, generator=gen) < 0.3] = PAD_SLOT
    caches = [torch.randn(blocks, bs, hkv, d, generator=gen).to(dtype) for _ in range(2)]
    ref_caches = [c.clone() for c in caches]
    assert native_fused.rope_supported(q, k, v, cos, sin, *caches, slots)
    got = native_fused.rope_write_kv(q, k, v, cos, sin, *caches, slots)
    want = fused.rope_write_kv_ref(q, k, v, cos, sin, *ref_caches, slots, pad)
    assert same(got, want)
    assert same(caches[0], ref_caches[0]) and same(caches[1], ref_caches[1])


def test_rope_refuses_a_slot_past_the_cache_before_writing():
    gen = torch.Generator().manual_seed(0)
    q, k, v = _qkv(3, 2, 1, 16, torch.bfloat16, gen)
    cos, sin = torch.ones(3, 16, dtype=torch.bfloat16), torch.zeros(3, 16, dtype=torch.bfloat16)
    caches = [torch.zeros(2, 4, 1, 16, dtype=torch.bfloat16) for _ in range(2)]
    with pytest.raises(IndexError):
        native_fused.rope_write_kv(q, k, v, cos, sin, *caches, torch.tensor([1, 8, 2]))
    assert not caches[0].any() and not caches[1].any()


def test_rope_declines_other_layouts():
    gen = torch.Generator().manual_seed(1)
    q, k, v = _qkv(3, 2, 1, 16, torch.float32, gen)
    cos, sin = torch.ones(3, 16), torch.zeros(3, 16)
    caches = [torch.zeros(2, 4, 1, 16) for _ in range(2)]
    slots = torch.tensor([0, 1, 2])
    assert native_fused.rope_write_kv(q, k, v, cos, sin, *caches, slots.int()) is None
    assert native_fused.rope_write_kv(q.transpose(0, 1).contiguous().transpose(0, 1), k, v,
                                      cos, sin, *caches, slots) is None
    assert native_fused.rope_write_kv(q, k, v, cos.bfloat16(), sin, *caches, slots) is None
    assert native_fused.rope_write_kv(q, k, v, cos, sin, caches[0][:, :2], caches[1],
                                      slots) is None


def test_loading_the_fused_kernels_keeps_subnormals():
    """Built without fast-math, so no crtfastmath constructor flips flush-to-zero (checked in a
    fresh interpreter)."""
    code = ("import torch; x = torch.tensor([1e-38]); before = (x * 0.01).item(); "
            "from radixkv.kernels import native_fused; assert native_fused._library(); "
            "print(before, (x * 0.01).item())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=300).stdout.split()
    before, after = map(float, out)
    assert before > 0 and after == before


def test_prepare_runs_the_checks_up_front(monkeypatch):
    """prepare() (what a CPU model runner calls when it is created) builds the library and
    remembers each check's outcome, so the first forward runs none of them."""
    monkeypatch.setattr(native_fused, "_norm_variant", {})
    monkeypatch.setattr(native_fused, "_rope_ok", {})
    monkeypatch.setattr(native_fused, "_silu_ok", {})
    assert native_fused.prepare((576, 64), 64, torch.bfloat16, (1536,))
    assert set(native_fused._silu_ok) == {1536}     # the exhaustive check ran (either outcome)
    assert set(native_fused._norm_variant) == {(576, torch.bfloat16), (64, torch.bfloat16)}
    assert native_fused._norm_variant[(576, torch.bfloat16)] is not None
    assert native_fused._rope_ok == {(64, torch.bfloat16): True}
    calls = []
    monkeypatch.setattr(native_fused, "_find_norm_variant",
                        lambda *a: calls.append(a))   # a check now would be recorded
    x = torch.randn(2, 576).bfloat16()
    assert native_fused.rms_norm(x, torch.ones(576).bfloat16(), 1e-5) is not None
    assert calls == []
    assert not native_fused.prepare((576,), 64, torch.float16)   # no kernel for fp16


@pytest.mark.parametrize("threads", [2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norms_over_many_rows_at_several_threads_equal_torch_bit_for_bit(monkeypatch, threads,
                                                                          dtype):
    """Where ATen reduces in parallel (>= 32768 elements, > 1 thread), the kernel is used only
    after a probe at that thread count matched; then any row count gives torch's bits."""
    before = torch.get_num_threads()
    monkeypatch.setattr(native_fused, "_parallel_same", {})
    try:
        torch.set_num_threads(threads)
        gen = torch.Generator().manual_seed(threads)
        w = torch.randn(576, generator=gen).to(dtype)
        for rows in (57, 243, 1001):
            x = (torch.randn(rows, 576, generator=gen) * 3).to(dtype)
            r = torch.randn(rows, 576, generator=gen).to(dtype)
            got = native_fused.add_rms_norm(x, r, w, 1e-5)
            ref = fused.add_rms_norm_ref(x, r, w, 1e-5)
            if got is None:   # the probe found torch's bits differ at this thread count
                assert native_fused._parallel_same and \
                    not any(native_fused._parallel_same.values())
                continue
            assert same(got[0], ref[0]) and same(got[1], ref[1])
        assert native_fused._parallel_same   # the probe ran for this thread count
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_calls_over_many_rows_split_on_torchs_openmp_team_with_the_same_bits(dtype):
    """From PAR_NUMEL elements a call's rows are split over the calling thread's OpenMP team
    (torch's runtime, shared; off where the process has another): rope + K/V write and the
    norm give the reference's bits either way."""
    lib = native_fused._library()
    if lib is None:
        pytest.skip("no native fused ops here")
    if not lib.radixkv_fused_set_parallel(1):
        pytest.skip("built without OpenMP")
    lib.radixkv_fused_set_parallel(int(native.one_openmp_runtime()))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        gen = torch.Generator().manual_seed(5)
        t, hkv, hq, d = 200, 3, 9, 64                 # 200 x 12 x 64 elements: split
        q, k, v = _qkv(t, hq, hkv, d, dtype, gen)
        cos = torch.randn(t, d, generator=gen).to(dtype)
        sin = torch.randn(t, d, generator=gen).to(dtype)
        slots = torch.randperm(32 * 8, generator=gen)[:t]
        slots[::7] = PAD_SLOT
        runs = []
        for split in (1, 0):
            lib.radixkv_fused_set_parallel(split)
            caches = [torch.zeros(32, 8, hkv, d).to(dtype) for _ in range(2)]
            out = native_fused.rope_write_kv(q, k, v, cos, sin, *caches, slots)
            assert out is not None
            runs.append((out, *caches))
        ref_caches = [torch.zeros(32, 8, hkv, d).to(dtype) for _ in range(2)]
        want = fused.rope_write_kv_ref(q, k, v, cos, sin, *ref_caches, slots, True)
        for got in runs:
            assert same(got[0], want) and same(got[1], ref_caches[0]) and \
                same(got[2], ref_caches[1])
        w = torch.randn(576, generator=gen).to(dtype)
        x = (torch.randn(300, 576, generator=gen) * 3).to(dtype)
        r = torch.randn(300, 576, generator=gen).to(dtype)
        outs = []
        for split in (1, 0):
            lib.radixkv_fused_set_parallel(split)
            got = native_fused.add_rms_norm(x, r, w, 1e-5)
            if got is None:
                pytest.skip("torch's parallel norm bits differ here: the kernel is not used")
            outs.append(got)
        assert same(outs[0][0], outs[1][0]) and same(outs[0][1], outs[1][1])
    finally:
        lib.radixkv_fused_set_parallel(int(native.one_openmp_runtime()))
        torch.set_num_threads(before)


def _silu_available() -> bool:
    return native_fused._silu_checked(64)


@given(rows=st.integers(1, 40), inter=st.sampled_from([32, 64, 96, 128, 160, 1536, 2048]),
       log_scale=st.floats(-6.0, 3.0), seed=st.integers(0, 2**16))
def test_silu_mul_is_bit_identical_to_the_reference(rows, inter, log_scale, seed):
    """Where the exhaustive check passed, any rows (any magnitudes, the eight-vector body and
    the one-vector tail of a row: 96 and 160 elements take both) give torch's bits."""
    if not _silu_available():
        pytest.skip("the native silu-multiply does not match torch on this machine")
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, 2 * inter, generator=gen) * 10.0 ** log_scale).bfloat16()
    assert native_fused.silu_mul_supported(x)
    assert same(native_fused.silu_mul(x), fused.silu_mul_ref(x))
    assert same(fused.silu_mul_cpu(x), fused.silu_mul_ref(x))


def test_silu_mul_check_covers_every_gate_value_and_special_up_values():
    """The check runs all 65,536 bf16 gate values (NaN payloads, infinities, subnormals, both
    zeros) against torch; special values give ATen's vector-path bits (a NaN is 0xffff)."""
    if not _silu_available():
        pytest.skip("the native silu-multiply does not match torch on this machine")
    specials = torch.tensor([0x0000, 0x8000, 0x0001, 0x8001, 0x007f, 0x7f80, 0xff80, 0x7fc0,
                             0xffc0, 0x7f81, 0x3f80, 0xbf80, 0x4300, 0xc300, 0x42c8, 0xc2d0],
                            dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    gate = specials.repeat(4)                        # 64 values
    up = specials.repeat_interleave(4)               # each up value against several gates
    x = torch.cat([gate, up]).view(1, 128).contiguous()
    got, want = native_fused.silu_mul(x), fused.silu_mul_ref(x)
    assert same(got, want)
    assert (bits(got) == -1).any()                   # a NaN, written as torch's vector loop does
    seen = []
    real = native_fused._call_silu_mul
    native_fused._silu_ok.pop(2048, None)
    try:
        native_fused._call_silu_mul = lambda lib, gu: seen.append(gu) or real(lib, gu)
        assert native_fused._silu_checked(2048)
    finally:
        native_fused._call_silu_mul = real
    gates = seen[0][:, :2048].reshape(-1)[:65536]
    assert torch.equal(bits(gates).sort().values,
                       torch.arange(-32768, 32768, dtype=torch.int16))


def test_silu_mul_declines_what_it_cannot_match(monkeypatch):
    """float32, row lengths that are not a multiple of ATen's 32-element bf16 vector (torch's
    scalar tail uses libm's exp), non-contiguous inputs; and a kernel that differs from torch
    anywhere is never used: the forward then runs the reference."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(3, 128, generator=gen)
    assert native_fused.silu_mul(x) is None                          # float32
    assert native_fused.silu_mul(torch.randn(3, 96).bfloat16()) is None   # I = 48
    assert native_fused.silu_mul(torch.randn(3, 256).bfloat16()[:, ::2]) is None
    assert not native_fused._silu_checked(48)
    monkeypatch.setattr(native_fused, "_silu_ok", {})
    monkeypatch.setattr(fused, "silu_mul_ref",
                        lambda gu: torch.nn.functional.silu(gu[..., :gu.shape[-1] // 2]) *
                        gu[..., gu.shape[-1] // 2:] * 1.01)   # "torch" computes otherwise
    y = torch.randn(2, 256, generator=gen).bfloat16()
    assert not native_fused.silu_mul_supported(y)
    assert native_fused._silu_ok == {128: False}


def test_silu_mul_at_several_threads_gives_the_same_bits():
    """Rows split over torch's OpenMP team (from PAR_NUMEL elements) are each computed by the
    same code: the same bits at one and two threads, split or not."""
    if not _silu_available():
        pytest.skip("the native silu-multiply does not match torch on this machine")
    lib = native_fused._library()
    before = torch.get_num_threads()
    gen = torch.Generator().manual_seed(9)
    x = (torch.randn(300, 3072, generator=gen) * 4).bfloat16()
    want = fused.silu_mul_ref(x)
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for split in (1, 0):
                lib.radixkv_fused_set_parallel(split)
                assert same(native_fused.run_silu_mul(x), want)
    finally:
        lib.radixkv_fused_set_parallel(int(native.one_openmp_runtime()))
        torch.set_num_threads(before)


def test_silu_mul_is_used_where_torch_runs_avx512_and_declined_without_it(tmp_path) -> None:
    """On a CPU where torch's kernels are its AVX-512 ones (SLEEF's 16-lane ``expf``, the
    arithmetic the kernel reproduces) the exhaustive check must pass, so that a change to the
    kernel that breaks it fails here instead of silently falling back to torch. A library built
    without AVX-512 (``RADIXKV_NATIVE_MARCH=x86-64-v3``, in a fresh interpreter and cache)
    declines: the check answers False, the runner's prepare() and the forward's op run torch."""
    import platform

    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("x86-64 targets")
    if torch.backends.cpu.get_cpu_capability() == "AVX512" and "avx512f" in open(
            "/proc/cpuinfo").read():
        assert native_fused._silu_checked(1536)
    code = ("import torch; from radixkv.kernels import native_fused, fused; "
            "assert native_fused._library() is not None; "
            "assert not native_fused._silu_checked(64); "
            "assert native_fused.prepare((576,), 64, torch.bfloat16, (1536,)); "
            "assert native_fused._silu_ok == {1536: False}; "
            "x = torch.randn(3, 128).bfloat16(); "
            "assert native_fused.silu_mul(x) is None; "
            "assert native_fused._silu_ok == {1536: False, 64: False}; "
            "assert torch.equal(fused.silu_mul_cpu(x), fused.silu_mul_ref(x)); print('ok')")
    env = dict(os.environ, RADIXKV_NATIVE_MARCH="x86-64-v3", RADIXKV_CACHE_DIR=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]
