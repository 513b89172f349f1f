"""``radixkv bench kv-quant``: what quantized KV blocks cost in quality, and what they save.

Question: with ``CacheConfig(kv_dtype="int8" | "fp8_e4m3")``, how far does the embedded
SmolLM2 move from the same model with full-precision KV, and how many blocks fit per GiB?

The model always runs in float32 (``EngineConfig(dtype="float32")``), so the only difference
between rows is how K/V are stored (a bf16 model is itself chaotic under 1-ulp changes of its
K/V, which would swamp the quantization error). Three measurements, each against float32 KV:

1. Greedy agreement: the first user message of the first ``--prompts`` ShareGPT conversations
   (cut to ``--max-chars``, the prompts the formats were tuned on), ``--tokens`` greedy tokens
   each, batched; continuations identical, mean leading tokens in agreement; and continuations
   identical on the held-back prompts of 2. (``identical_heldout``). A ``bf16 KV`` row
   (float32 model, each K/V row rounded to bfloat16 as it is written, by wrapping
   ``kernels.write_kv``) is the bar: what rounding to the ordinary half-precision KV does.
2. Perplexity on held-back data (ShareGPT conversations after the first ``--skip`` usable ones,
   never used for tuning): of the real first reply (up to ``--reply-tokens``) after its user
   message, and of the float32 model's own greedy continuation (``--tokens``) of that message.
   One teacher-forced forward per sequence through ``ModelRunner`` with quantized blocks: every
   position attends over stored (quantized) K/V of all positions before it and itself.
3. Bytes per block and blocks per GiB (SmolLM2 geometry, block size 16), and a bf16 block.

``--quality`` instead gives the table quantization is judged by (``kv_quant_quality.json``):
over a reference continuation made by the float32 model with float32 KV (``--tokens`` greedy
tokens after ``--heldout`` held-back ShareGPT prompts for the embedded SmolLM2; after
``--tiny-prompts`` random prompts of ``--tiny-prompt-len`` tokens, ``--tiny-tokens`` for the tiny
random models of :data:`TINY_ARCHS`), every position teacher-forced: top-1 agreement with the
reference token, KL(reference || row) per position, perplexity of the continuation, for
float32 / int8 / fp8_e4m3 KV (float32 weights) and the bf16 model (bf16 weights and KV, the bar);
cold (one prefill) and served from the cache (prompt prefilled, then one decode step per
token). ``--archs`` picks the architectures.

``--variants`` instead compares candidate formats by fake quantization on the tuning prompts
(teacher-forced flip rate and free-running identity; ``benchmarks/kv_quant_variants.py``).

``--decode-timing`` instead times decode steps only (``kv_quant_decode.json``): ``--batch``
sequences of ``--context`` random tokens prefilled through ``ModelRunner``, then ``--steps``
decode steps, per KV dtype, the dtypes interleaved over ``--rounds`` rounds (median step wall
and CPU time), so that other load on a shared machine hits every dtype alike.

``--extend C+S,...`` instead times cached-turn prefills (``kv_quant_extend.json``): S new tokens
of one sequence over C tokens already cached (a later chat turn after a prefix hit), ``--steps``
times per runner, per KV dtype, interleaved over ``--rounds`` rounds; each quantized dtype also
through the dequantizing scratch (``+ scratch``: the native prefill kernel's in-place read
switched off), the same-run baseline of that kernel.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
import time
from collections.abc import Iterator

from radixkv.benchmarks._common import (plain_doc, print_table, run_header,
                                        temp_results_unless_set, write_results)

DTYPES = ("auto", "int8", "fp8_e4m3")


@contextlib.contextmanager
def _bf16_kv() -> Iterator[None]:
    """Round every K/V row to bfloat16 as it is written (the float32 cache then holds
    bf16-representable values): the bf16-KV bar, without a bf16 model."""
    import torch

    from radixkv import kernels

    orig = kernels.write_kv

    def write_kv(key, value, *args, **kw):
        return orig(key.to(torch.bfloat16).to(key.dtype), value.to(torch.bfloat16).to(value.dtype),
                    *args, **kw)

    kernels.write_kv = write_kv
    try:
        yield
    finally:
        kernels.write_kv = orig


def _engine(kv: str):
    import radixkv
    from radixkv.config import CacheConfig, EngineConfig

    return radixkv.Engine.from_pretrained(
        cache_config=CacheConfig(num_device_blocks=2048, kv_dtype=kv,
                                 enable_prefix_caching=False),
        engine_config=EngineConfig(device="cpu", dtype="float32"))


def _greedy(eng, ids: list[list[int]], tokens: int) -> tuple[list[list[int]], float]:
    import radixkv

    t0 = time.perf_counter()
    outs = eng.generate(ids, radixkv.SamplingParams(max_tokens=tokens, ignore_eos=True))
    return [list(o.outputs[0].token_ids) for o in outs], time.perf_counter() - t0


def heldout_pairs(n: int, skip: int, max_chars: int) -> list[tuple[str, str]]:
    """(first user message, its real reply) of ``n`` usable ShareGPT conversations after the
    first ``skip`` (those before are the tuning prompts' neighbourhood; never scored)."""
    from radixkv.benchmarks.traces import clean_conversation, iter_sharegpt

    out: list[tuple[str, str]] = []
    seen = 0
    for obj in iter_sharegpt():
        pairs = clean_conversation(obj.get("conversations", []))
        if not pairs or not pairs[0][0].strip() or len(pairs[0][1].split()) < 20:
            continue
        seen += 1
        if seen > skip:
            out.append((pairs[0][0][:max_chars], pairs[0][1]))
        if len(out) >= n:
            break
    return out


def perplexity(model, kv: str, seqs: list[tuple[list[int], list[int]]]) -> float:
    """exp(mean NLL) of each ``target`` after its ``context``, teacher-forced in one forward
    per sequence over a fresh paged cache of ``kv`` blocks."""
    import torch

    from radixkv.engine.batch import SequenceChunk
    from radixkv.engine.model_runner import ModelRunner

    bs = 16
    longest = max(len(c) + len(t) for c, t in seqs)
    runner = ModelRunner.for_model(model, -(-longest // bs), bs, kv)
    nll, count = 0.0, 0
    for ctx, tgt in seqs:
        toks = list(ctx) + list(tgt)
        nb = -(-len(toks) // bs)
        chunk = SequenceChunk(toks, 0, list(range(nb)), list(range(len(toks))),
                              logit_offsets=list(range(len(ctx) - 1, len(toks) - 1)))
        logits = runner.execute(runner.build_batch([chunk]))
        lp = torch.log_softmax(logits.float(), dim=-1)
        nll -= float(lp[torch.arange(len(tgt)), torch.tensor(tgt)].sum())
        count += len(tgt)
    return math.exp(nll / count)


def decode_step_s(model, kv: str, batch: int, context: int, steps: int
                  ) -> tuple[float, float]:
    """Median (wall, CPU) seconds of one decode step of ``batch`` sequences at ``context``
    tokens. CPU time (``time.process_time``) is what this process computed; on a shared
    machine it moves far less than wall time with other jobs' load."""
    import statistics

    import torch

    from radixkv.engine.batch import SequenceChunk
    from radixkv.engine.model_runner import ModelRunner

    bs = 16
    per_seq = -(-(context + steps) // bs)
    runner = ModelRunner.for_model(model, batch * per_seq, bs, kv)
    gen = torch.Generator().manual_seed(0)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(batch)]

    def slot(t: list[int], pos: int) -> int:
        return t[pos // bs] * bs + pos % bs

    for t in tables:                                   # prefill one sequence at a time
        toks = torch.randint(100, 20000, (context,), generator=gen).tolist()
        runner.execute(runner.build_batch([SequenceChunk(toks, 0, t, [slot(t, p) for p in
                                                                     range(context)])]))
    wall, cpu = [], []
    for step in range(steps):
        pos = context + step
        chunks = [SequenceChunk([101 + step], pos, t, [slot(t, pos)]) for t in tables]
        t0, c0 = time.perf_counter(), time.process_time()
        runner.execute(runner.build_batch(chunks))
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return statistics.median(wall), statistics.median(cpu)


def extend_s(model, kv: str, context: int, suffix: int, repeats: int) -> tuple[float, float]:
    """Median (wall, CPU) seconds to compute ``suffix`` new tokens of one sequence on top of
    ``context`` cached ones (a later chat turn after a prefix hit: the new tokens attend to the
    stored, possibly quantized, K/V of the prefix), ``repeats`` times over the same slots."""
    import statistics

    import torch

    from radixkv.engine.batch import SequenceChunk
    from radixkv.engine.model_runner import ModelRunner

    bs = 16
    nblocks = -(-(context + suffix) // bs)
    runner = ModelRunner.for_model(model, nblocks, bs, kv)
    table = list(range(nblocks))
    gen = torch.Generator().manual_seed(0)
    toks = torch.randint(100, 20000, (context + suffix,), generator=gen).tolist()
    runner.execute(runner.build_batch([SequenceChunk(toks[:context], 0, table,
                                                     list(range(context)))]))
    chunk = SequenceChunk(toks[context:], context, table, list(range(context, context + suffix)))
    wall, cpu = [], []
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        runner.execute(runner.build_batch([chunk]))
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return statistics.median(wall), statistics.median(cpu)


def _extend_shapes(text: str) -> str:
    """``--extend``'s value, checked: comma-separated ``C+S`` with C >= 1 and S >= 1."""
    for part in text.split(","):
        c, plus, sfx = part.partition("+")
        if not (plus and c.isdigit() and sfx.isdigit() and int(c) > 0 and int(sfx) > 0):
            raise argparse.ArgumentTypeError(f"{part!r} is not C+S (cached + new tokens, "
                                             "both >= 1), e.g. 1024+64")
    return text


@contextlib.contextmanager
def _scratch_only(on: bool) -> Iterator[None]:
    """With ``on``, quantized prefill goes through the dequantizing scratch (the native
    in-place kernel reports itself not run)."""
    from radixkv.kernels import native

    orig = native.paged_prefill_quantized
    if on:
        native.paged_prefill_quantized = lambda *a, **k: False
    try:
        yield
    finally:
        native.paged_prefill_quantized = orig


def extend_timing(args: argparse.Namespace) -> int:
    """Cached-turn prefill per KV dtype, the dtypes interleaved over ``--rounds`` rounds, at
    each ``--extend`` shape (context+suffix)."""
    import statistics

    import torch

    from radixkv.models import load_model

    header = run_header(None, benchmark="kv-quant-extend", **vars(args))
    print(json.dumps(header))
    model = load_model(dtype=torch.float32)
    shapes = [tuple(int(x) for x in s.split("+")) for s in args.extend.split(",")]
    rows = []
    # "+ scratch": the same quantized cache read through the dequantizing scratch (the path
    # before the native prefill kernel read int8 / fp8 rows in place), the same-run baseline.
    names = [*DTYPES, *(f"{kv} + scratch" for kv in DTYPES if kv != "auto")]
    for context, suffix in shapes:
        runs: dict[str, list[tuple[float, float]]] = {kv: [] for kv in names}
        for _ in range(args.rounds):
            for kv in names:
                with _scratch_only(kv.endswith(" + scratch")):
                    runs[kv].append(extend_s(model, kv.split()[0], context, suffix,
                                             args.steps))
        base = [statistics.median(x[i] for x in runs["auto"]) for i in (0, 1)]
        for kv, r in runs.items():
            wall, cpu = (statistics.median(x[i] for x in r) for i in (0, 1))
            rows.append({"shape": f"{context}+{suffix}",
                         "kv": "float32 (auto)" if kv == "auto" else kv,
                         "wall_ms": round(1e3 * wall, 2),
                         "wall_vs_float32": round(wall / base[0], 3),
                         "cpu_ms": round(1e3 * cpu, 2), "cpu_vs_float32": round(cpu / base[1], 3),
                         "rounds_cpu_ms": [round(1e3 * x[1], 1) for x in r]})
    print_table(rows, title=f"cached-turn prefill (suffix over a cached context), float32 "
                            f"SmolLM2, {args.threads} thread(s)")
    write_results("kv_quant_extend" + ("_quick" if args.quick else ""), header, {"rows": rows})
    return 0


def decode_timing(args: argparse.Namespace) -> int:
    import statistics

    import torch

    from radixkv.models import load_model

    header = run_header(None, benchmark="kv-quant-decode", **vars(args))
    print(json.dumps(header))
    model = load_model(dtype=torch.float32)
    runs: dict[str, list[tuple[float, float]]] = {kv: [] for kv in DTYPES}
    for _ in range(args.rounds):
        for kv in DTYPES:
            runs[kv].append(decode_step_s(model, kv, args.batch, args.context, args.steps))
    base = [statistics.median(x[i] for x in runs["auto"]) for i in (0, 1)]
    rows = []
    for kv, r in runs.items():
        wall, cpu = (statistics.median(x[i] for x in r) for i in (0, 1))
        rows.append({"kv": "float32 (auto)" if kv == "auto" else kv,
                     "step_wall_ms": round(1e3 * wall, 2),
                     "wall_vs_float32": round(wall / base[0], 3),
                     "step_cpu_ms": round(1e3 * cpu, 2),
                     "cpu_vs_float32": round(cpu / base[1], 3),
                     "rounds_cpu_ms": [round(1e3 * x[1], 1) for x in r]})
    print_table(rows, title=f"decode step, {args.batch} sequences x {args.context} tokens, "
                            f"float32 SmolLM2, torch path, {args.threads} thread(s)")
    write_results("kv_quant_decode" + ("_quick" if args.quick else ""), header, {"rows": rows})
    return 0


def variants(args: argparse.Namespace) -> int:
    from radixkv.benchmarks.bench_serve import conversations
    from radixkv.benchmarks.kv_quant_variants import DEFAULT_VARIANTS, run_variants

    names = (DEFAULT_VARIANTS if args.variants == "default"
             else [v.strip() for v in args.variants.split(",") if v.strip()])
    header = run_header(None, benchmark="kv-quant-variants", **vars(args))
    print(json.dumps(header))
    eng = _engine("auto")
    texts = [c[0] for c in conversations(args.prompts, 2, args.max_chars)]
    ids = [eng.chat_template.prompt_ids([{"role": "user", "content": t}]) for t in texts]
    held = heldout_pairs(args.heldout, args.skip, args.max_chars)
    held_ctx = [eng.chat_template.prompt_ids([{"role": "user", "content": u}]) for u, _ in held]
    replies = [eng.tokenizer(r, add_special_tokens=False)["input_ids"][:args.reply_tokens]
               for _, r in held]
    rows = run_variants(eng.core.model, ids, args.tokens, names, list(zip(held_ctx, replies)))
    eng.close()
    print_table(rows, title=f"fake-quantized KV vs float32 KV (float32 SmolLM2), {len(ids)} "
                            f"tuning prompts x {args.tokens} tokens")
    write_results("kv_quant_variants" + ("_quick" if args.quick else ""), header,
                  {"rows": rows})
    return 0


# -- teacher-forced quality (--quality) ---------------------------------------------------------

#: The tiny random architectures of ``--quality`` (transformers config class, extra config):
#: 2 layers, hidden 128, 4 query heads of 32 over 2 KV heads, seeded weights with
#: ``initializer_range`` 0.25 (a random model's logits are otherwise nearly flat). Windows of 32
#: and Gemma-2's soft cap (lowered to 10 so it bites on these weights) are exercised because
#: every sequence is longer than 32 tokens.
TINY_ARCHS: dict[str, tuple[str, dict]] = {
    "llama": ("LlamaConfig", {}),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True)),
    "mistral_window": ("MistralConfig", dict(sliding_window=32)),
    "gemma2_window_softcap": ("Gemma2Config", dict(
        head_dim=32, query_pre_attn_scalar=32, sliding_window=32, tie_word_embeddings=False,
        attn_logit_softcapping=10.0, layer_types=["sliding_attention", "full_attention"])),
    "phi3": ("Phi3Config", {}),
}
#: The embedded SmolLM2-135M (float32), on held-out ShareGPT prompts.
SMOLLM2 = "smollm2-135m"
#: Rows of the quality table, in order: the fp32 reference itself, the bar, the formats.
QUALITY_KV = ("float32", "bf16 model", "int8", "fp8_e4m3")


def tiny_arch_model(name: str, seed: int = 0):
    """A seeded float32 random-weight model of :data:`TINY_ARCHS` ``name``. Qwen2's q/k/v
    biases, which random initialisation leaves at zero, are drawn N(0, 1): real Qwen2
    checkpoints carry large k biases, and this is what makes the model Qwen2-shaped."""
    import torch
    import transformers

    cls, extra = TINY_ARCHS[name]
    config = getattr(transformers, cls)(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        initializer_range=0.25, bos_token_id=None, eos_token_id=None, pad_token_id=None,
        **extra)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if config.model_type == "qwen2":
        gen = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj,
                             layer.self_attn.v_proj):
                    proj.bias.copy_(torch.randn(proj.bias.shape, generator=gen))
    return model.eval()


def greedy_reference(model, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    """The float32 model's greedy continuations with float32 KV (the reference every row is
    scored against), from the engine, batched."""
    import copy

    from radixkv.config import CacheConfig, EngineConfig
    from radixkv.engine.llm_engine import LLMEngine
    from radixkv.engine.sampling import SamplingParams

    bs = 16
    need = sum(-(-(len(p) + tokens) // bs) for p in prompts) + 2 * len(prompts)
    eng = LLMEngine(copy.deepcopy(model), None,
                    CacheConfig(block_size=bs, num_device_blocks=need,
                                enable_prefix_caching=False),
                    EngineConfig(max_num_seqs=len(prompts), max_num_batched_tokens=4096,
                                 dtype="float32"), model_id="quality-ref")
    for i, p in enumerate(prompts):
        eng.add_request(f"q{i}", p, SamplingParams(max_tokens=tokens, ignore_eos=True))
    final = {}
    while eng.has_unfinished_requests():
        final.update((o.request_id, list(o.outputs[0].token_ids)) for o in eng.step()
                     if o.finished)
    eng.close()
    return [final[f"q{i}"] for i in range(len(prompts))]


def teacher_forced(model, kv: str, seqs: list[tuple[list[int], list[int]]],
                   cached: bool) -> list:
    """float32 ``[len(target), vocab]`` log-probabilities of every target position of each
    ``(context, target)``: the model predicting ``target[j]`` after ``context + target[:j]``,
    every position attending over the K/V stored in a ``kv`` paged cache.

    ``cached=False`` (cold): one prefill forward over context and target. ``cached=True``
    (served from the cache): the context is prefilled first, then the target is fed one token
    per decode step, all sequences batched, each step attending over the stored (for int8 /
    fp8, quantized) rows of everything before it: the serving path of a cached turn."""
    import torch

    from radixkv.engine.batch import SequenceChunk
    from radixkv.engine.model_runner import ModelRunner

    bs = 16
    per = [-(-(len(c) + len(t)) // bs) for c, t in seqs]
    runner = ModelRunner.for_model(model, sum(per), bs, kv)
    tables, start = [], 0
    for n in per:
        tables.append(list(range(start, start + n)))
        start += n

    def slots(table: list[int], lo: int, hi: int) -> list[int]:
        return [table[p // bs] * bs + p % bs for p in range(lo, hi)]

    out: list[list] = [[] for _ in seqs]
    with torch.no_grad():
        for i, ((ctx, tgt), table) in enumerate(zip(seqs, tables)):
            toks = list(ctx) + (list(tgt[:-1]) if not cached else [])
            offs = (list(range(len(ctx) - 1, len(toks))) if not cached else None)
            chunk = SequenceChunk(toks, 0, table, slots(table, 0, len(toks)), offs)
            out[i].append(runner.execute(runner.build_batch([chunk])).float())
        if cached:
            for j in range(1, max(len(t) for _, t in seqs)):
                live = [i for i, (_, t) in enumerate(seqs) if j < len(t)]
                chunks = [SequenceChunk([seqs[i][1][j - 1]], len(seqs[i][0]) + j - 1,
                                        tables[i], slots(tables[i], len(seqs[i][0]) + j - 1,
                                                         len(seqs[i][0]) + j))
                          for i in live]
                logits = runner.execute(runner.build_batch(chunks)).float()
                for row, i in enumerate(live):
                    out[i].append(logits[row:row + 1])
    return [torch.log_softmax(torch.cat(parts), dim=-1) for parts in out]


def score(ref_lp: list, lp: list, seqs: list[tuple[list[int], list[int]]]) -> dict:
    """Top-1 agreement with the reference continuation, mean per-position KL(reference || row)
    in nats, the worst position's KL, and perplexity of the reference continuation."""
    import torch

    agree = kl_sum = nll = 0.0
    kl_max, n = 0.0, 0
    for r, x, (_, tgt) in zip(ref_lp, lp, seqs):
        t = torch.tensor(tgt)
        agree += float((x.argmax(-1) == t).sum())
        kl = (r.exp() * (r - x)).sum(-1)
        kl_sum += float(kl.sum())
        kl_max = max(kl_max, float(kl.max()))
        nll -= float(x[torch.arange(len(tgt)), t].sum())
        n += len(tgt)
    return {"agree": agree / n, "kl_mean": kl_sum / n, "kl_max": kl_max,
            "ppl": math.exp(nll / n), "positions": n}


def quality_for(model, seqs: list[tuple[list[int], list[int]]], modes=("cold", "cached")
                ) -> dict[tuple[str, str], dict]:
    """``(row, mode) -> score`` for every row of :data:`QUALITY_KV` on one model: the float32
    model with float32, int8 and fp8_e4m3 KV, and the model cast to bfloat16 (weights and KV).
    The reference log-probabilities are float32 KV's, cold."""
    import copy

    import torch

    ref = teacher_forced(model, "auto", seqs, cached=False)
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    out = {}
    for mode in modes:
        cached = mode == "cached"
        for row in QUALITY_KV:
            if row == "bf16 model":
                lp = teacher_forced(bf16, "auto", seqs, cached)
            else:
                lp = teacher_forced(model, "auto" if row == "float32" else row, seqs, cached)
            out[row, mode] = score(ref, lp, seqs)
    return out


def _smollm2_seqs(args: argparse.Namespace):
    """The embedded SmolLM2 (float32) and its held-out ``(prompt, greedy continuation)``."""
    import torch

    from radixkv.models import load_model

    model = load_model(dtype=torch.float32)
    eng = _engine("auto")
    held = heldout_pairs(args.heldout, args.skip, args.max_chars)
    ids = [eng.chat_template.prompt_ids([{"role": "user", "content": u}]) for u, _ in held]
    eng.close()
    return model, ids


def quality(args: argparse.Namespace) -> int:
    """``--quality``: the teacher-forced table per architecture and KV storage."""
    import torch

    archs = [a.strip() for a in args.archs.split(",") if a.strip()]
    unknown = [a for a in archs if a != SMOLLM2 and a not in TINY_ARCHS]
    if unknown:
        raise SystemExit(f"--archs: unknown {unknown}; use {[SMOLLM2, *TINY_ARCHS]}")
    header = run_header(None, benchmark="kv-quant-quality", **vars(args))
    print(json.dumps(header))
    rows = []
    for arch in archs:
        if arch == SMOLLM2:
            model, prompts = _smollm2_seqs(args)
            n_tok = args.tokens
        else:
            model = tiny_arch_model(arch)
            gen = torch.Generator().manual_seed(7)
            prompts = [torch.randint(0, 256, (args.tiny_prompt_len,), generator=gen).tolist()
                       for _ in range(args.tiny_prompts)]
            n_tok = args.tiny_tokens
        t0 = time.perf_counter()
        conts = greedy_reference(model, prompts, n_tok)
        seqs = list(zip(prompts, conts))
        scores = quality_for(model, seqs)
        for (row, mode), s in scores.items():
            bar = scores["bf16 model", mode]
            rows.append({"arch": arch, "kv": row, "mode": mode,
                         "agree_pct": round(100 * s["agree"], 2),
                         "vs_bf16_pts": round(100 * (s["agree"] - bar["agree"]), 2),
                         "kl_mean": float(f"{s['kl_mean']:.3g}"),
                         "kl_max": float(f"{s['kl_max']:.3g}"),
                         "ppl": round(s["ppl"], 4),
                         "ppl_vs_fp32_pct": round(
                             100 * (s["ppl"] / scores["float32", mode]["ppl"] - 1), 3),
                         "positions": s["positions"]})
        print(f"# {arch}: {len(seqs)} sequences, {time.perf_counter() - t0:.1f} s",
              file=sys.stderr)
    print_table(rows, title="teacher-forced over the float32 model's greedy continuation "
                            "(float32 KV): top-1 agreement, KL(reference || row) per position "
                            "(nats), perplexity; bf16 model = bf16 weights and KV")
    write_results("kv_quant_quality" + ("_quick" if args.quick else ""), header,
                  {"rows": rows})
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="radixkv bench kv-quant", description=plain_doc(__doc__))
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--max-chars", type=int, default=400)
    ap.add_argument("--heldout", type=int, default=32, help="held-back conversations scored")
    ap.add_argument("--skip", type=int, default=1000, help="usable conversations skipped first")
    ap.add_argument("--reply-tokens", type=int, default=256)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--decode-timing", action="store_true",
                    help="only time decode steps per KV dtype (see below)")
    ap.add_argument("--extend", nargs="?", const="1024+64,2048+128", default=None,
                    type=_extend_shapes,
                    metavar="C+S,...", help="only time cached-turn prefills: S new tokens over "
                                            "C cached ones, per KV dtype (see below)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--variants", nargs="?", const="default", default=None,
                    help="compare candidate formats by fake quantization (comma-separated "
                         "names of benchmarks/kv_quant_variants.py; default: all)")
    ap.add_argument("--quality", action="store_true",
                    help="only the teacher-forced quality table per architecture (see below)")
    ap.add_argument("--archs", default=",".join([SMOLLM2, *TINY_ARCHS]),
                    help="--quality: comma-separated architectures")
    ap.add_argument("--tiny-prompts", type=int, default=32)
    ap.add_argument("--tiny-prompt-len", type=int, default=48)
    ap.add_argument("--tiny-tokens", type=int, default=64)
    ap.add_argument("--quick", action="store_true", help="4 prompts x 16 tokens; temp results")
    args = ap.parse_args(argv)
    if args.quick:
        args.prompts, args.tokens, args.heldout, args.reply_tokens = 4, 16, 4, 64
        args.batch, args.context, args.steps, args.rounds = 2, 64, 4, 1
        if args.extend:
            args.extend = "64+16"
        args.tiny_prompts, args.tiny_prompt_len, args.tiny_tokens = 2, 40, 16
        temp_results_unless_set("radixkv-bench-")
    import torch

    torch.set_num_threads(args.threads)
    if args.decode_timing:
        return decode_timing(args)
    if args.extend:
        return extend_timing(args)
    if args.variants:
        return variants(args)
    if args.quality:
        return quality(args)

    from radixkv.benchmarks.bench_serve import conversations
    from radixkv.storage.layout import KVLayout

    torch.set_num_threads(args.threads)
    texts = [c[0] for c in conversations(args.prompts, 2, args.max_chars)]
    held = heldout_pairs(args.heldout, args.skip, args.max_chars)
    header = run_header(None, benchmark="kv-quant", **vars(args))
    print(json.dumps(header))

    engines = {kv: _engine(kv) for kv in DTYPES}
    ref_eng = engines["auto"]
    tok = ref_eng.tokenizer
    ids = [ref_eng.chat_template.prompt_ids([{"role": "user", "content": t}]) for t in texts]
    held_ctx = [ref_eng.chat_template.prompt_ids([{"role": "user", "content": u}])
                for u, _ in held]
    replies = [tok(r, add_special_tokens=False)["input_ids"][:args.reply_tokens]
               for _, r in held]
    own, _ = _greedy(ref_eng, held_ctx, args.tokens)   # the float32 model's own continuations

    greedy: dict[str, tuple[list[list[int]], float]] = {}
    held_greedy: dict[str, list[list[int]]] = {"auto": own}
    for kv in DTYPES:
        greedy[kv] = _greedy(engines[kv], ids, args.tokens)
        if kv != "auto":
            held_greedy[kv] = _greedy(engines[kv], held_ctx, args.tokens)[0]
    with _bf16_kv():
        greedy["bf16 KV"] = _greedy(ref_eng, ids, args.tokens)
        held_greedy["bf16 KV"] = _greedy(ref_eng, held_ctx, args.tokens)[0]

    model = ref_eng.core.model
    ppl: dict[str, tuple[float, float]] = {}
    for kv in DTYPES:
        ppl[kv] = (perplexity(model, kv, list(zip(held_ctx, replies))),
                   perplexity(model, kv, list(zip(held_ctx, own))))
    with _bf16_kv():
        ppl["bf16 KV"] = (perplexity(model, "auto", list(zip(held_ctx, replies))),
                          perplexity(model, "auto", list(zip(held_ctx, own))))
    for e in engines.values():
        e.close()

    ref_tokens = greedy["auto"][0]
    geo = ref_eng.core.layout
    bf16_bytes = KVLayout(geo.num_layers, geo.num_kv_heads, geo.head_dim, 16,
                          "bfloat16").bytes_per_block
    rows = []
    for name in ("auto", "bf16 KV", "int8", "fp8_e4m3"):
        toks, wall = greedy[name]
        lead = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), args.tokens)
                for a, b in zip(ref_tokens, toks)]
        layout = KVLayout(geo.num_layers, geo.num_kv_heads, geo.head_dim, 16,
                          {"auto": "float32", "bf16 KV": "bfloat16"}.get(name, name))
        real, mine = ppl[name]
        same_held = sum(a == b for a, b in zip(own, held_greedy[name]))
        rows.append({
            "kv": "float32 (auto)" if name == "auto" else name,
            "identical": f"{sum(x == args.tokens for x in lead)}/{len(lead)}",
            "mean_leading_agree": round(sum(lead) / len(lead), 1),
            "identical_heldout": f"{same_held}/{len(own)}",
            "ppl_real_replies": round(real, 4),
            "ppl_real_vs_fp32_pct": round(100 * (real / ppl["auto"][0] - 1), 3),
            "ppl_own_greedy": round(mine, 4),
            "ppl_own_vs_fp32_pct": round(100 * (mine / ppl["auto"][1] - 1), 3),
            "bytes_per_block": layout.bytes_per_block,
            "of_bf16": round(layout.bytes_per_block / bf16_bytes, 4),
            "blocks_per_GiB": layout.blocks_in(1 << 30),
            "greedy_wall_s": round(wall, 2),
        })
    print_table(rows, title=f"KV storage vs float32 KV (float32 SmolLM2): greedy agreement on "
                            f"{len(ids)} prompts x {args.tokens} tokens; perplexity on "
                            f"{len(held)} held-back replies ({sum(map(len, replies))} tokens) "
                            f"and own greedy continuations ({sum(map(len, own))} tokens)")
    write_results("kv_quant" + ("_quick" if args.quick else ""), header,
                  {"rows": rows, "heldout_skip": args.skip})
    return 0


if __name__ == "__main__":
    sys.exit(main())
