"""The ``radixkv`` command line: ``radixkv demo``, ``radixkv chat``, ``radixkv bench NAME``.

Subcommands are resolved lazily (module path + function) so ``radixkv bench core`` never imports
torch and ``radixkv --help`` is instant.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, function). Each function takes argv (list[str]) and returns an exit code.
BENCHMARKS: dict[str, tuple[str, str]] = {
    "core": ("radixkv.benchmarks.bench_core", "main"),
    "tiers": ("radixkv.benchmarks.bench_tiers", "main"),
    "kernels": ("radixkv.benchmarks.bench_kernels", "main"),
    "hit-rate": ("radixkv.benchmarks.bench_hit_rate", "main"),
    "ttft": ("radixkv.benchmarks.bench_ttft", "main"),
    "throughput": ("radixkv.benchmarks.bench_throughput", "main"),
    "async-loads": ("radixkv.benchmarks.bench_async_loads", "main"),
    "numerics": ("radixkv.benchmarks.bench_numerics", "main"),
    "engine": ("radixkv.benchmarks.bench_engine", "main"),
}
COMMANDS: dict[str, tuple[str, str, str]] = {
    "demo": ("radixkv.api.demo", "main", "scripted multi-turn chat + RAG round on the embedded model"),
    "chat": ("radixkv.api.demo", "chat_main", "interactive streaming chat with per-turn cache figures"),
}


def _run(target: tuple[str, str], argv: list[str]) -> int:
    module, func = target
    return int(getattr(importlib.import_module(module), func)(argv) or 0)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="radixkv", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (_, _, help_) in COMMANDS.items():
        sub.add_parser(name, help=help_, add_help=False)
    bench = sub.add_parser("bench", help="run a benchmark: " + ", ".join(BENCHMARKS))
    bench.add_argument("name", choices=sorted(BENCHMARKS))
    args, rest = parser.parse_known_args(argv)
    if args.command == "bench":
        return _run(BENCHMARKS[args.name], rest)
    module, func, _ = COMMANDS[args.command]
    return _run((module, func), rest)


if __name__ == "__main__":
    sys.exit(main())
