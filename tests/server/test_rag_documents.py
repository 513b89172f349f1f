"""``documents`` / ``blend_ratio``: a prompt's documents are blended from their cached entries
(docs/rag.md, docs/serve.md), through the real server: token spans of a token-id prompt, texts
found in a text prompt (/v1/completions), and texts the server places in a chat
(/v1/chat/completions, /tokenize)."""

from __future__ import annotations

import random
import sys
from pathlib import Path
from typing import Any

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

sys.path.insert(0, str(Path(__file__).parent))
from test_openai_server import KEY_A, MODEL, _value, running_server  # noqa: E402

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


# Three retrieved documents of several blocks each, and a question over them.
DOCS = [
    "The Loire is the longest river in France. It rises in the Massif Central, flows north "
    "towards Orleans, then west through Tours and Nantes, and reaches the Atlantic Ocean at "
    "Saint-Nazaire after about a thousand kilometres.",
    {"title": "alps", "text": "Mont Blanc, on the border between France and Italy, is the "
     "highest mountain of the Alps. Its summit is a thick dome of ice and snow whose height "
     "changes from year to year by a metre or two."},
    "Lyon lies where the Rhone and the Saone meet. Its old town, with narrow passages called "
    "traboules that cross from one street to the next through buildings, is a world heritage "
    "site known for its silk weavers.",
]
SYSTEM = "Answer the question using only the documents provided."
QUESTION = "Which river flows through Tours?"


def _chat_msgs() -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]


def _tokenize(server: Any, docs: list[Any]) -> tuple[list[int], list[list[int]]]:
    status, body = server.raw("POST", "/tokenize", {"model": MODEL, "messages": _chat_msgs(),
                                                   "documents": docs})
    assert status == 200, body
    return body["tokens"], body["document_spans"]


