"""Multi-turn chat traces: the same ShareGPT conversations under two arrival schedules.

Turn k of a conversation re-sends the whole history rendered through the chat template (default
SmolLM2 system prompt + user/assistant messages) plus the new user message; the reply is the
real ShareGPT answer. A conversation is cut at the first turn whose prompt + reply exceeds
``max_context`` tokens (SmolLM2's 8,192-token context by default) and dropped if no turn fits.
Which conversations, and in which order, depends only on the seed, ``n_conversations`` and
``max_context``, so ``chat`` and ``chat-rr`` with equal values replay the same conversations.

``chat`` (open loop)
    Conversations arrive as a Poisson process (``rate`` per second) and at most ``window`` are
    active at once; between turns a conversation waits for its reply (``decode_tps`` tokens/s)
    and a think time (exponential, mean ``think_s``). Arrivals do not wait for the server.
``chat-rr`` (round robin)
    ``slots`` conversations are active; the slots take turns in a fixed order, one request each
    ``interval_s`` seconds, and a slot whose conversation has ended takes the next one. Every
    live conversation comes back exactly ``slots`` requests later: the loop that LRU handles
    worst when the active histories exceed the cache.
``chat-shuffled`` (held out)
    ``slots`` conversations are live, and each request (one every ``interval_s`` seconds) is
    the next turn of one of them drawn at random; a slot whose conversation has ended takes
    the next one. The conversations are drawn with another seed than ``chat``'s and
    ``chat-rr``'s (no policy was tuned on them): the check that a default does not only fit
    the four workloads it was chosen on.
"""

from __future__ import annotations

import random
import time
from typing import Any

from radixkv.benchmarks.traces_format import Request
from radixkv.benchmarks.traces_sharegpt import ChatTokenizer, _bar, _msgs, _poisson_times, lcp

Kept = list[tuple[int, list[list[int]], list[list[int]]]]  # (conv index, prompts, replies)


def tokenize_conversations(convs: list[list[tuple[str, str]]], tk: ChatTokenizer,
                           rng: random.Random, n_conversations: int, max_context: int,
                           system: str | None = None, batch: int = 128,
                           progress: bool = True) -> tuple[Kept, dict[str, Any]]:
    """The first ``n_conversations`` usable conversations in a seeded order, every turn's prompt
    and reply tokenized, cut at ``max_context``; plus statistics (prefix property checked)."""
    order = [i for i in range(len(convs)) if convs[i]]
    rng.shuffle(order)
    kept: Kept = []
    stats: dict[str, Any] = {"cut_at_context": 0, "dropped_too_long": 0}
    t0 = time.perf_counter()
    pos = 0
    bar = _bar(n_conversations, "tokenize chat", progress)
    while len(kept) < n_conversations and pos < len(order):
        chunk = order[pos:pos + batch]
        pos += batch
        texts, replies = [], []
        for ci in chunk:
            for k in range(len(convs[ci])):
                texts.append(tk.render(_msgs(convs[ci], k, system)))
                replies.append(convs[ci][k][1])
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
    return kept, stats


def build_chat(convs: list[list[tuple[str, str]]], tk: ChatTokenizer, *, seed: int,
               n_conversations: int, window: int, rate: float, think_s: float,
               decode_tps: float, max_context: int, system: str | None = None,
               batch: int = 128, progress: bool = True) -> tuple[list[Request], dict[str, Any]]:
    """The open-loop chat trace (Poisson arrivals, reply + think time between turns)."""
    rng = random.Random(seed)
    kept, stats = tokenize_conversations(convs, tk, rng, n_conversations, max_context, system,
                                         batch, progress)
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


def build_chat_rr(convs: list[list[tuple[str, str]]], tk: ChatTokenizer, *, seed: int,
                  n_conversations: int, slots: int, interval_s: float, max_context: int,
                  system: str | None = None, batch: int = 128,
                  progress: bool = True) -> tuple[list[Request], dict[str, Any]]:
    """The round-robin chat trace: ``slots`` live conversations take turns in a fixed order."""
    if slots < 1 or not interval_s > 0:
        raise ValueError(f"need slots >= 1 and interval_s > 0, got {slots}, {interval_s}")
    kept, stats = tokenize_conversations(convs, tk, random.Random(seed), n_conversations,
                                         max_context, system, batch, progress)
    queue = iter(enumerate(kept))
    live: list[list[Any] | None] = [None] * slots  # per slot: [cid, (ci, ps, rs), next turn]
    reqs: list[Request] = []
    while True:
        progressed = False
        for s in range(slots):
            if live[s] is None or live[s][2] >= len(live[s][1][1]):
                nxt = next(queue, None)
                live[s] = None if nxt is None else [nxt[0], nxt[1], 0]
            if live[s] is None:
                continue
            cid, (ci, ps, rs), k = live[s]
            reqs.append(Request(len(reqs) * interval_s, cid, k, ps[k], rs[k], {"src": ci}))
            live[s][2] = k + 1
            progressed = True
        if not progressed:
            break
    return reqs, stats


def build_chat_shuffled(convs: list[list[tuple[str, str]]], tk: ChatTokenizer, *, seed: int,
                        n_conversations: int, slots: int, interval_s: float, max_context: int,
                        system: str | None = None, batch: int = 128,
                        progress: bool = True) -> tuple[list[Request], dict[str, Any]]:
    """The held-out chat trace: ``slots`` live conversations, each request the next turn of
    one of them drawn at random (seeded), conversations drawn with a seed of their own."""
    if slots < 1 or not interval_s > 0:
        raise ValueError(f"need slots >= 1 and interval_s > 0, got {slots}, {interval_s}")
    rng = random.Random(f"held-out-{seed}")
    kept, stats = tokenize_conversations(convs, tk, rng, n_conversations, max_context, system,
                                         batch, progress)
    queue = iter(enumerate(kept))
    live: list[list[Any]] = []      # [cid, (ci, ps, rs), next turn]
    reqs: list[Request] = []
    while True:
        while len(live) < slots:
            nxt = next(queue, None)
            if nxt is None:
                break
            live.append([nxt[0], nxt[1], 0])
        if not live:
            break
        i = rng.randrange(len(live))
        cid, (ci, ps, rs), k = live[i]
        reqs.append(Request(len(reqs) * interval_s, cid, k, ps[k], rs[k], {"src": ci}))
        live[i][2] = k + 1
        if k + 1 >= len(ps):
            live[i] = live[-1]
            live.pop()
    return reqs, stats
