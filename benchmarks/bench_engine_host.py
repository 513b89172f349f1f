"""``radixkv bench engine --host-overhead``: the engine's host (Python) cost per sequence per
decode step, with the model's forward taken out.

Why: with CUDA graphs the GPU forward of a 1B model at batch 256 is ~1-2 ms, and the rest of a
step is the host's Python (scheduling, batch metadata, sampling bookkeeping, outputs), which
grows with the batch. This benchmark isolates that cost on any machine: a random-weight
``tiny`` model (2 layers, 128 wide; :data:`bench_engine_device.SHAPES`) on the CPU, float32,
one torch thread, so the forward is small and timed apart.

Per batch size B (default 64 and 256), B random prompts of ``--prompt`` tokens, ``ignore_eos``:

* ``core`` path (``LLMEngine.step()`` called directly, as the engine loop does): after the
  prefill step and 2 warm-up steps, ``--steps`` decode steps are timed one by one;
  ``ModelRunner.execute`` (the packed forward: batch tensors already built, logits out) is
  wrapped to time it separately. ``host_us_per_seq`` = sum(step - forward) / steps / B.
* ``api`` path (``Engine.generate``: the loop thread + the caller reading the outputs):
  ``generate(max_tokens = steps + 1)``, timed from the end of its first step (the prefill,
  which gives every sequence its first token) to its return: wall time less forward time,
  / steps / B; ``host_cpu_us_per_seq`` the same with the process's CPU time (all threads)
  less the forward's thread CPU time.
* ``host_cpu_us_per_seq``: the core path's host cost as the thread's CPU time
  (``time.thread_time``; the forward runs on it with one torch thread), which a busy shared
  machine does not inflate the way it does wall time; ``admit_cpu_ms``: the host CPU time of
  the first step, which admits all B requests (shared-prefix hold checks) and prefills them.

Baseline in the same run: ``--baseline-tree PATH`` (a checkout of another commit, e.g.
``git worktree add --detach /tmp/base main``) is measured by the same worker code with that
tree's ``radixkv`` imported; the two alternate, ``--rounds`` times, each in a fresh process,
and the table shows medians and the median of the per-round ratios (paired: a change of load
between rounds cancels). ``--profile N`` prints cProfile's top N functions of the timed core
steps of this tree. Results: ``benchmarks/results/engine_host.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve()
_TREE = _HERE.parent.parent


def _build_tiny(torch: Any) -> Any:
    """The ``tiny`` random-weight Llama of bench_engine_device (float32, CPU)."""
    import transformers

    sys.path.insert(1, str(_HERE.parent))   # bench_engine_device as a plain module
    from bench_engine_device import SHAPES  # type: ignore[import-not-found]

    cfg = transformers.LlamaConfig(**SHAPES["tiny"], bos_token_id=None, eos_token_id=None,
                                   pad_token_id=None)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()


def _timed_runner(runner: Any) -> list[float]:
    """Wrap ``runner.execute`` (the forward) so that its wall seconds accumulate in
    ``spent[0]`` and its thread CPU seconds in ``spent[1]``."""
    spent = [0.0, 0.0]
    execute = runner.execute

    def timed(batch: Any) -> Any:
        t0, c0 = time.perf_counter(), time.thread_time()
        out = execute(batch)
        spent[0] += time.perf_counter() - t0
        spent[1] += time.thread_time() - c0
        return out

    runner.execute = timed
    return spent


def _configs(batch: int, prompt: int, steps: int) -> tuple[Any, Any]:
    from radixkv.config import CacheConfig, EngineConfig

    block = 16
    blocks = batch * (-(-(prompt + steps + 8) // block) + 1) + 16
    return (CacheConfig(num_device_blocks=blocks, block_size=block),
            EngineConfig(device="cpu", dtype="float32", max_num_seqs=batch,
                         max_num_batched_tokens=max(2048, batch * prompt)))


def _prompts(batch: int, prompt: int, vocab: int, seed: int) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(prompt)] for _ in range(batch)]


def core_path(model: Any, batch: int, prompt: int, steps: int, seed: int,
              profile: int) -> dict[str, Any]:
    """Time ``steps`` decode steps of ``LLMEngine.step()`` at ``batch`` sequences."""
    from radixkv.engine.llm_engine import LLMEngine
    from radixkv.engine.sampling import SamplingParams

    cache, cfg = _configs(batch, prompt, steps)
    engine = LLMEngine(model, None, cache, cfg, model_id="host-bench")
    fwd = _timed_runner(engine.model_runner)
    sp = SamplingParams(max_tokens=steps + 8, ignore_eos=True)
    for i, p in enumerate(_prompts(batch, prompt, model.config.vocab_size, seed)):
        engine.add_request(f"r{i}", p, sp)
    f0, c0 = fwd[1], time.thread_time()
    engine.step()   # admits every request (the shared-prefix hold checks) and prefills
    admit_cpu = time.thread_time() - c0 - (fwd[1] - f0)
    for _ in range(2):   # warm-up decode steps
        engine.step()
    prof = None
    if profile:
        import cProfile
        prof = cProfile.Profile()
    step_s, fwd_s, host_cpu = [], [], []
    for _ in range(steps):
        f0, fc0 = fwd
        t0, c0 = time.perf_counter(), time.thread_time()
        if prof is not None:
            prof.enable()
        outs = engine.step()
        if prof is not None:
            prof.disable()
        step_s.append(time.perf_counter() - t0)
        host_cpu.append(time.thread_time() - c0 - (fwd[1] - fc0))
        fwd_s.append(fwd[0] - f0)
        assert len(outs) == batch and not any(o.finished for o in outs), "a request ended"
    engine.close()
    host = [s - f for s, f in zip(step_s, fwd_s)]
    med = statistics.median
    row = {"path": "core", "batch": batch, "step_ms": med(step_s) * 1e3,
           "forward_ms": med(fwd_s) * 1e3, "host_ms": med(host) * 1e3,
           "host_us_per_seq": med(host) / batch * 1e6,
           "host_cpu_us_per_seq": med(host_cpu) / batch * 1e6,
           "admit_cpu_ms": admit_cpu * 1e3}
    if prof is not None:
        import io
        import pstats

        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(profile)
        row["profile"] = buf.getvalue()
    return row


def api_path(model: Any, batch: int, prompt: int, steps: int, seed: int) -> dict[str, Any]:
    """``Engine.generate`` of ``batch`` prompts, ``steps + 1`` tokens: the decode part, from
    the end of the first step (prefill, first token) to ``generate``'s return."""
    from radixkv.api.engine import Engine
    from radixkv.engine.sampling import SamplingParams

    cache, cfg = _configs(batch, prompt, steps)
    engine = Engine(model, None, cache, cfg, model_id="host-bench-api")
    fwd = _timed_runner(engine.core.model_runner)
    vocab = model.config.vocab_size
    marks: list[tuple[float, float, float, float]] = []   # after each step, on the loop thread
    step = engine.core.step

    def marked() -> Any:
        out = step()
        marks.append((time.perf_counter(), time.process_time(), fwd[0], fwd[1]))
        return out

    engine.core.step = marked

    def run(max_tokens: int, s: int) -> tuple[float, float, float, float]:
        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        prompts = _prompts(batch, prompt, vocab, s)
        marks.clear()
        outs = engine.generate(prompts, sp)
        end = (time.perf_counter(), time.process_time(), fwd[0], fwd[1])
        assert all(len(o.outputs[0].token_ids) == max_tokens for o in outs)
        w0, c0, f0, fc0 = marks[0]   # the prefill step is done: every sequence has a token
        return end[0] - w0, end[2] - f0, end[1] - c0, end[3] - fc0

    run(3, seed + 1000)   # warm-up
    wall, fwd_s, cpu, fwd_cpu = run(steps + 1, seed + 1)
    engine.close()
    # CPU of every thread of the process (the loop thread, the caller reading its outputs)
    return {"path": "api", "batch": batch, "step_ms": wall / steps * 1e3,
            "forward_ms": fwd_s / steps * 1e3, "host_ms": (wall - fwd_s) / steps * 1e3,
            "host_us_per_seq": (wall - fwd_s) / steps / batch * 1e6,
            "host_cpu_us_per_seq": (cpu - fwd_cpu) / steps / batch * 1e6}


