"""Compile every Triton kernel of the package for a CUDA target without a GPU (Triton's own
LLVM and the ptxas its wheel ships), with the launch shapes the launchers use: catches what
only the compiled path can show (the ``for`` token loops, constexpr branches, layouts, shared
memory), and reports whether the token loops are software-pipelined (``cp.async`` copies).

Run as a script in a process where triton is NOT in interpreter mode:
``python tests/kernels/triton_aot.py [ARCH ...]`` prints one JSON line per kernel variant.
Pointer arguments carry ``tt.divisibility = 16``, as the JIT gives them for 16-byte aligned
tensors (every cache, table and output the launchers pass)."""

from __future__ import annotations

import json
import re
import sys

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from radixkv.kernels import triton_attention as ta
from radixkv.kernels import triton_cache as tc

_PTR = {"bf16": "*bf16", "fp16": "*fp16", "fp32": "*fp32"}
_DOT = {"bf16": tl.bfloat16, "fp16": tl.float16, "fp32": tl.float32}


def _compile(fn, sig: dict, consts: dict, opts: dict, arch: int) -> dict:
    for k in consts:
        sig[k] = "constexpr"
    names = list(sig)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names if n.endswith("_ptr")}
    kernel = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                            target=GPUTarget("cuda", arch, 32), options=opts)
    ttgir = kernel.asm["ttgir"]
    return {"kernel": fn.__name__, "arch": arch, "shared_bytes": kernel.metadata.shared,
            "pipelined": "async_copy_global_to_local" in ttgir or "async_tma" in ttgir,
            "loops": len(re.findall(r"scf\.for", ttgir)),
            **{k: str(v) for k, v in consts.items() if k in ("HEAD_DIM", "QUANT", "DOT_TY",
                                                           "SPLIT", "BLOCK_N")}}


def decode(arch: int, dt: str, head_dim: int, quant: int = 0, split: bool = True,
           group: int = 4) -> dict:
    ptr, kv = _PTR[dt], {0: _PTR[dt], 1: "*i8", 2: "*u8"}[quant]
    scale = "*fp16" if quant else ptr
    cfg = dict(ta.DECODE_CONFIG[64 if ta._block_d(head_dim) <= 64 else 128])
    sig = dict(q_ptr=ptr, k_ptr=kv, v_ptr=kv, ks_ptr=scale, vs_ptr=scale, bt_ptr="*i32",
               lens_ptr="*i32", out_ptr=ptr, part_out_ptr="*fp32" if split else ptr,
               part_lse_ptr="*fp32" if split else ptr, scale_log2="fp32", stride_bt="i32",
               num_kv_heads="i32", tokens_per_split="i32", num_splits="i32")
    consts = dict(BLOCK_SIZE=16, HEAD_DIM=head_dim, BLOCK_D=ta._block_d(head_dim),
                  ROW=head_dim + 2 if quant else head_dim, QUANT=quant, GROUP=group,
                  BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_N=cfg.pop("BLOCK_N"),
                  SPLIT=split, WHILE_LOOP=False, DOT_TY=_DOT[dt],
                  PRECISION="ieee" if dt == "fp32" else None)
    return _compile(ta._decode_kernel, sig, consts, cfg, arch)


def merge(arch: int, head_dim: int) -> dict:
    sig = dict(part_out_ptr="*fp32", part_lse_ptr="*fp32", lens_ptr="*i32", out_ptr="*bf16",
               num_q_heads="i32", tokens_per_split="i32", num_splits="i32")
    consts = dict(HEAD_DIM=head_dim, BLOCK_S=32, BLOCK_D=ta._block_d(head_dim),
                  WHILE_LOOP=False)
    return _compile(ta._merge_kernel, sig, consts, {}, arch)


def prefill(arch: int, dt: str, head_dim: int, quant: int = 0) -> dict:
    ptr, kv = _PTR[dt], {0: _PTR[dt], 1: "*i8", 2: "*u8"}[quant]
    scale = "*fp16" if quant else ptr
    cfg = dict(ta.PREFILL_CONFIG[64 if ta._block_d(head_dim) <= 64 else 128])
    sig = dict(q_ptr=ptr, k_ptr=kv, v_ptr=kv, ks_ptr=scale, vs_ptr=scale, bt_ptr="*i32",
               cu_q_ptr="*i32", lens_ptr="*i32", out_ptr=ptr, scale_log2="fp32",
               stride_bt="i32", num_q_heads="i32", num_kv_heads="i32")
    consts = dict(BLOCK_SIZE=16, HEAD_DIM=head_dim, BLOCK_D=ta._block_d(head_dim),
                  ROW=head_dim + 2 if quant else head_dim, QUANT=quant, GROUP=4,
                  BLOCK_M=cfg.pop("BLOCK_M"), BLOCK_N=cfg.pop("BLOCK_N"), WHILE_LOOP=False,
                  DOT_TY=_DOT[dt], PRECISION="ieee" if dt == "fp32" else None)
    return _compile(ta._prefill_kernel, sig, consts, cfg, arch)


def cache_ops(arch: int) -> list[dict]:
    write = dict(key_ptr="*bf16", value_ptr="*bf16", k_cache_ptr="*bf16", v_cache_ptr="*bf16",
                 slot_ptr="*i64", num_tokens="i32", stride_key="i32", stride_value="i32")
    copy = dict(kv_ptr="*i64", src_ptr="*i64", dst_ptr="*i64", num_blocks="i32",
                block_words="i32")
    return [_compile(tc._write_kv_kernel, write, dict(ROW=512, BLOCK=512, BLOCK_T=8), {}, arch),
            _compile(tc._copy_blocks_kernel, copy, dict(BLOCK=1024), {}, arch)]


def all_variants(arch: int) -> list[dict]:
    return [
        decode(arch, "bf16", 64), decode(arch, "bf16", 64, split=False),
        decode(arch, "bf16", 128), decode(arch, "fp16", 96, group=2),
        decode(arch, "fp32", 128, group=8), decode(arch, "bf16", 64, quant=1),
        decode(arch, "bf16", 128, quant=2),
        merge(arch, 64), merge(arch, 96),
        prefill(arch, "bf16", 64), prefill(arch, "bf16", 128), prefill(arch, "fp16", 96),
        prefill(arch, "bf16", 64, quant=2),
        *cache_ops(arch),
    ]


if __name__ == "__main__":
    for a in [int(x) for x in sys.argv[1:]] or [90]:
        for row in all_variants(a):
            print(json.dumps(row), flush=True)
