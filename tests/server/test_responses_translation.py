"""The Responses API's translation to and from chat (radixkv/server/responses.py), without a
server: input items to chat messages, the stored conversations' bounds and owners. The
endpoint itself is tested through the server in test_openai_server.py and test_tool_calls.py.
"""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")

from radixkv.server import responses as rs  # noqa: E402
from radixkv.server.errors import APIError  # noqa: E402


def test_input_items_become_chat_messages() -> None:
    call = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}
    msgs = rs.input_messages([
        {"role": "developer", "content": "Be terse."},
        {"type": "message", "role": "user",
         "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Let me look."}]},
        call, {**call, "call_id": "c2"},
        {"type": "function_call_output", "call_id": "c1", "output": "1"},
        {"type": "function_call_output", "call_id": "c2", "output": "2"},
        call,
    ])
    assert msgs == [
        {"role": "developer", "content": "Be terse."},
        {"role": "user", "content": "ab"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
            {"id": "c2", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "1"},
        {"role": "tool", "tool_call_id": "c2", "content": "2"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
    ]
    assert rs.input_messages("hi") == [{"role": "user", "content": "hi"}]
    for bad in ([], [{"role": "tool", "content": "x"}], [{"type": "item_reference", "id": "x"}],
                [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}],
                [{"type": "function_call", "call_id": "c", "name": "f"}],
                [{"type": "function_call_output", "output": "x"}], ["text"]):
        with pytest.raises(APIError) as exc:
            rs.input_messages(bad)
        assert exc.value.status == 400 and exc.value.param == "input", bad


def test_the_reply_becomes_items_and_the_stored_conversation_continues_with_it() -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\"a\":1}"}}
    items = rs.output_items({"content": "ok", "reasoning": "hmm", "tool_calls": [call]})
    assert [it["type"] for it in items] == ["reasoning", "message", "function_call"]
    assert rs.assistant_message(items) == {"role": "assistant", "content": "ok",
                                           "tool_calls": [call]}
    only = rs.output_items({"content": None, "tool_calls": [call]})
    assert [it["type"] for it in only] == ["function_call"]
    assert rs.assistant_message(only)["content"] is None
    assert rs.output_items({"content": ""})[0]["content"][0]["text"] == ""


def test_the_store_is_bounded_least_recently_used_and_per_api_key() -> None:
    store = rs.ResponseStore(2)

    def put(rid: str, tenant: str = "k") -> None:
        store.put(rid, rs.Stored(tenant, (), {"id": rid}))

    put("a")
    put("b")
    assert store.get("k", "a") is not None    # a is now the most recently used
    put("c")
    assert store.get("k", "b") is None and len(store) == 2
    assert store.get("other", "a") is None and not store.delete("other", "a")
    assert store.delete("k", "a") and store.get("k", "a") is None
    none = rs.ResponseStore(0)
    none.put("x", rs.Stored("k", (), {}))
    assert len(none) == 0
    with pytest.raises(ValueError):
        rs.ResponseStore(-1)
