"""Do replicas that share a remote tier hit as often as one engine that saw everything?

The ``remote-engines`` part of ``radixkv bench tiers``. The ShareGPT chat trace (prompts
tokenized with the SmolLM2 chat template, each turn's prompt holding the real replies of the
turns before) is replayed through real ``LLMEngine`` s over a small random-weight Llama with
SmolLM2's vocabulary (the cache only sees token ids and KV bytes; a 135M model would only make
the run slower, not the hit rates different). Each request is prefilled and generates one
token; requests run one at a time per engine, in trace order. Remote blocks really go through
a ``redis-server`` on loopback (started here, flushed between runs).

Runs, all with the same *total* device and host memory:

* ``single``: one engine, the whole trace;
* ``single+remote``: the same engine with the remote tier;
* ``pair``: two engines in two processes, the trace split by conversation (odd/even), no
  sharing: what N replicas without a shared tier get;
* ``pair+remote``: the same pair sharing one server (write-back: blocks leaving a host tier);
* ``pair+remote wt``: the same with write-through (every computed block is written at once).

Hit rate = prompt tokens served from any cache tier / prompt tokens. Target (issue 12): the
pair sharing the server reaches >= 0.98 of one engine with the same total memory.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from typing import Any


def _model() -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=8192, tie_word_embeddings=True)
    return LlamaForCausalLM(cfg).eval()


def _replay(args: tuple) -> dict[str, Any]:
    """One engine replaying ``requests`` [(prompt ids)] in order (run in its own process)."""
    requests, device_blocks, host_blocks, url, write = args
    import torch

    from radixkv.config import CacheConfig, EngineConfig
    from radixkv.engine.llm_engine import LLMEngine
    from radixkv.engine.sampling import SamplingParams

    torch.set_num_threads(1)
    cc = CacheConfig(block_size=16, num_device_blocks=device_blocks, host_blocks=host_blocks,
                     remote_url=url, remote_write=write or "write_back", remote_timeout_s=5.0)
    eng = LLMEngine(_model(), None, cc, EngineConfig(max_num_seqs=4, device="cpu",
                                                     max_num_batched_tokens=4096),
                    model_id="bench-remote-engines")
    names = eng.output_tier_names
    prompt = cached = remote = 0
    t0 = time.perf_counter()
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    for i, ids in enumerate(requests):
        eng.add_request(f"r{i}", ids, params)
        while eng.has_unfinished_requests():
            for out in eng.step():
                if out.finished:
                    prompt += len(ids)
                    cached += out.num_cached_tokens
                    per = dict(zip(names, out.cached_tokens_per_tier))
                    remote += per.get("remote", 0)
    if eng._remote is not None:
        eng._remote.store.flush(10.0)
    eng.close()
    return {"prompt_tokens": prompt, "cached_tokens": cached, "remote_tokens": remote,
            "seconds": time.perf_counter() - t0}


def bench_remote_engines(quick: bool, device_fracs: tuple[float, ...] = (0.05, 0.1, 0.25)
                         ) -> dict[str, Any]:
    """Every run at each device capacity (a fraction of the trace's working set, plus a host
    tier of a quarter of it), on one redis-server."""
    from radixkv.benchmarks.bench_remote import LocalRedis
    from radixkv.benchmarks.bounds import infinite, prepare
    from radixkv.benchmarks.traces import Trace, load_trace

    trace = load_trace("chat", quick=quick, progress=False)
    if not quick:
        trace = Trace(trace[:800], trace.header)
    bt = prepare(trace, 16)
    work = bt.num_blocks
    halves = [[r.prompt for r in trace if r.conv % 2 == k] for k in (0, 1)]
    whole = [r.prompt for r in trace]
    server = LocalRedis()
    rows: list[dict[str, Any]] = []
    ctx = mp.get_context("spawn")
    try:
        for frac in device_fracs:
            dev = max(int(frac * work) // 2 * 2, 2 * (bt.min_capacity + 2))
            host = max(64, dev // 4) // 2 * 2

            def run(name: str, remote: bool, write: str | None, pair: bool) -> None:
                import redis

                redis.Redis(port=server.port).flushall()
                url = server.url if remote else None
                if pair:
                    with ctx.Pool(2) as pool:
                        parts = pool.map(_replay, [(h, dev // 2, host // 2, url, write)
                                                   for h in halves])
                else:
                    parts = [_replay((whole, dev, host, url, write))]
                p = sum(x["prompt_tokens"] for x in parts)
                c = sum(x["cached_tokens"] for x in parts)
                r = sum(x["remote_tokens"] for x in parts)
                rows.append({"device": frac, "run": name, "engines": len(parts),
                             "device_blocks_each": dev // len(parts),
                             "host_blocks_each": host // len(parts), "prompt_tokens": p,
                             "hit_rate": c / p, "remote_share": r / p,
                             "prefill_tokens_saved": c,
                             "seconds": max(x["seconds"] for x in parts)})
                print(f"  device {frac:.2f} {name}: hit rate {c / p:.4f} (remote {r / p:.4f})",
                      flush=True)

            run("single", False, None, False)
            run("single+remote", True, "write_back", False)
            run("pair", False, None, True)
            run("pair+remote", True, "write_back", True)
            run("pair+remote wt", True, "write_through", True)
    finally:
        server.close()
    for frac in device_fracs:
        mine = [r for r in rows if r["device"] == frac]
        by = {r["run"]: r["hit_rate"] for r in mine}
        for r in mine:
            r["of_single"] = r["hit_rate"] / by["single"]
            r["of_single+remote"] = r["hit_rate"] / by["single+remote"]
    pr = [r for r in rows if r["run"] == "pair+remote"]
    return {"trace": "chat", "requests": len(trace), "working_set_blocks": work,
            "infinite": infinite(bt).hit_rate, "rows": rows,
            "pair_remote_of_single_min": min(r["of_single"] for r in pr),
            "pair_remote_of_single_remote_min": min(r["of_single+remote"] for r in pr)}


__all__ = ["bench_remote_engines"]
