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
(``--responses-store-size`` conversations, the least recently used dropped first), and each
conversation by size (``--max-conversation-bytes``, :data:`DEFAULT_MAX_BYTES`): its items as
compact JSON (non-ASCII escaped, so at least their UTF-8 bytes). Adding items past it, or
creating a conversation with more, is a 400 ``conversation_too_large`` naming ``items`` that
changes nothing; a response in a conversation already at or past it is the same 400 naming
``conversation``. A response's own items are always recorded, so a conversation can pass the
bound by one turn, never more. Without it one API key could grow a conversation without
bound (20 items a call, no request ever reading them all: ``truncation: "auto"`` drops the
earliest turns), and the store's whole size is at most ``--responses-store-size`` times it.

One response at a time per conversation (:meth:`Conversation.lock`): while one runs, another
response in it, or adding or deleting its items, is a 400 ``conversation_locked``, as OpenAI
answers; the lock is released however the response ends (completed, failed, cancelled, its
client gone, a background run's end).

Pure Python, no torch. Event-loop thread only.
"""

from __future__ import annotations

import json
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
#: ``--max-conversation-bytes``' default: ~1M tokens of English, past any context a server of
#: this kind runs, and 4 GiB for a full store at the default ``--responses-store-size``.
DEFAULT_MAX_BYTES = 4 << 20


def item_size(item: Any) -> int:
    """An item's size as the bound counts it: its compact JSON, non-ASCII escaped."""
    return len(json.dumps(item, separators=(",", ":")))


def too_large(what: str, size: int, limit: int, param: str) -> APIError:
    """The 400 for ``what`` (a conversation) at ``size`` bytes of items against ``limit``."""
    return APIError(400, f"{what} holds or would hold {size} bytes of items, past this "
                    f"server's limit of {limit} (--max-conversation-bytes): start a new "
                    "conversation, or delete items", param=param, code="conversation_too_large")


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
    #: its items' :func:`item_size` summed
    size: int = 0

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

    def add(self, items: Sequence[dict[str, Any]], limit: int) -> None:
        """Append client ``items`` (a 400 ``conversation_too_large`` naming ``items``, nothing
        added, where they would take it past ``limit``)."""
        size = self.size + sum(map(item_size, items))
        if size > limit:
            raise too_large(f"conversation {self.id!r}", size, limit, "items")
        self.items.extend(items)
        self.size = size

    def remove(self, item: dict[str, Any]) -> None:
        self.items.remove(item)
        self.size -= item_size(item)

    def check_room(self, limit: int) -> None:
        """A 400 ``conversation_too_large`` naming ``conversation`` when it is at or past
        ``limit``: a response in it would take it further."""
        if self.size >= limit:
            raise too_large(f"conversation {self.id!r}", self.size, limit, "conversation")

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
    (0: none kept, and creating one is a 400), each at most ``max_bytes`` of items
    (:meth:`Conversation.add`)."""

    def __init__(self, capacity: int = rs.DEFAULT_STORE_SIZE,
                 max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        if capacity < 0:
            raise ValueError(f"the conversation store's capacity must be >= 0, got {capacity}")
        if max_bytes < 1:
            raise ValueError(f"a conversation's size bound must be >= 1, got {max_bytes}")
        self.capacity = capacity
        self.max_bytes = max_bytes
        self._items: OrderedDict[str, Conversation] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def create(self, tenant: str, items: Sequence[dict[str, Any]],
               metadata: dict[str, str]) -> Conversation:
        if self.capacity == 0:
            raise APIError(400, "this server keeps no conversations (--responses-store-size "
                           "0)", code="unsupported_parameter")
        conv = Conversation(rs.new_id("conv"), tenant, int(time.time()), metadata)
        conv.add(items, self.max_bytes)
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
    conversation it ran in, whatever its size (the response ran: its turn is kept)."""
    items = [*rs.message_items(inputs, rs.new_id("item")),
             *(dict(it) for it in response["output"])]
    conv.items.extend(items)
    conv.size += sum(map(item_size, items))


__all__ = ["Conversation", "ConversationStore", "DEFAULT_MAX_BYTES", "MAX_ITEMS_PER_CALL",
           "check_metadata", "conversation_id", "item_size", "new_items", "record", "too_large"]