def test_chat_documents_are_placed_and_blended_in_any_order(server: Any) -> None:
    """Chat ``documents`` (texts) are placed before the question, each padded to whole blocks,
    and blended wherever they appear: a second request with the documents in another order
    reuses their entries, where prefix caching alone reuses only the head."""
    api = server.client()
    a, b = DOCS, [DOCS[2], DOCS[0], DOCS[1]]
    ids_a, _ = _tokenize(server, a)
    ids_b, spans_b = _tokenize(server, b)
    assert len(spans_b) == 3 and all(s % BS == 0 and e % BS == 0 for s, e in spans_b)
    tok = {"model": MODEL, "tokens": ids_b[spans_b[0][0]:spans_b[0][1]]}
    assert DOCS[2] in server.raw("POST", "/detokenize", tok)[1]["prompt"]

    def chat(docs: list[Any], **extra: Any) -> Any:
        return api.chat.completions.create(model=MODEL, messages=_chat_msgs(), max_tokens=3,
                                           temperature=0, extra_body={"documents": docs,
                                                                      **extra})

    # prefix-only reuse of the same two prompts (token ids, no documents): only the head
    def plain(ids: list[int], salt: str) -> Any:
        return api.completions.create(model=MODEL, prompt=ids, max_tokens=3, temperature=0,
                                      extra_body={"cache_salt": salt})

    plain(ids_a, "prefix-only")
    prefix_only = plain(ids_b, "prefix-only").usage.prompt_tokens_details.cached_tokens
    assert prefix_only == spans_b[0][0]                  # the system head, nothing after it
    chat(a, blend_ratio=0.15, cache_salt="chat")         # entries computed, then blended
    second = chat(b, blend_ratio=0.15, cache_salt="chat")
    assert second.usage.prompt_tokens == len(ids_b)
    blended = spans_b[-1][1]                             # every full block up to the question
    assert second.usage.prompt_tokens_details.cached_tokens == blended > prefix_only
    # the chat's prompt and spans are /tokenize's: the same blend, served whole from the cache
    again = api.completions.create(model=MODEL, prompt=ids_b, max_tokens=1, temperature=0,
                                   extra_body={"documents": spans_b, "blend_ratio": 0.15,
                                               "cache_salt": "chat"})
    assert again.usage.prompt_tokens_details.cached_tokens >= blended
    # streamed, the same documents in a third order: blended too (usage in the last chunk)
    chunks = list(api.chat.completions.create(
        model=MODEL, messages=_chat_msgs(), max_tokens=2, temperature=0, stream=True,
        stream_options={"include_usage": True},
        extra_body={"documents": [DOCS[1], DOCS[2], DOCS[0]], "cache_salt": "chat"}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == blended
    # ratio 1 is a full prefill: the answer of the same tokens without documents
    full = chat(b, blend_ratio=1.0, cache_salt="full-chat")
    assert full.choices[0].message.content == plain(ids_b, "full-plain").choices[0].text


def test_text_prompt_documents_are_found_and_blended(server: Any) -> None:
    """A text prompt's ``documents`` are the texts found in it; the prompt itself is not changed
    (only tokenized piece by piece), and a reordered prompt reuses the entries."""
    api = server.client()
    texts = [d if isinstance(d, str) else d["text"] for d in DOCS]

    def prompt(order: list[int]) -> str:
        return "Documents:\n" + "\n\n".join(texts[i] for i in order) + "\n\nQ: " + QUESTION

    def ask(order: list[int], salt: str, docs: bool = True) -> Any:
        extra: dict[str, Any] = {"cache_salt": salt}
        if docs:
            extra["documents"] = [texts[i] for i in order]
        return api.completions.create(model=MODEL, prompt=prompt(order), max_tokens=2,
                                      temperature=0, extra_body=extra)

    ask([0, 1, 2], "text-prefix", docs=False)
    prefix_only = ask([1, 2, 0], "text-prefix", docs=False).usage.prompt_tokens_details
    ask([0, 1, 2], "text-blend")
    second = ask([1, 2, 0], "text-blend")
    status, tok = server.raw("POST", "/tokenize", {"model": MODEL, "prompt": prompt([1, 2, 0]),
                                                   "documents": [texts[i] for i in (1, 2, 0)]})
    assert status == 200 and tok["count"] == second.usage.prompt_tokens
    blended = tok["document_spans"][-1][1] // BS * BS
    assert second.usage.prompt_tokens_details.cached_tokens == blended
    assert blended > prefix_only.cached_tokens


CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Q?"}], "max_tokens": 1}
TEXT = {"model": MODEL, "prompt": "Context: alpha beta gamma. Q?", "max_tokens": 1}


@pytest.mark.parametrize("path,body,param", [
    ("/v1/chat/completions", {**CHAT, "documents": []}, "documents"),
    ("/v1/chat/completions", {**CHAT, "documents": ["  "]}, "documents"),
    ("/v1/chat/completions", {**CHAT, "documents": [[0, 16]]}, "documents"),
    ("/v1/chat/completions", {**CHAT, "documents": ["x"] * 257}, "documents"),
    ("/v1/chat/completions", {**CHAT, "documents": [{"text": "x", "url": "y"}]}, "documents"),
    ("/v1/chat/completions", {**CHAT, "blend_ratio": 0.3}, "blend_ratio"),
    ("/v1/chat/completions", {**CHAT, "documents": ["x"], "blend_ratio": 1.5}, "blend_ratio"),
    ("/v1/chat/completions", {**CHAT, "documents": ["x"],
                              "messages": [{"role": "system", "content": "no user"}]},
     "documents"),
    ("/v1/chat/completions", {**CHAT, "documents": ["x"], "add_generation_prompt": False},
     "documents"),
    ("/v1/completions", {**TEXT, "documents": ["delta"]}, "documents"),
    ("/v1/completions", {**TEXT, "documents": ["gamma", "alpha"]}, "documents"),
    ("/v1/completions", {**TEXT, "documents": [[0, 4]]}, "documents"),
    ("/v1/completions", {**TEXT, "documents": ["alpha", [0, 4]]}, "documents"),
    ("/v1/completions", {**TEXT, "prompt": ["Context: alpha", "beta"],
                         "documents": ["alpha"]}, "documents"),
    ("/v1/completions", {**TEXT, "prompt": list(range(100, 140)), "documents": ["alpha"]},
     "documents"),
    ("/v1/completions", {**TEXT, "documents": [{"title": "t", "text": "alpha"}]}, "documents"),
])
def test_bad_document_texts_are_a_400_that_changes_nothing(server: Any, path: str, body: dict,
                                                           param: str) -> None:
    before = _value(server.metrics(), "radixkv_prefix_cache_queries")
    status, err = server.raw("POST", path, body)
    assert status == 400, err
    assert err["error"]["param"] == param, err
    assert _value(server.metrics(), "radixkv_prefix_cache_queries") == before
