"""The fused per-layer ops (kernels/fused.py): custom ops vs their torch references vs
transformers' arithmetic, and the Triton kernels (kernels/triton_fused.py) under the interpreter
against the references (compiled on CUDA when there is one).

The references must compute what transformers' modules compute, bit for bit on the CPU: the
engine's fp32 greedy output is compared token for token with ``transformers.generate``, and the
lean forward's logits bit for bit with the module path (tests/engine/test_decoder_forward.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from triton_probe import triton_interpreted_here
from radixkv.kernels import PAD_SLOT, fused

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _hf_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    norm = LlamaRMSNorm(x.shape[-1], eps=eps).to(x.dtype)
    with torch.no_grad():
        norm.weight.copy_(w)
    return norm(x)


def _hf_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' apply_rotary_pos_emb on a token-major [T, H, D] tensor."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    xt = x.transpose(0, 1)[None]                      # [1, H, T, D]
    out, _ = apply_rotary_pos_emb(xt, xt, cos[None], sin[None])
    return out[0].transpose(0, 1)


def _cos_sin(positions: torch.Tensor, d: int, dtype: torch.dtype):
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    freqs = positions[:, None].float() * inv[None]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


# ----------------------------------------------------------------------------- references

@pytest.mark.parametrize("dtype", DTYPES)
def test_references_equal_transformers_bit_for_bit(dtype):
    g = _gen(1)
    x = torch.randn(5, 48, generator=g).to(dtype)
    r = torch.randn(5, 48, generator=g).to(dtype)
    w = (torch.rand(48, generator=g) + 0.5).to(dtype)
    assert torch.equal(fused.rms_norm(x, w, 1e-6), _hf_rms_norm(x, w, 1e-6))
    normed, total = fused.add_rms_norm(x, r, w, 1e-5)
    assert torch.equal(total, x + r)
    assert torch.equal(normed, _hf_rms_norm(x + r, w, 1e-5))
    gu = torch.randn(5, 64, generator=g).to(dtype)
    want = torch.nn.functional.silu(gu[:, :32]) * gu[:, 32:]
    assert torch.equal(fused.silu_mul(gu), want)
    q = torch.randn(5, 4, 16, generator=g).to(dtype)
    cos, sin = _cos_sin(torch.tensor([0, 3, 7, 8, 100]), 16, dtype)
    assert torch.equal(fused.rope_ref(q, cos, sin), _hf_rope(q, cos, sin))


def _rope_case(dtype, t=6, hq=4, hkv=2, d=16, num_blocks=6, block_size=4, seed=0, pad=()):
    """A fused q/k/v output, cos/sin and caches; slots of distinct shuffled blocks, ``pad``
    rows set to PAD_SLOT."""
    g = _gen(seed)
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g).to(dtype).view(t, hq + 2 * hkv, d)
    q, k, v = qkv[:, :hq], qkv[:, hq:hq + hkv], qkv[:, hq + hkv:]
    cos, sin = _cos_sin(torch.arange(t) * 5 + 1, d, dtype)
    kc = torch.randn(num_blocks, block_size, hkv, d, generator=g).to(dtype)
    vc = torch.randn(num_blocks, block_size, hkv, d, generator=g).to(dtype)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:t]
    for i in pad:
        slots[i] = PAD_SLOT
    return q, k, v, cos, sin, kc, vc, slots


@pytest.mark.parametrize("pad", [(), (1, 4)])
def test_rope_write_kv_writes_rotated_k_and_v_and_skips_pad(pad):
    q, k, v, cos, sin, kc, vc, slots = _rope_case(torch.float32, pad=pad)
    kc0, vc0 = kc.clone(), vc.clone()
    q_out = fused.rope_write_kv(q, k, v, cos, sin, kc, vc, slots, bool(pad))
    assert torch.equal(q_out, _hf_rope(q, cos, sin)) and q_out.is_contiguous()
    k_rot = _hf_rope(k, cos, sin)
    kf, vf = kc.view(-1, *kc.shape[2:]), vc.view(-1, *vc.shape[2:])
    want_k, want_v = kc0.view_as(kf).clone(), vc0.view_as(vf).clone()
    for i, s in enumerate(slots.tolist()):
        if s != PAD_SLOT:
            want_k[s], want_v[s] = k_rot[i], v[i]
    assert torch.equal(kf, want_k) and torch.equal(vf, want_v)


def test_ops_are_registered_custom_ops_with_fakes():
    """One dispatcher op each (what a dispatch mode counts), traceable with fake tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    for name in ("rms_norm", "add_rms_norm", "silu_mul", "rope_write_kv", "paged_decode"):
        assert hasattr(torch.ops.radixkv, name), name
    with FakeTensorMode():
        x = torch.empty(3, 32)
        assert fused.silu_mul(x).shape == (3, 16)
        assert fused.add_rms_norm(x, x, torch.empty(32), 1e-6)[1].shape == (3, 32)


# ----------------------------------------------------------------------------- Triton

def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:   # one unit in the last place of the dtype
        torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)


@pytest.fixture
def triton_fused(triton_backend):
    from radixkv.kernels import triton_fused as tf
    return tf


