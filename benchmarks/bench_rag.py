"""``radixkv bench rag``: blending cached documents into RAG prompts: TTFT, work and quality.

Question (issue 32, items 3 and 5): when a RAG prompt's documents are all cached but in another
order than the prompt lists them, how much faster is the first token with blending
(:mod:`radixkv.engine.blend`) than with prefix-only reuse, and how close are the blended
prompt's next-token distributions to a full prefill's?

Prompts: held-out multi-document prompts: 3-8 documents of 200-1,000 tokens each, assistant
replies of ShareGPT conversations from the second half of the packaged dump (the first half
is what the other benchmarks' traces draw from), laid out by :class:`radixkv.api.rag.RAGHelper`
(system head, ``Document [i]`` segments padded to whole blocks, the question: a ShareGPT user
turn), documents in a seeded shuffled order. The tiny random models (``--tiny``) use the same
layout with random token ids.

**Quality** (per prompt, against a full fp32 prefill of the same prompt): the full prefill's
greedy continuation of ``--tokens`` tokens is teacher-forced through each mode; reported are the
mean per-position KL(full || mode) of the next-token distributions and the share of positions
whose argmax agrees. Modes: ``prefix-only`` (the documents cached in another order: the exact
prefix path), ``plain`` (blend ratio 0: every document's cached KV reused, only re-rotated),
``blend-5%``, ``blend-15%``, ``blend-30%``. The bar: the same model in bfloat16, full prefill,
against fp32 (top-1 agreement of ``bf16``).

**TTFT and work** (embedded model, ``--ttft-prompts`` 4-document prompts): time to the first token
and prompt tokens computed (blending: tokens x layers computed / layers) for prefix-only, plain
reuse and blended reuse at the default ratio, *cold* (nothing cached: a blend first computes
each document's entry), *other order* (the documents cached by a prompt in another order: the
case blending is for) and *warm* (the same prompt again). Ratios are of medians in the same run.

**Quantized KV** (``--kv-dtype int8`` or ``fp8_e4m3``): the engine under test (entries,
blends, TTFT) holds its KV in that format (:mod:`radixkv.engine.kv_quant`; blending re-rotates
the quantized keys, see :mod:`radixkv.engine.blend`). Each mode is then compared twice: against
a full prefill of the same prompt on the same quantized cache (``kl_mean``, ``top1``: what
blending itself costs) and against the full fp32 prefill of a plain fp32 cache (``kl_fp32``,
``top1_fp32``: what a user of the quantized cache gets, quantization included); the row
``full prefill`` is the quantized cache's own full prefill against fp32 (quantization alone).
The continuation teacher-forced is the fp32 model's greedy one on the plain cache.

Writes ``rag.json`` (``--quick``: a temp folder; ``--kv-dtype``: ``rag_<kv-dtype>.json``) and
``docs/img/rag_quality.png`` (full runs on a plain cache). The last line reads
``blended/prefix-only TTFT R; top-1 agreement A (bar B)`` (A: the default ratio's agreement on
the embedded model against the full fp32 prefill, B: bf16's).
"""

from __future__ import annotations

import argparse
import copy
import random
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

from radixkv.benchmarks._common import (REPO_ROOT, plain_doc, print_table, run_header,
                                        write_results)

RATIOS = (0.0, 0.05, 0.15, 0.3)
BS = 16


@dataclass
class Case:
    """One multi-document prompt, as token ids (``docs`` already padded to whole blocks)."""

    head: list[int]
    docs: list[list[int]]
    question: list[int]
    order: list[int]          # the order the prompt lists the documents in
    other: list[int]          # the order another prompt cached them in (another first doc)

    def prompt(self, order: list[int]) -> list[int]:
        out = list(self.head)
        for i in order:
            out += self.docs[i]
        return out + self.question

    def spans(self, order: list[int]) -> list[Any]:
        from radixkv.engine.blend import DocSpan

        pos, out = len(self.head), []
        for i in order:
            out.append(DocSpan(pos, pos + len(self.docs[i])))
            pos += len(self.docs[i])
        return out


def _orders(rng: random.Random, k: int) -> tuple[list[int], list[int]]:
    order = list(range(k))
    rng.shuffle(order)
    other = order[:]
    while other[0] == order[0]:
        rng.shuffle(other)
    return order, other


