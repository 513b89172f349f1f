"""``radixkv bench sched``: admission order under load: FCFS against longest cached prefix first.

Question: when requests queue up, how much do TTFT (p50, p99) and the prefix-cache hit rate
change if the scheduler admits the requests with the longest cached prefix first (``lpm``:
groups over an uncached prefix led by one request, an age limit; see
``radixkv/engine/admission_order.py``) instead of in arrival order (``fcfs``)?

Workloads (``benchmarks.traces``, built from the packaged ShareGPT dump and the embedded
tokenizer): ``rag`` (system prompt + 4 Zipf-popular documents + a question) and ``chat``
(multi-turn conversations, each turn's prompt the whole history). The first ``--requests``
requests of each trace are replayed open loop through a real ``LLMEngine``: each is added at its
arrival time (so TTFT includes the wait in the queue), the engine steps while it has work, and
every request generates ``--max-tokens`` tokens.

Clock. Time is this process's CPU time with one torch thread (:class:`CPUClock`; idle gaps
before the next arrival are skipped): the engine step is CPU-bound work of this process, so
on an idle machine this is the wall time, and on a shared one (seven jobs on two cores here)
other processes do not stretch it. TTFT is the clock at the end of the step that produced
a request's first token minus its arrival; lpm's age limit runs on the same clock.

Load. The trace's arrival times are rescaled (keeping their order and burstiness) so that the
requests arrive over ``W / (P * load)`` seconds, where ``P`` is the engine's prefill rate
(prompt tokens per CPU second, measured on a cold prompt at warm-up) and ``W`` the prompt tokens an
unbounded cache would still compute (each prompt minus its longest full-block prefix shared with
an earlier prompt). ``--loads 1`` thus offers exactly the prefill work a perfect cache leaves,
at the rate the engine can do it; decode steps and misses come on top, so queues form.
The device pool (``--pool-tokens``) is smaller than the trace's distinct prefixes, so the
order decides what is still cached when a request is admitted.

Every policy (``fcfs``, and ``lpm`` once per age limit in ``--max-wait``) runs on one model
object, each on a fresh engine (empty cache), in the same process, in turn, ``--repeat``
times; the summary gives medians over repeats and each lpm variant's ratios to fcfs.
``--model tiny`` runs a random-weight Llama (4 layers,
hidden 256, the embedded vocabulary) instead of the embedded SmolLM2-135M, about ten times
faster: TTFT figures are then about scheduling, not about that model.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

from radixkv.benchmarks._common import plain_doc, print_table, run_header, write_results


def policy_names(max_waits: list[float]) -> list[str]:
    """``fcfs`` then one ``lpm/<age limit>s`` per age limit.

    >>> policy_names([2.0, 10.0])
    ['fcfs', 'lpm/2s', 'lpm/10s']
    """
    return ["fcfs"] + [f"lpm/{w:g}s" for w in max_waits]


def percentile(xs: list[float], q: float) -> float:
    """The ``q``-quantile (0..1) of ``xs`` by linear interpolation (numpy's default).

    >>> percentile([1.0, 2.0, 3.0, 4.0], 0.5), percentile([5.0], 0.99)
    (2.5, 5.0)
    """
    s = sorted(xs)
    pos = (len(s) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def uncached_work(prompts: list[list[int]], block_size: int) -> int:
    """Prompt tokens an unbounded prefix cache would still compute, in this order: each prompt
    minus its longest prefix of full blocks that an earlier prompt also had (at most all but
    the last token, as the engine matches).

    >>> uncached_work([[1, 2, 3, 4, 5], [1, 2, 3, 4, 6]], 2)   # 5, then 1 past 2 blocks
    6
    """
    from radixkv.core.hashing import Namespace, hash_blocks, token_bytes

    seed = Namespace("work").seed
    seen: set[bytes] = set()
    total = 0
    for p in prompts:
        hashes = hash_blocks(token_bytes(p), block_size, seed)
        hit = 0
        for h in hashes[:(len(p) - 1) // block_size]:
            if h not in seen:
                break
            hit += 1
        total += len(p) - hit * block_size
        seen.update(hashes)
    return total


def tiny_model() -> Any:
    """A seeded random-weight Llama over the embedded tokenizer's vocabulary (float32)."""
    import torch
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=49152, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192,
        bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(
        cfg, dtype=torch.float32, attn_implementation="sdpa").eval(), None, "tiny-llama-random"


def make_engine(model: Any, tokenizer: Any, model_id: str, policy: str, args: Any) -> Any:
    """A fresh engine (empty cache) for ``policy`` (a :func:`policy_names` entry)."""
    from radixkv.config import CacheConfig, EngineConfig
    from radixkv.engine.llm_engine import LLMEngine

    name, _, wait = policy.partition("/")

    bs = args.block_size
    return LLMEngine(model, tokenizer,
                     CacheConfig(block_size=bs, num_device_blocks=args.pool_tokens // bs),
                     EngineConfig(max_num_seqs=args.max_seqs,
                                  max_num_batched_tokens=args.batch_tokens,
                                  scheduling_policy=name,
                                  scheduling_max_wait_s=float(wait[:-1]) if wait else 10.0),
                     model_id=model_id)


class CPUClock:
    """Seconds of this process's CPU time, plus the idle gaps it skipped to the next arrival.

    With one torch thread the engine's step is CPU-bound work of this process, so this clock
    advances as the wall clock would on an idle machine, and other processes sharing the CPU
    (a busy CI box) do not stretch it. Idle time (no request in the engine) is skipped.
    """

    def __init__(self) -> None:
        self.offset = -time.process_time()

    def __call__(self) -> float:
        return time.process_time() + self.offset

    def skip_to(self, t: float) -> None:
        now = self()
        if t > now:
            self.offset += t - now


def replay(engine: Any, prompts: list[list[int]], arrivals: list[float],
           max_tokens: int) -> dict[str, Any]:
    """Open-loop replay on a :class:`CPUClock`: add each request at its arrival time, step
    while there is work; TTFT = the clock at the end of the step that produced the request's
    first token minus its arrival time (lpm's age limit runs on the same clock)."""
    from radixkv.engine.sampling import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    clock = CPUClock()
    adm = engine.scheduler.admission
    if hasattr(adm, "clock"):
        adm.clock = clock
    order_s = [0.0]
    reorder = adm.reorder

    def timed(waiting: Any) -> None:   # the policy's own cost per step
        t = time.process_time()
        reorder(waiting)
        order_s[0] += time.process_time() - t

    adm.reorder = timed
    n = len(prompts)
    first: dict[str, float] = {}
    done = 0
    i = 0
    max_waiting = 0
    while done < n:
        now = clock()
        while i < n and arrivals[i] <= now:
            engine.add_request(f"r{i}", prompts[i], params, arrival_time=arrivals[i])
            i += 1
        if not engine.has_unfinished_requests():
            clock.skip_to(arrivals[i])
            continue
        max_waiting = max(max_waiting, len(engine.scheduler.waiting))
        outs = engine.step()
        t = clock()
        for out in outs:
            if out.request_id not in first and out.outputs and out.outputs[0].token_ids:
                first[out.request_id] = t
            done += out.finished
    makespan = clock()
    del adm.reorder
    st = engine.stats()
    ttft = [first[f"r{j}"] - arrivals[j] for j in range(n)]
    return {
        "ttft_p50_s": percentile(ttft, 0.5), "ttft_p90_s": percentile(ttft, 0.9),
        "ttft_p99_s": percentile(ttft, 0.99), "ttft_mean_s": statistics.fmean(ttft),
        "hit_rate": st["hit_rate"], "prefill_tokens": st["prefill_tokens_computed"],
        "makespan_s": makespan, "steps": st["steps"], "held": st["held_admissions"],
        "preemptions": st["preemptions"], "max_waiting": max_waiting,
        "order_ms_per_step": 1e3 * order_s[0] / max(st["steps"], 1),
        "ttft_s": ttft,
    }


def prefill_rate(engine: Any, prompt: list[int], salt: str) -> float:
    """Prompt tokens per CPU second (:class:`CPUClock`) of one cold prefill (a fresh
    ``salt``: nothing cached)."""
    from radixkv.engine.sampling import SamplingParams

    engine.add_request(salt, prompt, SamplingParams(max_tokens=1), cache_salt=salt)
    t0 = time.process_time()
    while engine.has_unfinished_requests():
        engine.step()
    return len(prompt) / (time.process_time() - t0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="radixkv bench sched", description=plain_doc(__doc__))
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: tiny model, 16 requests per workload, one repeat")
    ap.add_argument("--model", choices=("embedded", "tiny"), default="embedded")
    ap.add_argument("--workloads", default="rag,chat")
    ap.add_argument("--requests", type=int, default=None, help="per workload (default 40)")
    ap.add_argument("--loads", default="1,2",
                    help="offered loads, comma-separated (see the description)")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--max-seqs", type=int, default=16)
    ap.add_argument("--batch-tokens", type=int, default=2048)
    ap.add_argument("--pool-tokens", type=int, default=8192)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-wait", default="2,10",
                    help="lpm's age limits (s, comma-separated): one lpm run per limit")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch CPU threads (1: the CPU clock then measures the step's time)")
    ap.add_argument("--out", default=None, help="results name (default sched[-tiny][-quick])")
    args = ap.parse_args(argv)
    if args.quick:
        args.model = "tiny"
    n_req = args.requests or (16 if args.quick else 40)

    import torch
    from radixkv.benchmarks.traces import load_trace

    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    if args.model == "tiny":
        model, tokenizer, model_id = tiny_model()
    else:
        from radixkv.api.engine import Engine
        from radixkv.config import CacheConfig

        e = Engine.from_pretrained(cache_config=CacheConfig(num_device_blocks=64))
        model, tokenizer, model_id = e.model, e.tokenizer, e.model_id
    load_s = time.perf_counter() - t0
    workloads = [w for w in args.workloads.split(",") if w]
    loads = [float(x) for x in args.loads.split(",") if x]
    max_waits = [float(x) for x in args.max_wait.split(",") if x]
    policies = policy_names(max_waits)
    traces = {w: load_trace(w, quick=True, progress=False)[:n_req] for w in workloads}
    probe = make_engine(model, tokenizer, model_id, "fcfs", args)
    warm = traces[workloads[0]][0].prompt
    prefill_rate(probe, warm[:64], "warm-up")
    rate = statistics.median(prefill_rate(probe, warm, f"rate-{i}") for i in range(3))
    del probe
    header = run_header(seed=0, benchmark="sched", model=model_id, load_s=round(load_s, 1),
                        quick=args.quick, requests=n_req, loads=loads,
                        max_tokens=args.max_tokens, max_num_seqs=args.max_seqs,
                        max_num_batched_tokens=args.batch_tokens, pool_tokens=args.pool_tokens,
                        block_size=args.block_size, lpm_max_wait_s=max_waits,
                        repeat=args.repeat, prefill_tok_per_s=round(rate, 1),
                        torch_threads=torch.get_num_threads())
    print(header, flush=True)

    rows: list[dict[str, Any]] = []
    ratios: list[dict[str, Any]] = []
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for w in workloads:
        tr = traces[w]
        prompts = [r.prompt for r in tr]
        work = uncached_work(prompts, args.block_size)
        print(f"\n{w}: {len(tr)} requests, {sum(map(len, prompts))} prompt tokens, "
              f"{work} an unbounded cache would compute", flush=True)
        for load in loads:
            span = work / rate / load
            t_first, t_last = tr[0].t, tr[-1].t
            arrivals = [(r.t - t_first) / max(t_last - t_first, 1e-9) * span for r in tr]
            key = f"{w}@{load:g}"
            runs[key] = {p: [] for p in policies}
            for rep in range(args.repeat):
                for policy in policies:
                    eng = make_engine(model, tokenizer, model_id, policy, args)
                    res = replay(eng, prompts, arrivals, args.max_tokens)
                    runs[key][policy].append(res)
                    print(f"  load {load:g}, arriving over {span:.1f} s, {policy} #{rep}: TTFT "
                          f"p50 {res['ttft_p50_s']:.3f} s, p99 {res['ttft_p99_s']:.3f} s, hit "
                          f"rate {res['hit_rate']:.3f}, makespan {res['makespan_s']:.1f} s",
                          flush=True)
            med = {}
            for policy in policies:
                rs = runs[key][policy]
                med[policy] = {k: statistics.median(r[k] for r in rs) for k in rs[0]
                               if k != "ttft_s"}
                rows.append({"workload": w, "load": load, "policy": policy, **{
                    k: med[policy][k] for k in (
                        "ttft_p50_s", "ttft_p99_s", "ttft_mean_s", "hit_rate", "prefill_tokens",
                        "makespan_s", "held", "preemptions", "max_waiting",
                        "order_ms_per_step")}})
            f = med["fcfs"]
            for policy in policies[1:]:
                m = med[policy]
                ratios.append({"workload": w, "load": load, "policy": policy,
                               "p50/fcfs": m["ttft_p50_s"] / f["ttft_p50_s"],
                               "p99/fcfs": m["ttft_p99_s"] / f["ttft_p99_s"],
                               "mean/fcfs": m["ttft_mean_s"] / f["ttft_mean_s"],
                               "hit_rate_fcfs": f["hit_rate"], "hit_rate": m["hit_rate"],
                               "prefill/fcfs": m["prefill_tokens"] / f["prefill_tokens"]})
    print_table(rows, title=f"medians over {args.repeat} repeat(s), {model_id}; seconds of "
                            "the CPU clock")
    print_table(ratios, title="lpm against fcfs (same run)")
    name = args.out or ("sched" + ("-tiny" if args.model == "tiny" else "")
                        + ("-quick" if args.quick else ""))
    write_results(name, header, {"summary": rows, "ratios": ratios, "runs": runs})
    return 0


if __name__ == "__main__":
    sys.exit(main())
