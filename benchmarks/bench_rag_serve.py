"""``radixkv bench rag-serve``: what the server's chat ``documents`` field saves a RAG app: time to
first token of a chat whose documents were cached in another order, blended, against
prefix-only reuse of the same prompt tokens, both measured in the same run through the server's
app (docs/serve.md, "RAG documents").

Per prompt (``--docs`` ShareGPT assistant replies of ``--min-len``..``--max-len`` tokens from the
held-out second half of the dump, a short user turn as the question): the documents are sent in
one order, then in another, under a cache salt of their own for each mode:

* *prefix-only*: ``/v1/completions`` with the prompt's token ids (``/tokenize`` of the chat with
  its documents), no ``documents``: the second order reuses the system head only;
* *blended*: ``/v1/chat/completions`` with ``documents`` (default ``blend_ratio``): the second
  order reuses every document's entry.

TTFT is the server's own (``usage.radixkv.server_ttft_s``: arrival to the first token, templating
and tokenization included for the chat, none for the token ids). The app runs in process
(FastAPI's TestClient over ``create_app``): no socket, the same routes and engine loop.
"""

from __future__ import annotations

import argparse
import random
import statistics
from typing import Any

from radixkv.benchmarks._common import plain_doc, print_table, run_header, write_results

SYSTEM = "Answer the question using only the documents provided."


def _cases(n: int, k: int, min_len: int, max_len: int, seed: int, tokenizer: Any
           ) -> list[tuple[list[str], str]]:
    """``n`` (documents, question) pairs from the held-out half of the ShareGPT dump."""
    from radixkv.benchmarks.bench_rag import held_out_texts

    docs, questions = held_out_texts(tokenizer, n * k, n, min_len, max_len, random.Random(seed))
    return [(docs[i * k:(i + 1) * k], questions[i]) for i in range(n)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="radixkv bench rag-serve", description=plain_doc(__doc__))
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--docs", type=int, default=4, help="documents per prompt")
    ap.add_argument("--min-len", type=int, default=200)
    ap.add_argument("--max-len", type=int, default=400)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="1 prompt of 2 short documents")
    args = ap.parse_args(argv)
    if args.quick:
        args.prompts, args.docs, args.min_len, args.max_len = 1, 2, 60, 120

    import torch
    from fastapi.testclient import TestClient

    import radixkv
    from radixkv.config import CacheConfig, EngineConfig
    from radixkv.server.app import create_app

    torch.set_num_threads(args.threads)
    engine = radixkv.Engine.from_pretrained(
        None, cache_config=CacheConfig(num_device_blocks=4096),
        engine_config=EngineConfig(device="cpu", dtype="float32"))
    header = run_header(args.seed, quick=args.quick, threads=args.threads, prompts=args.prompts,
                        docs=args.docs, min_len=args.min_len, max_len=args.max_len,
                        model=engine.model_id, app="in-process (TestClient)")
    print(header)
    cases = _cases(args.prompts, args.docs, args.min_len, args.max_len, args.seed,
                   engine.tokenizer)
    rows: list[dict[str, Any]] = []
    rng = random.Random(args.seed)
    try:
        with TestClient(create_app(engine, model_name="m").fastapi) as c:
            def post(path: str, body: dict[str, Any]) -> Any:
                r = c.post(path, json={"model": "m", **body})
                assert r.status_code == 200, r.text
                return r.json()

            post("/v1/chat/completions", {   # warm-up: the first forward's one-time costs
                "messages": [{"role": "user", "content": "Hi"}], "documents": ["warm up " * 20],
                "max_tokens": 1, "cache_salt": "warm-up"})
            for i, (docs, question) in enumerate(cases):
                msgs = [{"role": "system", "content": SYSTEM},
                        {"role": "user", "content": question}]
                first = list(range(len(docs)))
                second = first[:]
                while second[0] == first[0]:
                    rng.shuffle(second)
                for mode in ("prefix-only", "blended"):
                    for state, order in (("cold", first), ("other order", second)):
                        ds = [docs[j] for j in order]
                        if mode == "blended":
                            out = post("/v1/chat/completions", {
                                "messages": msgs, "documents": ds, "max_tokens": 1,
                                "temperature": 0, "cache_salt": f"b{i}"})
                        else:
                            ids = post("/tokenize", {"messages": msgs, "documents": ds})["tokens"]
                            out = post("/v1/completions", {
                                "prompt": ids, "max_tokens": 1, "temperature": 0,
                                "cache_salt": f"p{i}"})
                        u = out["usage"]
                        rows.append({"prompt": i, "mode": mode, "cache": state,
                                     "prompt_tokens": u["prompt_tokens"],
                                     "cached_tokens": u["prompt_tokens_details"]["cached_tokens"],
                                     "ttft_s": u["radixkv"]["server_ttft_s"]})
                        print(rows[-1], flush=True)
    finally:
        engine.close()
    table = []
    for mode in ("prefix-only", "blended"):
        for state in ("cold", "other order"):
            sel = [r for r in rows if r["mode"] == mode and r["cache"] == state]
            table.append({"mode": mode, "cache": state,
                          "prompt tokens": statistics.median(r["prompt_tokens"] for r in sel),
                          "cached tokens": statistics.median(r["cached_tokens"] for r in sel),
                          "TTFT s (median)": statistics.median(r["ttft_s"] for r in sel)})
    ratios = [b["ttft_s"] / p["ttft_s"] for p, b in zip(
        [r for r in rows if r["mode"] == "prefix-only" and r["cache"] == "other order"],
        [r for r in rows if r["mode"] == "blended" and r["cache"] == "other order"])]
    print_table(table, title="chat documents through the server (SmolLM2-135M, float32, CPU)")
    ratio = statistics.median(ratios)
    write_results("rag_serve_quick" if args.quick else "rag_serve", header,
                  {"rows": rows, "table": table, "ratio_per_prompt": ratios,
                   "ratio_median": ratio})
    print(f"documents in another order: blended/prefix-only TTFT {ratio:.2f} "
          f"(median of {len(ratios)} prompts)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
