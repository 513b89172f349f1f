"""``radixkv bench decode-ops``: what the native CPU norm, rope and (bf16) silu-multiply
(``kernels/native_fused.py``) buy a forward of the embedded model, paired against the torch
references in the same process.

Question: at one thread a decode step of the embedded SmolLM2-135M spent ~2 ms of ~17 in the
lean forward's small torch ops (residual add + RMSNorm, rope + K/V write; since 2026-12-07 the
MLP's silu-multiply too, where it is native) and in re-planning
the decode attention per layer. How much faster is a forward with the native ops and the
per-forward plans, at batch 1 and 4 and on a cached chat turn (32 new tokens over a cached
history), and are the outputs still the same?

Method: one ``Engine`` (bf16 by the machine's default, ``--threads`` torch threads); the
switch ``decoder_forward.use_native_cpu_ops`` flips before every forward, so consecutive
forwards of the same batch alternate between the two op sets, and each forward's wall time is
taken around ``DecoderForward.__call__``. Per scenario: the medians of each arm, the median of
the per-pair ratios (native / reference, a pair = two consecutive forwards of the same kind)
and in how many pairs native was lower. The greedy tokens of a run with each op set alone are
compared (they must be equal: the ops are bit-identical). JSON:
``benchmarks/results/decode_ops.json``.

Usage: ``radixkv bench decode-ops [--quick] [--threads N] [--tokens K] [--turns T]``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from radixkv.benchmarks._common import plain_doc, print_table, run_header, write_results

PROMPT = "Explain the history of the Roman empire in detail, with dates and names. "


def _summary(name: str, pairs: list[tuple[float, float]]) -> dict[str, Any]:
    ref = [r for r, _ in pairs]
    nat = [n for _, n in pairs]
    ratios = [n / r for r, n in pairs]
    return {"scenario": name, "pairs": len(pairs),
            "reference_ms": statistics.median(ref) * 1e3,
            "native_ms": statistics.median(nat) * 1e3,
            "pair_ratio_median": statistics.median(ratios),
            "native_lower_in": sum(r < 1 for r in ratios)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="radixkv bench decode-ops", description=plain_doc(__doc__))
    ap.add_argument("--quick", action="store_true", help="40 tokens, 4 turns (a smoke run)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=300, help="decoded tokens per decode scenario")
    ap.add_argument("--turns", type=int, default=24, help="cached chat turns (extend scenario)")
    args = ap.parse_args(argv)
    if args.quick:
        args.tokens, args.turns = 40, 4
    import torch

    torch.set_num_threads(args.threads)
    import radixkv
    from radixkv.engine import decoder_forward

    header = run_header(None, quick=args.quick, threads=args.threads, tokens=args.tokens,
                        turns=args.turns, cpu_capability=torch.backends.cpu.get_cpu_capability())
    print(header)
    engine = radixkv.Engine.from_pretrained()
    forwards: list[tuple[str, int, float]] = []   # (arm, new tokens, seconds)
    alternate = [True]
    original = decoder_forward.DecoderForward.__call__

    def timed(self: Any, ctx: Any) -> Any:
        native = decoder_forward._native_cpu_ops[0]
        if alternate[0]:
            native = not native
            decoder_forward.use_native_cpu_ops(native)
        t0 = time.perf_counter()
        out = original(self, ctx)
        forwards.append(("native" if native else "reference", int(ctx.batch.input_ids.shape[1]),
                         time.perf_counter() - t0))
        return out

    greedy = radixkv.SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
    rows = []
    decoder_forward.DecoderForward.__call__ = timed   # type: ignore[method-assign]
    try:
        # same tokens with each op set alone
        alternate[0] = False
        tokens = {}
        for native in (False, True):
            decoder_forward.use_native_cpu_ops(native)
            out = engine.generate([PROMPT + "same"], greedy)
            tokens[native] = list(out[0].outputs[0].token_ids)
        same = tokens[True] == tokens[False]
        alternate[0] = True
        for batch in (1, 4):
            forwards.clear()
            engine.generate([PROMPT * 2 + f"b{batch} #{i}" for i in range(batch)], greedy)
            decode = [(arm, dt) for arm, n, dt in forwards if n == batch]
            pairs = [(a[1], b[1]) if a[0] == "reference" else (b[1], a[1])
                     for a, b in zip(decode[0::2], decode[1::2])]
            rows.append(_summary(f"decode, batch {batch}", pairs))
        # cached chat turns: each turn adds ~32 tokens to a cached history of ~500
        tok = engine.tokenizer
        history = tok.encode("The history of the Roman empire spans many centuries. " * 50)[:500]
        engine.generate([history], radixkv.SamplingParams(max_tokens=1))
        forwards.clear()
        for i in range(args.turns):
            turn = tok.encode(f" Question {i}: what happened in the year {100 + i} and why did "
                              "it matter so much to everyone involved then?")[:32]
            history = history + turn
            engine.generate([history], radixkv.SamplingParams(max_tokens=1))
        ext = [(arm, dt) for arm, n, dt in forwards if n > 1]
        pairs = [(a[1], b[1]) if a[0] == "reference" else (b[1], a[1])
                 for a, b in zip(ext[0::2], ext[1::2]) if a[0] != b[0]]
        rows.append(_summary("cached turn, 32 new over ~500-1300 cached", pairs))
    finally:
        decoder_forward.DecoderForward.__call__ = original   # type: ignore[method-assign]
        decoder_forward.use_native_cpu_ops(True)
        engine.close()
    print_table(rows, ["scenario", "pairs", "reference_ms", "native_ms", "pair_ratio_median",
                       "native_lower_in"],
                title=f"lean forward, native CPU norm/rope/silu vs the torch references "
                      f"({args.threads} thread(s), paired in one process)")
    print(f"greedy tokens equal with either op set ({args.tokens} tokens): "
          f"{'yes' if same else 'NO'}")
    write_results("decode_ops_quick" if args.quick else "decode_ops", header,
                  {"rows": rows, "same_tokens": same})
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
