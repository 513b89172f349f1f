"""The Responses API's translation to and from chat (radixkv/server/responses.py), without a
server: input items to chat messages, the stored conversations' bounds and owners. The
endpoint itself is tested through the server in test_openai_server.py and test_tool_calls.py.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

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


def test_a_running_background_response_outlives_the_store_bound() -> None:
    """A background response its client polls must not be dropped while it runs (a burst of
    background requests past the store's size lost the first ones while they were queued):
    the bound drops finished responses first, and the running one once it has ended."""
    from radixkv.server.protocol import ResponsesRequest

    store = rs.ResponseStore(2)
    run = rs.Run(rs.EventStream("resp_a", ResponsesRequest(input="x"), "m", queued=True),
                 keep_events=False)
    store.put("resp_a", rs.Stored("k", (), {"id": "resp_a"}, run=run))
    for rid in ("b", "c", "d"):
        store.put(rid, rs.Stored("k", (), {"id": rid}))
    assert store.get("k", "resp_a", touch=False) is not None and store.get("k", "b") is None
    assert len(store) == 2 and store.get("k", "d") is not None   # the running one, the newest
    run.finish()
    store.put("e", rs.Stored("k", (), {"id": "e"}))
    assert store.get("k", "resp_a") is None and len(store) == 2


def test_input_items_are_the_stored_messages_as_items_again() -> None:
    """``GET .../input_items`` writes the stored chat messages back as items: read again by
    :func:`input_messages`, they are the same messages; ids are stable per response."""
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "q"},
            {"role": "assistant", "content": "let me see", "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "1"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "[]"}}]}]
    items = rs.message_items(msgs, "resp_abc")
    assert [i["type"] for i in items] == ["message", "message", "message", "function_call",
                                          "function_call_output", "function_call"]
    assert rs.input_messages(items) == msgs
    assert items == rs.message_items(msgs, "resp_abc") and len({i["id"] for i in items}) == 6
    page = rs.page(items, None, 4, "desc")
    assert [i["id"] for i in page["data"]] == [i["id"] for i in items[::-1][:4]]
    assert page["has_more"] and page["first_id"] == items[-1]["id"]
    rest = rs.page(items, page["last_id"], 4, "desc")
    assert [i["id"] for i in rest["data"]] == [items[1]["id"], items[0]["id"]]
    assert not rest["has_more"]
    with pytest.raises(APIError):
        rs.page(items, "msg_nothing", 4, "asc")


def test_a_background_response_cancelled_before_it_ran_leaves_the_engine() -> None:
    """A background response's task may be cancelled before it first runs (a cancel that
    arrives at once): its chat stream never starts, and still its admission and engine
    request are released (the stream's ``on_close``) and it is stored ``cancelled``."""
    import asyncio

    from radixkv.server import app as app_mod
    from radixkv.server.protocol import ResponsesRequest
    from radixkv.server.tenants import Tenants

    state = app_mod.ServerState("m", Tenants.create([], None), 4, None)
    closed = []

    async def chat() -> object:
        yield 'data: {"choices": []}\n\n'

    async def go() -> dict:
        req = ResponsesRequest(input="x", background=True)
        stream = app_mod._Stream(chat(), lambda: closed.append(1))
        first = app_mod._background(state, "", "resp_1", req,
                                    ({"role": "user", "content": "x"},), 0, stream)
        assert first.status_code == 200
        entry = state.responses.get("", "resp_1")
        assert entry.current()["status"] == "queued"
        await entry.run.cancel()   # before the task had a turn
        assert not state.background
        ended = state.responses.get("", "resp_1")
        # the size --max-conversation-bytes counts, kept with the entry (the question's 0 here
        # stands for its history; its message and the reply added)
        from radixkv.server import conversations as cv
        assert ended.size == sum(map(cv.item_size, ended.messages[1:])) > 0
        return ended.response

    final = asyncio.run(go())
    assert final["status"] == "cancelled" and final["output"] == [] and closed == [1]


def test_truncation_drops_whole_turns_and_keeps_instructions() -> None:
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "1"},
            {"role": "assistant", "content": "a1"}, {"role": "developer", "content": "d"},
            {"role": "user", "content": "2"}, {"role": "tool", "tool_call_id": "c",
                                               "content": "t"},
            {"role": "user", "content": "3"}]
    starts = rs.turn_starts(msgs)
    assert starts == [1, 4, 6]
    assert rs.without_turns(msgs, starts, 0) == msgs
    assert rs.without_turns(msgs, starts, 1) == [msgs[0], msgs[3], *msgs[4:]]
    assert rs.without_turns(msgs, starts, 2) == [msgs[0], msgs[3], msgs[6]]


