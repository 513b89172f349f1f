"""Linear layers on the CPU with their weights pre-packed for oneDNN: bfloat16 on CPUs with
native bf16, float32 on x86-64 CPUs (:data:`PACKED_DTYPES`).

Why: in decode every step multiplies a few rows (one per running sequence) by every weight
matrix, so the step is bound by streaming the weights. ``F.linear`` hands oneDNN a plain
row-major bf16 weight, which oneDNN re-lays out into its blocked (AMX / AVX512-BF16) format on
every call. Packing each weight once (``torch.ops.mkldnn._reorder_linear_weight``, what
``torch.compile(freezing=True)`` does for bf16 linears on the CPU) and calling
``torch.ops.mkldnn._linear_pointwise`` skips that: on the embedded model (16 sequences, 1
thread) decode went from 211 to 255 tok/s in one run (see docs/benchmarks.md). In float32,
``F.linear`` is MKL's sgemm; on an AVX2-only EPYC (Zen 2, where radixkv runs float32 by
default) oneDNN's packed GEMMs took 0.66-0.89x its time on one thread from 2 rows up, and
0.40-0.86x on two (MKL ran GEMMs of a few rows on one thread); whole forwards of the embedded
model: ``radixkv bench linears``, docs/benchmarks.md ("Packed linears").

Numerics, bf16: the packed call runs the same oneDNN kernel family as ``F.linear`` on the same
values; on the shapes of the embedded model and the tiny test models it is bit-identical to
``F.linear`` up to 256 rows (``tests/engine/test_packed_linear.py``, 1 and 2 threads), and on
an AVX512-BF16 EPYC (Zen 5) at every row count tried, up to 2,100. Beyond 256 rows another
CPU's ``F.linear`` may pick another kernel (an earlier machine did from ~300 rows for some
shapes), so there the two agree to bf16 rounding, not necessarily to the bit. Every row count
is packed: until 2026-11-28 inputs of more than 256 rows took ``F.linear`` to stay transformers'
own, but a cold bf16 prefill is not bit-identical to transformers' anyway (docs/architecture.md)
and ``F.linear`` re-lays out the weight on every call: a 257-token prefill of the embedded model
took 199 ms against 169 ms packed (one thread, medians of 5; docs/benchmarks.md).

Numerics, float32: not bit-identical to MKL's ``F.linear`` (another summation order: outputs
differ by float32 rounding, ~1e-6 relative), so a float32 forward agrees with transformers' to
float32 rounding rather than to the bit. What it gains besides speed: a row's bits do not
depend on how many rows share the call, nor on the thread count (MKL's do), on every shape
tested (tests/engine/test_packed_linear.py; a CPU where that fails the test fails), once a single
row goes through as two where the CPU's one-row kernel sums differently (:func:`single_row_differs`:
an AVX-512 EPYC's, for 1,536-wide inputs).

How: :func:`pack_linears` switches each ``nn.Linear`` of a bf16 or float32 model on the CPU to
:class:`PackedLinear` (a subclass: ``isinstance(m, nn.Linear)``, the state dict and the
``weight`` parameter are unchanged). The packed copy is kept *beside* the weight, not in a
buffer: ``model.to(...)``, ``load_state_dict`` or an in-place edit of the weight leave it stale,
and the layer notices (the weight's data pointer, dtype and version are the key) and repacks or
falls back to ``F.linear`` (a dtype this CPU does not pack). The cost is memory: a second copy
of every linear weight (on the embedded model 134 M parameters, +256 MiB in bf16; in float32
RSS went from 1,091 to 1,635 MiB); ``pack_linears(model, enable=False)`` /
:func:`unpack_linears` give it back (``EngineConfig.pack_weights=False`` never packs).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

#: The batch-size hint given to oneDNN when packing (decode batches are a few to tens of rows).
PACK_HINT_ROWS = 16


def packing_supported(dtype: torch.dtype, device: torch.device) -> bool:
    """True when weights of ``dtype`` on this CPU are pre-packed: bf16 where oneDNN has native
    bf16, float32 on x86-64 (oneDNN's AVX2 / AVX-512 kernels; see :data:`PACKED_DTYPES`)."""
    if dtype not in _CANDIDATES or device.type != "cpu":
        return False
    mkldnn = getattr(torch.ops, "mkldnn", None)
    try:
        if not (torch.backends.mkldnn.is_available()
                and mkldnn is not None and hasattr(mkldnn, "_linear_pointwise")):
            return False
        if dtype is torch.float32:
            return _x86_64()
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def _x86_64() -> bool:
    import platform
    return platform.machine().lower() in ("x86_64", "amd64")


class _Packed:
    """The packed weight and what it was packed from (the weight's storage pointer, dtype and
    version: a conversion or an in-place edit changes one of them).

    Deep copies and pickles of the model carry an empty holder (oneDNN's opaque tensors can be
    neither copied nor pickled); the copy packs its own weight on first use.
    """

    __slots__ = ("ptr", "version", "tensor", "pad_one")

    def __init__(self) -> None:
        self.ptr = self.version = -1
        self.tensor: torch.Tensor | None = None
        #: a single row goes through as two (:func:`single_row_differs`)
        self.pad_one = False

    def __deepcopy__(self, memo: dict) -> _Packed:
        return _Packed()

    def __getstate__(self) -> dict:
        return {}

    def __setstate__(self, state: dict) -> None:
        self.__init__()


_CANDIDATES = (torch.bfloat16, torch.float32)
#: The dtypes :class:`PackedLinear` packs on this CPU (:func:`packing_supported`). float32
#: since 2026-11-28: on a CPU without native bf16 (radixkv's default dtype there is float32)
#: ``F.linear`` goes to MKL's sgemm, which on the project's AVX2 EPYC (Zen 2) took 1.1-1.5x
#: oneDNN's packed time at 2-512 rows on one thread and up to 2.5x on two (MKL ran those
#: small GEMMs on one thread), and whose rows depend on the row count and the thread count;
#: oneDNN's packed float32 rows do not (tests/engine/test_packed_linear.py), which makes the
#: float32 lean forward thread-invariant too (docs/benchmarks.md, "Packed linears").
PACKED_DTYPES = frozenset(d for d in _CANDIDATES if packing_supported(d, torch.device("cpu")))


def weight_version(t: torch.Tensor) -> int:
    """``t._version``, or -2 for an inference tensor (weights created under
    ``torch.inference_mode`` track no version; only their pointer is compared then)."""
    return -2 if t.is_inference() else t._version


class PackedLinear(torch.nn.Linear):
    """``nn.Linear`` whose CPU forward in a :data:`PACKED_DTYPES` dtype uses a once-packed
    oneDNN weight (see module doc); anything else goes to ``F.linear``.

    ``_packed`` is an instance attribute, not a buffer or parameter, so the module's state dict
    and ``.to()`` see exactly an ``nn.Linear``. The forward runs once per layer per step, so it
    reads ``_parameters`` directly (``nn.Module.__getattr__`` costs more than the checks).
    """

    _packed: _Packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        params = self._parameters
        w = params["weight"]
        if (x.dtype is not w.dtype or w.dtype not in PACKED_DTYPES or x.is_cuda or w.is_cuda
                or x.device.type != "cpu"
                or (w.requires_grad and torch.is_grad_enabled())):
            return F.linear(x, w, params["bias"])
        holder = self._packed
        if holder.ptr != w.data_ptr() or holder.version != weight_version(w):
            with torch.no_grad():
                holder.tensor = torch.ops.mkldnn._reorder_linear_weight(
                    w.detach(), PACK_HINT_ROWS)
                holder.pad_one = single_row_differs(holder.tensor, w.shape[1], w.dtype)
            holder.ptr, holder.version = w.data_ptr(), weight_version(w)
        return packed_matmul(x, holder.tensor, params["bias"], holder.pad_one)


def packed_matmul(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
                  pad_one: bool = False) -> torch.Tensor:
    """``x @ W^T (+ bias)`` with ``W`` packed by ``_reorder_linear_weight``: every packed call.
    With ``pad_one`` (what :func:`single_row_differs` found for this weight) an input of a
    single row goes through as two rows (the row twice; the first comes back)."""
    if pad_one and x.numel() == x.shape[-1]:
        row = x if x.dim() == 2 else x.reshape(1, x.shape[-1])
        out = torch.ops.mkldnn._linear_pointwise(torch.cat((row, row)), packed, bias, "none",
                                                 [], "")[:1]
        return out if x.dim() == 2 else out.reshape(*x.shape[:-1], out.shape[-1])
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def single_row_differs(packed: torch.Tensor, width: int, dtype: torch.dtype) -> bool:
    """Whether this CPU's oneDNN gives a single row of ``packed`` other bits than the same row
    in a call of two (checked once per packed weight, on a seeded input; float32 only).

    Why: on an AVX-512 EPYC (Zen 5) oneDNN takes another kernel for one float32 row than for
    two or more, whose sums differ in the last bit for the embedded model's 1,536-wide down
    projection (not for its 576-wide inputs, not in bf16, not on the AVX2 EPYC), so a lone
    decode row would not be the bits the same row gets in a batch. From two rows up every row
    count tried gives each row the same bits (``tests/engine/test_packed_linear.py``), and two
    rows cost what one does (50.1 against 50.8 us for that weight, one thread), so where the
    single row differs it goes through as two; the copy costs ~2 us a call, paid only there.
    """
    if dtype is not torch.float32:
        return False
    x = torch.randn(2, width, generator=torch.Generator().manual_seed(width))
    lp = torch.ops.mkldnn._linear_pointwise
    return not torch.equal(lp(x[:1], packed, None, "none", [], ""),
                           lp(x, packed, None, "none", [], "")[:1])


def pack_linears(model: torch.nn.Module, enable: bool = True) -> int:
    """Switch every ``nn.Linear`` of ``model`` to :class:`PackedLinear` (``enable=False``:
    back to ``nn.Linear``); returns how many layers changed. Packing happens lazily, at each
    layer's first bf16 CPU forward, so this is cheap and safe on any dtype or device: layers
    that never see a packable input behave exactly as ``nn.Linear``.
    """
    changed = 0
    for mod in model.modules():
        if enable and type(mod) is torch.nn.Linear:
            mod.__class__ = PackedLinear
            object.__setattr__(mod, "_packed", _Packed())
            changed += 1
        elif not enable and type(mod) is PackedLinear:
            mod.__class__ = torch.nn.Linear
            mod.__dict__.pop("_packed", None)
            changed += 1
    return changed


def unpack_linears(model: torch.nn.Module) -> int:
    """Undo :func:`pack_linears` (frees the packed copies)."""
    return pack_linears(model, enable=False)


def thread_variance(gemms: Sequence[tuple[str, Callable[[torch.Tensor], torch.Tensor], int]],
                    dtype: torch.dtype, threads: int, row_counts: Sequence[int]) -> str | None:
    """Where one of ``gemms`` (name, the call, its input width) gives other bits on ``threads``
    threads than on one, for inputs of each of ``row_counts`` rows; None where none does.

    Why: the runner lets a packed forward's thread count follow the machine's load
    (``ModelRunner.thread_invariant``) because oneDNN's packed GEMMs did not change a bit with
    the thread count on every CPU the tests ran on; this checks it on the CPU the engine runs
    on, with the engine's own packed copies, before it relies on it. Fixed inputs (seeded); the
    calling thread's torch thread count is set back afterwards.
    """
    gen = torch.Generator().manual_seed(0x5EED)
    current = torch.get_num_threads()
    try:
        with torch.inference_mode():
            for name, gemm, width in gemms:
                for rows in row_counts:
                    x = torch.randn(rows, width, generator=gen).to(dtype)
                    torch.set_num_threads(threads)
                    many = gemm(x)
                    torch.set_num_threads(1)
                    one = gemm(x)
                    if not torch.equal(many, one):
                        worst = float((many.float() - one.float()).abs().max())
                        return (f"{name} on {rows} rows x {width}: {threads} threads and one "
                                f"differ by up to {worst:.3g}")
    finally:
        torch.set_num_threads(current)
    return None


def packed_bytes(model: Any) -> int:
    """Bytes held by packed copies right now (their weights' sizes; oneDNN's opaque tensors do
    not report storage)."""
    total = 0
    for mod in model.modules():
        holder = getattr(mod, "_packed", None)
        if isinstance(holder, _Packed) and holder.tensor is not None:
            total += mod.weight.numel() * mod.weight.element_size()
    return total
