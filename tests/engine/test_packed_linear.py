"""Pre-packed linears (engine/packed_linear.py): bf16 bit-identical to ``F.linear``, float32
within rounding of it and with rows that depend neither on the row count nor on the thread
count; safe to copy, convert and undo; what the runner turns on for CPU models."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
import torch.nn.functional as F

from radixkv.engine import packed_linear as pl
from radixkv.engine.model_runner import ModelRunner

needs_bf16 = pytest.mark.skipif(
    not pl.packing_supported(torch.bfloat16, torch.device("cpu")),
    reason="this CPU/torch has no oneDNN bf16 (packing is off there, nothing to test)")
needs_fp32 = pytest.mark.skipif(
    not pl.packing_supported(torch.float32, torch.device("cpu")),
    reason="float32 linears are packed on x86-64 with oneDNN only")
#: The embedded model's fused GEMMs (q/k/v 960 x 576, o, gate/up 3072 x 576, down), its head
#: and the tiny test models' shapes.
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576), (64, 64),
          (128, 64), (64, 128), (256, 64)]


def _unpacked_call(*args, **kwargs):
    raise AssertionError("F.linear called where the packed weight should have been used")


@needs_bf16
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("out_f, in_f", [(576, 576), (192, 576), (1536, 576), (576, 1536),
                                         (4096, 576), (64, 64), (32, 64), (128, 64)])
def test_packed_is_bit_identical_up_to_256_rows_and_close_beyond(threads, out_f, in_f,
                                                                 monkeypatch):
    """The shapes of the embedded model (q/o 576x576, k/v 192x576, MLP, a large head) and of the
    tiny test models: bit-identical to ``F.linear`` from 1 to 256 rows; longer inputs are packed
    too and agree to bf16 rounding (bit-identical on this project's EPYC, not promised on every
    CPU: ``F.linear`` may pick another kernel for many rows)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(out_f + in_f)
        lin = torch.nn.Linear(in_f, out_f, bias=out_f == 192).to(torch.bfloat16)
        ref = copy.deepcopy(lin)
        assert pl.pack_linears(lin) == 1 and isinstance(lin, torch.nn.Linear)
        for rows in (1, 2, 3, 16, 17, 64, 100, 255, 256, 300, 600):
            x = torch.randn(1, rows, in_f, generator=g).to(torch.bfloat16)
            with torch.inference_mode():
                want = ref(x)
                with monkeypatch.context() as m:   # every row count takes the packed call
                    m.setattr(pl.F, "linear", _unpacked_call)
                    got = lin(x)
            if rows <= 256:
                assert torch.equal(got, want), rows
            else:
                torch.testing.assert_close(got, want, rtol=2 ** -7, atol=1e-2)
        assert pl.packed_bytes(lin) == out_f * in_f * 2
    finally:
        torch.set_num_threads(before)


@needs_bf16
def test_stale_pack_is_noticed_and_copies_repack():
    lin = torch.nn.Linear(64, 32).to(torch.bfloat16)
    pl.pack_linears(lin)
    x = torch.randn(5, 64).to(torch.bfloat16)
    with torch.inference_mode():
        lin(x)
    with torch.no_grad():
        lin.weight.mul_(2)                       # in-place edit: the version changes
    with torch.inference_mode():
        assert torch.equal(lin(x), F.linear(x, lin.weight, lin.bias))
    twin = copy.deepcopy(lin)                    # oneDNN tensors cannot be copied: repacked
    again = pickle.loads(pickle.dumps(lin))
    with torch.inference_mode():
        assert torch.equal(twin(x), lin(x)) and torch.equal(again(x), lin(x))
    lin.float()                                  # a dtype change: float32, repacked if packed
    with torch.inference_mode():
        got, want = lin(x.float()), F.linear(x.float(), lin.weight, lin.bias)
        if torch.float32 in pl.PACKED_DTYPES:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        else:
            assert torch.equal(got, want)
    assert pl.unpack_linears(lin) == 1 and type(lin) is torch.nn.Linear
    assert "_packed" not in lin.__dict__


def test_runner_packs_the_dtypes_this_cpu_packs(tiny_model):
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        model = tiny_model("llama").to(dtype)
        ModelRunner.for_model(model, num_blocks=8, block_size=4)
        packed = any(isinstance(m, pl.PackedLinear) for m in model.modules())
        assert packed == (dtype in pl.PACKED_DTYPES)
        assert packed == pl.packing_supported(dtype, torch.device("cpu"))
    assert torch.float16 not in pl.PACKED_DTYPES
    assert not pl.packing_supported(torch.float32, torch.device("meta"))


