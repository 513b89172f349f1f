"""Run the native float32-query kernels on seeded cases and save every output (torch.save to
argv[1]): ``test_native_isa_parity.py`` runs this under two builds of the library (AVX-512 and
AVX2 + FMA) on one CPU and compares the files. Not a test module (no ``test_`` prefix)."""

from __future__ import annotations

import sys

import torch

from kernel_cases import make_case
from radixkv.engine.kv_quant import quantize_rows
from radixkv.kernels import native


def _quantized(case, fmt: str) -> list[torch.Tensor]:
    return [quantize_rows(x.nan_to_num(0.0) * 3, fmt) for x in (case.k_cache, case.v_cache)]


def main(path: str) -> None:
    gen = torch.Generator().manual_seed(20261207)
    outs: dict[str, torch.Tensor | bool] = {"bf16_prefill_ran": False}
    for head_dim in sorted(native.HEAD_DIMS):
        for group, kv_heads in ((1, 2), (3, 2), (8, 1), (2, 5)):
            # cached lengths and chunk lengths across tile edges (16 rows / keys)
            lens, chunks = [37, 5, 70, 16, 1], [21, 5, 17, 16, 1]
            case = make_case(lens, block_size=16, num_kv_heads=kv_heads, head_dim=head_dim,
                             share_prefix=0, gen=gen)
            hq = group * kv_heads
            scale = head_dim ** -0.5
            cu = torch.tensor([0] + list(torch.tensor(chunks).cumsum(0)), dtype=torch.int32)
            q = torch.randn(int(cu[-1]), hq, head_dim, generator=gen) * 2
            qd = torch.randn(len(lens), hq, head_dim, generator=gen) * 2
            name = f"d{head_dim}-g{group}-h{kv_heads}"
            caches = {"float": (case.k_cache, case.v_cache)}
            for fmt in ("int8", "fp8_e4m3"):
                caches[fmt] = tuple(_quantized(case, fmt))
            for kind, (k, v) in caches.items():
                out = torch.full_like(q, float("nan"))
                if kind == "float":
                    ran = native.paged_prefill(q, k, v, case.block_tables, cu, case.seq_lens,
                                               max(lens), scale, out, parts=1)
                else:
                    ran = native.paged_prefill_quantized(q, k, v, case.block_tables, cu,
                                                         case.seq_lens, max(lens), scale, out,
                                                         parts=1)
                assert ran, ("prefill declined", name, kind)
                outs[f"prefill-{kind}-{name}"] = out
                dec = torch.full_like(qd, float("nan"))
                if kind == "float":
                    ran = native.paged_decode(qd, k, v, case.block_tables, case.seq_lens, scale,
                                              dec, parts=1)
                else:
                    ran = native.paged_decode_quantized(qd, k, v, case.block_tables,
                                                        case.seq_lens, scale, dec, parts=1)
                assert ran, ("decode declined", name, kind)
                outs[f"decode-{kind}-{name}"] = dec
    # whether this build has the bf16 prefill (AVX512-BF16): says which build ran
    case = make_case([20], head_dim=64, gen=gen)
    qb = torch.randn(20, 2, 64, generator=gen).bfloat16()
    cu = torch.tensor([0, 20], dtype=torch.int32)
    outs["bf16_prefill_ran"] = native.paged_prefill(
        qb, case.k_cache.bfloat16(), case.v_cache.bfloat16(), case.block_tables, cu,
        case.seq_lens, 20, 0.125, torch.empty_like(qb), parts=1)
    torch.save(outs, path)


if __name__ == "__main__":
    main(sys.argv[1])