def test_the_conversation_store_is_bounded_and_per_api_key() -> None:
    from radixkv.server import conversations as cv

    store = cv.ConversationStore(2)
    a = store.create("k1", cv.new_items([{"role": "user", "content": "hi"}]), {})
    b = store.create("k1", [], {"x": "y"})
    assert a.messages() == [{"role": "user", "content": "hi"}] and b.messages() == []
    with pytest.raises(APIError) as exc:
        store.get("k2", a.id)   # another key's
    assert exc.value.status == 404
    store.get("k1", a.id)       # now the most recently used: b is dropped next
    store.create("k1", [], {})
    assert len(store) == 2 and store.get("k1", a.id) is a
    with pytest.raises(APIError) as exc:
        store.get("k1", b.id, param="conversation")
    assert (exc.value.status, exc.value.param) == (400, "conversation")
    with pytest.raises(APIError):
        cv.ConversationStore(0).create("k1", [], {})
    with pytest.raises(APIError) as exc:
        cv.check_metadata({str(i): "v" for i in range(17)})
    assert exc.value.param == "metadata"
    assert cv.conversation_id({"id": "conv_1"}) == cv.conversation_id("conv_1") == "conv_1"


def test_a_conversation_is_bounded_in_size_and_a_refused_add_changes_nothing() -> None:
    """``--max-conversation-bytes``: adding items that would take a conversation past the
    bound (or creating one with them) is a 400 ``conversation_too_large`` naming ``items``
    that leaves it as it was; a response's own turn is always recorded, after which the
    conversation, at or past the bound, takes no response (the same 400, naming
    ``conversation``) until items are deleted."""
    from radixkv.server import conversations as cv

    def user(n: int) -> list[dict]:
        return cv.new_items([{"role": "user", "content": "x" * n}])

    limit = cv.item_size(user(1000)[0]) * 3
    store = cv.ConversationStore(4, max_bytes=limit)
    with pytest.raises(APIError) as exc:
        store.create("k1", user(1000) * 4, {})
    assert (exc.value.status, exc.value.code, exc.value.param) == (
        400, "conversation_too_large", "items") and len(store) == 0
    conv = store.create("k1", user(1000), {})
    conv.add(user(1000), store.max_bytes)
    before = (list(conv.items), conv.size)
    with pytest.raises(APIError) as exc:
        conv.add(user(1000) + user(1), store.max_bytes)
    assert exc.value.code == "conversation_too_large" and (conv.items, conv.size) == before
    conv.check_room(store.max_bytes)          # under the bound: a response may run
    cv.record(conv, [{"role": "user", "content": "y" * 2000}],
              {"output": [{"type": "message", "role": "assistant", "id": "msg_1",
                           "content": [{"type": "output_text", "text": "ok"}]}]})
    assert conv.size > limit                  # the turn that ran is kept whole
    with pytest.raises(APIError) as exc:
        conv.check_room(store.max_bytes)
    assert (exc.value.code, exc.value.param) == ("conversation_too_large", "conversation")
    conv.remove(conv.items[0])
    conv.remove(conv.items[0])
    conv.check_room(store.max_bytes)
    assert conv.size == sum(map(cv.item_size, conv.items))
    with pytest.raises(ValueError):
        cv.ConversationStore(4, max_bytes=0)


@given(st.lists(st.tuples(st.sampled_from(["add", "remove", "record"]),
                          st.integers(0, 400), st.integers(1, 3)), max_size=40))
def test_a_conversations_size_is_its_items_and_past_the_bound_by_one_turn_at_most(
        ops: list[tuple[str, int, int]]) -> None:
    """Whatever adds, deletes and recorded turns come: ``size`` is its items' sizes summed, a
    refused add changes nothing, and only a recorded turn takes it past the bound."""
    from radixkv.server import conversations as cv

    limit = 1500
    conv = cv.ConversationStore(1, max_bytes=limit).create("k", [], {})
    for op, chars, count in ops:
        if op == "add":
            items = cv.new_items([{"role": "user", "content": "z" * chars}] * count)
            before = (list(conv.items), conv.size)
            fits = before[1] + sum(map(cv.item_size, items)) <= limit
            try:
                conv.add(items, limit)
            except APIError as exc:
                assert not fits and exc.code == "conversation_too_large"
                assert (conv.items, conv.size) == before
            else:
                assert fits and conv.size <= limit
        elif op == "remove" and conv.items:
            conv.remove(conv.items[chars % len(conv.items)])
        elif op == "record":
            was = conv.size
            cv.record(conv, [{"role": "user", "content": "w" * chars}], {"output": []})
            assert conv.size > was
        assert conv.size == sum(map(cv.item_size, conv.items))
