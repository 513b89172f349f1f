"""``documents`` / ``blend_ratio`` on /v1/completions: a token-id prompt's documents are blended
from their cached entries (docs/rag.md, docs/serve.md), through the real server."""

from __future__ import annotations

import random
import sys
from pathlib import Path
from typing import Any

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

sys.path.insert(0, str(Path(__file__).parent))
from test_openai_server import KEY_A, MODEL, running_server  # noqa: E402

pytestmark = pytest.mark.model
BS = 16


@pytest.fixture(scope="module")
def server() -> Any:
    with running_server(["--api-key", KEY_A, "--device-blocks", "512", "--threads", "1",
                         "--device", "cpu", "--dtype", "float32"]) as srv:
        yield srv


def _prompt(order: list[int], docs: list[list[int]], head: list[int], question: list[int]
            ) -> tuple[list[int], list[tuple[int, int]]]:
    ids, spans = list(head), []
    for i in order:
        spans.append((len(ids), len(ids) + len(docs[i])))
        ids += docs[i]
    return ids + question, spans


def test_documents_are_blended_in_any_order(server: Any) -> None:
    rng = random.Random(0)
    head = [rng.randrange(100, 20000) for _ in range(BS)]
    docs = [[rng.randrange(100, 20000) for _ in range(3 * BS)] for _ in range(3)]
    question = [rng.randrange(100, 20000) for _ in range(9)]
    api = server.client()

    def ask(order: list[int], **extra: Any) -> Any:
        ids, spans = _prompt(order, docs, head, question)
        return api.completions.create(model=MODEL, prompt=ids, max_tokens=2, temperature=0,
                                      extra_body={"documents": spans, **extra})

    first = ask([0, 1, 2], blend_ratio=0.15)     # entries computed, then blended
    assert first.usage.prompt_tokens_details.cached_tokens == 10 * BS
    second = ask([2, 0, 1], blend_ratio=0.15)    # every document cached, in another order
    assert second.usage.prompt_tokens_details.cached_tokens == 10 * BS
    # ratio 1 is a full prefill: the same answer as a request without documents
    ids, _ = _prompt([2, 0, 1], docs, head, question)
    plain = api.completions.create(model=MODEL, prompt=ids, max_tokens=2, temperature=0,
                                   extra_body={"cache_salt": "fresh"})
    full = ask([2, 0, 1], blend_ratio=1.0, cache_salt="other")
    assert full.choices[0].text == plain.choices[0].text


@pytest.mark.parametrize("body", [{"documents": [[5, 3]]}, {"documents": [[0, 99999]]},
                                  {"documents": [[0, 4]], "blend_ratio": 2.0},
                                  {"documents": [[0, 4], [2, 6]]}, {"documents": "x"}])
def test_bad_documents_are_a_400(server: Any, body: dict) -> None:
    status, err = server.raw("POST", "/v1/completions",
                             {"model": MODEL, "prompt": list(range(100, 140)), "max_tokens": 1,
                              **body})
    assert status == 400, err