def worker(args: Any) -> None:
    """One process's measurements, printed as one JSON line (radixkv from ``args.tree``)."""
    sys.path.insert(0, str(Path(args.tree).resolve()))
    import torch

    torch.set_num_threads(1)
    import radixkv

    model = _build_tiny(torch)
    rows = []
    with torch.inference_mode():
        for b in args.batches:
            rows.append(core_path(model, b, args.prompt, args.steps, args.seed, args.profile))
            if not args.core_only:
                rows.append(api_path(model, b, args.prompt, args.steps, args.seed))
    print("RESULT " + json.dumps({"radixkv": radixkv.__file__, "rows": rows}), flush=True)


def _run_worker(tree: str, args: Any, profile: int) -> dict[str, Any]:
    cmd = [sys.executable, str(_HERE), "--worker", "--tree", tree, "--prompt", str(args.prompt),
           "--steps", str(args.steps), "--seed", str(args.seed), "--profile", str(profile),
           "--batches", *map(str, args.batches)] + (["--core-only"] if args.core_only else [])
    env = dict(os.environ, PYTHONPATH="")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    if proc.returncode or not line:
        raise RuntimeError(f"worker for {tree} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    result = json.loads(line[-1][len("RESULT "):])
    expect = Path(tree).resolve() / "radixkv" / "__init__.py"
    assert Path(result["radixkv"]).resolve() == expect, (result["radixkv"], expect)
    return result


def main_host(args: Any) -> int:
    """Entry of ``radixkv bench engine --host-overhead`` (``args`` from bench_engine)."""
    sys.path.insert(0, str(_TREE))
    from benchmarks._common import print_table, run_header, write_results

    if args.quick:
        args.batches, args.steps, args.rounds = [64], 8, 1
    sides = [("this", str(_TREE))]
    if args.baseline_tree:
        sides.append(("baseline", args.baseline_tree))
    rounds: list[dict[str, dict]] = []
    for r in range(args.rounds):
        got = {}
        order = sides if r % 2 == 0 else sides[::-1]
        for name, tree in order:
            res = _run_worker(tree, args, 0)
            got[name] = {(row["path"], row["batch"]): row for row in res["rows"]}
        rounds.append(got)
        print(f"round {r + 1}/{args.rounds} done", flush=True)
    if args.profile:   # a run of its own: the profiler's cost stays out of the table
        for row in _run_worker(str(_TREE), args, args.profile)["rows"]:
            if "profile" in row:
                print(f"\n##### cProfile, core path, batch {row['batch']}, {args.steps} "
                      f"steps (this tree)\n{row.pop('profile')}")
    table = []
    for key in rounds[0]["this"]:
        path, batch = key
        row: dict[str, Any] = {"path": path, "batch": batch}
        for name, _ in sides:
            for metric in ("step_ms", "forward_ms", "host_us_per_seq", "host_cpu_us_per_seq",
                           "admit_cpu_ms"):
                if metric in rounds[0][name][key]:
                    row[f"{name}_{metric}"] = statistics.median(g[name][key][metric]
                                                                for g in rounds)
        if args.baseline_tree:
            for metric, label in (("host_us_per_seq", "host_ratio"),
                                  ("host_cpu_us_per_seq", "host_cpu_ratio")):
                if metric in rounds[0]["this"][key]:
                    row[label] = statistics.median(
                        g["baseline"][key][metric] / g["this"][key][metric] for g in rounds)
            row["step_ratio"] = statistics.median(
                g["baseline"][key]["step_ms"] / g["this"][key]["step_ms"] for g in rounds)
        table.append(row)
    cols = list(table[0])
    print_table(table, cols, title="host us per sequence per decode step (tiny model, CPU, "
                                   "1 thread; medians of rounds; ratio = baseline / this)")
    header = run_header(seed=args.seed, benchmark="engine-host", quick=args.quick,
                        load_avg=os.getloadavg(), baseline_tree=args.baseline_tree,
                        args={k: v for k, v in vars(args).items() if k != "func"})
    if args.baseline_tree:
        header["baseline_commit"] = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=args.baseline_tree,
            capture_output=True, text=True).stdout.strip()
    path = write_results(args.name, header, table)
    print(f"results: {path}")
    return 0


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """Options of ``--host-overhead`` (shared with bench_engine's parser)."""
    ap.add_argument("--host-overhead", action="store_true",
                    help="host us per sequence per decode step, forward excluded, on a tiny "
                         "CPU model (bench_engine_host.py); --batches, --steps, "
                         "--baseline-tree, --profile apply")
    ap.add_argument("--steps", type=int, default=24, help="--host-overhead: timed steps")
    ap.add_argument("--baseline-tree", default=None,
                    help="--host-overhead: a checkout of the baseline commit, measured in the "
                         "same run (alternating processes)")
    ap.add_argument("--profile", type=int, default=0,
                    help="--host-overhead: print cProfile's top N functions (core path)")
    ap.add_argument("--core-only", action="store_true",
                    help="--host-overhead: skip the api (Engine.generate) path")


def _worker_main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--tree", required=True)
    ap.add_argument("--batches", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", type=int, default=0)
    ap.add_argument("--core-only", action="store_true")
    worker(ap.parse_args())


if __name__ == "__main__":
    _worker_main()
