"""``radixkv bench linears``: what pre-packed oneDNN linears (``engine/packed_linear.py``) buy
over ``F.linear`` on this CPU, per dtype the CPU runs, and whether their rows depend on the
batch or the thread count.

Question: radixkv packs each linear weight once for oneDNN. For bf16 (CPUs with native bf16)
that has been measured since the packing landed; float32 (radixkv's default dtype on every CPU
without native bf16, e.g. an AVX2-only EPYC) went to ``F.linear``, i.e. MKL's sgemm, until
2026-11-28. How much faster is the packed path, at the row counts a server's forwards have
(decode batches of 1-16 rows, chunks of tens to hundreds of tokens), at one and two threads,
on the GEMMs alone and on whole forwards of the embedded model? And are a row's bits the same
whatever the number of rows beside it and whatever the thread count (what
``ModelRunner.thread_invariant`` relies on, and what batch-composition determinism needs)?

Method, part 1 (GEMMs): the embedded model's per-layer linear shapes (q/k/v and gate/up fused,
as the lean forward runs them), one distinct random weight set per layer of the model so that,
as in a real forward, weights stream from memory rather than sit in cache; one "pass" = every
layer's four GEMMs on the same input rows. The two arms alternate pass by pass; per row count
and thread count the medians of each arm and the median of the per-pair ratios (packed / plain).
Invariance: the rows of an m-row call against the first m rows of a 600-row call (one thread),
and one thread against two, for both arms.

Method, part 2 (forwards): one ``Engine`` in ``--dtype`` (default float32), ``--threads``
torch threads. Before every forward (around ``ModelRunner.execute``, before the runner picks
the forward's thread count) the switch flips: ``packed_linear.PACKED_DTYPES`` without or with
the dtype, and the runner's ``thread_invariant`` as the unpacked runner would have it (so each
arm gets its own thread rule: docs/serve.md, "CPU threads on a shared machine"). Consecutive
forwards of the same batch alternate between the arms; each forward's wall time is taken
around ``DecoderForward.__call__``, with the thread count it ran on. Scenarios as ``bench
decode-ops``: decode at batch 1, 4 and 16, and cached chat turns (32 new tokens over a cached
history). The packed and plain GEMMs differ by float rounding, so the greedy tokens of each
arm alone are reported, not required equal. JSON: ``benchmarks/results/linears.json``.

Usage: ``radixkv bench linears [--quick] [--threads N] [--dtype float32|bfloat16]``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from radixkv.benchmarks._common import plain_doc, print_table, run_header, write_results

PROMPT = "Explain the history of the Roman empire in detail, with dates and names. "
ROWS = (1, 2, 4, 16, 64, 243, 512)


def _pairs_summary(pairs: list[tuple[float, float]]) -> dict[str, Any]:
    ratios = [p / r for r, p in pairs]
    return {"pairs": len(pairs),
            "plain_ms": statistics.median(r for r, _ in pairs) * 1e3,
            "packed_ms": statistics.median(p for _, p in pairs) * 1e3,
            "pair_ratio_median": statistics.median(ratios),
            "packed_lower_in": sum(r < 1 for r in ratios)}


def _layer_shapes(config: Any) -> list[tuple[int, int]]:
    """(in, out) of the lean forward's four GEMMs of one layer."""
    hidden = config.hidden_size
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    inter = config.intermediate_size
    return [(hidden, (heads + 2 * kv_heads) * head_dim), (heads * head_dim, hidden),
            (hidden, 2 * inter), (inter, hidden)]


