"""``radixkv run-batch``: OpenAI's batch file format, run offline through the server's own routes.

Each line of the input is ``{"custom_id", "method": "POST", "url", "body"}`` with ``url`` one of
``/v1/chat/completions``, ``/v1/completions`` or ``/v1/responses`` (vLLM's ``run_batch`` and
OpenAI's Batch API take the same file); each line of the output is ``{"id", "custom_id",
"response": {"status_code", "request_id", "body"}, "error"}``, in input order. A request the
server answers with an error has that status and OpenAI's error JSON as ``body``; a line that
is not a request at all (bad JSON, a missing field, another URL or method, a repeated
``custom_id``, ``stream: true``) has ``response: null`` and ``error: {"code", "message"}``.

Why through the HTTP routes (in-process: each line is an ASGI call of the app, no socket): a batch
line then means exactly what the same body means to ``radixkv serve`` (validation, chat
templates, tools, grammars, admission), with one implementation. Every line is submitted at
once up to the server's admission window (``--max-num-seqs`` + ``--max-queued``, retried on
its 429), so the scheduler sees a deep queue: with ``--scheduling-policy lpm`` (the default)
the lines that share a prefix (a system prompt, a document, few-shot examples) are admitted
together and the prefix is computed once. The summary on stderr says how many prompt tokens
the cache served.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import uuid
from typing import Any, TextIO

URLS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")
#: run-batch's engine defaults (``--max-num-seqs``, ``--max-num-batched-tokens``): on the
#: 256-line benchmark file (docs/benchmarks.md, "Offline batch files") 128 / 4096 took the
#: batch from 21.5-22.5 s (serve's 32 / 2048) to 16.0-16.8 s
BATCH_MAX_NUM_SEQS = 128
BATCH_MAX_NUM_BATCHED_TOKENS = 4096


def build_parser() -> argparse.ArgumentParser:
    from radixkv.server.cli import build_parser as serve_parser

    p = serve_parser()
    p.prog = "radixkv run-batch"
    p.description = ("Run an OpenAI batch file (JSONL of {custom_id, method, url, body}) "
                     "through radixkv's OpenAI routes in this process; write one result line "
                     "per request, in input order. Takes radixkv serve's model and engine "
                     "flags (docs/serve.md, 'Batch files').")
    # offline: throughput over latency (vLLM's offline runner batches 256 sequences); serve's
    # defaults (32, 2048) keep each request's time to first token short instead
    p.set_defaults(max_num_seqs=BATCH_MAX_NUM_SEQS,
                   max_num_batched_tokens=BATCH_MAX_NUM_BATCHED_TOKENS)
    p.add_argument("-i", "--input-file", required=True, metavar="PATH",
                   help="the batch file (JSONL); - reads standard input")
    p.add_argument("-o", "--output-file", required=True, metavar="PATH",
                   help="where the results go (JSONL); - writes standard output")
    return p


def _line_error(custom_id: Any, code: str, message: str) -> dict[str, Any]:
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id, "response": None,
            "error": {"code": code, "message": message}}


def parse_line(text: str, seen: set[str]) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """``(request, None)`` for a well-formed line, ``(None, error line)`` otherwise."""
    try:
        line = json.loads(text)
    except json.JSONDecodeError as exc:
        return None, _line_error(None, "invalid_json", f"the line is not JSON: {exc}")
    except RecursionError:
        return None, _line_error(None, "invalid_json", "the line is not JSON: nested too deep")
    if not isinstance(line, dict):
        return None, _line_error(None, "invalid_request", "a line must be a JSON object")
    cid = line.get("custom_id")
    if not isinstance(cid, str) or not cid:
        return None, _line_error(cid, "invalid_request", "custom_id must be a non-empty string")
    if cid in seen:
        return None, _line_error(cid, "duplicate_custom_id", f"custom_id {cid!r} is repeated")
    seen.add(cid)
    if line.get("method", "POST") != "POST":
        return None, _line_error(cid, "invalid_request", "method must be POST")
    if line.get("url") not in URLS:
        return None, _line_error(cid, "invalid_url", f"url must be one of {', '.join(URLS)}, "
                                 f"got {line.get('url')!r}")
    body = line.get("body")
    if not isinstance(body, dict):
        return None, _line_error(cid, "invalid_request", "body must be a JSON object")
    if body.get("stream"):
        return None, _line_error(cid, "invalid_request", "stream is not supported in a batch")
    if body.get("background"):   # its answer would be "queued", and the run ends with the file
        return None, _line_error(cid, "invalid_request",
                                 "background is not supported in a batch")
    return line, None


def _usage(body: Any) -> tuple[int, int]:
    """(prompt tokens, cached prompt tokens) of an answer (chat, completions or Responses)."""
    u = body.get("usage") if isinstance(body, dict) else None
    if not isinstance(u, dict):
        return 0, 0
    if "input_tokens" in u:
        return u["input_tokens"], (u.get("input_tokens_details") or {}).get("cached_tokens", 0)
    return u.get("prompt_tokens", 0), (u.get("prompt_tokens_details") or {}).get(
        "cached_tokens", 0)


async def post(app: Any, path: str, payload: bytes) -> tuple[int, bytes]:
    """``POST path`` with a JSON ``payload`` to the ASGI ``app`` in this process: the status
    and the whole body. The client "stays connected" until the answer is complete (the
    routes watch for ``http.disconnect`` to abort a request whose client went away)."""
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(),
             "query_string": b"", "root_path": "", "client": ("127.0.0.1", 0),
             "server": ("radixkv-batch", 0),
             "headers": [(b"content-type", b"application/json"),
                         (b"content-length", str(len(payload)).encode())]}
    done = asyncio.Event()
    status, chunks, sent = 500, [], False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": payload, "more_body": False}
        await done.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                done.set()

    try:
        await app(scope, receive, send)
    finally:
        done.set()
    return status, b"".join(chunks)


async def run_lines(app: Any, lines: list[str], out: TextIO, model_name: str,
                    window: int) -> dict[str, int]:
    """Answer ``lines`` through ``app`` (its lifespan already entered), ``window`` requests in
    flight at most; write the result lines to ``out`` in input order as soon as every earlier
    one is written. Returns the counts for the summary."""
    seen: set[str] = set()
    results: list[dict[str, Any] | None] = [None] * len(lines)
    written = 0
    counts = {"requests": len(lines), "ok": 0, "failed": 0, "prompt_tokens": 0,
              "cached_tokens": 0}
    gate = asyncio.Semaphore(max(1, window))

    def flush() -> None:
        nonlocal written
        while written < len(results) and results[written] is not None:
            out.write(json.dumps(results[written], separators=(",", ":")) + "\n")
            written += 1
        out.flush()

    async def one(i: int) -> None:
        line, error = parse_line(lines[i], seen)
        if line is None:
            results[i] = error
            counts["failed"] += 1
            flush()
            return
        payload = json.dumps({"model": model_name, **line["body"]}).encode()
        async with gate:
            delay = 0.01
            while True:
                status, raw = await post(app, line["url"], payload)
                if status != 429:
                    break
                await asyncio.sleep(delay)   # the admission window is full: wait for room
                delay = min(delay * 2, 0.5)
        try:
            answer = json.loads(raw)
        except ValueError:
            answer = {"error": {"message": raw.decode(errors="replace"), "code": "server_error"}}
        ok = status == 200
        counts["ok" if ok else "failed"] += 1
        if ok:
            p, c = _usage(answer)
            counts["prompt_tokens"] += p
            counts["cached_tokens"] += c
        results[i] = {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": line["custom_id"],
                      "response": {"status_code": status,
                                   "request_id": answer.get("id") if ok else None,
                                   "body": answer},
                      "error": None}
        flush()

    await asyncio.gather(*(one(i) for i in range(len(lines))))
    flush()
    return counts


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from radixkv.server.cpu import prepare_openmp

    wait_policy = prepare_openmp()   # before anything loads torch's OpenMP runtime
    from radixkv.errors import ConfigError
    from radixkv.server import cli

    try:
        from radixkv.server.app import create_app
    except ImportError as exc:
        print(f"radixkv run-batch needs the serve extra ({exc}): pip install 'radixkv[serve]'",
              file=sys.stderr)
        return 2
    try:
        cli.check_flags(args)
        cc, ec = cli.configs(args)
    except ConfigError as exc:
        print(f"radixkv run-batch: {exc}", file=sys.stderr)
        return 2
    if args.replicas is not None or args.ray_address:
        print("radixkv run-batch: runs one engine in this process (no --replicas)",
              file=sys.stderr)
        return 2
    try:
        src = sys.stdin if args.input_file == "-" else open(args.input_file, encoding="utf-8")
        with src:
            lines = [t for t in src.read().splitlines() if t.strip()]
    except OSError as exc:
        print(f"radixkv run-batch: cannot read {args.input_file}: {exc}", file=sys.stderr)
        return 2
    from radixkv.server.cpu import apply_threads

    print(f"radixkv run-batch: {apply_threads(args.threads)}; OMP_WAIT_POLICY {wait_policy}",
          file=sys.stderr, flush=True)
    try:
        backend = cli.engine_loader(args, cc, ec, "radixkv run-batch")()
    except Exception as exc:  # noqa: BLE001 (any load failure: say why, exit non-zero)
        print(f"radixkv run-batch: the model failed to load: {exc}", file=sys.stderr)
        return 1
    cli.install_request_log(args)
    app = create_app(backend, **cli.app_options(args))
    window = backend.max_num_seqs + args.max_queued
    t0 = time.perf_counter()

    entered = []

    async def run() -> dict[str, int]:
        # the app's lifespan: the backend is served from here, and closed at its end
        async with app.fastapi.router.lifespan_context(app.fastapi):
            entered.append(True)
            dst = sys.stdout if args.output_file == "-" else open(args.output_file, "w",
                                                                 encoding="utf-8")
            try:
                return await run_lines(app, lines, dst, app.state.model_name, window)
            finally:
                if dst is not sys.stdout:
                    dst.close()

    try:
        counts = asyncio.run(run())
    except OSError as exc:
        print(f"radixkv run-batch: cannot write {args.output_file}: {exc}", file=sys.stderr)
        return 2
    finally:
        if not entered:
            backend.close()
    share = counts["cached_tokens"] / counts["prompt_tokens"] if counts["prompt_tokens"] else 0.0
    print(f"radixkv run-batch: {counts['requests']} requests ({counts['ok']} ok, "
          f"{counts['failed']} failed) in {time.perf_counter() - t0:.1f} s; prompt tokens "
          f"{counts['prompt_tokens']}, {counts['cached_tokens']} from the cache ({share:.0%})",
          file=sys.stderr, flush=True)
    return 0


__all__ = ["URLS", "build_parser", "main", "parse_line", "post", "run_lines"]
