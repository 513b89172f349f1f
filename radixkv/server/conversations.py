"""OpenAI's Conversations API (``/v1/conversations``): a conversation the server keeps as items.

A conversation is an ordered list of Responses items (messages, function calls and their
outputs, reasoning) owned by one API key. A client creates one (optionally with its first
items), adds items, lists and deletes them, and runs ``POST /v1/responses`` with
``conversation: id``: the response answers the conversation's items as its history, and its
input and output items are appended once it ends, so the next response continues it. It is
the durable sibling of ``previous_response_id`` (which chains immutable responses): the same
prompt grows by appending, so each turn's prefix is the previous turn's prompt and comes from
the prefix cache.

Items are stored normalized: read as chat messages (:func:`responses.input_messages`, which
refuses what radixkv cannot answer) and written back as items with ids of their own
(:func:`responses.message_items`); a response's output items are stored as they were sent.
The store is one process's memory, bounded like the response store
(``--responses-store-size`` conversations, the least recently used dropped first).

One response at a time per conversation (:meth:`Conversation.lock`): while one runs, another
response in it, or adding or deleting its items, is a 400 ``conversation_locked``, as OpenAI
answers; the lock is released however the response ends (completed, failed, cancelled, its
client gone, a background run's end).

Pure Python, no torch. Event-loop thread only.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from radixkv.server import responses as rs
from radixkv.server.errors import APIError

#: Items one create call may add (OpenAI's limit).
MAX_ITEMS_PER_CALL = 20
#: Metadata pairs a conversation may carry, and the lengths of keys and values (OpenAI's).
MAX_METADATA, MAX_KEY, MAX_VALUE = 16, 64, 512


@dataclass
class Conversation:
    """One conversation: its owner, its items (oldest first) and metadata."""

    id: str
    tenant: str
    created_at: int
    metadata: dict[str, str] = field(default_factory=dict)
    items: list[dict[str, Any]] = field(default_factory=list)
    #: the response running in it now (its id), if any: :meth:`lock`
    busy: str | None = None

    def body(self) -> dict[str, Any]:
        """The ``conversation`` object."""
        return {"id": self.id, "object": "conversation", "created_at": self.created_at,
                "metadata": dict(self.metadata)}

    def messages(self) -> list[dict[str, Any]]:
        """The items as chat messages (the history of a response in this conversation)."""
        return rs.input_messages(self.items) if self.items else []

    def check_unlocked(self) -> None:
        """A 400 ``conversation_locked`` (OpenAI's code and ``param``) while a response runs
        in this conversation: its items are what that response answers and what it will be
        appended to, so another response or an item added or deleted meanwhile would answer a
        history the conversation will not have."""
        if self.busy is not None:
            raise APIError(400, f"response {self.busy!r} is in progress in conversation "
                           f"{self.id!r}; retry once it has ended", param="conversation",
                           code="conversation_locked")

    def lock(self, response_id: str) -> Callable[[], None]:
        """Hold the conversation for ``response_id`` (a 400 where another response holds it);
        returns the release, which is safe to call more than once."""
        self.check_unlocked()
        self.busy = response_id

        def release() -> None:
            if self.busy == response_id:
                self.busy = None
        return release

    def item(self, item_id: str) -> dict[str, Any]:
        for it in self.items:
            if it.get("id") == item_id:
                return it
        raise APIError(404, f"no item {item_id!r} in conversation {self.id!r}",
                       code="item_not_found")


def check_metadata(metadata: Any) -> dict[str, str]:
    """``metadata``: at most 16 string pairs, keys up to 64 characters, values up to 512."""
    if metadata is None:
        return {}
    if not isinstance(metadata, dict) or len(metadata) > MAX_METADATA or not all(
            isinstance(k, str) and isinstance(v, str) and len(k) <= MAX_KEY
            and len(v) <= MAX_VALUE for k, v in metadata.items()):
        raise APIError(400, f"metadata must be at most {MAX_METADATA} string pairs (keys up to "
                       f"{MAX_KEY} characters, values up to {MAX_VALUE})", param="metadata")
    return dict(metadata)


def new_items(items: Any) -> list[dict[str, Any]]:
    """Client items to add to a conversation, normalized and given ids; a 400 naming
    ``items`` for more than :data:`MAX_ITEMS_PER_CALL` or an item radixkv cannot answer."""
    if not isinstance(items, list):
        raise APIError(400, "items must be a list of items", param="items")
    if len(items) > MAX_ITEMS_PER_CALL:
        raise APIError(400, f"at most {MAX_ITEMS_PER_CALL} items may be added at a time, got "
                       f"{len(items)}", param="items")
    if not items:
        return []
    try:
        messages = rs.input_messages(items)
    except APIError as exc:
        exc.param = "items"
        raise
    return rs.message_items(messages, rs.new_id("conv"))


class ConversationStore:
    """The conversations, per API key, the least recently used dropped past ``capacity``
    (0: none kept, and creating one is a 400)."""

    def __init__(self, capacity: int = rs.DEFAULT_STORE_SIZE) -> None:
        if capacity < 0:
            raise ValueError(f"the conversation store's capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self._items: OrderedDict[str, Conversation] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def create(self, tenant: str, items: Sequence[dict[str, Any]],
               metadata: dict[str, str]) -> Conversation:
        if self.capacity == 0:
            raise APIError(400, "this server keeps no conversations (--responses-store-size "
                           "0)", code="unsupported_parameter")
        conv = Conversation(rs.new_id("conv"), tenant, int(time.time()), metadata, list(items))
        self._items[conv.id] = conv
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)
        return conv

    def get(self, tenant: str, cid: str, param: str | None = None) -> Conversation:
        """The conversation ``cid`` of ``tenant`` (now the most recently used); a 404 (a 400
        naming ``param`` when given) for one that is not there or another key's."""
        conv = self._items.get(cid)
        if conv is None or conv.tenant != tenant:
            raise APIError(404 if param is None else 400,
                           f"no conversation with id {cid!r} (deleted, dropped from the store, "
                           "or another API key's)", param=param, code="conversation_not_found")
        self._items.move_to_end(cid)
        return conv

    def delete(self, tenant: str, cid: str) -> None:
        self.get(tenant, cid)
        del self._items[cid]


def conversation_id(value: Any) -> str | None:
    """A Responses request's ``conversation``: an id, or ``{"id": id}``."""
    if value is None:
        return None
    if isinstance(value, dict):
        value = value.get("id")
    if not isinstance(value, str) or not value:
        raise APIError(400, "conversation must be a conversation id or {\"id\": id}",
                       param="conversation")
    return value


def record(conv: Conversation, inputs: Sequence[dict[str, Any]],
           response: dict[str, Any]) -> None:
    """Append a response's input (chat messages, given ids) and its output items to the
    conversation it ran in."""
    conv.items.extend(rs.message_items(inputs, rs.new_id("item")))
    conv.items.extend(dict(it) for it in response["output"])


__all__ = ["Conversation", "ConversationStore", "MAX_ITEMS_PER_CALL", "check_metadata",
           "conversation_id", "new_items", "record"]
