"""``radixkv bench fleet``: multi-turn chat against a 2-replica fleet, routed three ways.

Question: with the cache split over replicas, how much of a single engine's hit rate does
routing keep, and what does it do to time to first token?

Workload (the serve benchmark's): the first ``--conversations`` ShareGPT conversations with >= 2
turns, user messages cut to ``--max-chars``; clients arrive as a Poisson process (``--rate``
conversations/s), think ``--think`` s (exponential) between turns, re-send the whole history with
the model's replies, streamed, ``temperature=0``. At most ``--clients`` conversations at once.

Configurations, each started by this benchmark on this machine and fed the same schedule:

* ``single``: one ``radixkv serve`` with ``2 x --device-blocks`` (the same total memory: the hit
  rate a fleet can at best keep);
* ``pow2``: ``--replicas 2`` with Ray Serve's default router (power of two choices);
* ``kv``: ``--replicas 2`` with radixkv's KV-aware router;
* ``kv+remote``: ``kv`` with both replicas sharing a real ``redis-server`` remote tier.

Each replica has ``--device-blocks`` blocks, so one replica holds about half the working set.
Reported per configuration: hit rate (cached / prompt tokens, all turns), prefill tokens computed,
TTFT p50/p99 of later turns (client side), and load imbalance (max / mean of the prompt tokens
each replica received). Targets (issue 13): hit rate of ``kv`` >= 0.95 x ``single``;
p50 TTFT of ``kv`` <= 0.7 x ``pow2``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from radixkv.benchmarks._common import (REPO_ROOT, print_table, run_header,
                                        temp_results_unless_set, write_results)
from radixkv.benchmarks.bench_serve import (_free_port, _pct, conversations, run_clients,
                                             ttft_cdf)


def _start(extra: list[str], args: argparse.Namespace, log: Path) -> tuple[Any, str]:
    """Start a server and wait until all of it serves. A fleet's ``/health`` is 200 once the
    ingress and one replica are up; traffic sent then would all go to that replica, so a fleet
    is ready at the command's "fleet ready" line with every replica in ``/metrics``."""
    replicas = int(extra[extra.index("--replicas") + 1]) if "--replicas" in extra else 0
    port = _free_port()
    cmd = [sys.executable, "-m", "radixkv.server.cli", "--port", str(port), "--device", "cpu",
           "--dtype", "float32", "--max-num-seqs", str(args.max_seqs), *extra]
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT,
                                start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"exited ({proc.returncode}): {' '.join(cmd)}\n"
                               f"{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(base + "/health", timeout=5) as r:
                if r.status == 200 and (not replicas or (
                        "fleet ready" in log.read_text()
                        and len(_per_replica_prompt_tokens(base)) == replicas)):
                    return proc, base
        except OSError:
            pass
        time.sleep(1)
    raise TimeoutError("not ready")


def _stop(proc: Any) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _per_replica_prompt_tokens(base: str) -> dict[str, float]:
    with urllib.request.urlopen(base + "/metrics", timeout=30) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r'^radixkv_prefix_cache_queries_total\{([^}]*)\}\s+(\S+)$', line)
        if m:
            rep = re.search(r'replica="([^"]+)"', m.group(1))
            out[rep.group(1) if rep else "single"] = float(m.group(2))
    return out


def summarize(name: str, run: dict[str, Any], per_replica: dict[str, float]) -> dict[str, Any]:
    allr = run["requests"]
    later = [r for r in allr if r["turn"] > 0]
    ttft = [r["ttft"] for r in later]
    prompt = sum(r["prompt_tokens"] for r in allr)
    cached = sum(r["cached_tokens"] for r in allr)
    loads = list(per_replica.values())
    return {
        "config": name, "requests": len(allr), "hit_rate": cached / max(1, prompt),
        "prefill_tokens": prompt - cached, "ttft_p50_s": _pct(ttft, 0.5),
        "ttft_mean_s": sum(ttft) / len(ttft),
        "ttft_p99_s": _pct(ttft, 0.99), "wall_s": run["wall_s"],
        "imbalance": (max(loads) / (sum(loads) / len(loads))) if loads and sum(loads) else 1.0,
        "per_replica_prompt_tokens": per_replica,
    }


