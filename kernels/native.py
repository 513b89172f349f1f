"""Native CPU kernels (``cpu_attention.c``): built with the machine's C compiler on first use.

Why: a CPU decode step's attention is many tiny (sequence, KV head) problems, for which torch's
SDPA costs a fixed ~5 us each plus a gather of every sequence's blocks; the C kernel reads the
paged pool in place (see the C file). Prefill's causal attention through torch's CPU flash
kernel runs at 36-64 GFLOP/s on one core; the bf16 prefill kernel, on CPUs with AVX512-BF16,
tiles 16 query rows x 16 keys on the CPU's bf16 dot products (scores, and P.V with P rounded
to bf16 as FlashAttention does) at ~250 on the project's Zen 5 EPYC; the float32 prefill runs
on AVX-512 or, in 8-lane halves with the same arithmetic, AVX2 with FMA (most laptops' and Zen 2
/ 3 servers' ``-march=native``); the float32-query decode heads are AVX2 intrinsics in both
builds (faster than the compiler's 16 lanes on AVX-512 too: docs/kernels.md). All are
accelerators, never requirements: without a compiler, with ``$RADIXKV_NATIVE_KERNELS=0``, on
an unsupported shape, dtype or CPU, or if the build fails, :func:`paged_decode` and
:func:`paged_prefill` return ``False`` and the caller runs the torch path.

Building: ``cc -O3 -march=native`` with the reassociation part of fast-math (:data:`FLAGS`; not
``-ffast-math`` itself, which would change the process's float environment) (about 9 s),
into ``$RADIXKV_CACHE_DIR/kernels`` (else ``$XDG_CACHE_HOME/radixkv/kernels``, else
``~/.cache/radixkv/kernels``). The file name is a digest of the source, the flags, the
compiler's version and this CPU's feature flags, so a cache shared between machines never loads
a library built for other instructions (``$RADIXKV_NATIVE_MARCH`` builds for a named target
instead of ``native``, e.g. ``x86-64-v3``); a library is written under a temporary name and renamed
into place, so concurrent processes never load a half-written file. ``$CC`` picks the compiler.

Loaded with :mod:`ctypes` (no torch headers, no pybind: the build needs only a C compiler).
Threads: with ``torch.get_num_threads() > 1`` a call is split into that many parts (decode: every
n-th (sequence, KV head); prefill: every n-th (query head, 16-row tile)); each row is computed
by the same code whatever the split, so results do not depend on the thread count. The parts
run on the calling thread's OpenMP team: the library is built with ``-fopenmp`` and, loaded
after torch, shares torch's ``libgomp`` (checked: one OpenMP runtime in ``/proc/self/maps``),
so the same threads that ran the GEMM before pick the parts up while still polling. Without
OpenMP (a compiler that lacks it, or a second runtime) the parts go to a small pool of Python
threads (ctypes releases the GIL for the call, but every part's hand-over takes it: ~0.1 ms a
call, so only larger calls are split there). Why and the figures: docs/kernels.md.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

log = logging.getLogger("radixkv.kernels")

ENV_VAR = "RADIXKV_NATIVE_KERNELS"
#: Compiled together into one library; cpu_math.h is included by both (and hashed with them).
SOURCES = tuple(Path(__file__).with_name(n) for n in ("cpu_attention.c", "cpu_sampling.c"))
HEADERS = (Path(__file__).with_name("cpu_math.h"),)
#: -ffast-math's reassociation (so the compiler vectorizes the dot products and sums) without
#: -ffast-math itself: with it, gcc < 13 and clang link crtfastmath.o into the library, whose
#: constructor sets flush-to-zero and denormals-are-zero in the loading thread's MXCSR, which
#: silently changed every later float computation of the process (torch's included: 1e-38 *
#: 0.01 read 0 after an engine was built). Infinities and NaN keep their meaning.
FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fno-signed-zeros", "-fno-trapping-math",
         "-fassociative-math", "-freciprocal-math", "-ffp-contract=fast", "-shared", "-fPIC",
         "-fopenmp")
#: The flag that gives the prefill's parts torch's OpenMP team (``radixkv_prefill_parallel``);
#: a compiler without OpenMP builds the library without it (parts then go to a Python pool).
OPENMP_FLAG = "-fopenmp"
#: ``$RADIXKV_NATIVE_MARCH`` replaces ``native`` in ``-march=`` (e.g. ``x86-64-v3`` for one
#: library that every AVX2 machine sharing a cache folder can load).
MARCH_VAR = "RADIXKV_NATIVE_MARCH"
_ABI = 8
#: (head_dim, query heads per KV head) combinations instantiated in the C file.
HEAD_DIMS = frozenset({16, 32, 64, 128})
MAX_GROUP = 8
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
#: quantized cache dtypes (engine/kv_quant.py) -> the C entry's kind, added to the query's
_QUANT_KINDS = {torch.int8: 2, torch.float8_e4m3fn: 4}

_lock = threading.Lock()
_state: dict = {}   # "fn": the ctypes function or None once tried; "error": why not


def enabled() -> bool:
    """False when ``$RADIXKV_NATIVE_KERNELS`` is ``0``/``false``/``off``."""
    return os.environ.get(ENV_VAR, "1").strip().lower() not in ("0", "false", "off", "no")


def cache_dir() -> Path:
    env = os.environ.get("RADIXKV_CACHE_DIR")
    if env:
        return Path(env) / "kernels"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return Path(xdg or Path.home() / ".cache") / "radixkv" / "kernels"


def _compiler() -> str | None:
    cc = os.environ.get("CC")
    if cc:
        return shutil.which(cc)
    for name in ("cc", "gcc", "clang"):
        path = shutil.which(name)
        if path:
            return path
    return None


def _cpu_flags() -> str:
    """This CPU's feature flags (what -march=native compiles for)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def flags() -> tuple[str, ...]:
    """The compiler flags: :data:`FLAGS` with ``$RADIXKV_NATIVE_MARCH`` as the ``-march``."""
    march = os.environ.get(MARCH_VAR, "").strip()
    return tuple(f"-march={march}" if march and f == "-march=native" else f for f in FLAGS)