def held_out_texts(tokenizer: Any, n_docs: int, n_questions: int, min_len: int, max_len: int,
                   rng: random.Random) -> tuple[list[str], list[str]]:
    """``n_docs`` documents (assistant replies of ``min_len``..``max_len`` tokens) and
    ``n_questions`` questions (user turns of 5-200 characters) from the held-out second half
    of the packaged ShareGPT dump, in the order ``rng`` shuffles them (also ``bench
    rag-serve``'s)."""
    from radixkv.benchmarks.traces_sharegpt import load_conversations

    convs = load_conversations()
    held = convs[len(convs) // 2:]
    rng.shuffle(held)
    docs: list[str] = []
    questions: list[str] = []
    for pairs in held:
        for q, a in pairs:
            na = len(tokenizer(a, add_special_tokens=False)["input_ids"])
            if min_len <= na <= max_len and len(docs) < n_docs:
                docs.append(a)
            elif 5 <= len(q) <= 200 and len(questions) < n_questions:
                questions.append(q)
        if len(docs) >= n_docs and len(questions) >= n_questions:
            break
    return docs, questions


def smol_cases(n: int, min_docs: int, max_docs: int, min_len: int, max_len: int, seed: int,
               tokenizer: Any, engine: Any) -> list[Case]:
    """Held-out prompts: documents are assistant replies of ``min_len``..``max_len`` tokens from
    the second half of the ShareGPT dump, questions short user turns of the same half."""
    rng = random.Random(seed)
    rag = engine.rag(order="given")
    docs, questions = held_out_texts(tokenizer, n * max_docs, n, min_len, max_len, rng)
    cases = []
    for c in range(n):
        k = rng.randint(min_docs, max_docs)
        picked = [docs.pop() for _ in range(k)]
        ids = []
        for j, text in enumerate(picked):
            rag.add_document(f"c{c}d{j}", text)
            ids.append(rag.document_entry_ids(f"c{c}d{j}"))
        q = rag.template.encode("Question: " + questions[c] + rag._tail_text)
        order, other = _orders(rng, k)
        cases.append(Case(list(rag.head_ids), ids, q, order, other))
    return cases


def tiny_cases(n: int, min_docs: int, max_docs: int, min_len: int, max_len: int, seed: int
               ) -> list[Case]:
    rng = random.Random(seed)
    cases = []
    for _ in range(n):
        k = rng.randint(min_docs, max_docs)
        docs = []
        for _ in range(k):
            m = rng.randint(min_len, max_len)
            m += -m % BS
            docs.append([rng.randrange(3, 256) for _ in range(m)])
        head = [rng.randrange(3, 256) for _ in range(BS)]
        question = [rng.randrange(3, 256) for _ in range(rng.randint(8, 24))]
        order, other = _orders(rng, k)
        cases.append(Case(head, docs, question, order, other))
    return cases


# ------------------------------------------------------------------------------- engines
TINY = {
    # name: (config class, extra kwargs); 4 layers: the check layer (1) then 2 selective ones.
    # mistral's window (512) is shorter than the prompts; phi3 has no lean forward (fallback).
    "llama": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=2)),
    "qwen2": ("Qwen2Config", dict(num_attention_heads=4, num_key_value_heads=1,
                                  tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16)),
    "mistral": ("MistralConfig", dict(num_attention_heads=4, num_key_value_heads=2,
                                      sliding_window=512)),
    "phi3": ("Phi3Config", dict(num_attention_heads=4, num_key_value_heads=2)),
}


def tiny_model(name: str, seed: int = 0) -> Any:
    import torch
    import transformers

    cls, extra = TINY[name]
    cfg = getattr(transformers, cls)(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        max_position_embeddings=16384, initializer_range=0.25, bos_token_id=None,
        eos_token_id=None, pad_token_id=None, **extra)
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(
        cfg, dtype=torch.float32, attn_implementation="sdpa").eval()


def make_engine(model: Any, tokenizer: Any, dtype: str, blocks: int, model_id: str,
                kv_dtype: str = "auto") -> Any:
    from radixkv import CacheConfig
    from radixkv.api.engine import Engine
    from radixkv.config import EngineConfig

    return Engine(model, tokenizer, CacheConfig(block_size=BS, num_device_blocks=blocks,
                                                kv_dtype=kv_dtype),
                  EngineConfig(device="cpu", dtype=dtype, max_num_seqs=8,
                               max_num_batched_tokens=16384, max_model_len=16384),
                  model_id=model_id)