def plot(rows: list[dict[str, Any]], runs: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.6))
    names = [r["config"] for r in rows]
    a1.bar(names, [r["hit_rate"] for r in rows], color="#4c72b0")
    a1.set_ylabel("prompt tokens from cache")
    a1.set_title("hit rate (2 replicas vs one with their memory)")
    ttft_cdf(a2, runs, "TTFT (same schedule)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="radixkv bench fleet", description=__doc__.splitlines()[0])
    ap.add_argument("--conversations", type=int, default=24)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--rate", type=float, default=0.5)
    ap.add_argument("--think", type=float, default=1.0)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--max-chars", type=int, default=4000)
    ap.add_argument("--device-blocks", type=int, default=384, help="per replica")
    ap.add_argument("--max-seqs", type=int, default=4)
    ap.add_argument("--configs", default="single,pow2,kv,kv+remote")
    ap.add_argument("--load-tokens", type=int, default=None,
                    help="the KV router's --route-load-tokens (default: the server's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="6 conversations, 2 turns; temp dir")
    args = ap.parse_args(argv)
    if args.quick:
        args.conversations, args.turns, args.max_tokens = 6, 2, 8
        temp_results_unless_set("radixkv-bench-")
    convs = conversations(args.conversations, args.turns, args.max_chars)
    header = run_header(args.seed, benchmark="fleet",
                        **{k: v for k, v in vars(args).items() if k != "seed"})
    print(json.dumps(header))
    logs = Path(tempfile.mkdtemp(prefix="radixkv-fleet-bench-"))
    blocks = str(args.device_blocks)
    fleet = ["--replicas", "2", "--ray-cpus", "2", "--replica-cpus", "1", "--device-blocks",
             blocks]
    lt = ["--route-load-tokens", str(args.load_tokens)] if args.load_tokens is not None else []
    configs = {
        "single": ["--device-blocks", str(2 * args.device_blocks), "--threads", "1"],
        "pow2": [*fleet, "--router", "pow2"],
        "kv": [*fleet, "--router", "kv", *lt],
        "kv+remote": [*fleet, "--router", "kv", *lt, "--remote-timeout", "5"],
    }
    rows, runs = [], {}
    for name in args.configs.split(","):
        extra = list(configs[name])
        redis_srv = None
        if name.endswith("+remote"):
            from radixkv.benchmarks.bench_remote import LocalRedis

            redis_srv = LocalRedis()
            extra += ["--remote-url", redis_srv.url]
        t0 = time.perf_counter()
        proc, base = _start(extra, args, logs / f"{name}.log")
        print(f"{name}: ready in {time.perf_counter() - t0:.0f} s", flush=True)
        try:
            run = run_clients(base, convs, args)
            time.sleep(1.5)                       # replicas ship stats every second
            per = _per_replica_prompt_tokens(base)
        finally:
            _stop(proc)
            if redis_srv is not None:
                redis_srv.close()
        runs[name] = run
        rows.append(summarize(name, run, per))
        print(f"{name}: {len(run['requests'])} requests in {run['wall_s']:.0f} s", flush=True)
    print_table([{k: v for k, v in r.items() if k != "per_replica_prompt_tokens"} for r in rows],
                title="radixkv fleet (2 replicas x --device-blocks; single: one replica, 2x)")
    by = {r["config"]: r for r in rows}
    ratios: dict[str, float] = {}
    if "kv" in by and "single" in by:
        ratios["kv_hit_over_single"] = by["kv"]["hit_rate"] / max(1e-9, by["single"]["hit_rate"])
    if "kv" in by and "pow2" in by:
        ratios["kv_ttft_p50_over_pow2"] = by["kv"]["ttft_p50_s"] / by["pow2"]["ttft_p50_s"]
    if "kv" in by and "pow2" in by:
        ratios["kv_ttft_mean_over_pow2"] = by["kv"]["ttft_mean_s"] / by["pow2"]["ttft_mean_s"]
    if "pow2" in by and "single" in by:
        ratios["pow2_hit_over_single"] = by["pow2"]["hit_rate"] / max(1e-9,
                                                                      by["single"]["hit_rate"])
    for k, v in ratios.items():
        print(f"{k} = {v:.2f}")
    print("targets: kv_hit_over_single >= 0.95, kv_ttft_p50_over_pow2 <= 0.7")
    write_results("fleet" + ("-quick" if args.quick else ""), header,
                  {"summary": rows, "ratios": ratios, "runs": runs})
    if not args.quick:
        plot(rows, runs, REPO_ROOT / "docs" / "img" / "bench_fleet.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
