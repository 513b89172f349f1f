"""Native CPU versions of :mod:`radixkv.kernels.fused`'s norm, rope and silu-multiply
references, used only where they are bit-identical to them on this machine.

Why: a one-thread decode step of the embedded 30-layer model spends ~2 ms of its ~17 ms in the
references' small torch ops (residual add + RMSNorm: 9 ops, ~14 us a call, twice a layer;
rope + K/V write: ~20 ops and views, ~36 us a layer). ``cpu_fused.c`` does each in one call.

Exactness: the lean forward promises logits bit-identical to transformers' modules, so these
kernels must compute exactly what the references compute. The elementwise steps are single
IEEE operations rounded where the references round; the mean of squares follows ATen's cascade
sum, whose vector width and last step (divide, or multiply by the reciprocal) depend on the
build of torch and the CPU. Before a kernel is used for a (row length, dtype), it is run
against the reference on random rows of many magnitudes for each candidate (width 16, 8 or 4;
divide or multiply) and kept only if some candidate matches every bit; otherwise the reference
runs, as it does without a C compiler or with ``$RADIXKV_NATIVE_KERNELS=0``.

A norm over ``>= 32768`` elements with more than one torch thread is where torch itself might
reduce differently: ATen then reduces in parallel. Over many rows it splits the rows between
threads (each row's sum as in one thread), but that is ATen's choice, not a promise; so the
first such norm of a (row length, dtype, thread count) runs both on large random inputs of
several row counts at that thread count, and the kernel is used there only if every bit
matches (else torch runs). Why it matters: a 243-token prefill of the embedded model at two
threads spent 25 ms of its 129 in torch's norms (each a parallel region whose sleeping threads
must be woken, ``OMP_WAIT_POLICY=PASSIVE``) against 3.5 ms in the kernel.

Threads: from ``PAR_NUMEL`` (32,768) elements a call's rows are split over the calling thread's
OpenMP team, torch's runtime, shared as the attention kernels share it (one runtime checked in
``/proc/self/maps``, else the split stays off); each row is computed by the same code on any
thread. A 243-token prefill at two threads: 0.945x. Before, these ran on one thread whatever
the count (8 ms of a ~100 ms two-thread prefill).

``silu(gate) * up`` (bf16, CPUs with AVX-512): the reference is two torch ops, each a pass
over the MLP's ``[T, I]`` rows; the kernel does one pass with ATen's arithmetic (SLEEF's
``expf``, step for step; the roundings of ATen's vectorized bf16 conversion). Its input is a bf16
value, so the check is exhaustive: all 65,536 gate values, in rows of the model's intermediate
size, against the reference, every bit (NaNs included); used only where every one agrees and the
row length is a multiple of ATen's 32-element bf16 vector (so that torch never takes its scalar
tail, whose ``exp`` is libm's). Rows of 1,536 (the embedded model), one thread: 250 rows
172 -> 122 us a layer, one row 5.0 -> 3.3 us (figures: ``docs/kernels.md``).

The library is built like the attention kernels (:mod:`radixkv.kernels.native`: same cache
folder, digest-named) but apart from them and without their reassociation flags
(``-ffp-contract=off``): a fused multiply-add or a reordered sum would round differently.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from pathlib import Path

import torch

from . import native

log = logging.getLogger("radixkv.kernels")

SOURCE = Path(__file__).with_name("cpu_fused.c")
_ABI = 3
#: ATen's serial-reduction bound (``internal::GRAIN_SIZE``): below it a sum never splits.
_SERIAL_NUMEL = 32768
_MAX_HIDDEN = 16384
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
#: (vector width, 1 = multiply by 1/h) candidates for ATen's mean, most likely first
_NORM_VARIANTS = ((16, 0), (8, 0), (16, 1), (8, 1), (4, 0), (4, 1))

_lock = threading.Lock()
_lib: list = []                     # [ctypes library or None] once tried
_norm_variant: dict = {}            # (h, dtype) -> (lanes, recip) or None
_parallel_same: dict = {}           # (h, dtype, threads, variant) -> bool (see the module doc)
_rope_ok: dict = {}                 # (d, dtype) -> bool
_silu_ok: dict = {}                 # intermediate size -> bool (bf16 only)
#: ATen's bf16 vector length under AVX-512: rows that are a multiple of it never take its
#: scalar tail (another ``exp``)
_SILU_ROW_MULTIPLE = 32


def build_flags() -> tuple[str, ...]:
    """Strict IEEE flags: the attention library's ``-O3 -march=...`` without its fast-math
    reassociation, and no contraction into fused multiply-adds."""
    march = next(f for f in native.flags() if f.startswith("-march="))
    return ("-O3", march, "-fno-math-errno", "-ffp-contract=off", "-shared", "-fPIC",
            native.OPENMP_FLAG)


def _library():
    """The ctypes library (built on a machine's first use), or None when it cannot be had."""
    if _lib:
        return _lib[0]
    with _lock:
        if _lib:
            return _lib[0]
        lib = None
        try:
            try:
                path = native.build_library((SOURCE,), build_flags(), "cpu_fused")
            except RuntimeError as exc:   # a compiler without OpenMP
                log.info("radixkv: native fused ops built without OpenMP (%s)", exc)
                path = native.build_library(
                    (SOURCE,), tuple(f for f in build_flags() if f != native.OPENMP_FLAG),
                    "cpu_fused")
            lib = ctypes.CDLL(str(path))
            if lib.radixkv_fused_abi() != _ABI:
                raise RuntimeError("library interface version mismatch")
            # rows split over torch's OpenMP team only where it is the one runtime
            lib.radixkv_fused_set_parallel(int(native.one_openmp_runtime()))
            vp, i32, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
            lib.radixkv_add_rms_norm.argtypes = [vp, vp, vp, vp, vp, i64, i64, ctypes.c_float,
                                                 i32, i32, i32]
            lib.radixkv_add_rms_norm.restype = i32
            lib.radixkv_rope_write_kv.argtypes = [vp, vp, vp, vp, vp, vp, vp, vp, vp, i64, i64,
                                                  i64, i64, i64, i64, i32]
            lib.radixkv_rope_write_kv.restype = i32
            lib.radixkv_silu_mul.argtypes = [vp, vp, i64, i64, i32]
            lib.radixkv_silu_mul.restype = i32
        except (OSError, RuntimeError, AttributeError) as exc:
            log.warning("radixkv: native fused CPU ops unavailable, using torch (%s)", exc)
            lib = None
        _lib.append(lib)
        return lib


def _call_norm(lib, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
               eps: float, variant: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    out = torch.empty_like(x)
    s = torch.empty_like(x) if residual is not None else x
    h = x.shape[-1]
    rc = lib.radixkv_add_rms_norm(x.data_ptr(),
                                  None if residual is None else residual.data_ptr(),
                                  weight.data_ptr(), out.data_ptr(),
                                  None if residual is None else s.data_ptr(),
                                  x.numel() // h, h, eps, _DTYPES[x.dtype], *variant)
    if rc != 0:
        raise RuntimeError(f"radixkv_add_rms_norm returned {rc}")
    return out, s


def _probe_rows(h: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Rows of many magnitudes (scales 1e-6 to 1e6 between rows, 400x within one, so that
    the sums of squares round and their order shows), below the serial-reduction bound."""
    rows = max(1, min(24, (_SERIAL_NUMEL - 1) // h))
    scale = torch.exp(torch.empty(rows, 1).uniform_(-14.0, 14.0, generator=gen))
    spread = torch.exp(torch.empty(rows, h).uniform_(-3.0, 3.0, generator=gen))
    return (torch.randn(rows, h, generator=gen) * scale * spread).to(dtype)


def _matching(h: int, dtype: torch.dtype, variants: tuple[tuple[int, int], ...]
              ) -> tuple[int, int] | None:
    """The first of ``variants`` whose norms of random ``h``-element rows of ``dtype`` equal
    the references' bit for bit (with and without a residual), or None."""
    from .fused import add_rms_norm_ref, rms_norm_ref   # fused imports this module lazily
    lib = _library()
    if lib is None:
        return None
    gen = torch.Generator().manual_seed(h * 31 + _DTYPES[dtype])
    cases = []
    for eps in (1e-5, 1e-6):
        for _ in range(4):
            x, r = _probe_rows(h, dtype, gen), _probe_rows(h, dtype, gen)
            w = torch.randn(h, generator=gen).to(dtype)
            cases.append((x, r, w, eps, add_rms_norm_ref(x, r, w, eps),
                          rms_norm_ref(x, w, eps)))
    for variant in variants:
        ok = True
        for x, r, w, eps, (ref_out, ref_sum), ref_plain in cases:
            out, s = _call_norm(lib, x, r, w, eps, variant)
            plain, _ = _call_norm(lib, x, None, w, eps, variant)
            if not (_same_bits(out, ref_out) and _same_bits(s, ref_sum)
                    and _same_bits(plain, ref_plain)):
                ok = False
                break
        if ok:
            return variant
    return None


def _find_norm_variant(h: int, dtype: torch.dtype) -> tuple[int, int] | None:
    """The (width, recip) that reproduces the references bit for bit for rows of ``h``
    elements of ``dtype``, or None. The variant is found on float32 rows, whose sums of
    squares round (bf16 rows' squares have 16 significant bits, so short sums of them are
    exact in any order and cannot tell the variants apart), then confirmed on ``dtype``'s."""
    variant = _matching(h, torch.float32, _NORM_VARIANTS)
    if variant is not None and dtype is not torch.float32:
        variant = _matching(h, dtype, (variant,))
    if variant is None:
        log.info("radixkv: no native RMSNorm variant matches torch for rows of %d (%s); "
                 "using torch", h, dtype)
    return variant


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit patterns (so -0.0 differs from 0.0 and NaN payloads count)."""
    view = torch.int16 if a.dtype is torch.bfloat16 else torch.int32
    return a.shape == b.shape and torch.equal(a.contiguous().view(view),
                                              b.contiguous().view(view))


def _norm_ok(x: torch.Tensor, weight: torch.Tensor) -> tuple[int, int] | None:
    """The variant to run ``x``'s norm with, or None (the caller runs the reference)."""
    if (x.device.type != "cpu" or x.dtype not in _DTYPES or weight.dtype is not x.dtype
            or not x.is_contiguous() or not weight.is_contiguous() or x.dim() == 0
            or weight.shape[0] != x.shape[-1] or weight.dim() != 1
            or not native.enabled()):
        return None
    key = (x.shape[-1], x.dtype)
    variant = _norm_variant.get(key, False)
    if variant is False:   # first use: find it (two threads racing compute the same answer)
        h = x.shape[-1]
        variant = _find_norm_variant(h, x.dtype) if 1 <= h <= _MAX_HIDDEN else None
        _norm_variant[key] = variant
    if variant is not None and x.numel() >= _SERIAL_NUMEL:
        threads = torch.get_num_threads()
        if threads > 1:
            pkey = (x.shape[-1], x.dtype, threads, variant)
            same = _parallel_same.get(pkey)
            if same is None:
                same = _parallel_same[pkey] = _parallel_matches(x.shape[-1], x.dtype, variant)
            if not same:
                return None
    return variant


def _parallel_matches(h: int, dtype: torch.dtype, variant: tuple[int, int]) -> bool:
    """Whether the kernel's norms equal torch's at the current thread count on inputs of
    ``>= 32768`` elements (where ATen reduces in parallel): float32 and ``dtype`` rows of many
    magnitudes, three row counts (odd ones too), with and without a residual."""
    from .fused import add_rms_norm_ref, rms_norm_ref
    lib = _library()
    if lib is None:
        return False
    gen = torch.Generator().manual_seed(h * 7 + 3)
    base = -(-_SERIAL_NUMEL // h)
    for rows in (base, 2 * base + 1, 8 * base + 5):
        for dt in dict.fromkeys((torch.float32, dtype)):
            parts = [_probe_rows(h, dt, gen) for _ in range(-(-2 * rows // 24) + 1)]
            x, r = torch.cat(parts)[:rows], torch.cat(parts[::-1])[:rows]
            w = torch.randn(h, generator=gen).to(dt)
            ref_out, ref_sum = add_rms_norm_ref(x, r, w, 1e-6)
            out, s = _call_norm(lib, x, r, w, 1e-6, variant)
            plain, _ = _call_norm(lib, x, None, w, 1e-6, variant)
            if not (_same_bits(out, ref_out) and _same_bits(s, ref_sum)
                    and _same_bits(plain, rms_norm_ref(x, w, 1e-6))):
                log.info("radixkv: torch's RMSNorm over %d rows of %d (%s) at %d threads "
                         "differs from the native kernel's; using torch there", rows, h, dt,
                         torch.get_num_threads())
                return False
    return True


def run_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
             variant: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(norm, sum)`` of :func:`add_rms_norm` (``residual`` None: ``(norm, x)`` of
    :func:`rms_norm`) without the checks: ``variant`` is what :func:`norm_variant` returned
    for operands of the same kinds (a forward's later layers)."""
    return _call_norm(_lib[0], x, residual, weight, eps, variant)


def norm_variant(x: torch.Tensor, weight: torch.Tensor,
                 residual: torch.Tensor | None = None) -> tuple[int, int] | None:
    """The variant :func:`run_norm` takes for these operands, or None when the native kernel
    does not apply (the caller runs the reference)."""
    if residual is not None and (
            residual.dtype is not x.dtype or residual.shape != x.shape
            or not residual.is_contiguous() or residual.device.type != "cpu"):
        return None
    if x.numel() == 0:
        return None
    return _norm_ok(x, weight)


def prepare(norm_sizes: tuple[int, ...], head_dim: int, dtype: torch.dtype,
            mlp_sizes: tuple[int, ...] = ()) -> bool:
    """Build or load the library and run the bit-identity checks for these row lengths, this
    head_dim and these MLP intermediate sizes now (a model's runner calls it when it is
    created), so that the first forward, and so a first request's TTFT, pays neither the
    compiler (~2 s on a machine's first use) nor the checks (~20 ms per row length, ~6 ms per
    intermediate size). Returns whether the library loaded;
    the checks' outcomes are remembered as on first use."""
    if not native.enabled() or dtype not in _DTYPES or _library() is None:
        return False
    threads = torch.get_num_threads()
    for h in norm_sizes:
        key = (h, dtype)
        if key not in _norm_variant and 1 <= h <= _MAX_HIDDEN:
            _norm_variant[key] = _find_norm_variant(h, dtype)
        variant = _norm_variant.get(key)
        if variant is not None and threads > 1 and (h, dtype, threads, variant) not in \
                _parallel_same:   # a prefill's norms at this thread count (module doc)
            _parallel_same[(h, dtype, threads, variant)] = _parallel_matches(h, dtype, variant)
    if head_dim % 2 == 0 and (head_dim, dtype) not in _rope_ok:
        _rope_ok[(head_dim, dtype)] = _rope_checked(head_dim, dtype)
    if dtype is torch.bfloat16:
        for inter in mlp_sizes:
            if inter not in _silu_ok:
                _silu_ok[inter] = _silu_checked(inter)
    return True


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """:func:`fused.rms_norm_ref`'s result, natively; None when not run (see module doc)."""
    variant = norm_variant(x, weight)
    return None if variant is None else run_norm(x, None, weight, eps, variant)[0]


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    """:func:`fused.add_rms_norm_ref`'s ``(norm, sum)``, natively; None when not run."""
    variant = norm_variant(x, weight, residual)
    return None if variant is None else run_norm(x, residual, weight, eps, variant)


def _call_rope(lib, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               slot_mapping: torch.Tensor) -> torch.Tensor:
    t, hq, d = q.shape
    q_out = torch.empty((t, hq, d), dtype=q.dtype)
    rc = lib.radixkv_rope_write_kv(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), cos.data_ptr(), sin.data_ptr(),
        q_out.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), slot_mapping.data_ptr(), t,
        hq, k.shape[1], d, q.stride(0), k_cache.shape[0] * k_cache.shape[1], _DTYPES[q.dtype])
    if rc != 0:
        raise IndexError(f"rope_write_kv: a slot is past the cache (code {rc})")
    return q_out


def _rope_checked(d: int, dtype: torch.dtype) -> bool:
    """Whether the native rope reproduces :func:`fused.rope_write_kv_ref` for this head_dim
    and dtype (run once on random rows)."""
    from .fused import rope_write_kv_ref
    lib = _library()
    if lib is None:
        return False
    gen = torch.Generator().manual_seed(d * 7 + _DTYPES[dtype])
    hq, hkv, t = 4, 2, 5
    qkv = (torch.randn(t, hq + 2 * hkv, d, generator=gen) * 3).to(dtype)
    q, k, v = qkv[:, :hq], qkv[:, hq:hq + hkv], qkv[:, hq + hkv:]
    cos = torch.randn(t, d, generator=gen).to(dtype)
    sin = torch.randn(t, d, generator=gen).to(dtype)
    caches = [torch.zeros(3, 4, hkv, d, dtype=dtype) for _ in range(4)]
    slots = torch.tensor([5, 0, 11, 7, 2])
    ref_q = rope_write_kv_ref(q, k, v, cos, sin, caches[0], caches[1], slots, False)
    got_q = _call_rope(lib, q, k, v, cos, sin, caches[2], caches[3], slots)
    return (_same_bits(ref_q, got_q) and _same_bits(caches[0], caches[2])
            and _same_bits(caches[1], caches[3]))


def rope_supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> bool:
    """Whether :func:`run_rope` computes :func:`fused.rope_write_kv_ref` for these operands:
    CPU, float32 or bfloat16 throughout, ``q``/``k``/``v`` rows of one ``[T, heads, D]`` GEMM
    output (unit element stride, head stride ``D``, one token stride), contiguous ``[T, D]``
    cos/sin and caches, int64 slots; and the kernel matched the reference on this machine."""
    if (q.device.type != "cpu" or q.dtype not in _DTYPES or q.dim() != 3 or k.dim() != 3
            or v.dim() != 3 or not native.enabled()):
        return False
    dt = q.dtype
    t, _, d = q.shape
    ts = q.stride(0)
    if (k.dtype is not dt or v.dtype is not dt or cos.dtype is not dt or sin.dtype is not dt
            or k_cache.dtype is not dt or v_cache.dtype is not dt
            or q.stride(2) != 1 or k.stride(2) != 1 or v.stride(2) != 1
            or q.stride(1) != d or k.stride(1) != d or v.stride(1) != d
            or k.stride(0) != ts or v.stride(0) != ts or k.shape != v.shape
            or k.shape[0] != t or k.shape[2] != d or cos.shape != (t, d)
            or sin.shape != (t, d) or not cos.is_contiguous() or not sin.is_contiguous()
            or k_cache.dim() != 4 or k_cache.shape[2:] != k.shape[1:]
            or v_cache.shape != k_cache.shape or not k_cache.is_contiguous()
            or not v_cache.is_contiguous() or k_cache.device.type != "cpu"
            or slot_mapping.dtype != torch.int64 or slot_mapping.shape != (t,)
            or not slot_mapping.is_contiguous() or slot_mapping.device.type != "cpu"):
        return False
    key = (d, dt)
    ok = _rope_ok.get(key)
    if ok is None:
        ok = _rope_ok[key] = _rope_checked(d, dt)
    return ok


def run_rope(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
             sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> torch.Tensor:
    """The native rope and K/V write without the checks: :func:`rope_supported` held for
    operands of the same kinds (a forward's later layers). A slot past the cache is still
    refused (IndexError, nothing written)."""
    return _call_rope(_lib[0], q, k, v, cos, sin, k_cache, v_cache, slot_mapping)


def rope_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor) -> torch.Tensor | None:
    """:func:`fused.rope_write_kv_ref` natively (the rotated ``q``; rotated ``k`` and ``v``
    written to their slots, ``PAD_SLOT`` rows skipped); None when not run
    (:func:`rope_supported` says when)."""
    if not rope_supported(q, k, v, cos, sin, k_cache, v_cache, slot_mapping):
        return None
    return run_rope(q, k, v, cos, sin, k_cache, v_cache, slot_mapping)


def _call_silu_mul(lib, gate_up: torch.Tensor) -> torch.Tensor:
    inter = gate_up.shape[-1] // 2
    out = gate_up.new_empty(*gate_up.shape[:-1], inter)
    rc = lib.radixkv_silu_mul(gate_up.data_ptr(), out.data_ptr(), gate_up.numel() // (2 * inter),
                              inter, _DTYPES[gate_up.dtype])
    if rc != 0:
        raise RuntimeError(f"radixkv_silu_mul returned {rc}")
    return out


def _silu_checked(inter: int) -> bool:
    """Whether the native silu-multiply equals :func:`fused.silu_mul_ref` bit for bit on every
    bf16 gate value (all 65,536, in rows of ``inter``), against up values of every kind (random,
    zeros, signed infinities, NaNs, subnormals), at one thread and at the current count."""
    from .fused import silu_mul_ref
    lib = _library()
    if lib is None or inter < _SILU_ROW_MULTIPLE or inter % _SILU_ROW_MULTIPLE:
        return False
    gen = torch.Generator().manual_seed(inter)
    every = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    rows = -(-65536 // inter)
    gate = torch.zeros(rows * inter, dtype=torch.bfloat16)
    gate[:65536] = every
    up = torch.randn(rows * inter, generator=gen).to(torch.bfloat16)
    up[torch.randperm(rows * inter, generator=gen)[:4096]] = every[
        torch.randint(0, 65536, (4096,), generator=gen)]   # up's special values too
    gate_up = torch.cat([gate.view(rows, inter), up.view(rows, inter)], 1).contiguous()
    if lib.radixkv_silu_mul(gate_up.data_ptr(), gate_up.data_ptr(), 0, inter, 1) != 0:
        return False   # built without AVX-512: the kernel declines every call
    threads = torch.get_num_threads()
    try:
        for n in dict.fromkeys((1, threads)):
            torch.set_num_threads(n)
            if not _same_bits(_call_silu_mul(lib, gate_up), silu_mul_ref(gate_up)):
                log.info("radixkv: the native silu-multiply differs from torch's for rows of "
                         "%d at %d threads; using torch", inter, n)
                return False
    finally:
        torch.set_num_threads(threads)
    return True


def silu_mul_supported(gate_up: torch.Tensor) -> bool:
    """Whether :func:`run_silu_mul` computes :func:`fused.silu_mul_ref` for ``gate_up``: a
    contiguous bf16 CPU tensor ``[..., 2I]`` whose ``I`` is a multiple of 32 and passed the
    exhaustive check on this machine (:func:`_silu_checked`)."""
    if (gate_up.device.type != "cpu" or gate_up.dtype is not torch.bfloat16
            or gate_up.dim() < 1 or gate_up.shape[-1] % 2 or not gate_up.is_contiguous()
            or gate_up.numel() == 0 or not native.enabled()):
        return False
    inter = gate_up.shape[-1] // 2
    ok = _silu_ok.get(inter)
    if ok is None:
        ok = _silu_ok[inter] = _silu_checked(inter)
    return ok


def run_silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """The native silu-multiply without the checks: :func:`silu_mul_supported` held for an
    operand of the same kind (a forward's later layers)."""
    return _call_silu_mul(_lib[0], gate_up)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """:func:`fused.silu_mul_ref` natively; None when not run (:func:`silu_mul_supported`)."""
    return run_silu_mul(gate_up) if silu_mul_supported(gate_up) else None