def gemm_part(dtype: Any, threads: list[int], rows: tuple[int, ...], passes: int,
              layers: int, shapes: list[tuple[int, int]]) -> tuple[list[dict], dict]:
    import torch
    import torch.nn.functional as F

    from radixkv.engine import packed_linear

    gen = torch.Generator().manual_seed(0)
    sets = []
    for _ in range(layers):
        ws = [(torch.randn(n, k, generator=gen) * k ** -0.5).to(dtype) for k, n in shapes]
        packs = [torch.ops.mkldnn._reorder_linear_weight(w, packed_linear.PACK_HINT_ROWS)
                 for w in ws]
        # each packed weight with its single-row rule, as the engine's packed layers run it
        sets.append([(w, (pw, packed_linear.single_row_differs(pw, w.shape[1], dtype)))
                     for w, pw in zip(ws, packs)])
    inputs = {k: torch.randn(600, k, generator=gen).to(dtype) for k, _ in shapes}

    def plain(m: int) -> None:
        for layer in sets:
            for (k, _), (w, _) in zip(shapes, layer):
                F.linear(inputs[k][:m], w)

    def packed(m: int) -> None:
        for layer in sets:
            for (k, _), (_, (pw, pad)) in zip(shapes, layer):
                packed_linear.packed_matmul(inputs[k][:m], pw, None, pad)

    out = []
    before = torch.get_num_threads()
    try:
        for n in threads:
            torch.set_num_threads(n)
            for m in rows:
                plain(m)
                packed(m)
                pairs = []
                for i in range(passes):
                    arms = (plain, packed) if i % 2 == 0 else (packed, plain)
                    t = {}
                    for arm in arms:
                        t0 = time.perf_counter()
                        arm(m)
                        t[arm] = time.perf_counter() - t0
                    pairs.append((t[plain], t[packed]))
                row = {"dtype": str(dtype).replace("torch.", ""), "threads": n, "rows": m}
                row.update(_pairs_summary(pairs))
                out.append(row)
        # invariance, on the first layer's weights
        inv: dict[str, dict[str, bool]] = {"plain": {}, "packed": {}}
        for name in inv:
            rows_same = threads_same = True
            for (k, _), (w, pw) in zip(shapes, sets[0]):
                def f(x: Any, w: Any = w, pw: Any = pw, name: str = name) -> Any:
                    if name == "plain":
                        return F.linear(x, w)
                    return packed_linear.packed_matmul(x, pw[0], None, pw[1])
                torch.set_num_threads(1)
                full = f(inputs[k])
                for m in (1, 2, 3, 4, 7, 16, 33, 64, 243, 257, 512):
                    rows_same &= torch.equal(f(inputs[k][:m]), full[:m])
                torch.set_num_threads(max(2, max(threads)))
                for m in (1, 2, 4, 16, 64, 243, 600):
                    threads_same &= torch.equal(f(inputs[k][:m]), full[:m])
            inv[name] = {"rows_invariant": bool(rows_same), "thread_invariant": bool(threads_same)}
    finally:
        torch.set_num_threads(before)
    return out, inv


