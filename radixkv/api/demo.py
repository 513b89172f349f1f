"""``radixkv demo`` and ``radixkv chat``: the prefix cache at work, turn by turn.

``radixkv demo`` loads the embedded SmolLM2-135M-Instruct, runs a scripted multi-turn chat and a
RAG round (several questions over the same documents), and prints for every turn the prompt
tokens, the tokens served from the cache, the hit rate, the time to first token (TTFT), and the
TTFT of the *same prompt* on an engine with prefix caching disabled, measured in the same run on
the same model weights. ``radixkv chat`` is the interactive version (reads lines from stdin,
streams replies; ``/exit`` or end of input quits, ``/stats`` prints the engine's counters).
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any, TextIO

SYSTEM = ("You are a friendly assistant for a small bakery called The Golden Crust. "
          "The bakery is open from 7 am to 6 pm on weekdays and from 8 am to 2 pm on Saturdays; "
          "it is closed on Sundays. It sells sourdough loaves, rye bread, croissants, cinnamon "
          "rolls, fruit tarts and custom birthday cakes, which must be ordered three days in "
          "advance. Answer customers' questions politely and briefly, in one or two sentences.")
CHAT_SCRIPT = (
    "Hi! Are you open on Saturday?",
    "Great. What kinds of bread do you sell?",
    "Can I order a birthday cake for tomorrow?",
    "Thanks! What else would you recommend?",
)
DOCUMENTS = {
    "apollo-11": (
        "Apollo 11 was the American spaceflight that first landed humans on the Moon. Commander "
        "Neil Armstrong and lunar module pilot Buzz Aldrin landed the lunar module Eagle on July "
        "20, 1969, at 20:17 UTC, and Armstrong became the first person to step onto the lunar "
        "surface six hours and 39 minutes later. Aldrin joined him 19 minutes later, and they "
        "spent about two and a quarter hours together exploring the site they had named "
        "Tranquility Base. They collected 47.5 pounds of lunar material to bring back to Earth. "
        "Command module pilot Michael Collins flew the command module Columbia alone in lunar "
        "orbit while they were on the Moon's surface."),
    "voyager": (
        "Voyager 1 is a space probe launched by NASA on September 5, 1977, as part of the Voyager "
        "program to study the outer Solar System and the interstellar space beyond the Sun's "
        "heliosphere. It flew past Jupiter in 1979 and Saturn in 1980, where it made a close "
        "approach to the moon Titan. On August 25, 2012, Voyager 1 became the first spacecraft to "
        "cross the heliopause and enter interstellar space. It is the most distant human-made "
        "object from Earth and still communicates with the Deep Space Network, although its "
        "instruments are being switched off one by one to save power from its radioisotope "
        "thermoelectric generators."),
    "hubble": (
        "The Hubble Space Telescope was launched into low Earth orbit in April 1990 aboard the "
        "Space Shuttle Discovery. It has a 2.4 metre mirror and observes in the near ultraviolet, "
        "visible and near infrared. Shortly after launch, astronomers found that the main mirror "
        "had been ground to the wrong shape, producing blurred images; a servicing mission in "
        "1993 installed corrective optics. Five servicing missions by astronauts between 1993 and "
        "2009 repaired and upgraded the telescope. Hubble's observations helped determine the "
        "rate of expansion of the universe and showed that the expansion is accelerating."),
}
RAG_QUESTIONS = (
    "Who stayed in lunar orbit during Apollo 11?",
    "When did Voyager 1 enter interstellar space?",
    "What was wrong with Hubble's mirror?",
)
COLUMNS = ("step", "prompt_tok", "cached_tok", "hit_rate", "ttft_ms", "ttft_nocache_ms", "speedup")


def set_threads(n: int | None) -> None:
    """Set torch's intra-op CPU threads (None: leave torch's default). On a CPU shared with
    other busy processes, 1 thread avoids OpenMP threads spinning against each other."""
    if n:
        import torch

        torch.set_num_threads(n)


#: Printed under the table: what the speed-up column means, and why a cold turn has none.
LEGEND = ("speedup = TTFT of the same prompt with caching disabled / TTFT with the cache "
          "(same run).\n'cold'  = nothing of that prompt was cached yet: both engines compute "
          "all of it,\n         so a ratio there would only measure timing noise.")


def _fmt_row(row: dict[str, Any]) -> dict[str, str]:
    out = {"step": row["step"], "prompt_tok": str(row["prompt_tok"]),
           "cached_tok": str(row["cached_tok"]), "hit_rate": f"{row['hit_rate']:.0%}",
           "ttft_ms": f"{row['ttft_ms']:.0f}"}
    if row.get("ttft_nocache_ms") is not None and row["cached_tok"] == 0:
        out["ttft_nocache_ms"] = f"{row['ttft_nocache_ms']:.0f}"
        out["speedup"] = "cold"
    elif row.get("ttft_nocache_ms") is not None:
        out["ttft_nocache_ms"] = f"{row['ttft_nocache_ms']:.0f}"
        out["speedup"] = f"{row['ttft_nocache_ms'] / max(row['ttft_ms'], 1e-9):.1f}x"
    else:
        out["ttft_nocache_ms"] = out["speedup"] = "-"
    return out


def print_rows(rows: Iterable[dict[str, Any]], file: TextIO | None = None) -> None:
    file = file or sys.stdout
    cells = [_fmt_row(r) for r in rows]
    widths = {c: max(len(c), *(len(r[c]) for r in cells)) for c in COLUMNS}
    print("  ".join(c.ljust(widths[c]) for c in COLUMNS), file=file)
    print("  ".join("-" * widths[c] for c in COLUMNS), file=file)
    for r in cells:
        print("  ".join(r[c].ljust(widths[c]) for c in COLUMNS), file=file)


def nocache_ttft(baseline: Any, prompt_ids: list[int]) -> float:
    """TTFT (seconds) of a prompt on the no-cache engine: a full prefill plus one token."""
    from radixkv.engine.sampling import SamplingParams

    [out] = baseline.generate([prompt_ids], SamplingParams(max_tokens=1))
    return float(out.ttft)


def _row(step: str, prompt_tok: int, cached: int, ttft: float | None,
         ttft_nocache: float | None) -> dict[str, Any]:
    return {"step": step, "prompt_tok": prompt_tok, "cached_tok": cached,
            "hit_rate": cached / prompt_tok if prompt_tok else 0.0,
            "ttft_ms": (ttft or 0.0) * 1e3,
            "ttft_nocache_ms": None if ttft_nocache is None else ttft_nocache * 1e3}


@contextmanager
def progress(what: str, file: TextIO | None = None, every_s: float = 1.0) -> Iterator[None]:
    """Show that a long step is alive: a line on stderr updated every second on a terminal
    (every 15 s otherwise), and the time it took at the end."""
    file = file or sys.stderr
    tty = file.isatty()
    done = threading.Event()
    t0 = time.perf_counter()

    def tick() -> None:
        while not done.wait(every_s if tty else 15.0):
            print(f"\r{what}... {time.perf_counter() - t0:.0f} s", end="" if tty else "\n",
                  file=file, flush=True)
    print(f"{what}...", end="" if tty else "\n", file=file, flush=True)
    ticker = threading.Thread(target=tick, daemon=True)
    ticker.start()
    try:
        yield
    finally:
        done.set()
        ticker.join()
        print(f"\r{what}: done in {time.perf_counter() - t0:.1f} s", file=file, flush=True)


def model_source(path: str | None) -> tuple[str | None, str | None]:
    """``--model PATH`` as ``(model_dir, gguf_file)`` for ``Engine.from_pretrained``: a
    transformers model directory, or a ``.gguf`` file (its folder and name); None = embedded."""
    if path is None:
        return None, None
    if os.path.isfile(path) and path.endswith(".gguf"):
        return os.path.dirname(os.path.abspath(path)), os.path.basename(path)
    if os.path.isdir(path):
        return path, None
    raise SystemExit(f"radixkv: --model {path!r} is neither a model directory nor a .gguf file")


def load_engines(compare: bool = True, max_tokens: int = 48,
                 model: str | None = None) -> tuple[Any, Any | None]:
    """The model (default: the embedded one) in an engine with caching, and (``compare``) a
    second engine over the same weights with ``enable_prefix_caching=False``."""
    from radixkv.api.engine import Engine
    from radixkv.config import CacheConfig

    model_dir, gguf_file = model_source(model)
    t0 = time.perf_counter()
    name = model or "the embedded SmolLM2-135M-Instruct"
    with progress(f"loading {name}"):
        engine = Engine.from_pretrained(model_dir, gguf_file)
    base = None
    if compare:
        cc = engine.cache_config
        base = Engine(engine.model, engine.tokenizer,
                      CacheConfig(block_size=cc.block_size, num_device_blocks=cc.num_device_blocks,
                                  device_memory=cc.device_memory, enable_prefix_caching=False),
                      engine.engine_config, model_id=engine.model_id)
    print(f"loaded {engine.model_id} in {time.perf_counter() - t0:.1f} s", flush=True)
    return engine, base


def warm_up(*engines: Any) -> None:
    """A short and a ~600-token request per engine (under a salt no measured turn uses), so
    one-off costs (first kernels of each shape, the allocator growing to a long prefill's
    buffers) land on neither side of a measured comparison. Without the long one, whichever
    engine ran a long prompt first paid ~40% extra on it."""
    from radixkv.engine.sampling import SamplingParams

    long_ids = [(i * 7919) % 20000 + 100 for i in range(600)]
    for e in engines:
        if e is not None:
            e.generate("Hello", SamplingParams(max_tokens=2), cache_salt="warm-up")
            e.generate([long_ids], SamplingParams(max_tokens=2), cache_salt="warm-up")


def run_chat(engine: Any, baseline: Any | None, script: Iterable[str], max_tokens: int,
             say: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """The scripted chat: one row per turn (prompt/cached tokens, TTFT, no-cache TTFT)."""
    from radixkv.engine.sampling import SamplingParams

    session = engine.chat(system=SYSTEM)
    params = SamplingParams(max_tokens=max_tokens)
    rows = []
    for i, message in enumerate(script, 1):
        prompt = session.next_prompt_ids(message)
        naive = session.naive_prompt_ids(message)
        common = next((j for j, (a, b) in enumerate(zip(prompt, naive)) if a != b),
                      min(len(prompt), len(naive)))
        reply = session.send(message, params)
        base_ttft = nocache_ttft(baseline, prompt) if baseline is not None else None
        say(f"  user: {message}\n  bot:  {reply.text.strip()[:200]}")
        if i > 1:
            say(f"        (re-rendering the history as text would give a prompt sharing "
                f"{common} of {len(prompt)} tokens with the session's)")
        rows.append(_row(f"chat turn {i}", reply.prompt_tokens, reply.cached_tokens, reply.ttft,
                         base_ttft))
    return rows


def run_rag(engine: Any, baseline: Any | None, questions: Iterable[str], max_tokens: int,
            say: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """The RAG round: every question over the same documents (one row per question)."""
    from radixkv.engine.sampling import SamplingParams

    rag = engine.rag()
    for doc_id, text in DOCUMENTS.items():
        rag.add_document(doc_id, text)
    params = SamplingParams(max_tokens=max_tokens)
    rows = []
    for i, q in enumerate(questions, 1):
        ans = rag.ask(q, params=params)
        base_ttft = (nocache_ttft(baseline, rag.prompt_ids(q)) if baseline is not None else None)
        say(f"  Q: {q}\n  A: {ans.text.strip()[:200]}")
        rows.append(_row(f"rag question {i}", ans.prompt_tokens, ans.cached_tokens, ans.ttft,
                         base_ttft))
    return rows


def add_model_arg(ap: argparse.ArgumentParser) -> None:
    """``--model PATH``, shared by ``radixkv demo`` and ``radixkv chat``."""
    ap.add_argument("--model", default=None, metavar="PATH",
                    help="a transformers model directory or a .gguf file (default: the "
                         "embedded SmolLM2-135M-Instruct)")


def main(argv: list[str] | None = None, *, engine: Any = None, baseline: Any = None) -> int:
    """``radixkv demo``: scripted chat + RAG round with per-turn cache figures."""
    ap = argparse.ArgumentParser(prog="radixkv demo",
                                 description="Scripted multi-turn chat and RAG round, with "
                                             "per-turn cache figures.")
    add_model_arg(ap)
    ap.add_argument("--max-tokens", type=int, default=40, help="reply length cap (tokens)")
    ap.add_argument("--quick", action="store_true", help="3 chat turns, 2 RAG questions")
    ap.add_argument("--no-compare", action="store_true",
                    help="skip the no-cache engine (no baseline TTFT column)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch CPU threads (default: torch's; 1 is faster on a busy machine)")
    args = ap.parse_args(argv)
    set_threads(args.threads)
    if engine is None:
        engine, baseline = load_engines(compare=not args.no_compare, model=args.model)
    elif args.no_compare:
        baseline = None
    with progress("warming up (one-off costs land on neither side of a comparison)"):
        warm_up(engine, baseline)
    script = CHAT_SCRIPT[:3] if args.quick else CHAT_SCRIPT
    questions = RAG_QUESTIONS[:2] if args.quick else RAG_QUESTIONS
    t0 = time.perf_counter()
    print("\n== multi-turn chat (each turn re-sends the whole history) ==")
    rows = run_chat(engine, baseline, script, args.max_tokens)
    print("\n== RAG: questions over the same three documents ==")
    rows += run_rag(engine, baseline, questions, args.max_tokens)
    print("\n== per-turn figures (TTFT no-cache: same prompt, caching disabled, same run) ==")
    print_rows(rows)
    if baseline is not None:
        print(LEGEND)
    prompt = sum(r["prompt_tok"] for r in rows)
    cached = sum(r["cached_tok"] for r in rows)
    print(f"\nhit rate over these turns: {cached}/{prompt} prompt tokens"
          f" = {cached / max(prompt, 1):.1%}"
          f" (engine lifetime, warm-up included: {engine.stats().get('hit_rate', 0.0):.1%})")
    print(f"demo ran in {time.perf_counter() - t0:.1f} s")
    return 0


def chat_main(argv: list[str] | None = None, *, engine: Any = None, baseline: Any = None,
              stdin: TextIO | None = None, stdout: TextIO | None = None) -> int:
    """``radixkv chat``: interactive streaming chat with per-turn cache figures."""
    ap = argparse.ArgumentParser(prog="radixkv chat",
                                 description="Interactive streaming chat with per-turn cache "
                                             "figures.")
    add_model_arg(ap)
    ap.add_argument("--system", default=None, help="system message")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--no-compare", action="store_true",
                    help="do not measure the no-cache TTFT of each turn")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    args = ap.parse_args(argv)
    set_threads(args.threads)
    stdin = stdin or sys.stdin
    out = stdout or sys.stdout
    if engine is None:
        engine, baseline = load_engines(compare=not args.no_compare, model=args.model)
    elif args.no_compare:
        baseline = None
    from radixkv.engine.sampling import SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    session = engine.chat(system=args.system)
    interactive = stdin.isatty()
    print("type a message; /exit to quit, /stats for engine counters, /reset to start over",
          file=out, flush=True)
    while True:
        if interactive:
            print("> ", end="", file=out, flush=True)
        line = stdin.readline()
        if not line:
            break
        message = line.strip()
        if not message:
            continue
        if message in ("/exit", "/quit"):
            break
        if message == "/stats":
            for k, v in engine.stats().items():
                print(f"  {k}: {v}", file=out)
            continue
        if message == "/reset":
            session.reset()
            continue
        prompt = session.next_prompt_ids(message)
        for piece in session.stream(message, params):
            print(piece, end="", file=out, flush=True)
        reply = session.last_reply
        base = nocache_ttft(baseline, prompt) if baseline is not None else None
        figures = (f"[turn {reply.turn}: prompt {reply.prompt_tokens} tok, cached "
                   f"{reply.cached_tokens} ({reply.hit_rate:.0%}), TTFT {reply.ttft * 1e3:.0f} ms")
        if base is not None:
            figures += f", no-cache TTFT {base * 1e3:.0f} ms"
            if reply.cached_tokens == 0:
                figures += " (cold: nothing cached yet, so both compute it all)"
        print(f"\n{figures}]", file=out, flush=True)
    return 0