class Runner:
    """Token-level operations on one engine (each call isolated by its own salt)."""

    def __init__(self, engine: Any) -> None:
        self.e = engine
        self.core = engine.core
        self._salts = 0

    def salt(self) -> str:
        self._salts += 1
        return f"bench-rag-{self._salts}"

    def run(self, prompt: list[int], salt: str, extra: str | None = None, tokens: int = 1
            ) -> Any:
        from radixkv.engine.sampling import SamplingParams

        rid = self.e.submit(prompt, SamplingParams(max_tokens=tokens, ignore_eos=True),
                            cache_salt=salt, namespace_extra=extra)
        return self.e.wait(rid)

    def warm_docs(self, case: Case, salt: str) -> None:
        from radixkv.engine.blend import DOCUMENT_EXTRA
        from radixkv.engine.sampling import SamplingParams

        lead = case.head if len(case.head) % BS == 0 else []   # blend.entry_lead
        rids = [self.e.submit(lead + d, SamplingParams(max_tokens=1), cache_salt=salt,
                              namespace_extra=DOCUMENT_EXTRA) for d in case.docs]
        for r in rids:
            self.e.wait(r)

    def blend(self, prompt: list[int], spans: list[Any], salt: str, ratio: float) -> Any:
        from radixkv.engine.blend import blend_context

        return self.e.loop.call(lambda: blend_context(self.core, prompt, spans, salt, ratio))

    def logits(self, tokens: list[int], salt: str, first: int, extra: str | None = None
               ) -> Any:
        from radixkv.core.hashing import Namespace
        from radixkv.engine.blend import prompt_logits

        ns = self.core.namespace.with_salt(salt)
        if extra is not None:
            ns = Namespace(ns.model, salt, ns.adapter_id, extra)
        return self.e.loop.call(lambda: prompt_logits(self.core, tokens, ns, first))

    def mode_logits(self, case: Case, mode: str, cont: list[int], doc_salt: str
                    ) -> tuple[Any, Any]:
        """(teacher-forced logits [T, V], blend report or None) of one mode; ``doc_salt``:
        the salt whose document entries are cached (each ratio blends into its own blend
        namespace, so the modes share the entries, not the blends)."""
        prompt = case.prompt(case.order)
        first = len(prompt) - 1
        seq = prompt + cont[:-1]
        if mode == "prefix-only":
            salt = self.salt()
            self.run(case.prompt(case.other), salt)          # cached in another order
            return self.logits(seq, salt, first), None
        ratio, salt = float(mode), doc_salt
        rep = self.blend(prompt, case.spans(case.order), salt, ratio)
        return self.logits(seq, salt, first, rep.namespace_extra if rep else None), rep


def compare(ref: Any, got: Any) -> tuple[float, float, float]:
    """(mean KL(ref || got) nats, max KL, top-1 agreement) over positions. A position's KL is
    clamped at 0: it is never negative, but for two distributions equal to float rounding the
    float32 sum can come out a few 1e-8 below."""
    import torch

    p = torch.log_softmax(ref.float(), -1)
    q = torch.log_softmax(got.float(), -1)
    kl = (p.exp() * (p - q)).sum(-1).clamp_min(0)
    agree = (ref.argmax(-1) == got.argmax(-1)).float().mean()
    return float(kl.mean()), float(kl.max()), float(agree)