def forward_part(engine: Any, dtype: Any, tokens: int, turns: int) -> tuple[list[dict], bool]:
    import torch

    import radixkv
    from radixkv.engine import decoder_forward, packed_linear

    runner = engine.core.model_runner
    with_dtype = packed_linear.PACKED_DTYPES
    without = frozenset(with_dtype - {dtype})
    invariant_packed = runner.thread_invariant
    forwards: list[tuple[str, int, float, int]] = []   # (arm, new tokens, seconds, threads)
    alternate = [True]
    state = {"packed": True}
    original = decoder_forward.DecoderForward.__call__

    def use(packed: bool) -> None:
        state["packed"] = packed
        packed_linear.PACKED_DTYPES = with_dtype if packed else without
        runner.thread_invariant = invariant_packed if packed else False

    execute = runner.execute

    def flip_then_execute(batch: Any) -> Any:
        # flipped before the runner picks the forward's thread count (which reads
        # thread_invariant), not inside the timed forward
        if alternate[0]:
            use(not state["packed"])
        return execute(batch)

    def timed(self: Any, ctx: Any) -> Any:
        t0 = time.perf_counter()
        out = original(self, ctx)
        forwards.append(("packed" if state["packed"] else "plain",
                         int(ctx.batch.input_ids.shape[1]), time.perf_counter() - t0,
                         torch.get_num_threads()))
        return out

    def paired(kind: Any) -> dict[str, Any]:
        sel = [(arm, dt) for arm, n, dt, _ in forwards if kind(n)]
        pairs = [(a[1], b[1]) if a[0] == "plain" else (b[1], a[1])
                 for a, b in zip(sel[0::2], sel[1::2]) if a[0] != b[0]]
        out = _pairs_summary(pairs)
        for arm in ("plain", "packed"):   # the thread counts the runner chose, and how often
            seen = sorted({th for a, n, _, th in forwards if a == arm and kind(n)})
            out[f"{arm}_threads"] = "/".join(
                f"{th}x{sum(1 for a, n, _, t in forwards if a == arm and kind(n) and t == th)}"
                for th in seen)
        return out

    greedy = radixkv.SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    rows = []
    decoder_forward.DecoderForward.__call__ = timed   # type: ignore[method-assign]
    runner.execute = flip_then_execute
    try:
        alternate[0] = False
        got = {}
        for packed in (False, True):
            use(packed)
            out = engine.generate([PROMPT + "same"], greedy)
            got[packed] = list(out[0].outputs[0].token_ids)
        same = got[True] == got[False]
        alternate[0] = True
        for batch in (1, 4, 16):
            forwards.clear()
            engine.generate([PROMPT * 2 + f"b{batch} #{i}" for i in range(batch)], greedy)
            rows.append({"scenario": f"decode, batch {batch}",
                         **paired(lambda n, b=batch: n == b)})
        tok = engine.tokenizer
        history = tok.encode("The history of the Roman empire spans many centuries. " * 50)[:500]
        engine.generate([history], radixkv.SamplingParams(max_tokens=1))
        forwards.clear()
        for i in range(turns):
            turn = tok.encode(f" Question {i}: what happened in the year {100 + i} and why did "
                              "it matter so much to everyone involved then?")[:32]
            history = history + turn
            engine.generate([history], radixkv.SamplingParams(max_tokens=1))
        rows.append({"scenario": "cached turn, 32 new over ~500 cached",
                     **paired(lambda n: n > 1)})
    finally:
        decoder_forward.DecoderForward.__call__ = original   # type: ignore[method-assign]
        del runner.execute                                   # the class's method again
        packed_linear.PACKED_DTYPES = with_dtype
        runner.thread_invariant = invariant_packed
    return rows, same


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="radixkv bench linears", description=plain_doc(__doc__))
    ap.add_argument("--quick", action="store_true",
                    help="4 layers of weights, 4 passes, rows 1/16/243, one thread, 12 tokens")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of part 2")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="dtype of part 2 (part 1 runs float32, and bf16 where it is native)")
    ap.add_argument("--passes", type=int, default=12, help="paired passes per row count")
    ap.add_argument("--tokens", type=int, default=64, help="decoded tokens per decode scenario")
    ap.add_argument("--turns", type=int, default=16, help="cached chat turns")
    ap.add_argument("--forwards-only", action="store_true", help="skip part 1 (the GEMMs)")
    args = ap.parse_args(argv)
    import torch

    import radixkv
    from radixkv.engine import packed_linear

    dtype = getattr(torch, args.dtype)
    if not packed_linear.packing_supported(dtype, torch.device("cpu")):
        print(f"radixkv bench linears: {args.dtype} linears are not packed on this CPU "
              f"({torch.backends.cpu.get_cpu_capability()})")
        return 2
    torch.set_num_threads(args.threads)
    engine = radixkv.Engine.from_pretrained(dtype=dtype)
    config = engine.core.model_runner.model.config
    layers, rows_list, threads = config.num_hidden_layers, ROWS, [1, 2]
    if args.quick:
        layers, rows_list, threads = 4, (1, 16, 243), [1]
        args.passes, args.tokens, args.turns = 4, 12, 4
    header = run_header(None, quick=args.quick, threads=args.threads, dtype=args.dtype,
                        passes=args.passes, layers=layers,
                        cpu_capability=torch.backends.cpu.get_cpu_capability())
    print(header)
    dtypes = [d for d in (torch.float32, torch.bfloat16)
              if packed_linear.packing_supported(d, torch.device("cpu"))]
    shapes = _layer_shapes(config)
    gemm_rows: list[dict] = []
    invariance: dict[str, Any] = {}
    for d in ([] if args.forwards_only else dtypes):
        part, inv = gemm_part(d, threads, rows_list, args.passes, layers, shapes)
        gemm_rows += part
        invariance[str(d).replace("torch.", "")] = inv
    torch.set_num_threads(args.threads)
    if gemm_rows:
        print_table(gemm_rows, ["dtype", "threads", "rows", "pairs", "plain_ms", "packed_ms",
                                "pair_ratio_median", "packed_lower_in"],
                    title=f"GEMMs of {layers} layers of the embedded model's shapes, F.linear "
                          "(plain) vs packed oneDNN, paired")
    for d, inv in invariance.items():
        print(f"{d}: plain rows/thread invariant {inv['plain']['rows_invariant']}/"
              f"{inv['plain']['thread_invariant']}; packed "
              f"{inv['packed']['rows_invariant']}/{inv['packed']['thread_invariant']}")
    try:
        fwd_rows, same = forward_part(engine, dtype, args.tokens, args.turns)
    finally:
        engine.close()
    print_table(fwd_rows, ["scenario", "pairs", "plain_ms", "packed_ms", "pair_ratio_median",
                           "packed_lower_in", "plain_threads", "packed_threads"],
                title=f"whole forwards of the embedded model, {args.dtype}, "
                      f"{args.threads} thread(s), paired in one process")
    print(f"greedy tokens equal with either arm ({args.tokens} tokens; not required: the "
          f"two differ by float rounding): {'yes' if same else 'no'}")
    name = f"linears_{args.dtype}_{args.threads}t" + ("_forwards" if args.forwards_only else "")
    write_results("linears_quick" if args.quick else name,
                  header, {"gemms": gemm_rows, "invariance": invariance, "forwards": fwd_rows,
                           "same_tokens": same})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
