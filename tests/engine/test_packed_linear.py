"""Pre-packed bf16 linears (engine/packed_linear.py): bit-identical to ``F.linear``, safe to copy,
convert and undo, and what the runner turns on for bf16 CPU models."""

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
    lin.float()                                  # a dtype change: plain F.linear in float32
    with torch.inference_mode():
        assert torch.equal(lin(x.float()), F.linear(x.float(), lin.weight, lin.bias))
    assert pl.unpack_linears(lin) == 1 and type(lin) is torch.nn.Linear
    assert "_packed" not in lin.__dict__


def test_runner_packs_bf16_cpu_models_only(tiny_model):
    fp32 = tiny_model("llama")
    ModelRunner.for_model(fp32, num_blocks=8, block_size=4)
    assert not any(isinstance(m, pl.PackedLinear) for m in fp32.modules())
    bf16 = tiny_model("llama").to(torch.bfloat16)
    ModelRunner.for_model(bf16, num_blocks=8, block_size=4)
    packed = any(isinstance(m, pl.PackedLinear) for m in bf16.modules())
    assert packed == pl.packing_supported(torch.bfloat16, torch.device("cpu"))


@needs_bf16
def test_weights_made_under_inference_mode():
    """Inference tensors track no version: the pack is keyed by the pointer alone."""
    with torch.inference_mode():
        lin = torch.nn.Linear(64, 32).to(torch.bfloat16)
        pl.pack_linears(lin)
        x = torch.randn(3, 64).to(torch.bfloat16)
        assert torch.equal(lin(x), F.linear(x, lin.weight, lin.bias))