def quality(r32: Runner, r16: Runner | None, cases: list[Case], tokens: int,
            label: str, rfp: Runner | None = None) -> list[dict[str, Any]]:
    """Per mode: mean KL and top-1 agreement over every prompt's continuation positions,
    against ``r32``'s own full prefill; with ``rfp`` (a plain fp32 cache, when ``r32``'s is
    quantized) also against ``rfp``'s full prefill (``kl_fp32``, ``top1_fp32``; the
    continuation is then ``rfp``'s), plus the row ``full prefill``: ``r32``'s against it."""
    modes = ["prefix-only", *(str(x) for x in RATIOS)]
    acc: dict[str, list[tuple[float, float, float]]] = {m: [] for m in modes + ["bf16"]}
    acc_fp: dict[str, list[tuple[float, float, float]]] = {m: [] for m in modes + ["full"]}
    for i, case in enumerate(cases):
        print(f"  quality {label}: prompt {i + 1}/{len(cases)}, {len(case.docs)} documents, "
              f"{len(case.prompt(case.order))} tokens", file=sys.stderr, flush=True)
        prompt = case.prompt(case.order)
        src = rfp if rfp is not None else r32
        out = src.run(prompt, src.salt(), tokens=tokens)
        cont = list(out.outputs[0].token_ids)
        seq, first = prompt + cont[:-1], len(prompt) - 1
        ref = r32.logits(seq, r32.salt(), first)
        ref_fp = rfp.logits(seq, rfp.salt(), first) if rfp is not None else ref
        if rfp is not None:
            acc_fp["full"].append(compare(ref_fp, ref))
        if r16 is not None:
            acc["bf16"].append(compare(ref_fp, r16.logits(seq, r16.salt(), first)))
        doc_salt = r32.salt()
        r32.warm_docs(case, doc_salt)
        for m in modes:
            got, _ = r32.mode_logits(case, m, cont, doc_salt)
            acc[m].append(compare(ref, got))
            if rfp is not None:
                acc_fp[m].append(compare(ref_fp, got))
    rows = []
    for m in modes + ["full", "bf16"]:
        own = acc.get(m) or acc_fp.get(m)
        if not own:
            continue
        name = {"full": "full prefill"}.get(m, m) if m in ("prefix-only", "bf16", "full") else (
            "plain (0%)" if float(m) == 0 else f"blend {float(m):.0%}")
        row: dict[str, Any] = {"model": label, "mode": name}
        if m != "full":      # bf16 is against fp32 either way; "full" only against fp32
            row.update(kl_mean=statistics.fmean(a[0] for a in own),
                       kl_max=max(a[1] for a in own),
                       top1=statistics.fmean(a[2] for a in own))
        fp = acc_fp.get(m) or (acc["bf16"] if m == "bf16" and rfp is not None else None)
        if fp:
            row.update(kl_fp32=statistics.fmean(a[0] for a in fp),
                       top1_fp32=statistics.fmean(a[2] for a in fp))
        row["prompts"] = len(own)
        rows.append(row)
    return rows


def computed_tokens(prompt_len: int, cached: int, rep: Any, layers: int, check: int,
                    ratio: float = 0.0) -> float:
    """Prompt tokens computed, in full-prefill token equivalents (tokens x layers / layers):
    a blend computes its fresh tokens on every layer, the reused ones on layers ``0..check``
    (none at ratio 0) and the recomputed ones on the others."""
    if rep is None:
        return float(prompt_len - cached)
    rest = prompt_len - rep.num_blended_tokens
    if rep.warm:
        return float(rest)
    c = min(check, layers - 1) + 1 if ratio > 0 else 0
    blended = (rep.fresh_tokens * layers + rep.reused_tokens * c
               + rep.recomputed_tokens * (layers - c)) / layers
    return blended + rest


