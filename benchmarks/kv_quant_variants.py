"""``radixkv bench kv-quant --variants``: which change to the KV format could move greedy
identity with float32 KV, measured before building it (issue 16).

Every variant is a *fake* quantization: the float32 model writes K/V into a float32 cache, and
each row is replaced by what the variant would store and read back (quantize, dequantize,
rotate back) as it is written, by wrapping ``kernels.write_kv``. That needs no new storage
format, so formats the block layout cannot hold yet (int4, groups, zero points, per-channel
key scales) can be compared with the shipped ones on the same harness. Two measures on the
tuning prompts (the first user messages of the first ``--prompts`` ShareGPT conversations, as
in ``radixkv bench kv-quant``), and one on the held-back conversations:

* ``flips``: the float32 model's own greedy continuation (``--tokens`` tokens) teacher-forced
  in one forward per prompt; positions whose argmax differs from that continuation, per 1,000
  tokens. It does not cascade, so it is a far steadier measure than free-running identity:
  a continuation stays identical with probability about (1 - flip rate) ^ tokens. The
  ``float32`` row is its floor: float32 KV teacher-forced in one forward (prefill kernels)
  against its own step-by-step decode, where near-ties can already flip.
* ``identical``: free-running greedy continuations identical to float32 KV's (batched decode
  through ``ModelRunner``, the same prompts), and the mean number of leading tokens that agree.
* ``ppl``: perplexity of the real first replies of the held-back conversations (as in
  ``radixkv bench kv-quant``; scored only, never used to choose a variant), teacher-forced over
  the fake-quantized cache, and its change against float32 KV.

Bytes per block are computed for each variant's layout at the model's geometry (per-row fp16
scales, and zero points where a variant has them). Fake and real quantization differ by float32
rounding only (the real path attends over rotated rows with a rotated query), which changes
which close calls flip in free-running generation (docs/quantization.md): compare variants with
each other here, and the shipped formats through ``radixkv bench kv-quant``.

Variants (all round to nearest, scales rounded to fp16 before use, ``H``: the Hadamard rotation):

``int8``            the shipped format: per-row scale max|xH| / 127.
``int8 K only``     K quantized as int8, V kept in float32 (and ``int8 V only``): where the
                    error matters.
``int8 no rotation`` the first format (13/32 identical on the real path).
``int8 g32``        two scales per row (groups of 32 channels).
``int8 clip``       per-row scale chosen among max|xH| x {1, .95, .9, .85, .8} / 127 for the
                    least squared error (same bytes).
``int8 asym``       min/max with a zero point (255 levels over [min, max]; 2 more bytes a row).
``int8 sink``       int8, but the first block of every sequence (16 tokens, the attention sink)
                    kept in float32.
``kivi``            KIVI-style: K per channel over each full block of 16 tokens (a fp16 scale
                    per channel and block; the partial last block kept in float32 until it is
                    full), V per row as ``int8``.
``int4`` / ``int4 g32`` / ``int4 g16``   4-bit values (max |x| / 7) per row or per group.
``fp8_e4m3``        the shipped fp8 format.
``bf16``            every row rounded to bfloat16 (the bar).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from radixkv.engine.kv_quant import rotation

BLOCK = 16


def _h(d: int) -> torch.Tensor:
    return rotation(d)


def _fp16(s: torch.Tensor) -> torch.Tensor:
    """Scales as stored: rounded to fp16 (clamped to its range)."""
    return s.clamp(max=65504.0).to(torch.float16).float()


def _grid(x: torch.Tensor, qmax: float, group: int | None = None) -> torch.Tensor:
    """Symmetric round-to-nearest over ``[-qmax, qmax]`` with one scale per ``group`` values of
    the last axis (None: the whole row)."""
    shape = x.shape
    g = x.reshape(*shape[:-1], -1, group or shape[-1])
    s = _fp16(g.abs().amax(-1, keepdim=True) / qmax)
    safe = torch.where(s > 0, s, torch.ones_like(s))
    q = torch.where(s > 0, torch.round(g / safe).clamp(-qmax, qmax) * s, torch.zeros_like(g))
    return q.reshape(shape)


def _rotated(fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    def f(x: torch.Tensor) -> torch.Tensor:
        h = _h(x.shape[-1])
        return fn(x @ h) @ h
    return f


def _clip(x: torch.Tensor) -> torch.Tensor:
    amax = x.abs().amax(-1, keepdim=True)
    best, err = None, None
    for a in (1.0, 0.95, 0.9, 0.85, 0.8):
        s = _fp16(amax * a / 127)
        safe = torch.where(s > 0, s, torch.ones_like(s))
        q = torch.round(x / safe).clamp(-127, 127) * s
        e = ((q - x) ** 2).sum(-1, keepdim=True)
        if best is None:
            best, err = q, e
        else:
            better = e < err
            best = torch.where(better, q, best)
            err = torch.where(better, e, err)
    return best


def _asym(x: torch.Tensor) -> torch.Tensor:
    lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    s = _fp16((hi - lo) / 255)
    z = _fp16(lo)
    safe = torch.where(s > 0, s, torch.ones_like(s))
    return torch.round((x - z) / safe).clamp(0, 255) * s + z


def _fp8(x: torch.Tensor) -> torch.Tensor:
    s = _fp16(x.abs().amax(-1, keepdim=True) / 448)
    safe = torch.where(s > 0, s, torch.ones_like(s))
    return (x / safe).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s


ROW = {
    "int8": _rotated(lambda x: _grid(x, 127)),
    "int8 no rotation": lambda x: _grid(x, 127),
    "int8 g32": _rotated(lambda x: _grid(x, 127, 32)),
    "int8 clip": _rotated(_clip),
    "int8 asym": _rotated(_asym),
    "int4": _rotated(lambda x: _grid(x, 7)),
    "int4 g32": _rotated(lambda x: _grid(x, 7, 32)),
    "int4 g16": _rotated(lambda x: _grid(x, 7, 16)),
    "fp8_e4m3": _rotated(_fp8),
    "bf16": lambda x: x.to(torch.bfloat16).float(),
}


def row_bytes(variant: str, d: int) -> float:
    """Bytes one (token, head) row of K (or V) takes in ``variant``."""
    if variant in ("float32",):
        return 4 * d
    if variant == "bf16":
        return 2 * d
    if variant.startswith("int4"):
        g = int(variant.split("g")[1]) if " g" in variant else d
        return d / 2 + 2 * d / g
    if variant == "int8 g32":
        return d + 4
    if variant == "int8 asym":
        return d + 4
    if variant == "kivi":     # K: d bytes + d fp16 scales per 16-token block; V: d + 2
        return (d + 2 * d / BLOCK + d + 2) / 2
    return d + 2              # int8 variants, fp8, sink (the sink block is not counted)


class FakeQuant:
    """A ``kernels.write_kv`` replacement that writes each row as ``variant`` would store it.

    ``first_blocks``: block ids holding positions [0, 16) (the ``sink`` variant keeps them);
    ``kivi``: K of a block is re-quantized per channel once its last slot is written.
    """

    def __init__(self, orig: Callable[..., Any], variant: str, first_blocks: set[int]) -> None:
        self.orig, self.variant, self.first = orig, variant, first_blocks
        base = variant.replace(" K only", "").replace(" V only", "").replace(" sink", "")
        self.row = ROW.get(base, ROW["int8"])

    def __call__(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slot_mapping: torch.Tensor, **kw: Any) -> None:
        v = self.variant
        k2 = key if v.endswith("V only") or v == "kivi" else self.row(key.float())
        v2 = value if v.endswith("K only") else self.row(value.float())
        if v.endswith("sink"):
            keep = torch.tensor([int(s) // k_cache.shape[1] in self.first
                                 for s in slot_mapping.tolist()])[:, None, None]
            k2 = torch.where(keep, key, k2)
            v2 = torch.where(keep, value, v2)
        self.orig(k2.to(key.dtype).contiguous(), v2.to(value.dtype).contiguous(), k_cache,
                  v_cache, slot_mapping, **kw)
        if v == "kivi":
            bs = k_cache.shape[1]
            full = sorted({int(s) // bs for s in slot_mapping.tolist() if int(s) % bs == bs - 1})
            if full:
                ids = torch.tensor(full)
                blk = k_cache[ids].float()                       # [n, bs, H, d]
                s = _fp16(blk.abs().amax(1, keepdim=True) / 127)   # per channel over tokens
                safe = torch.where(s > 0, s, torch.ones_like(s))
                k_cache[ids] = (torch.round(blk / safe).clamp(-127, 127) * s).to(k_cache.dtype)


def _greedy(runner: Any, prompts: list[list[int]], tokens: int, tables: list[list[int]]
            ) -> list[list[int]]:
    """Batched greedy decoding through ``runner``: each prompt prefilled alone, then
    ``tokens`` decode steps for all of them."""
    from radixkv.engine.batch import SequenceChunk

    bs = runner.block_size

    def slots(t: list[int], a: int, b: int) -> list[int]:
        return [t[p // bs] * bs + p % bs for p in range(a, b)]

    nxt = []
    for p, t in zip(prompts, tables):
        logits = runner.execute(runner.build_batch([SequenceChunk(p, 0, t, slots(t, 0, len(p)))]))
        nxt.append(int(logits[-1].argmax()))
    outs = [[x] for x in nxt]
    for step in range(1, tokens):
        chunks = [SequenceChunk([o[-1]], len(p) + step - 1, t,
                                slots(t, len(p) + step - 1, len(p) + step))
                  for p, o, t in zip(prompts, outs, tables)]
        logits = runner.execute(runner.build_batch(chunks))
        for o, row in zip(outs, logits):
            o.append(int(row.argmax()))
    return outs


def _flips(runner: Any, prompts: list[list[int]], conts: list[list[int]],
           tables: list[list[int]]) -> int:
    """Teacher-forced argmax disagreements with ``conts`` (one forward per prompt)."""
    from radixkv.engine.batch import SequenceChunk

    bs = runner.block_size
    bad = 0
    for p, c, t in zip(prompts, conts, tables):
        toks = list(p) + list(c)
        logits = runner.execute(runner.build_batch([SequenceChunk(
            toks, 0, t, [t[i // bs] * bs + i % bs for i in range(len(toks))],
            logit_offsets=list(range(len(p) - 1, len(toks) - 1)))]))
        bad += int((logits.argmax(-1) != torch.tensor(c)).sum())
    return bad


def run_variants(model: Any, prompts: list[list[int]], tokens: int, variants: list[str],
                 held: list[tuple[list[int], list[int]]] | None = None
                 ) -> list[dict[str, Any]]:
    """Flip rate and free-running identity of every variant against float32 KV, and the
    perplexity of ``held`` (context, reply) pairs when given."""
    from radixkv import kernels
    from radixkv.benchmarks.bench_kv_quant import perplexity
    from radixkv.engine.model_runner import ModelRunner

    bs = BLOCK
    per_seq = -(-(max(map(len, prompts)) + tokens) // bs)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(len(prompts))]
    first = {t[0] for t in tables}
    d = model.config.hidden_size // model.config.num_attention_heads

    def fresh() -> Any:
        return ModelRunner.for_model(model, len(prompts) * per_seq, bs, "auto")

    t0 = time.perf_counter()
    ref = _greedy(fresh(), prompts, tokens, tables)
    # the floor: float32 KV itself, teacher-forced in one forward instead of step by step
    # (other kernels, other float32 rounding: near-ties can flip)
    floor = _flips(fresh(), prompts, ref, tables)
    rows = [{"variant": "float32", "flips_per_1000": round(1000 * floor / (tokens * len(prompts)),
                                                           2),
             "identical": f"{len(ref)}/{len(ref)}",
             "mean_leading_agree": float(tokens), "row_bytes": row_bytes("float32", d),
             "of_bf16": 2.0, "seconds": round(time.perf_counter() - t0, 1)}]
    base_ppl = perplexity(model, "auto", held) if held else None
    if base_ppl is not None:
        rows[0].update(ppl_heldout=round(base_ppl, 4), ppl_vs_fp32_pct=0.0)
    orig = kernels.write_kv
    for v in variants:
        t0 = time.perf_counter()
        kernels.write_kv = FakeQuant(orig, v, first)
        try:
            flips = _flips(fresh(), prompts, ref, tables)
            got = _greedy(fresh(), prompts, tokens, tables)
            ppl = perplexity(model, "auto", held) if held else None
        finally:
            kernels.write_kv = orig
        lead = [next((i for i, (a, b) in enumerate(zip(r, g)) if a != b), tokens)
                for r, g in zip(ref, got)]
        rows.append({"variant": v,
                     "flips_per_1000": round(1000 * flips / (tokens * len(prompts)), 2),
                     "identical": f"{sum(x == tokens for x in lead)}/{len(lead)}",
                     "mean_leading_agree": round(sum(lead) / len(lead), 1),
                     "row_bytes": row_bytes(v, d), "of_bf16": round(row_bytes(v, d) / (2 * d), 4),
                     "seconds": round(time.perf_counter() - t0, 1)})
        if ppl is not None:
            rows[-1].update(ppl_heldout=round(ppl, 4),
                            ppl_vs_fp32_pct=round(100 * (ppl / base_ppl - 1), 3))
        print(rows[-1], flush=True)
    return rows


DEFAULT_VARIANTS = ["bf16", "int8", "int8 K only", "int8 V only", "int8 no rotation",
                    "int8 g32", "int8 clip", "int8 asym", "int8 sink", "kivi", "fp8_e4m3",
                    "int4", "int4 g32", "int4 g16"]

__all__ = ["run_variants", "FakeQuant", "ROW", "row_bytes", "DEFAULT_VARIANTS"]
