"""The ``radixkv`` command line: ``radixkv demo``, ``radixkv chat``, ``radixkv serve``,
``radixkv run-batch``, ``radixkv bench NAME``.

Subcommands are resolved lazily (module path + function) so ``radixkv bench core`` never imports
torch and ``radixkv --help`` is instant.
"""

from __future__ import annotations

import argparse
import importlib
import sys

#: ``radixkv --help`` text (plain: argparse prints it as is).
DESCRIPTION = ("radixkv: a prefix-caching LLM inference engine. Run 'radixkv COMMAND --help' "
               "for a command's options.")

# name -> (module, function). Each function takes argv (list[str]) and returns an exit code.
BENCHMARKS: dict[str, tuple[str, str]] = {
    "core": ("radixkv.benchmarks.bench_core", "main"),
    "tiers": ("radixkv.benchmarks.bench_tiers", "main"),
    "kernels": ("radixkv.benchmarks.bench_kernels", "main"),
    "hit-rate": ("radixkv.benchmarks.bench_hit_rate", "main"),
    "ttft": ("radixkv.benchmarks.bench_ttft", "main"),
    "throughput": ("radixkv.benchmarks.bench_throughput", "main"),
    "async-loads": ("radixkv.benchmarks.bench_async_loads", "main"),
    "serve": ("radixkv.benchmarks.bench_serve", "main"),
    "fleet": ("radixkv.benchmarks.bench_fleet", "main"),
    "numerics": ("radixkv.benchmarks.bench_numerics", "main"),
    "engine": ("radixkv.benchmarks.bench_engine", "main"),
    "kv-quant": ("radixkv.benchmarks.bench_kv_quant", "main"),
    "sched": ("radixkv.benchmarks.bench_sched", "main"),
    "rag": ("radixkv.benchmarks.bench_rag", "main"),
    "rag-serve": ("radixkv.benchmarks.bench_rag_serve", "main"),
    "sampling": ("radixkv.benchmarks.bench_sampling", "main"),
    "decode-ops": ("radixkv.benchmarks.bench_decode_ops", "main"),
    "linears": ("radixkv.benchmarks.bench_linears", "main"),
    "batch": ("radixkv.benchmarks.bench_batch", "main"),
    "kv-pool": ("radixkv.benchmarks.bench_kv_pool", "main"),
}
COMMANDS: dict[str, tuple[str, str, str]] = {
    "demo": ("radixkv.api.demo", "main",
             "scripted multi-turn chat + RAG round on the embedded model"),
    "chat": ("radixkv.api.demo", "chat_main",
             "interactive streaming chat with per-turn cache figures"),
    "serve": ("radixkv.server.cli", "main", "OpenAI-compatible HTTP server (docs/serve.md)"),
    "run-batch": ("radixkv.server.batch", "main",
                  "run an OpenAI batch file (JSONL) offline through the server's routes"),
}


def _run(target: tuple[str, str], argv: list[str]) -> int:
    module, func = target
    return int(getattr(importlib.import_module(module), func)(argv) or 0)


def main(argv: list[str] | None = None) -> int:
    from radixkv import __version__

    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="radixkv", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"radixkv {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (_, _, help_) in COMMANDS.items():
        sub.add_parser(name, help=help_, add_help=False)
    # add_help=False: `radixkv bench NAME --help` reaches the benchmark's own parser
    bench = sub.add_parser("bench", add_help=False, usage="radixkv bench NAME [options]",
                           help="run a benchmark: " + ", ".join(BENCHMARKS),
                           description="Run a benchmark; 'radixkv bench NAME --help' lists "
                                       "its options.")
    bench.add_argument("name", nargs="?", choices=sorted(BENCHMARKS), metavar="NAME",
                       help="one of: " + ", ".join(sorted(BENCHMARKS)))
    args, rest = parser.parse_known_args(argv)
    if args.command == "bench":
        if args.name is None:
            bench.print_help()
            return 0 if {"-h", "--help"} & set(rest) else 2
        return _run(BENCHMARKS[args.name], rest)
    module, func, _ = COMMANDS[args.command]
    return _run((module, func), rest)


if __name__ == "__main__":
    sys.exit(main())
