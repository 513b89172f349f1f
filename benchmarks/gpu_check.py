"""The one prepared GPU check (``bash scripts/gpu_check.sh``): CUDA tests, ``bench engine
--device cuda`` and ``bench kernels`` in one run, one JSON and one table, the card's name on
every figure.

On a machine with CUDA (budget <= 8 minutes on one H100/H200, no network):

1. ``pytest`` on the suites that run on CUDA there: the engine's CUDA-only cases first (CUDA
   graphs, a decode forward under sync-debug mode, pool sizing, the sampler and quantized
   blending on the device), then tests/kernels (every
   Triton case compiled on the GPU, then rerun interpreted in a subprocess), tests/storage's
   pool and transfer tests; pass / fail / skip counts and the failures' names are recorded
   (verbose, so a step stopped by its limit still names them; the whole log is kept).
2. ``radixkv bench engine --device cuda --cuda-graphs`` on random-weight Llama-3.2-1B and
   (where it fits) Llama-3.1-8B shapes: decode ms/step at batch 1, 64, 256, eager and with
   CUDA graphs, vs transformers and the limit; greedy vs sampled vs penalized decode steps
   (``--sampling``, batch 1 and 64); prefill tok/s, cached-prefix TTFT gain.
3. ``radixkv bench kernels`` (CUDA mode): paged decode GB/s vs device copy, prefill TFLOP/s vs
   SDPA, copy_blocks and write_kv.

Writes ``benchmarks/results/gpu_check.json`` ({"header", "results": {"tests", "engine",
"kernels", "steps"}}) and prints the tables. Exits non-zero if a step failed.

Without CUDA it runs its CPU self-check instead (< 2 minutes): the Triton split-K, plan and
block-copy cases under the interpreter, the same engine benchmark code on a tiny model
(``--shapes tiny --device cpu``) and ``bench kernels --quick``; results go to a temporary folder
(or ``--results-dir``), not benchmarks/results. It exits 0 when all of that passes.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ._common import REPO_ROOT, plain_doc, print_table, run_header

#: pytest selections per mode.
CUDA_TESTS = [
    # the engine's CUDA-only cases first (they never run in CI): CUDA graphs, a decode forward
    # under torch.cuda.set_sync_debug_mode("error"), pool sizing by gpu_memory_utilization
    "tests/engine/test_cuda_graphs.py", "tests/engine/test_memory_sizing.py",
    "tests/engine/test_decode_ops.py::test_decode_forward_passes_cuda_sync_debug_mode",
    "tests/kernels/test_engine_on_cuda.py", "tests/kernels/test_cuda_sampling_blend.py",
    "tests/kernels/test_fused.py",
    "tests/kernels", "tests/storage/test_storage_pools.py",
    "tests/storage/test_storage_transfer.py"]
CPU_TESTS = ["tests/kernels/test_triton.py", "-k",
             "split_k_boundaries or plan_is_made or copy_blocks or write_kv"]

#: Wall-clock limits per step (seconds): the whole check stays within 8 minutes on a GPU.
CUDA_LIMITS = {"tests": 240, "engine": 170, "kernels": 60}
#: A step stopped by its limit still reports what it finished: the engine benchmark writes its
#: JSON after each model shape (1B first), and the summary shows it with the step FAILED.
CPU_LIMITS = {"tests": 60, "engine": 60, "kernels": 40}


def _run(name: str, cmd: list[str], limit: int, env: dict[str, str]) -> dict[str, Any]:
    """Run one step as a subprocess (its own CUDA context and memory); echo its output."""
    print(f"\n=== {name}: {' '.join(cmd)} (limit {limit} s)", flush=True)
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                              timeout=limit)
        rc, out = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:
        rc = -1
        out = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) \
            else (e.stdout or "")
        out += f"\n[timed out after {limit} s]"
    print(out[-6000:], flush=True)
    (Path(env["RADIXKV_RESULTS_DIR"]) / f"{name}.log").write_text(out)
    return {"step": name, "rc": rc, "seconds": round(time.perf_counter() - t0, 1),
            "ok": rc == 0, "tail": out[-3000:]}


def _pytest_counts(tail: str) -> dict[str, Any]:
    """passed / failed / skipped / errors from pytest's closing line, and failed test ids."""
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?)", tail)}
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", tail, re.M)
    if not failed:   # no closing summary (stopped by its limit): the verbose per-case lines
        pairs = re.findall(r"(?:FAILED|ERROR) (\S+::\S+)|(\S+::\S+) (?:FAILED|ERROR)", tail)
        failed = sorted({a or b for a, b in pairs})
    if not counts:   # the same: count the verdicts of the cases that finished
        verdicts = re.findall(r"\b(PASSED|FAILED|SKIPPED|ERROR)\b[^\n]*::", tail)
        counts = {k.lower(): verdicts.count(k) for k in ("PASSED", "FAILED", "SKIPPED")}
        counts["stopped_by_limit"] = 1
    return {**counts, "failed_tests": failed}


