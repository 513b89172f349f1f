"""Agent-loop traces: one long shared system prompt with tools, many short turns per session.

``agent``
    Every session starts from the same prefix: a system message made of an instruction (a long
    ShareGPT user message) and ``n_tools`` tool definitions (JSON, each described by a real
    ShareGPT sentence). The user states a task (a short first ShareGPT user message); then the
    model calls a tool (a short JSON call, ``call_tokens`` long: the reply), the tool answers (a
    ShareGPT answer of ``result_tokens`` length, sent back as a ``tool`` message) and the model
    is asked again, re-sending the whole history. A session makes ``steps`` calls, drawn from a
    Pareto law (``min_steps`` * Pareto(``steps_alpha``), at most ``max_steps``, cut where the
    context would pass ``max_context``), so a few sessions are far longer than most: the
    "sessions of very different lengths" of issue 15. Sessions arrive as a Poisson process
    (``rate``/s); between steps a session waits for its call to decode (``decode_tps``) and the
    tool to run (exponential, mean ``tool_s``): short gaps, unlike a human's think time.

The prompt of step k+1 extends prompt k + reply k by one tool turn, exactly as the chat template
renders it (the first ``verify`` prompts are checked against the template).
"""

from __future__ import annotations

import json
import math
import random
import time
from collections.abc import Sequence
from typing import Any

from radixkv.benchmarks.traces_format import Request
from radixkv.benchmarks.traces_sharegpt import (
    ChatTokenizer, _answers, _pick_texts, _poisson_times, _user_turn_ids,
)

TOOL_NAMES = ("search_web", "read_file", "write_file", "run_python", "query_database",
              "list_directory", "http_get", "send_email", "calendar_lookup", "summarize_text",
              "translate_text", "get_weather", "create_ticket", "run_shell", "fetch_docs",
              "math_eval")


def session_steps(rng: random.Random, n: int, min_steps: int, alpha: float,
                  max_steps: int) -> list[int]:
    """Tool calls per session: ``ceil(min_steps * Pareto(alpha))``, at most ``max_steps``.

    >>> s = session_steps(random.Random(0), 1000, 2, 1.1, 64)
    >>> min(s) >= 2 and max(s) <= 64 and sorted(s)[500] < 8 < max(s)
    True
    """
    return [min(max_steps, math.ceil(min_steps * rng.paretovariate(alpha))) for _ in range(n)]


def build_agent(convs, tk: ChatTokenizer, *, seed: int, n_sessions: int, n_tools: int,
                instruction_tokens: Sequence[int], call_tokens: Sequence[int],
                result_tokens: Sequence[int], min_steps: int, steps_alpha: float,
                max_steps: int, rate: float, tool_s: float, decode_tps: float,
                max_context: int, progress: bool = True,
                verify: int = 20) -> tuple[list[Request], dict[str, Any]]:
    rng = random.Random(seed)
    t0 = time.perf_counter()
    if n_tools > len(TOOL_NAMES):
        raise ValueError(f"at most {len(TOOL_NAMES)} tools, got {n_tools}")
    instruction = _pick_texts(convs, rng, tk, 1, 0, *instruction_tokens)[0][1]
    descs = _pick_texts(convs, rng, tk, n_tools, 0, 12, 60)
    tools = [{"type": "function", "function": {
        "name": TOOL_NAMES[i], "description": d.strip(),
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}},
                       "required": ["query"]}}} for i, (_, d, _) in enumerate(descs)]
    system = (f"{instruction.strip()}\n\nYou can call these tools. To call one, reply with a "
              f"JSON object {{\"name\": ..., \"arguments\": ...}}.\n"
              + "\n".join(json.dumps(t) for t in tools))
    sys_msgs = [{"role": "system", "content": system}]
    prefix_ids = tk.encode_many([tk.render(sys_msgs, False)])[0]
    tasks = _pick_texts(convs, rng, tk, n_sessions, 0, 8, 200)
    task_ids = _user_turn_ids(tk, [q for _, q, _ in tasks])
    finals = _answers(convs, tasks, tk, call_tokens[1] * 2)
    n_results = min(max(4 * n_sessions, 64), 3000)
    results = _pick_texts(convs, rng, tk, n_results, 1, *result_tokens, first_only=False,
                          strip=True)
    result_ids = tk.encode_many([f"\n<|im_start|>tool\n{r}<|im_end|>\n<|im_start|>assistant\n"
                                 for _, r, _ in results])
    # Tool calls: a tool name and a query of real words, cut to call_tokens.
    words = [q.split() for _, q, _ in tasks]
    n_calls = 4 * n_sessions
    call_texts = []
    for _ in range(n_calls):
        w = words[rng.randrange(len(words))]
        n_w = rng.randint(max(1, call_tokens[0] // 3), max(2, call_tokens[1] // 3))
        query = " ".join(w[:n_w])
        call_texts.append(json.dumps({"name": TOOL_NAMES[rng.randrange(n_tools)],
                                      "arguments": {"query": query}}))
    call_ids = [ids[:call_tokens[1]] + [tk.eos_id] for ids in tk.encode_many(call_texts)]
    call_ids = [c for c in call_ids if len(c) > call_tokens[0]] or call_ids

    steps = session_steps(rng, n_sessions, min_steps, steps_alpha, max_steps)
    arrivals = _poisson_times(rng, n_sessions, rate)
    reqs: list[Request] = []
    cut = 0
    transcript: dict[int, list[tuple[int, int]]] = {}  # session -> [(call, result)] (verify)
    for s in range(n_sessions):
        prompt = prefix_ids + task_ids[s]
        t = arrivals[s]
        calls: list[tuple[int, int]] = []
        for k in range(steps[s] + 1):
            last = k == steps[s]
            ci, ri = rng.randrange(len(call_ids)), rng.randrange(len(result_ids))
            reply = finals[s] if last else call_ids[ci]
            if len(prompt) + len(reply) > max_context:
                cut += 1
                break
            reqs.append(Request(t, s, k, prompt, reply, {"steps": steps[s]}))
            if last:
                break
            calls.append((ci, ri))
            prompt = prompt + reply + result_ids[ri]
            t += len(reply) / decode_tps + rng.expovariate(1.0 / tool_s)
        transcript[s] = calls
    reqs.sort(key=lambda r: (r.t, r.conv, r.turn))

    ok = checked = 0
    for r in reqs[:verify]:
        msgs = list(sys_msgs) + [{"role": "user", "content": tasks[r.conv][1]}]
        for ci, ri in transcript[r.conv][:r.turn]:
            text = tk.tok.decode(call_ids[ci][:-1])
            msgs += [{"role": "assistant", "content": text},
                     {"role": "tool", "content": results[ri][1]}]
        checked += 1
        ok += tk.template_ids(msgs) == r.prompt
    per_session = sorted(steps)
    stats = {"tokenize_s": round(time.perf_counter() - t0, 2),
             "assembly_verified": f"{ok}/{checked}", "prefix_tokens": len(prefix_ids),
             "sessions_cut_at_context": cut,
             "steps_min_median_max": [per_session[0], per_session[len(per_session) // 2],
                                      per_session[-1]] if per_session else []}
    return reqs, stats