def _build(cc: str, sources: tuple[Path, ...] = SOURCES, headers: tuple[Path, ...] = HEADERS,
           build_flags: tuple[str, ...] | None = None, stem: str = "cpu_attention") -> Path:
    """The shared library of ``sources`` built with ``build_flags`` (default :func:`flags`),
    from the cache when an identical build is there (see the module docstring)."""
    version = subprocess.run([cc, "--version"], capture_output=True, text=True,
                             timeout=30).stdout
    if build_flags is None:
        build_flags = flags()
    digest = hashlib.sha256(b"\0".join([
        *(p.read_bytes() for p in sources + headers), " ".join(build_flags).encode(),
        version.encode(), _cpu_flags().encode(), platform.machine().encode()])).hexdigest()[:20]
    target = cache_dir() / f"{stem}-{digest}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        proc = subprocess.run([cc, *build_flags, "-o", tmp, *map(str, sources)],
                              capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            raise RuntimeError(f"{cc} failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def compiler() -> str | None:
    """The C compiler the native kernels are built with (``$CC``, else cc/gcc/clang), or None."""
    return _compiler()


def build_library(sources: tuple[Path, ...], build_flags: tuple[str, ...], stem: str) -> Path:
    """Build (or find in the cache) a library of other native sources with their own flags
    (``native_fused`` builds its exact kernels without fast-math this way); RuntimeError when
    there is no compiler or the build fails."""
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler found (cc, gcc or clang on PATH, or $CC)")
    return _build(cc, sources, (), build_flags, stem)


def _load():
    """The kernel's ctypes function, building it if needed; None (and ``_state['error']``)
    when it cannot be had. Tried once per process."""
    with _lock:
        if "fn" in _state:
            return _state["fn"]
        fn = None
        try:
            cc = _compiler()
            if cc is None:
                raise RuntimeError("no C compiler found (cc, gcc or clang on PATH, or $CC)")
            try:
                path = _build(cc)
            except RuntimeError as exc:   # e.g. clang without an OpenMP runtime
                log.info("radixkv: native kernels built without OpenMP (%s)", exc)
                path = _build(cc, build_flags=tuple(f for f in flags() if f != OPENMP_FLAG))
            lib = ctypes.CDLL(str(path))
            if lib.radixkv_native_abi() != _ABI:
                raise RuntimeError("library interface version mismatch")
            fn = lib.radixkv_paged_decode
            vp, i32 = ctypes.c_void_p, ctypes.c_int
            fn.argtypes = [vp, vp, vp, vp, vp, vp, i32, i32, i32, i32, i32, i32,
                           ctypes.c_float, i32, i32, i32]
            fn.restype = i32
            for key, name in (("prefill", "radixkv_paged_prefill_bf16"),
                              ("prefill_f32", "radixkv_paged_prefill_f32")):
                prefill = getattr(lib, name)
                prefill.argtypes = [vp, vp, vp, vp, vp, vp, vp, i32, i32, i32, i32, i32, i32,
                                    ctypes.c_float, vp, i32, i32]
                prefill.restype = i32
                _state[key] = prefill
            prefill_q = lib.radixkv_paged_prefill_quantized
            prefill_q.argtypes = [vp, vp, vp, vp, vp, vp, vp, i32, i32, i32, i32, i32, i32,
                                  ctypes.c_float, vp, i32, i32, i32]
            prefill_q.restype = i32
            _state["prefill_quantized"] = prefill_q
            if lib.radixkv_native_openmp() and one_openmp_runtime():
                par = lib.radixkv_prefill_parallel
                par.argtypes = [vp, vp, vp, vp, vp, vp, vp, vp, i32, i32, i32, i32, i32, i32,
                                ctypes.c_float, vp, ctypes.c_int64, i32]
                par.restype = i32
                _state["prefill_parallel"] = par
                dpar = lib.radixkv_decode_parallel
                dpar.argtypes = [vp, vp, vp, vp, vp, vp, i32, i32, i32, i32, i32, i32,
                                 ctypes.c_float, i32, i32]
                dpar.restype = i32
                _state["decode_parallel"] = dpar
                for key in ("prefill", "prefill_f32"):
                    _state[key + "_addr"] = ctypes.cast(_state[key], ctypes.c_void_p).value
            greedy = lib.radixkv_greedy_logsumexp
            greedy.argtypes = [vp, i32, i32, ctypes.c_int64, vp, vp]
            greedy.restype = i32
            _state["greedy"] = greedy
        except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
            _state["error"] = str(exc)
            log.warning("radixkv: native CPU attention kernels unavailable, using the torch path "
                        "(%s)", exc)
        _state["fn"] = fn
        return fn


#: A call is split only when each part gets at least this much work: (decode) keys read times
#: KV heads, (prefill) query rows. Below, a pool round trip (tens of us, and the GIL handed
#: between threads) costs more than it saves: 16 sequences of ~100 tokens decoded slower split.
_MIN_DECODE_KEYS_PER_PART = 16384   # keys x KV heads: ~0.2 ms of work on one core
_MIN_PREFILL_ROWS_PER_PART = 64
#: The same where the parts run on torch's OpenMP team (``radixkv_*_parallel``), whose threads
#: are caught still polling after the GEMM before (no GIL, no pool round trip). In one process
#: 2,048 and 8 paid (a 32-token turn's forward 0.88x at two threads), but through the server
#: with its benchmark clients on the same cores they lost at four clients (docs/kernels.md).
_MIN_DECODE_KEYS_PER_PART_OMP = 8192
_MIN_PREFILL_ROWS_PER_PART_OMP = 32
#: ``MAX_PARTS`` of cpu_attention.c: the most parts a ``radixkv_*_parallel`` call takes
MAX_PARALLEL_PARTS = 256
_pool: list = [None, 0]   # (executor, its workers)


def _parts(work: int, per_part: int, parts: int | None) -> int:
    """How many parts to split a call into: ``parts`` if given, else torch's thread count,
    bounded so each part has at least ``per_part`` of ``work``."""
    if parts is None:
        parts = min(torch.get_num_threads(), max(1, work // per_part))
    return max(1, parts)


def decode_parts(seq_lens: torch.Tensor | list[int], num_kv_heads: int) -> int:
    """How many ways to split a decode call: 1 on one torch thread, else by the keys it reads
    (one host read of the lengths, none when they are given as host ints; a forward's later
    layers reuse the answer)."""
    if torch.get_num_threads() == 1:
        return 1
    total = sum(seq_lens) if isinstance(seq_lens, list) else int(seq_lens.sum())
    if "fn" not in _state:
        _load()
    per_part = (_MIN_DECODE_KEYS_PER_PART_OMP if "decode_parallel" in _state
                else _MIN_DECODE_KEYS_PER_PART)
    parts = _parts(total * num_kv_heads, per_part, None)
    return max(1, min(parts, len(seq_lens) * num_kv_heads))


def one_openmp_runtime() -> bool:
    """Whether exactly one OpenMP runtime is mapped into this process (torch's libgomp, which
    the library then shares), read from ``/proc/self/maps``; False where it cannot be read.
    Two runtimes (a torch built with Intel's and a library linked to GNU's) would each keep a
    team of threads on the same cores."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f
                     if any(n in line for n in ("libgomp", "libiomp", "libomp"))}
    except OSError:
        return False
    return len({os.path.realpath(p) for p in paths}) == 1


def _run_parts(call, parts: int) -> bool:
    """``call(part, parts)`` for every part (part 0 on this thread), True if all returned 0."""
    if parts == 1:
        return call(0, 1) == 0
    with _lock:
        pool, workers = _pool
        if pool is None or workers < parts - 1:
            # A larger pool replaces the old one, which is not shut down: another thread may
            # be submitting to it right now (its idle threads end when it is collected).
            pool = ThreadPoolExecutor(max_workers=parts - 1, thread_name_prefix="radixkv-attn")
            _pool[:] = [pool, parts - 1]
    futures = [pool.submit(call, p, parts) for p in range(1, parts)]
    ok = call(0, parts) == 0
    return all([f.result() == 0 for f in futures]) and ok


def _entry(name: str):
    """The library's entry point ``name`` ("fn": decode, "prefill", "greedy"), loading (and on
    a machine's first use building) the library first; None when it cannot be had."""
    if "fn" not in _state:
        _load()
    return _state.get(name)


def available() -> bool:
    """Whether the native decode kernel is enabled and loads (builds it on first call)."""
    return enabled() and _load() is not None


def _operands_ok(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_tables: torch.Tensor, seq_lens: torch.Tensor, out: torch.Tensor) -> bool:
    """What both kernels need: CPU, one float32/bfloat16 dtype, an instantiated head_dim, whole
    groups of query heads per KV head, int32 tables and lengths, everything contiguous."""
    return (q.device.type == "cpu" and q.dtype in _DTYPES and k_cache.dtype == q.dtype
            and v_cache.dtype == q.dtype and out.dtype == q.dtype
            and k_cache.shape[3] in HEAD_DIMS and q.shape[1] % k_cache.shape[2] == 0
            and out.shape == q.shape
            and block_tables.dtype == torch.int32 and seq_lens.dtype == torch.int32
            and all(t.is_contiguous() and t.device.type == "cpu"
                    for t in (q, k_cache, v_cache, block_tables, seq_lens, out)))


def supports(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             block_tables: torch.Tensor, seq_lens: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether :func:`paged_decode` handles these operands (at most :data:`MAX_GROUP` query
    heads per KV head, besides what :func:`_operands_ok` checks)."""
    return (_operands_ok(q, k_cache, v_cache, block_tables, seq_lens, out)
            and q.shape[1] // k_cache.shape[2] <= MAX_GROUP)


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                 out: torch.Tensor, checked: bool = False, parts: int | None = None) -> bool:
    """Decode attention into ``out`` (see ``cpu_attention.c`` for layouts); ``False`` when not run
    (the caller then takes the torch path). Values are trusted: the launchers in ``ops.py``
    checked shapes, dtypes and, unless told not to, tables and lengths. ``checked=True``: the
    caller saw :func:`supports` hold for operands of the same kinds (a forward's later layers),
    so it is not evaluated again. ``parts``: split the call this many ways (default: by torch's
    thread count, see the module docstring)."""
    if not checked and not (enabled() and supports(q, k_cache, v_cache, block_tables,
                                                   seq_lens, out)):
        return False
    return _decode(q, k_cache, v_cache, block_tables, seq_lens, scale, out,
                   _DTYPES[q.dtype], parts)


def _decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float, out: torch.Tensor,
            kind: int, parts: int | None) -> bool:
    """One call of the C decode entry for cache ``kind`` (see ``radixkv_paged_decode``)."""
    fn = _entry("fn")
    if fn is None:
        return False
    n, hq, d = q.shape
    hkv = k_cache.shape[2]
    args = (q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
            seq_lens.data_ptr(), out.data_ptr(), n, hq, hkv, d, k_cache.shape[1],
            block_tables.shape[1], float(scale), kind)
    if parts is None:
        parts = decode_parts(seq_lens, hkv)
    par = _state.get("decode_parallel")
    if parts > 1 and par is not None:
        return par(*args, min(parts, MAX_PARALLEL_PARTS)) == 0
    return _run_parts(lambda part, count: fn(*args, part, count), parts)


def supports_quantized(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       block_tables: torch.Tensor, seq_lens: torch.Tensor,
                       out: torch.Tensor) -> bool:
    """Whether :func:`paged_decode_quantized` handles these operands: a float32/bfloat16 query
    and output, int8 or float8_e4m3fn caches of rows ``head_dim + 2`` wide (``kv_quant``'s
    layout), an instantiated head_dim, at most :data:`MAX_GROUP` query heads per KV head."""
    d = q.shape[-1]
    return (q.dim() == 3 and q.device.type == "cpu" and q.dtype in _DTYPES
            and out.dtype == q.dtype and out.shape == q.shape
            and k_cache.dtype in _QUANT_KINDS and v_cache.dtype == k_cache.dtype
            and k_cache.dim() == 4 and k_cache.shape == v_cache.shape
            and k_cache.shape[3] == d + 2 and d in HEAD_DIMS
            and q.shape[1] % k_cache.shape[2] == 0
            and q.shape[1] // k_cache.shape[2] <= MAX_GROUP
            and block_tables.dtype == torch.int32 and seq_lens.dtype == torch.int32
            and all(t.is_contiguous() and t.device.type == "cpu"
                    for t in (q, k_cache, v_cache, block_tables, seq_lens, out)))


def paged_decode_quantized(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           out: torch.Tensor, parts: int | None = None,
                           checked: bool = False) -> bool:
    """Decode attention over int8 / fp8 caches read in place: each row is widened to exactly
    what the torch path's dequantized scratch holds, with no scratch and no gather (the
    attention then agrees with the float kernel on the scratch to float32 rounding: these
    heads take the group size at run time). Rows are in their stored (rotated) domain: the
    caller rotates ``q`` before and the output after, as for the scratch. ``False`` when not
    run (the caller then dequantizes and takes the float path), which includes an e4m3 cache
    on a thread with denormals-are-zero set (the e4m3 decode goes through float subnormals).
    ``checked`` and ``parts``: as in :func:`paged_decode`."""
    if not checked and not (enabled() and supports_quantized(q, k_cache, v_cache, block_tables,
                                                             seq_lens, out)):
        return False
    return _decode(q, k_cache, v_cache, block_tables, seq_lens, scale, out,
                   _QUANT_KINDS[k_cache.dtype] + _DTYPES[q.dtype], parts)


_scratch = threading.local()
#: query dtype -> the prefill entry point (``_state`` key) that computes it
_PREFILL_ENTRIES = {torch.bfloat16: "prefill", torch.float32: "prefill_f32"}


def paged_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
                  seq_lens: torch.Tensor, max_seq_len: int, scale: float, out: torch.Tensor,
                  checked: bool = False, parts: int | None = None,
                  _quantized_kind: int | None = None) -> bool:
    """Causal extend-case attention (q packed ``[total, hq, D]`` by ``cu_seqlens_q``; query i of
    a sequence sees keys up to ``seq_len - q_len + i``) into ``out``, bf16 (AVX512-BF16) or
    float32 (AVX512F, or AVX2 with FMA); ``False`` when not run (other dtypes or sizes, a CPU
    without those instructions, no compiler). ``max_seq_len`` (the longest ``seq_lens`` entry)
    sizes the per-thread scratch the kernel packs K and V into. Otherwise as
    :func:`paged_decode`."""
    key = _PREFILL_ENTRIES.get(q.dtype)
    if _quantized_kind is not None and key is not None:
        key += "_quantized"   # "no_" flags per query dtype; the C entry is one
    if key is None or _state.get("no_" + key):
        return False
    if not checked and _quantized_kind is None and not (
            enabled() and cu_seqlens_q.dtype == torch.int32 and cu_seqlens_q.is_contiguous()
            and _operands_ok(q, k_cache, v_cache, block_tables, seq_lens, out)):
        return False
    fn = _entry(key if _quantized_kind is None else "prefill_quantized")
    if fn is None:
        return False
    n, hq, d = q.shape
    # 16 keys per tile: K packed (bf16 pairs: d / 2 words per key, float32: d) + V as float32
    words = (16 * d // (2 if q.dtype == torch.bfloat16 else 1) + 16 * d) * (-(-max_seq_len // 16))
    args = (q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
            cu_seqlens_q.data_ptr(), seq_lens.data_ptr(), out.data_ptr(), seq_lens.shape[0], hq,
            k_cache.shape[2], d, k_cache.shape[1], block_tables.shape[1], float(scale))

    par = _state.get("prefill_parallel") if _quantized_kind is None else None
    count = _parts(q.shape[0], _MIN_PREFILL_ROWS_PER_PART if par is None
                   else _MIN_PREFILL_ROWS_PER_PART_OMP, parts)
    if count > 1 and par is not None:
        count = min(count, MAX_PARALLEL_PARTS)
        # every part on the calling thread's OpenMP team (radixkv_prefill_parallel), each with
        # its own slice of one scratch buffer
        words = max(words, 1 << 16)
        buf = getattr(_scratch, "buf", None)
        if buf is None or buf.numel() < words * count:
            buf = _scratch.buf = torch.empty(words * count, dtype=torch.int32)
        rc = par(_state[key + "_addr"], *args, buf.data_ptr(), words, count)
        if rc == -3:   # built without the instructions: never ask again in this process
            _state["no_" + key] = True
        return rc == 0

    def call(part: int, count: int) -> int:
        buf = getattr(_scratch, "buf", None)   # per thread: each part packs its own K/V
        if buf is None or buf.numel() < words:
            buf = _scratch.buf = torch.empty(max(words, 1 << 16), dtype=torch.int32)
        rc = fn(*args, buf.data_ptr(), part, count,
                *(() if _quantized_kind is None else (_quantized_kind,)))
        if rc == -3:   # built without the instructions: never ask again in this process
            _state["no_" + key] = True
        return rc

    return _run_parts(call, count)


def paged_prefill_quantized(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
                            seq_lens: torch.Tensor, max_seq_len: int, scale: float,
                            out: torch.Tensor, parts: int | None = None) -> bool:
    """:func:`paged_prefill` over int8 / fp8 caches read in place: the kernel packs each
    sequence's K and V tiles straight from the quantized rows, each widened once to exactly
    what the dequantized scratch holds, so the attention equals the float kernel on the scratch
    (same packing, same arithmetic) without the scratch. Rows are in their stored (rotated)
    domain, as for :func:`paged_decode_quantized`. ``False`` when not run: operands
    :func:`supports_quantized` refuses (cu_seqlens_q must be int32 and contiguous too), a CPU
    without AVX512F or AVX2 + FMA (float32 query) / AVX512-BF16 (bfloat16), e4m3 under
    denormals-are-zero."""
    if not (enabled() and cu_seqlens_q.dtype == torch.int32 and cu_seqlens_q.is_contiguous()
            and cu_seqlens_q.device.type == "cpu"
            and supports_quantized(q, k_cache, v_cache, block_tables, seq_lens, out)):
        return False
    return paged_prefill(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens,
                         max_seq_len, scale, out, checked=True, parts=parts,
                         _quantized_kind=_QUANT_KINDS[k_cache.dtype] + _DTYPES[q.dtype])


def greedy_logsumexp(logits: torch.Tensor) -> tuple[list[int], list[float]] | None:
    """(greedy token, log-sum-exp) of each row of float32 CPU ``[R, V]`` logits, in one native
    pass per row (``cpu_sampling.c``): the token is the lowest index of the row's maximum, as
    ``max(dim)`` gives. ``None`` when not run (the caller uses torch): disabled, no library,
    another dtype or device, a non-unit inner stride, or a row holding a NaN."""
    if (not enabled() or logits.dim() != 2 or logits.dtype != torch.float32
            or logits.device.type != "cpu" or logits.stride(1) != 1 or logits.shape[0] == 0):
        return None
    fn = _entry("greedy")
    if fn is None:
        return None
    rows = logits.shape[0]
    tokens = torch.empty(rows, dtype=torch.int64)
    lse = torch.empty(rows, dtype=torch.float32)
    if fn(logits.data_ptr(), rows, logits.shape[1], logits.stride(0), tokens.data_ptr(),
          lse.data_ptr()) != 0:
        return None
    return tokens.tolist(), lse.tolist()