def _load(path: Path) -> Any:
    try:
        return json.loads(path.read_text())["results"]
    except (OSError, ValueError, KeyError):
        return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="gpu_check", description=plain_doc(__doc__))
    ap.add_argument("--cpu", action="store_true",
                    help="run the CPU self-check even where CUDA is present")
    ap.add_argument("--results-dir", default=None,
                    help="where the JSON goes (default benchmarks/results on CUDA, a temporary "
                         "folder for the CPU self-check)")
    ap.add_argument("--skip", nargs="*", default=[], choices=["tests", "engine", "kernels"],
                    help="steps to leave out")
    ap.add_argument("--engine-shapes", nargs="+", default=["llama-3.2-1b", "llama-3.1-8b"],
                    help="model shapes of the engine step on CUDA (8B only where it fits)")
    args = ap.parse_args(argv)

    import torch

    cuda = torch.cuda.is_available() and not args.cpu
    card = torch.cuda.get_device_name(0) if cuda else "cpu (self-check, no CUDA)"
    out_dir = Path(args.results_dir) if args.results_dir else (
        REPO_ROOT / "benchmarks" / "results" if cuda
        else Path(tempfile.mkdtemp(prefix="radixkv-gpu-check-")))
    out_dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="radixkv-gpu-check-steps-"))
    atexit.register(shutil.rmtree, work, True)   # the steps' scratch (their logs are copied)
    env = dict(os.environ, RADIXKV_RESULTS_DIR=str(work), PYTHONSAFEPATH="1")
    env.pop("RADIXKV_KERNEL_BACKEND", None)
    if cuda:
        env.pop("TRITON_INTERPRET", None)
    py = sys.executable
    limits = CUDA_LIMITS if cuda else CPU_LIMITS
    header = run_header(benchmark="gpu_check", device_name=card, cuda=cuda,
                        triton=_version("triton"), transformers=_version("transformers"))
    print(f"gpu_check on {card} (torch {torch.__version__}, triton {header['triton']})",
          flush=True)
    steps, results = [], {}
    if "tests" not in args.skip:
        sel = CUDA_TESTS if cuda else CPU_TESTS
        # On a GPU machine the cases are bound by Triton's JIT compiles (one per kernel
        # variant, a cold cache on a fresh machine): pytest-xdist, where installed, spreads
        # the files over workers (loadfile: each file's in-process state stays together).
        par = ["-n", "12", "--dist", "loadfile"] if cuda and _has("xdist") else []
        # -v (and no -q, which cancels it): each case's verdict as it ends, so a step stopped
        # by its limit still names its failures (the full log is kept next to the JSON); -rfE
        # lists them again at the end. The no-AVX native rebuild takes ~130 s on a fresh card.
        par += ["-v", "-rfE", "--timeout", "200"] if _has("pytest_timeout") else ["-v", "-rfE"]
        step = _run("tests", [py, "-m", "pytest", "-p", "no:cacheprovider", *par, *sel],
                    limits["tests"], env)
        log = (work / "tests.log").read_text()
        results["tests"] = {"device": card, "selection": sel, **_pytest_counts(log)}
        steps.append(step)
    if "engine" not in args.skip:
        cmd = [py, "-m", "radixkv.cli", "bench", "engine", "--name", "gpu_check_engine"]
        cmd += (["--device", "cuda", "--decode-tokens", "32", "--repeat", "2", "--cuda-graphs",
                 "--sampling", "--shapes", *args.engine_shapes] if cuda else
                ["--device", "cpu", "--shapes", "tiny", "--batches", "1", "4", "--prompt", "16",
                 "--sampling", "--sampling-batches", "1", "4",
                 "--decode-tokens", "4", "--prefill-batch", "2", "--prefill-len", "32",
                 "--ttft-prefix", "128", "--repeat", "1"])
        steps.append(_run("engine", cmd, limits["engine"], env))
        results["engine"] = _load(work / "gpu_check_engine.json")
    if "kernels" not in args.skip:
        cmd = [py, "-m", "radixkv.cli", "bench", "kernels"] + ([] if cuda else ["--quick"])
        steps.append(_run("kernels", cmd, limits["kernels"], env))
        results["kernels"] = _load(work / "kernels.json")
    results["steps"] = [{k: v for k, v in s.items() if k != "tail"} for s in steps]
    path = out_dir / ("gpu_check.json" if cuda else "gpu_check_cpu.json")
    path.write_text(json.dumps({"header": header, "results": results}, indent=2, default=str))
    for s in steps:   # each step's whole output beside the JSON (gpu_check_<step>.log)
        log = work / f"{s['step']}.log"
        if log.exists():
            (out_dir / f"{path.stem}_{s['step']}.log").write_text(log.read_text())
    _summary(card, results)
    print(f"\nwrote {path}")
    ok = all(s["ok"] for s in steps) and results.get("engine", True) is not None
    print("gpu_check:", "PASSED" if ok else "FAILED", f"on {card}")
    return 0 if ok else 1