def ttft_rows(r: Runner, cases: list[Case], ratio: float, layers: int) -> list[dict[str, Any]]:
    """TTFT and computed tokens per (mode, cache state), medians over ``cases``."""
    from radixkv.engine.blend import DEFAULT_CHECK_LAYER

    samples: dict[tuple[str, str], list[tuple[float, float]]] = {}

    def add(mode: str, state: str, ttft: float, work: float) -> None:
        samples.setdefault((mode, state), []).append((ttft, work))

    for i, case in enumerate(cases):
        print(f"  ttft: prompt {i + 1}/{len(cases)}", file=sys.stderr, flush=True)
        prompt, other = case.prompt(case.order), case.prompt(case.other)
        spans = case.spans(case.order)
        # prefix-only
        s = r.salt()
        out = r.run(prompt, s)
        add("prefix-only", "cold", out.ttft, computed_tokens(len(prompt), 0, None, layers, 0))
        s = r.salt()
        r.run(other, s)
        out = r.run(prompt, s)
        add("prefix-only", "other order", out.ttft,
            computed_tokens(len(prompt), out.num_cached_tokens, None, layers, 0))
        out = r.run(prompt, s)
        add("prefix-only", "warm", out.ttft,
            computed_tokens(len(prompt), out.num_cached_tokens, None, layers, 0))
        def blended(mode: str, state: str, s: str, rt: float, setup: Any = None,
                    extra_tokens: float = 0.0) -> None:
            """One timed blend of this prompt at ratio ``rt`` under salt ``s`` (after
            ``setup()``, timed with it) and its request: a row of ``mode`` / ``state``."""
            t0 = time.perf_counter()
            if setup is not None:
                setup()
            rep = r.blend(prompt, spans, s, rt)
            before = time.perf_counter() - t0
            out = r.run(prompt, s, rep.namespace_extra if rep else None)
            add(mode, state, before + out.ttft,
                computed_tokens(len(prompt), out.num_cached_tokens, rep, layers,
                                DEFAULT_CHECK_LAYER, rt) + extra_tokens)

        def other_order(mode: str, rt: float) -> None:
            """The documents cached by a prompt that lists them in another order, then
            this prompt blended at ratio ``rt``."""
            s = r.salt()
            r.warm_docs(case, s)
            rep = r.blend(other, case.spans(case.other), s, rt)
            r.run(other, s, rep.namespace_extra if rep else None)
            blended(mode, "other order", s, rt)

        for rt in sorted({*RATIOS, ratio}):
            if rt not in (0.0, ratio):
                other_order(f"blend {rt:.0%}", rt)
        for mode, rt in (("plain (0%)", 0.0), (f"blend {ratio:.0%}", ratio)):
            s = r.salt()
            blended(mode, "cold", s, rt, lambda s=s: r.warm_docs(case, s),
                    sum(len(d) for d in case.docs))
            other_order(mode, rt)
            blended(mode, "warm", s, rt)
    rows = []
    for (mode, state), xs in samples.items():
        rows.append({"mode": mode, "cache": state,
                     "ttft_s": statistics.median(x[0] for x in xs),
                     "computed_tokens": statistics.median(x[1] for x in xs),
                     "prompt_tokens": statistics.median(len(c.prompt(c.order)) for c in cases),
                     "prompts": len(xs)})
    base = {row["cache"]: row["ttft_s"] for row in rows if row["mode"] == "prefix-only"}
    for row in rows:
        row["ttft_vs_prefix_only"] = row["ttft_s"] / base[row["cache"]]
    return rows