@needs_fp32
def test_a_dtype_this_cpu_does_not_pack_falls_back_to_f_linear(monkeypatch):
    """A packed float32 model converted to a dtype the CPU does not pack (float16; bf16 on a
    CPU without native bf16) runs ``F.linear``: no oneDNN call that would raise."""
    lin = torch.nn.Linear(64, 32)
    pl.pack_linears(lin)
    x = torch.randn(3, 64)
    with torch.inference_mode():
        lin(x)
    lin.half()
    monkeypatch.setattr(pl.torch.ops.mkldnn, "_reorder_linear_weight", _unpacked_call,
                        raising=False)
    with torch.inference_mode():
        assert torch.equal(lin(x.half()), F.linear(x.half(), lin.weight, lin.bias))


@needs_fp32
@pytest.mark.parametrize("out_f, in_f", SHAPES)
def test_float32_packed_rows_do_not_depend_on_the_row_or_thread_count(out_f, in_f, monkeypatch):
    """Every row of a packed float32 call is the same bits whatever rows share the call and
    on one or two threads (what ``ModelRunner.thread_invariant`` relies on); against MKL's
    ``F.linear`` the values agree to float32 rounding."""
    before = torch.get_num_threads()
    g = torch.Generator().manual_seed(out_f * 7 + in_f)
    lin = torch.nn.Linear(in_f, out_f, bias=out_f == 960)
    ref = copy.deepcopy(lin)
    pl.pack_linears(lin)
    x = torch.randn(600, in_f, generator=g)
    try:
        with torch.inference_mode(), monkeypatch.context() as m:
            m.setattr(pl.F, "linear", _unpacked_call)   # every call takes the packed path
            torch.set_num_threads(1)
            full = lin(x)
            for start, stop in ((0, 1), (0, 2), (5, 8), (0, 16), (3, 67), (100, 343),
                                (0, 257), (88, 600)):
                assert torch.equal(lin(x[start:stop]), full[start:stop]), (start, stop)
            torch.set_num_threads(2)
            for start, stop in ((0, 1), (0, 4), (7, 40), (0, 243), (0, 600)):
                assert torch.equal(lin(x[start:stop]), full[start:stop]), (start, stop)
        with torch.inference_mode():
            torch.testing.assert_close(full, ref(x), rtol=1e-4, atol=1e-5)
        assert pl.packed_bytes(lin) == out_f * in_f * 4
    finally:
        torch.set_num_threads(before)


@needs_bf16
def test_weights_made_under_inference_mode():
    """Inference tensors track no version: the pack is keyed by the pointer alone."""
    with torch.inference_mode():
        lin = torch.nn.Linear(64, 32).to(torch.bfloat16)
        pl.pack_linears(lin)
        x = torch.randn(3, 64).to(torch.bfloat16)
        assert torch.equal(lin(x), F.linear(x, lin.weight, lin.bias))


@needs_fp32
def test_a_single_row_marked_to_pad_is_the_first_row_of_a_call_of_two():
    """``packed_matmul`` with ``pad_one`` (set per packed weight where this CPU's single-row
    kernel sums differently: AVX-512 Zen 5, 1,536-wide float32 inputs) returns the row as a
    call of two rows makes it, in the input's own shape, bias included."""
    g = torch.Generator().manual_seed(3)
    w, b = torch.randn(40, 1536, generator=g), torch.randn(40, generator=g)
    packed = torch.ops.mkldnn._reorder_linear_weight(w, pl.PACK_HINT_ROWS)
    x = torch.randn(1, 1536, generator=g)
    with torch.inference_mode():
        two = pl.packed_matmul(torch.cat((x, x)), packed, b)
        assert torch.equal(pl.packed_matmul(x, packed, b, True), two[:1])
        three_d = pl.packed_matmul(x.view(1, 1, 1536), packed, b, True)
        assert three_d.shape == (1, 1, 40) and torch.equal(three_d.view(1, 40), two[:1])
        # several rows are never padded
        many = torch.randn(3, 1536, generator=g)
        assert torch.equal(pl.packed_matmul(many, packed, b, True),
                           pl.packed_matmul(many, packed, b))
        assert isinstance(pl.single_row_differs(packed, 1536, torch.float32), bool)
        assert pl.single_row_differs(packed, 1536, torch.bfloat16) is False
