"""``radixkv run-batch``: an OpenAI batch file through the server's routes, in one process.

One subprocess run over a file that mixes the three endpoints, requests that share a long
system prompt, a repeat of one request, lines that are not requests, and a request the server
refuses. The answers themselves are the routes' (tested through the server elsewhere); this
checks the file format, the order, the errors, and that the shared prefix came from the cache.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("fastapi")

SYSTEM = ("You are a careful assistant. You answer every question about lighthouses, tides, "
          "ships and the sea in one short sentence, and you never use lists or headings.")


def _chat(cid: str, question: str) -> dict:
    return {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "system", "content": SYSTEM},
                                  {"role": "user", "content": question}],
                     "max_tokens": 6, "temperature": 0}}


@pytest.mark.model
def test_run_batch_answers_every_line_in_order(tmp_path: Path) -> None:
    lines = [json.dumps(_chat(f"q{i}", q)) for i, q in enumerate(
        ["What is a lighthouse?", "Why are tides?", "What is a lighthouse?",
         "Name a ship.", "Is the sea salty?"])]
    lines += [
        json.dumps({"custom_id": "text", "method": "POST", "url": "/v1/completions",
                    "body": {"prompt": "The tide comes in", "max_tokens": 4,
                             "temperature": 0}}),
        json.dumps({"custom_id": "resp", "method": "POST", "url": "/v1/responses",
                    "body": {"input": "Name a colour.", "max_output_tokens": 4,
                             "temperature": 0}}),
        "this is not json",
        json.dumps({"custom_id": "emb", "method": "POST", "url": "/v1/embeddings",
                    "body": {"input": "x"}}),
        json.dumps({**_chat("q0", "again"), "custom_id": "q0"}),
        json.dumps({**_chat("streamed", "x"), "body": {**_chat("s", "x")["body"],
                                                       "stream": True}}),
        json.dumps({"custom_id": "bad", "method": "POST", "url": "/v1/completions",
                    "body": {"prompt": "x", "max_tokens": -1}}),
        "",
    ]
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(lines) + "\n")
    proc = subprocess.run([sys.executable, "-m", "radixkv.cli", "run-batch", "-i", str(src),
                           "-o", str(dst), "--threads", "1", "--device", "cpu", "--dtype",
                           "float32", "--device-blocks", "256",
                           "--response-role", "batch-helper"],   # serve's frontend flags too
                          capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    out = [json.loads(t) for t in dst.read_text().splitlines()]
    assert [o["custom_id"] for o in out] == ["q0", "q1", "q2", "q3", "q4", "text", "resp", None,
                                             "emb", "q0", "streamed", "bad"]
    assert len({o["id"] for o in out}) == len(out)
    ok = {o["custom_id"]: o["response"]["body"] for o in out[:7]}
    assert all(o["response"]["status_code"] == 200 and o["error"] is None for o in out[:7])
    assert ok["q0"]["object"] == "chat.completion" and ok["text"]["object"] == "text_completion"
    assert ok["resp"]["object"] == "response" and ok["resp"]["output"][0]["type"] == "message"
    assert ok["q0"]["choices"][0]["message"]["role"] == "batch-helper"
    assert ok["resp"]["output"][0]["role"] == "assistant"   # Responses' items keep theirs
    assert out[0]["response"]["request_id"] == ok["q0"]["id"]
    # the same request, greedy: the same answer; the shared system prompt came from the cache
    assert ok["q0"]["choices"][0]["message"] == ok["q2"]["choices"][0]["message"]
    cached = sorted(ok[f"q{i}"]["usage"]["prompt_tokens_details"]["cached_tokens"]
                    for i in range(5))
    assert cached[-4:] >= [32] * 4, cached   # computed once, read by the other four
    codes = [o["error"]["code"] for o in out[7:11]]
    assert codes == ["invalid_json", "invalid_url", "duplicate_custom_id", "invalid_request"]
    assert all(o["response"] is None for o in out[7:11])
    bad = out[11]
    assert bad["error"] is None and bad["response"]["status_code"] == 400
    assert bad["response"]["body"]["error"]["param"] == "max_tokens"
    assert "12 requests (7 ok, 5 failed)" in proc.stderr and "from the cache" in proc.stderr


def test_run_batch_usage_errors(tmp_path: Path, monkeypatch) -> None:
    from radixkv.server.batch import main

    monkeypatch.setenv("OMP_WAIT_POLICY", "")   # main() must not set it for this process
    assert main(["-i", str(tmp_path / "missing.jsonl"), "-o", str(tmp_path / "o")]) == 2
    with pytest.raises(SystemExit) as exc:
        main(["-o", str(tmp_path / "o")])   # no input file
    assert exc.value.code == 2


def test_lines_a_batch_cannot_answer_are_line_errors() -> None:
    """A streamed or a background request has no place in an output file (a background one
    would answer ``queued`` and end with the run): an error line each, the rest go on."""
    from radixkv.server.batch import parse_line

    def line(body: dict) -> str:
        return json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/responses",
                           "body": body})

    for body, words in (({"input": "x", "stream": True}, "stream"),
                        ({"input": "x", "background": True}, "background")):
        req, err = parse_line(line(body), set())
        assert req is None and err["error"]["code"] == "invalid_request"
        assert words in err["error"]["message"]
    req, err = parse_line(line({"input": "x", "background": False}), set())
    assert err is None and req["body"]["background"] is False
    req, err = parse_line("[" * 100_000 + "]" * 100_000, set())   # (RecursionError in json)
    assert req is None and err["error"]["code"] == "invalid_json"


@pytest.mark.model
def test_a_thinking_budget_cuts_the_reasoning_through_the_server(tmp_path: Path) -> None:
    """``thinking_token_budget`` with ``--reasoning-parser deepseek_r1`` (thinking from the
    first token): the reasoning is the first N tokens of the free reply, then ``</think>`` is
    forced and the rest is the answer; the 135M model never closes on its own, so without a
    budget its whole reply is reasoning. In a completion the prompt says whether the reply
    starts inside the thinking (as vLLM's budget reads it): one that ends with ``<think>`` is
    cut the same way; one that does not has nothing to budget here (``<think>`` is not one
    token of this vocabulary): a 400, as with beam search."""
    ask = {"messages": [{"role": "user", "content": "Why is the sky blue?"}],
           "max_tokens": 16, "temperature": 0}
    lines = [{"custom_id": name, "method": "POST", "url": "/v1/chat/completions",
              "body": {**ask, **extra}}
             for name, extra in (("free", {}), ("cut", {"thinking_token_budget": 3}),
                                 ("zero", {"thinking_token_budget": 0}),
                                 ("beams", {"thinking_token_budget": 3, "n": 2,
                                            "use_beam_search": True}))]
    lines.append({"custom_id": "text", "method": "POST", "url": "/v1/completions",
                  "body": {"prompt": "x", "max_tokens": 2, "thinking_token_budget": 3}})
    thinks = {"prompt": "Q: Why is the sky blue?\nA: <think>\n", "max_tokens": 16,
              "temperature": 0, "return_token_ids": True}
    lines += [{"custom_id": name, "method": "POST", "url": "/v1/completions",
               "body": {**thinks, **extra}}
              for name, extra in (("text_free", {}), ("text_cut", {"thinking_token_budget": 3}))]
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps(x) + "\n" for x in lines))
    proc = subprocess.run([sys.executable, "-m", "radixkv.cli", "run-batch", "-i", str(src),
                           "-o", str(dst), "--threads", "1", "--device", "cpu", "--dtype",
                           "float32", "--device-blocks", "64", "--reasoning-parser",
                           "deepseek_r1"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    out = {o["custom_id"]: o["response"] for o in map(json.loads, dst.read_text().splitlines())}
    free, cut, zero = (out[k]["body"]["choices"][0]["message"] for k in ("free", "cut", "zero"))
    assert free["content"] is None and len(free["reasoning"]) > 10
    assert cut["reasoning"] and free["reasoning"].startswith(cut["reasoning"].rstrip())
    assert len(cut["reasoning"]) < len(free["reasoning"]) and cut["content"]
    assert zero["reasoning"] in ("", None) and zero["content"]
    for name in ("beams", "text"):
        assert out[name]["status_code"] == 400, out[name]
        assert out[name]["body"]["error"]["param"] == "thinking_token_budget", out[name]
    text_free, text_cut = (out[k]["body"]["choices"][0] for k in ("text_free", "text_cut"))
    assert "</think>" not in text_free["text"] and "</think>" in text_cut["text"]
    assert text_cut["token_ids"][:3] == text_free["token_ids"][:3]   # 3 free, then forced
    assert text_cut["text"].index("</think>") > 0
