"""Shared-prefix traces: RAG over Zipf-popular documents, shared system prompts, sampling/beams.

``rag``
    Documents are ShareGPT answers of ``doc_tokens`` length; popularity is Zipf(``zipf_s``) over a
    seeded ranking; each question (a short first ShareGPT user message) gets ``k`` distinct
    documents, placed after the (default) system prompt and an instruction and before the
    question, in canonical order (ascending document id) in one user message, so that requests
    sharing leading documents share a prefix.
``system``
    A few long common prefixes (a system prompt taken from a long ShareGPT user message plus
    ``shots`` real few-shot user/assistant pairs), chosen with Zipf popularity, each followed by one
    short question.
``sampling``
    Groups of requests on one prompt (a ShareGPT first user message): ``n`` parallel samples (same
    prompt, replies that share a random-length prefix of the real answer and then diverge) and a
    beam search of ``beams`` beams over ``steps`` steps of ``chunk`` tokens (each step, every live
    beam extends by one chunk; the children of a random subset of beams survive).

Prompts are assembled from per-piece token ids (special tokens split the text before BPE), and
the first ``verify`` prompts of each trace are checked against tokenizing the rendered whole.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from typing import Any

from radixkv.benchmarks.traces_format import Request
from radixkv.benchmarks.traces_sharegpt import (
    ChatTokenizer, _answers, _pick_texts, _poisson_times, _user_turn_ids, _zipf_sampler,
)


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
    stats = {"tokenize_s": round(time.perf_counter() - t0, 2),
             "assembly_verified": f"{ok}/{verify}", "distinct_questions": len(questions)}
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