@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_norms_and_silu_match_references(triton_fused, triton_device, dtype):
    """Built on the CPU, run where the Triton cases run (the GPU with CUDA, else the
    interpreter), compared with the torch references on the CPU."""
    dev = triton_device
    g = _gen(2)
    x = torch.randn(7, 40, generator=g).to(dtype)          # 40: not a power of two (masked)
    r = torch.randn(7, 40, generator=g).to(dtype)
    w = (torch.rand(40, generator=g) + 0.5).to(dtype)
    _close(triton_fused.rms_norm(x.to(dev), w.to(dev), 1e-6).cpu(),
           fused.rms_norm_ref(x, w, 1e-6))
    got, total = triton_fused.add_rms_norm(x.to(dev), r.to(dev), w.to(dev), 1e-6)
    want, want_total = fused.add_rms_norm_ref(x, r, w, 1e-6)
    _close(total.cpu(), want_total)   # the interpreter may round bf16 otherwise than the GPU
    _close(got.cpu(), want)
    heads = torch.randn(3, 4, 16, generator=g).to(dtype)   # q/k norm: rows of [T, H, D]
    hw = torch.rand(16, generator=g).to(dtype)
    _close(triton_fused.rms_norm(heads.to(dev), hw.to(dev), 1e-6).cpu(),
           fused.rms_norm_ref(heads, hw, 1e-6))
    gu = torch.randn(5, 2 * 24, generator=g).to(dtype)
    _close(triton_fused.silu_mul(gu.to(dev)).cpu(), fused.silu_mul_ref(gu))


@pytest.mark.parametrize("dtype,pad", [(torch.float32, ()), (torch.bfloat16, (0, 3)),
                                       (torch.float16, ())])
def test_triton_rope_write_kv_matches_reference(triton_fused, triton_device, dtype, pad):
    dev = triton_device
    q, k, v, cos, sin, kc, vc, slots = _rope_case(dtype, d=32, hq=6, hkv=2, pad=pad, seed=3)
    kc_want, vc_want = kc.clone(), vc.clone()
    want = fused.rope_write_kv_ref(q, k, v, cos, sin, kc_want, vc_want, slots, True)
    kd, vd = kc.to(dev), vc.to(dev)
    got = triton_fused.rope_write_kv(q.to(dev), k.to(dev), v.to(dev), cos.to(dev),
                                     sin.to(dev), kd, vd, slots.to(dev))
    _close(got.cpu(), want)
    _close(kd.cpu(), kc_want)
    assert torch.equal(vd.cpu(), vc_want)      # V is copied, never rounded


def test_triton_fused_cases_in_subprocess():
    """Rerun this file with TRITON_INTERPRET=1 when triton was imported compiled before
    tests/kernels/conftest.py could set it (the Triton cases above then skip)."""
    pytest.importorskip("triton")
    if triton_interpreted_here():
        pytest.skip("the Triton cases ran in this process")
    if torch.cuda.is_available():
        pytest.skip("CUDA: test_triton_fused_compiled_on_cuda runs them compiled")
    env = dict(os.environ, TRITON_INTERPRET="1")
    env.pop("RADIXKV_KERNEL_BACKEND", None)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
         str(Path(__file__))], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and "was imported before TRITON_INTERPRET" not in proc.stdout


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_triton_fused_compiled_on_cuda():
    """The custom ops on CUDA (their Triton kernels, compiled) against the references."""
    if triton_interpreted_here():
        pytest.skip("triton imported in interpreter mode in this process")
    dev = "cuda"
    for dtype in DTYPES:
        g = _gen(4)
        x = torch.randn(9, 2048, generator=g).to(dtype)
        r = torch.randn(9, 2048, generator=g).to(dtype)
        w = torch.rand(2048, generator=g).to(dtype)
        _close(fused.rms_norm(x.to(dev), w.to(dev), 1e-5).cpu(), fused.rms_norm_ref(x, w, 1e-5))
        got, total = fused.add_rms_norm(x.to(dev), r.to(dev), w.to(dev), 1e-5)
        want, want_total = fused.add_rms_norm_ref(x, r, w, 1e-5)
        _close(got.cpu(), want)
        assert torch.equal(total.cpu(), want_total)
        gu = torch.randn(9, 2 * 8192, generator=g).to(dtype)
        _close(fused.silu_mul(gu.to(dev)).cpu(), fused.silu_mul_ref(gu))
        case = _rope_case(dtype, t=17, hq=32, hkv=8, d=64, num_blocks=8, seed=5, pad=(2,))
        q, k, v, cos, sin, kc, vc, slots = case
        kc_w, vc_w = kc.clone(), vc.clone()
        want = fused.rope_write_kv_ref(q, k, v, cos, sin, kc_w, vc_w, slots, True)
        kd, vd = kc.to(dev), vc.to(dev)
        got = fused.rope_write_kv(q.to(dev), k.to(dev), v.to(dev), cos.to(dev), sin.to(dev),
                                  kd, vd, slots.to(dev), True)
        _close(got.cpu(), want)
        _close(kd.cpu(), kc_w)
        assert torch.equal(vd.cpu(), vc_w)