def _has(module: str) -> bool:
    import importlib.util
    return importlib.util.find_spec(module) is not None


def _version(name: str) -> str:
    try:
        from importlib.metadata import version
        return version(name)
    except Exception:  # noqa: BLE001 - not installed: say so in the header
        return "absent"


def _summary(card: str, results: dict) -> None:
    """One table of the headline figures, each with the card's name."""
    rows: list[dict[str, Any]] = []
    for s in results.get("steps", []):
        rows.append({"device": card, "what": f"step {s['step']}",
                     "figure": "ok" if s["ok"] else f"FAILED (rc {s['rc']})",
                     "seconds": s["seconds"]})
    t = results.get("tests")
    if t:
        rows.append({"device": card, "what": "tests",
                     "figure": f"{t.get('passed', 0)} passed, {t.get('failed', 0)} failed, "
                               f"{t.get('skipped', 0)} skipped"})
    eng = results.get("engine") or {}
    for r in eng.get("decode", []):
        rows.append({"device": card, "what": f"decode {r['shape']} batch {r['batch']}",
                     "figure": f"{r['radixkv_ms']:.2f} ms/step (transformers "
                               f"{r['transformers_ms']:.2f}, limit {r['limit_ms']:.3f}, "
                               f"x{r['radixkv_over_limit']:.1f} of limit)"})
        if "radixkv_graphs_ms" in r:
            rows.append({"device": card, "what": f"decode {r['shape']} batch {r['batch']}, "
                                                 "CUDA graphs",
                         "figure": f"{r['radixkv_graphs_ms']:.2f} ms/step (x"
                                   f"{r['graphs_speedup']:.2f} of eager; tokens match "
                                   f"{r['graphs_token_match']:.2f})"})
    for r in eng.get("sampling", []):
        rows.append({"device": card, "what": f"decode {r['shape']} batch {r['batch']} by "
                                             "sampling mode" +
                                             (", CUDA graphs" if r.get("cuda_graphs") else ""),
                     "figure": f"greedy {r['greedy_ms']:.2f}, sampled {r['sampled_ms']:.2f} "
                               f"(x{r['sampled_over_greedy']:.2f}), penalized "
                               f"{r['penalized_ms']:.2f} ms/step "
                               f"(x{r['penalized_over_greedy']:.2f})"})
    for r in eng.get("prefill", []):
        rows.append({"device": card, "what": f"prefill {r['shape']} {r['batch']}x"
                                             f"{r['new_tokens']}",
                     "figure": f"{r['radixkv_tok_s']:.0f} tok/s (transformers forward "
                               f"{r['transformers_forward_tok_s']:.0f}: "
                               f"x{r['radixkv_over_transformers']:.2f})"})
    for r in eng.get("ttft", []):
        rows.append({"device": card, "what": f"TTFT {r['shape']} {r['prefix']} cached + "
                                             f"{r['new_tokens']}",
                     "figure": f"{r['cached_ttft_ms']:.1f} ms vs cold {r['cold_ttft_ms']:.1f} "
                               f"(gain x{r['ttft_gain']:.2f})"})
    kern = results.get("kernels") or {}
    for r in kern.get("decode", []):
        frac, dense, bf16 = (r.get(k) for k in ("fraction_of_copy_bw", "paged_over_dense",
                                                  "over_bf16"))
        rows.append({"device": card, "what": f"kernel {r['op']} {r['case']} "
                                             f"{r.get('heads', '')} {r['dtype']}",
                     "figure": f"{r['paged_GBps']:.0f} GB/s" +
                               (f" ({frac:.2f} of copy)" if frac else "") +
                               (f", x{dense:.2f} of dense SDPA time" if dense else "") +
                               (f", x{bf16:.2f} of bf16 KV time" if bf16 else "")})
    for r in kern.get("prefill", []):
        rows.append({"device": card, "what": f"kernel prefill {r['case']} "
                                             f"{r.get('heads', '')} {r['dtype']}",
                     "figure": f"{r['paged_TFLOPs']:.3g} TFLOP/s (SDPA "
                               f"{r['dense_TFLOPs']:.3g})"})
    for r in kern.get("copies", []):
        base = r.get("baseline_GBps")
        rows.append({"device": card, "what": f"kernel {r['op']} {r['case']}",
                     "figure": f"{r['GBps']:.1f} GB/s" +
                               (f" (plain copy {base:.1f})" if base else "")})
    print_table(rows, ["device", "what", "figure", "seconds"], title="gpu_check summary")


if __name__ == "__main__":
    raise SystemExit(main())