def plot(rows: list[dict[str, Any]], path: Any) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    models = sorted({r["model"] for r in rows}, key=lambda m: (m != "SmolLM2-135M", m))
    for m in models:
        pts = [(r["mode"], r["top1"], r["kl_mean"]) for r in rows
               if r["model"] == m and r["mode"].startswith(("plain", "blend"))]
        xs = [0.0 if p[0].startswith("plain") else float(p[0].split()[1].rstrip("%")) / 100
              for p in pts]
        axes[0].plot(xs, [p[1] for p in pts], marker="o", label=m)
        axes[1].plot(xs, [p[2] for p in pts], marker="o", label=m)
        bar = [r["top1"] for r in rows if r["model"] == m and r["mode"] == "bf16"]
        if bar and m == "SmolLM2-135M":
            axes[0].axhline(bar[0], ls="--", c="gray", label="bf16 vs fp32 (SmolLM2)")
    axes[0].set_xlabel("blend ratio")
    axes[0].set_ylabel("top-1 agreement with full prefill")
    axes[1].set_xlabel("blend ratio")
    axes[1].set_ylabel("mean KL(full || blended), nats")
    axes[1].set_yscale("log")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="radixkv bench rag", description=plain_doc(__doc__))
    ap.add_argument("--quick", action="store_true", help="a smoke run: 2 short prompts")
    ap.add_argument("--prompts", type=int, default=8, help="quality prompts per model")
    ap.add_argument("--ttft-prompts", type=int, default=3, help="4-document TTFT prompts")
    ap.add_argument("--tokens", type=int, default=16, help="teacher-forced continuation")
    ap.add_argument("--ratio", type=float, default=None,
                    help="the blend ratio of the TTFT runs (default: DEFAULT_BLEND_RATIO)")
    ap.add_argument("--no-tiny", action="store_true", help="skip the tiny random models")
    ap.add_argument("--tiny", nargs="+", choices=TINY, default=None, metavar="ARCH",
                    help=f"only these tiny random models (of {', '.join(TINY)})")
    ap.add_argument("--no-smol", action="store_true",
                    help="skip the embedded SmolLM2 model (quality and TTFT): tiny models only")
    ap.add_argument("--only", choices=("quality", "ttft"), default=None,
                    help="run one half (the last line then needs the other's JSON: skipped)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None, help="torch threads")
    ap.add_argument("--kv-dtype", default=None, choices=("int8", "fp8_e4m3", "fp8"),
                    help="quantized KV cache of the engines under test (fp8: fp8_e4m3); "
                         "compared with full prefills on the same cache and on fp32")
    args = ap.parse_args(argv)
    kv_dtype = {"fp8": "fp8_e4m3"}.get(args.kv_dtype, args.kv_dtype)
    import torch

    from radixkv.engine.blend import DEFAULT_BLEND_RATIO

    if args.threads:
        torch.set_num_threads(args.threads)
    ratio = DEFAULT_BLEND_RATIO if args.ratio is None else args.ratio
    n_q, min_len, max_len, min_docs, max_docs = (
        (2, 200, 300, 3, 4) if args.quick else (args.prompts, 200, 1000, 3, 8))
    n_t = 1 if args.quick else args.ttft_prompts
    header = run_header(args.seed, quick=args.quick, ratio=ratio, tokens=args.tokens,
                        threads=torch.get_num_threads(), kv_dtype=kv_dtype or "model dtype")
    print(header)
    qrows: list[dict[str, Any]] = []
    trows: list[dict[str, Any]] = []
    if not args.no_smol:
        qrows, trows = _smol_rows(args, kv_dtype, ratio, n_q, n_t, min_len, max_len, min_docs,
                                  max_docs)
    if not args.no_tiny and args.only != "ttft":
        qrows += _tiny_rows(args, kv_dtype, n_q, min_len, max_len, min_docs, max_docs)
    _report(args, kv_dtype, ratio, header, qrows, trows)
    return 0


def _smol_rows(args: Any, kv_dtype: str | None, ratio: float, n_q: int, n_t: int,
               min_len: int, max_len: int, min_docs: int, max_docs: int
               ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Quality and TTFT rows of the embedded SmolLM2-135M."""
    import torch

    from radixkv.models import load_model, load_tokenizer

    tok = load_tokenizer()
    m32 = load_model(dtype=torch.float32, device="cpu", progress=False)
    layers = int(m32.config.num_hidden_layers)
    e32 = make_engine(m32, tok, "float32", 3072, "smol-fp32", kv_dtype or "auto")
    efp = (None if kv_dtype is None or args.only == "ttft" else
           make_engine(copy.deepcopy(m32), tok, "float32", 1024, "smol-fp32-ref"))
    qrows: list[dict[str, Any]] = []
    trows: list[dict[str, Any]] = []
    try:
        cases = smol_cases(n_q + n_t, min_docs, max_docs, min_len, max_len, args.seed, tok, e32)
        if args.only != "ttft":
            e16 = make_engine(copy.deepcopy(m32).to(torch.bfloat16), tok, "bfloat16", 3072,
                              "smol-bf16")
            try:
                qrows = quality(Runner(e32), Runner(e16), cases[:n_q], args.tokens,
                                "SmolLM2-135M", Runner(efp) if efp is not None else None)
            finally:
                e16.close()
        if args.only != "quality":
            tcases = []
            for c in cases[n_q:]:     # 4-document prompts for the TTFT target
                while len(c.docs) < 4:
                    c.docs.append(c.docs[0])
                c.docs = c.docs[:4]
                c.order, c.other = _orders(random.Random(args.seed), 4)
                tcases.append(c)
            trows = ttft_rows(Runner(e32), tcases, ratio, layers)
    finally:
        e32.close()
        if efp is not None:
            efp.close()
    return qrows, trows


def _tiny_rows(args: Any, kv_dtype: str | None, n_q: int, min_len: int, max_len: int,
               min_docs: int, max_docs: int) -> list[dict[str, Any]]:
    """Quality rows of the tiny random models (``--tiny`` picks some)."""
    import torch

    from radixkv.engine.blend import blend_unsupported, window_unsupported

    qrows: list[dict[str, Any]] = []
    for name in args.tiny or TINY:
        t32 = tiny_model(name)
        t16 = copy.deepcopy(t32).to(torch.bfloat16)
        tc = tiny_cases(max(2, n_q), min_docs, max_docs, min_len, max_len, args.seed)
        a = make_engine(t32, None, "float32", 2048, f"tiny-{name}", kv_dtype or "auto")
        b = make_engine(t16, None, "bfloat16", 2048, f"tiny-{name}-bf16")
        c = (None if kv_dtype is None else
             make_engine(copy.deepcopy(t32), None, "float32", 2048, f"tiny-{name}-ref"))
        try:
            rows = quality(Runner(a), Runner(b), tc, args.tokens, f"tiny {name}",
                           Runner(c) if c is not None else None)
            reason = blend_unsupported(a.core.model_runner)
            lean = a.core.model_runner.lean
            windowed = 0 if lean is None else sum(
                window_unsupported(lean, len(case.prompt(case.order))) is not None
                for case in tc)
            if not reason and windowed:
                reason = (f"{windowed} of {len(tc)} prompts longer than the sliding window "
                          "(prefix-only there)")
            for row in rows:
                row["note"] = f"prefix-only fallback: {reason}" if reason else ""
            qrows += rows
        finally:
            a.close()
            b.close()
            if c is not None:
                c.close()
    return qrows


def _report(args: Any, kv_dtype: str | None, ratio: float, header: dict,
            qrows: list[dict[str, Any]], trows: list[dict[str, Any]]) -> None:
    """The tables, the JSON and the last line a script checks."""
    if qrows:
        cols = ["model", "mode", "kl_mean", "kl_max", "top1", "prompts", "note"]
        title = "quality vs a full fp32 prefill (teacher-forced continuation)"
        if kv_dtype is not None:
            cols[5:5] = ["kl_fp32", "top1_fp32"]
            title = (f"quality, {kv_dtype} KV: kl_mean/top1 vs a full prefill on the same "
                     f"{kv_dtype} cache, kl_fp32/top1_fp32 vs a full fp32 prefill (bf16: vs "
                     "fp32 in both)")
        print_table(qrows, cols, title=title)
    if trows:
        print_table(trows, ["mode", "cache", "ttft_s", "ttft_vs_prefix_only", "computed_tokens",
                            "prompt_tokens", "prompts"],
                    title=f"TTFT, 4-document prompts, SmolLM2-135M fp32 on the CPU, "
                          f"{kv_dtype or 'fp32'} KV (default ratio {ratio})")
    partial = args.no_smol or args.tiny is not None   # a subset: its own JSON, no plot
    suffix = ("" if kv_dtype is None else f"_{kv_dtype}") + (
        "" if args.only is None else f"_{args.only}") + ("_subset" if partial else "")
    name = ("rag_quick" if args.quick else "rag") + suffix
    write_results(name, header, {"quality": qrows, "ttft": trows})
    if not args.quick and qrows and kv_dtype is None and not partial:
        out = REPO_ROOT / "docs" / "img" / "rag_quality.png"
        out.parent.mkdir(parents=True, exist_ok=True)
        plot(qrows, out)
        print(f"wrote {out}")
    pick = f"blend {ratio:.0%}" if ratio > 0 else "plain (0%)"
    r = next((x["ttft_vs_prefix_only"] for x in trows
              if x["mode"] == pick and x["cache"] == "other order"), float("nan"))
    key = "top1" if kv_dtype is None else "top1_fp32"
    if kv_dtype is not None:
        own = next((x["top1"] for x in qrows
                    if x["model"] == "SmolLM2-135M" and x["mode"] == pick), float("nan"))
        print(f"{kv_dtype} KV: top-1 agreement of {pick} with a full prefill on the same "
              f"cache {own:.3f}")
    a = next((x[key] for x in qrows if x["model"] == "SmolLM2-135M" and x["mode"] == pick),
             float("nan"))
    b = next((x["top1"] for x in qrows if x["model"] == "SmolLM2-135M" and x["mode"] == "bf16"),
             float("nan"))
    print(f"blended/prefix-only TTFT {r:.2f}; top-1 agreement {a:.3f} (bar {b:.3f})")


if __name__ == "__main__":
    sys.exit(main())
