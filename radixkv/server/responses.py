"""OpenAI's Responses API (``POST /v1/responses``) as a view of the chat pipeline.

A Responses request is a chat request in other clothes: ``instructions`` is a system message,
``input`` is a list of items (messages, the model's function calls, their outputs), ``tools``
are flat function definitions, ``text.format`` is ``response_format`` and
``max_output_tokens`` is ``max_completion_tokens``. So the endpoint translates the request
(:func:`chat_request`), runs it through exactly the chat path (template, tools, grammar,
reasoning parser, admission, the engine), and translates the answer back: a ``Response``
object (:func:`response_body`) or, streamed, the Responses event sequence
(:class:`EventStream`, from the chat chunks). What differs is state: with ``store`` (the
default) the server keeps each response and the conversation that led to it
(:class:`ResponseStore`), so a client continues a conversation by sending only
``previous_response_id`` and the new input, and ``GET /v1/responses/{id}`` reads one back.
The prefix cache makes that continuation cheap: the next turn's prompt starts with the
previous turn's tokens, which are cached. ``background: true`` runs the response apart from
the HTTP request that asked for it (:class:`Run`): polled with ``GET``, followed from any event
with ``GET ?stream=true&starting_after=N``, stopped with ``POST .../cancel``.

Why translate rather than implement the endpoint beside chat: every chat feature (tools,
structured outputs, reasoning, documents' cache fields, admission, disconnect handling) then
behaves identically on both endpoints, and is tested once. The cost is a JSON round trip of
each streamed chunk inside the server, small beside a decode step.

Pure Python, no torch.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterable, AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from radixkv.server.errors import APIError

#: Responses kept for ``previous_response_id`` (``radixkv serve --responses-store-size``).
DEFAULT_STORE_SIZE = 1024

#: Chat request field -> the Responses field a 400 names (the rest keep their names).
_PARAMS = {"messages": "input", "max_completion_tokens": "max_output_tokens",
           "response_format": "text", "max_tokens": "max_output_tokens"}


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def response_param(chat_param: str | None) -> str | None:
    """The Responses field a chat request's field came from (for a 400's ``param``)."""
    if chat_param is None:
        return None
    head = chat_param.split(".")[0]
    return _PARAMS.get(head, head)


# ---------------------------------------------------------------------------- the request

def _text(content: Any, where: str) -> str:
    """An input message's text: a string, or a list of text parts (``input_text``,
    ``output_text``; images and files are a 400)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where}: content must be a string or a list of parts",
                       param="input")
    out = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text") and isinstance(part.get("text"), str):
            out.append(part["text"])
        else:
            raise APIError(400, f"{where}: only text parts are supported (input_text, "
                           f"output_text), got {kind!r}", param="input",
                           code="unsupported_parameter")
    return "".join(out)


def input_messages(items: str | Sequence[Any]) -> list[dict[str, Any]]:
    """``input`` as chat messages. A string is one user message. Items: messages (``role``
    user/assistant/system/developer, text content), ``function_call`` (joins the assistant
    message before it as a ``tool_calls`` entry, or starts one), ``function_call_output`` (a
    ``tool`` message) and ``reasoning`` (dropped: chat templates leave earlier turns' thinking
    out of the prompt). Anything else is a 400 naming ``input``."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not items:
        raise APIError(400, "input must not be empty", param="input")
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise APIError(400, f"{where} must be an object", param="input")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise APIError(400, f"{where}: role must be user, assistant, system or "
                               f"developer, got {role!r}", param="input")
            out.append({"role": role, "content": _text(item.get("content"), where)})
        elif kind == "function_call":
            call_id, name, args = item.get("call_id"), item.get("name"), item.get("arguments")
            if not all(isinstance(v, str) and v for v in (call_id, name)) or \
                    not isinstance(args, str):
                raise APIError(400, f"{where}: a function_call needs call_id, name and "
                               "arguments (a JSON string)", param="input")
            call = {"id": call_id, "type": "function",
                    "function": {"name": name, "arguments": args}}
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id, result = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str) or not call_id:
                raise APIError(400, f"{where}: a function_call_output needs the call_id it "
                               "answers", param="input")
            out.append({"role": "tool", "tool_call_id": call_id,
                        "content": _text(result, where)})
        elif kind == "reasoning":
            continue
        else:
            raise APIError(400, f"{where}: items of type {kind!r} are not supported (message, "
                           "function_call, function_call_output, reasoning)", param="input",
                           code="unsupported_parameter")
    return out


def chat_tools(tools: Sequence[Any] | None) -> list[dict[str, Any]] | None:
    """Responses' flat function tools as chat ``tools`` (other tool types are a 400)."""
    if tools is None:
        return None
    out = []
    for t in tools:
        if not isinstance(t, dict) or t.get("type") != "function":
            kind = t.get("type") if isinstance(t, dict) else type(t).__name__
            raise APIError(400, f"only function tools are supported, got {kind!r}",
                           param="tools", code="unsupported_parameter")
        fn = {k: t[k] for k in ("name", "description", "parameters", "strict") if k in t}
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(choice: Any) -> Any:
    """``tool_choice``: the strings as they are, ``{"type": "function", "name": n}`` as chat's
    named form; hosted-tool and ``allowed_tools`` choices are a 400."""
    if choice is None or isinstance(choice, str):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and \
            isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise APIError(400, f"tool_choice {choice!r:.80} is not supported (none, auto, required or "
                   "a function by name)", param="tool_choice", code="unsupported_parameter")


def response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """``text.format`` as chat's ``response_format`` (``text``: none)."""
    if not text:
        return None
    if text.get("verbosity") not in (None, "medium"):
        raise APIError(400, "text.verbosity is not supported", param="text",
                       code="unsupported_parameter")
    fmt = text.get("format")
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema":
        schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": schema}
    raise APIError(400, f"text.format type {fmt.get('type')!r} is not supported (text, "
                   "json_object, json_schema)", param="text")


def chat_request(req: Any, history: Sequence[dict[str, Any]]) -> tuple[dict[str, Any],
                                                                        list[dict[str, Any]]]:
    """The chat request body for a ``ResponsesRequest`` continuing ``history`` (the messages
    of the stored conversation, without its instructions: OpenAI does not carry
    ``instructions`` over to the next response). Returns it and the request's own input
    messages (what the stored conversation grows by, before the reply)."""
    new = input_messages(req.input)
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions else [])
    messages += [*history, *new]
    body: dict[str, Any] = {"model": req.model or "", "messages": messages,
                            "stream": req.stream, **req.passthrough()}
    if req.stream:
        body["stream_options"] = {"include_usage": True}
    if req.include:   # message.output_text.logprobs (the only value the model lets through)
        body["logprobs"] = True
        body["top_logprobs"] = req.top_logprobs or 0
    elif req.top_logprobs:
        raise APIError(400, "top_logprobs needs include: [\"message.output_text.logprobs\"]",
                       param="top_logprobs")
    if req.reasoning_effort() is not None:
        body["reasoning_effort"] = req.reasoning_effort()
    for key, value in (("max_completion_tokens", req.max_output_tokens),
                       ("temperature", req.temperature), ("top_p", req.top_p),
                       ("tools", chat_tools(req.tools)),
                       ("tool_choice", chat_tool_choice(req.tool_choice)),
                       ("parallel_tool_calls", req.parallel_tool_calls),
                       ("response_format", response_format(req.text))):
        if value is not None:
            body[key] = value
    return body, new


def turn_starts(messages: Sequence[dict[str, Any]]) -> list[int]:
    """Where each turn of a conversation starts: its user messages (a turn is a user message
    and the replies, calls and results after it)."""
    return [i for i, m in enumerate(messages) if m["role"] == "user"]


def without_turns(messages: Sequence[dict[str, Any]], starts: Sequence[int], k: int
                  ) -> list[dict[str, Any]]:
    """``messages`` without its first ``k`` turns (``truncation: "auto"``); the system and
    developer messages among them stay, in order: they are instructions, not history."""
    if k == 0:
        return list(messages)
    cut = starts[k]
    return [m for m in messages[:cut] if m["role"] in ("system", "developer")] + \
        list(messages[cut:])


# ---------------------------------------------------------------------------- the answer

def usage(chat_usage: dict[str, Any] | None) -> dict[str, Any] | None:
    """Chat's usage in the Responses shape; ``cached_tokens`` is the prompt tokens served
    from the cache (radixkv's own figures stay under ``radixkv``)."""
    if chat_usage is None:
        return None
    out = {"input_tokens": chat_usage["prompt_tokens"],
           "input_tokens_details": {"cached_tokens": chat_usage.get(
               "prompt_tokens_details", {}).get("cached_tokens", 0)},
           "output_tokens": chat_usage["completion_tokens"],
           "output_tokens_details": {"reasoning_tokens": 0},
           "total_tokens": chat_usage["total_tokens"]}
    if "radixkv" in chat_usage:
        out["radixkv"] = chat_usage["radixkv"]
    return out


def message_item(text: str, item_id: str | None = None, status: str = "completed",
                 logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """A message item; ``logprobs``: its text tokens' (chat's ``logprobs.content`` entries:
    ``token``, ``logprob``, ``bytes``, ``top_logprobs``, the shape Responses uses too)."""
    return {"type": "message", "id": item_id or new_id("msg"), "status": status,
            "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [],
                         "logprobs": logprobs or []}]}


def reasoning_item(text: str, item_id: str | None = None, status: str = "completed"
                   ) -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id or new_id("rs"), "status": status, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}


def call_item(call: dict[str, Any], item_id: str | None = None, status: str = "completed"
              ) -> dict[str, Any]:
    return {"type": "function_call", "id": item_id or new_id("fc"), "call_id": call["id"],
            "name": call["function"]["name"], "arguments": call["function"]["arguments"],
            "status": status}


def output_items(message: dict[str, Any], logprobs: dict[str, Any] | None = None
                 ) -> list[dict[str, Any]]:
    """A chat reply (``choices[0].message``, and its ``logprobs``) as output items: its
    reasoning, its text, its function calls, in that order (a reply that is only calls has no
    message item)."""
    items = []
    if message.get("reasoning"):
        items.append(reasoning_item(message["reasoning"]))
    calls = message.get("tool_calls") or []
    if message.get("content") or not calls:
        items.append(message_item(message.get("content") or "",
                                  logprobs=(logprobs or {}).get("content")))
    items.extend(call_item(c) for c in calls)
    return items


def assistant_message(items: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The output items as the chat message the stored conversation continues with."""
    text = "".join(p["text"] for it in items if it["type"] == "message"
                   for p in it["content"])
    calls = [{"id": it["call_id"], "type": "function",
              "function": {"name": it["name"], "arguments": it["arguments"]}}
             for it in items if it["type"] == "function_call"]
    msg: dict[str, Any] = {"role": "assistant", "content": text or (None if calls else "")}
    if calls:
        msg["tool_calls"] = calls
    return msg


def response_body(rid: str, req: Any, model: str, created: int, output: list[dict[str, Any]],
                  usage_: dict[str, Any] | None, finish: str | None,
                  status: str | None = None, error: dict[str, Any] | None = None
                  ) -> dict[str, Any]:
    """A ``Response`` object. ``finish``: the chat finish reason (``length`` makes it
    ``incomplete`` with reason ``max_output_tokens``); ``status`` overrides (in_progress,
    failed, queued, cancelled)."""
    if status is None:
        status = "incomplete" if finish == "length" else "completed"
    fmt = (req.text or {}).get("format") or {"type": "text"}
    return {
        "id": rid, "object": "response", "created_at": created, "status": status,
        "error": error,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete"
        else None,
        "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
        "model": model, "output": output,
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": req.previous_response_id,
        "reasoning": {"effort": req.reasoning_effort(), "summary": None}, "store": req.store,
        "temperature": req.temperature if req.temperature is not None else 1.0,
        "text": {"format": fmt}, "tool_choice": req.tool_choice or "auto",
        "tools": req.tools or [], "top_p": req.top_p if req.top_p is not None else 1.0,
        "truncation": req.truncation or "disabled", "usage": usage_,
        "user": (req.model_extra or {}).get("user"), "metadata": req.metadata or {},
        "background": bool(req.background), "max_tool_calls": req.max_tool_calls,
        "conversation": _conversation_ref(req.conversation),
    }


def _conversation_ref(value: Any) -> dict[str, str] | None:
    """A response's ``conversation`` field: ``{"id": id}`` of the one it ran in, or None."""
    cid = value.get("id") if isinstance(value, dict) else value
    return {"id": cid} if isinstance(cid, str) and cid else None


# ---------------------------------------------------------------------------- streaming

def _sse(event: dict[str, Any]) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event, separators=(',', ':'))}\n\n"


def _chat_events(chunk: str) -> list[Any]:
    """The JSON payloads in chat SSE text (``[DONE]`` as the string)."""
    out: list[Any] = []
    for block in chunk.split("\n\n"):
        for line in block.split("\n"):
            if line.startswith("data: "):
                data = line[6:]
                out.append(data if data == "[DONE]" else json.loads(data))
    return out


class EventStream:
    """Turns one chat request's SSE chunks into the Responses event sequence:
    ``response.created``, ``response.in_progress``; per output item ``output_item.added``,
    its content part, its deltas (``reasoning_text``, ``output_text``,
    ``function_call_arguments``), their ``.done`` events and ``output_item.done``; then
    ``response.completed`` (or ``response.incomplete`` at ``max_output_tokens``), every event
    numbered (``sequence_number``). An error the chat stream reports (a replica that died)
    becomes an ``error`` event and ``response.failed``. ``on_done(response)`` runs once the
    response completed (to store it). ``queued`` (a background response): it starts
    ``response.created`` (status ``queued``) and ``response.queued``, and is
    ``response.in_progress`` from the engine's first output on. ``final``: the response of
    the terminal event sent (completed, incomplete or failed), None before."""

    def __init__(self, rid: str, req: Any, model: str, on_done: Any = None,
                 queued: bool = False) -> None:
        self.rid, self.req, self.model, self.on_done = rid, req, model, on_done
        self.created = int(time.time())
        self.seq = 0
        self.output: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None   # the item whose deltas are flowing
        self.finish: str | None = None
        self.usage: dict[str, Any] | None = None
        self.status = "queued" if queued else "in_progress"
        self.final: dict[str, Any] | None = None

    def event(self, kind: str, **fields: Any) -> str:
        """One more event of this response (numbered after the last), as SSE text."""
        return self._event(kind, **fields)

    def snapshot(self, status: str | None = None) -> dict[str, Any]:
        """The response as it stands (``status``, default its own): the items so far, the
        one being written with its text up to now."""
        items = []
        for it in self.output:
            if it is not self.open:
                items.append({k: v for k, v in it.items() if k not in ("_text", "_lps")})
            elif it["type"] == "message":
                items.append(message_item(it["_text"], it["id"], "in_progress",
                                          it.get("_lps")))
            elif it["type"] == "reasoning":
                items.append(reasoning_item(it["_text"], it["id"], "in_progress"))
            else:
                items.append({**{k: v for k, v in it.items() if k != "_text"},
                              "arguments": it["_text"]})
        return response_body(self.rid, self.req, self.model, self.created, items,
                             usage(self.usage), self.finish, status or self.status)

    def _event(self, kind: str, **fields: Any) -> str:
        ev = {"type": kind, **fields, "sequence_number": self.seq}
        self.seq += 1
        return _sse(ev)

    def _body(self, status: str | None = None, error: dict[str, Any] | None = None
              ) -> dict[str, Any]:
        return response_body(self.rid, self.req, self.model, self.created, list(self.output),
                             usage(self.usage), self.finish, status, error)

    def _where(self) -> dict[str, Any]:
        assert self.open is not None
        return {"item_id": self.open["id"], "output_index": len(self.output) - 1}

    def _start(self, item: dict[str, Any], part: dict[str, Any] | None) -> list[str]:
        out = self._close()
        self.output.append(item)
        self.open = item
        out.append(self._event("response.output_item.added", output_index=len(self.output) - 1,
                               item=item))
        if part is not None:
            out.append(self._event("response.content_part.added", **self._where(),
                                   content_index=0, part=part))
        return out

    def close_open(self) -> None:
        """End the item being written without its ``.done`` events (a run that stopped
        before its terminal event: the item stays as far as it got, ``incomplete``)."""
        it = self.open
        if it is None:
            return
        if it["type"] == "message":
            done = message_item(it["_text"], it["id"], "incomplete", it.get("_lps"))
        elif it["type"] == "reasoning":
            done = reasoning_item(it["_text"], it["id"], "incomplete")
        else:
            done = {**{k: v for k, v in it.items() if k != "_text"},
                    "arguments": it["_text"], "status": "incomplete"}
        self.output[-1] = done
        self.open = None

    def _close(self) -> list[str]:
        """Finish the open item: its text's ``.done``, its part's, the item's."""
        item, out = self.open, list[str]()
        if item is None:
            return out
        where = self._where()
        if item["type"] == "function_call":
            args = item["_text"]
            out.append(self._event("response.function_call_arguments.done", **where,
                                   arguments=args, name=item["name"]))
            done = {k: v for k, v in item.items() if k != "_text"}
            done.update(arguments=args, status="completed")
            self.output[-1] = done
            out.append(self._event("response.output_item.done",
                                   output_index=where["output_index"], item=done))
        elif item["type"] in ("message", "reasoning"):
            text, lps = item["_text"], item.get("_lps") or []
            kind = "output_text" if item["type"] == "message" else "reasoning_text"
            out.append(self._event(f"response.{kind}.done", **where, content_index=0,
                                   text=text, **({"logprobs": lps} if kind == "output_text"
                                                 else {})))
            done = message_item(text, item["id"], logprobs=lps) if item["type"] == "message" \
                else reasoning_item(text, item["id"])
            out.append(self._event("response.content_part.done", **where, content_index=0,
                                   part=done["content"][0]))
            self.output[-1] = done
            out.append(self._event("response.output_item.done",
                                   output_index=where["output_index"], item=done))
        self.open = None
        return out

    def _text(self, kind: str, delta: str, lps: list[dict[str, Any]] | None = None
              ) -> list[str]:
        out: list[str] = []
        if self.open is None or self.open["type"] != kind:
            empty = (message_item if kind == "message" else reasoning_item)(
                "", status="in_progress")
            part = empty["content"][0]
            empty["content"] = []
            out = self._start(empty, part)
            empty["_text"] = ""   # after the added event: kept out of what is sent
        assert self.open is not None
        self.open["_text"] += delta
        name = "output_text" if kind == "message" else "reasoning_text"
        if kind == "message":
            self.open.setdefault("_lps", []).extend(lps or ())
        out.append(self._event(f"response.{name}.delta", **self._where(), content_index=0,
                               delta=delta, **({"logprobs": lps or []} if kind == "message"
                                               else {})))
        return out

    def _call(self, delta: dict[str, Any]) -> list[str]:
        """A chat ``tool_calls`` delta: the first of a call (it has the ``id``) starts a
        ``function_call`` item; its arguments, in that delta or the ones after, are
        ``function_call_arguments.delta`` events; the item ends when the next item starts or
        the response does (:meth:`_close`)."""
        out: list[str] = []
        fn = delta.get("function") or {}
        if delta.get("id"):
            item = call_item({"id": delta["id"], "function": {
                "name": fn.get("name", ""), "arguments": ""}}, status="in_progress")
            out = self._start(item, None)
            item["_text"] = ""   # after the added event: kept out of what is sent
        piece = fn.get("arguments") or ""
        if piece and self.open is not None and self.open["type"] == "function_call":
            self.open["_text"] += piece
            out.append(self._event("response.function_call_arguments.delta", **self._where(),
                                   delta=piece))
        return out

    def _items(self) -> list[dict[str, Any]]:
        return [{k: v for k, v in it.items() if k not in ("_text", "_lps")}
                for it in self.output]

    async def adapt(self, chat: AsyncIterable[Any]) -> AsyncIterator[str]:
        """The Responses events of the chat SSE stream ``chat`` (closed when this ends)."""
        try:
            body = self._body(self.status)
            yield self._event("response.created", response=body)
            yield self._event(f"response.{self.status}", response=body)
            async for chunk in chat:
                text = chunk.decode() if isinstance(chunk, bytes) else chunk
                if self.status == "queued":   # the engine has begun answering
                    self.status = "in_progress"
                    yield self._event("response.in_progress", response=self._body(self.status))
                for data in _chat_events(text):
                    if data == "[DONE]":
                        for e in self._close():
                            yield e
                        self.output = self._items()
                        final = self._body()
                        kind = "response.incomplete" if final["status"] == "incomplete" \
                            else "response.completed"
                        self.final = final
                        if self.on_done is not None:
                            self.on_done(final)
                        yield self._event(kind, response=final)
                        return
                    if "error" in data:
                        err = data["error"]
                        yield self._event("error", code=err.get("code"),
                                          message=err.get("message"), param=err.get("param"))
                        self.output = self._items()
                        self.final = self._body("failed", {
                            "code": err.get("code") or "server_error",
                            "message": err.get("message")})
                        yield self._event("response.failed", response=self.final)
                        return
                    if data.get("usage"):
                        self.usage = data["usage"]
                    for choice in data.get("choices") or ():
                        delta = choice.get("delta") or {}
                        if delta.get("reasoning"):
                            for e in self._text("reasoning", delta["reasoning"]):
                                yield e
                        if delta.get("content"):
                            lps = (choice.get("logprobs") or {}).get("content")
                            for e in self._text("message", delta["content"], lps):
                                yield e
                        for call in delta.get("tool_calls") or ():
                            for e in self._call(call):
                                yield e
                        if choice.get("finish_reason"):
                            self.finish = choice["finish_reason"]
        finally:
            aclose = getattr(chat, "aclose", None)
            if aclose is not None:
                await aclose()


# ---------------------------------------------------------------------------- background

class Run:
    """A background response (``background: true``) being generated apart from any HTTP
    request: ``task`` drives the chat stream through ``stream`` (:class:`EventStream`) and
    pushes each event here. Readers poll :meth:`response` or follow the events from any
    sequence number (:meth:`follow`), kept when the response was created with ``stream``
    (``events`` None otherwise: nobody can ask for them). Event-loop thread only."""

    def __init__(self, stream: EventStream, keep_events: bool) -> None:
        self.stream = stream
        self.events: list[str] | None = [] if keep_events else None
        self.task: asyncio.Task[None] | None = None
        self.done = False
        self.cancelling = False   # :meth:`cancel` asked: the run ends as ``cancelled``
        self._wake = asyncio.Event()
        self._finished = asyncio.Event()

    def push(self, event: str) -> None:
        if self.events is not None:
            self.events.append(event)
        self._notify()

    def finish(self) -> None:
        """The run ended and its final response is stored (called once, by the task's done
        callback)."""
        self.done = True
        self._finished.set()
        self._notify()

    def _notify(self) -> None:
        # each waiter holds the event it waits on; a fresh one for the next wait
        self._wake.set()
        self._wake = asyncio.Event()

    def response(self) -> dict[str, Any]:
        """The response as it stands while running (queued or in progress, the output so
        far)."""
        return self.stream.snapshot()

    async def follow(self, after: int = -1) -> AsyncIterator[str]:
        """The events numbered after ``after`` (events are numbered from 0 and kept in
        order, so that is their index), then each new one as it comes, until the run ends."""
        assert self.events is not None, "a run created without stream keeps no events"
        i = after + 1
        while True:
            wake = self._wake
            while i < len(self.events):
                yield self.events[i]
                i += 1
            if self.done:
                return
            await wake.wait()

    async def cancel(self) -> None:
        """Stop generating and return once the cancelled response is stored: the task is
        cancelled, which closes the chat stream (aborting the engine request, its blocks
        freed within a step), and its ending records the response as ``cancelled``
        (:meth:`ended`, :meth:`finish`)."""
        if self.done or self.task is None:
            return
        self.cancelling = True
        self.task.cancel()
        await self._finished.wait()

    def ended(self) -> dict[str, Any]:
        """The final response once the stream stopped: the terminal event's, else
        ``cancelled`` (with an ``error`` event, code ``response_cancelled``, for followers:
        OpenAI's stream has no cancelled event) or ``failed`` (a task that died)."""
        s = self.stream
        if s.final is not None:
            return s.final
        s.close_open()
        if self.cancelling:
            self.push(s.event("error", code="response_cancelled", param=None,
                              message="the response was cancelled"))
            return s.snapshot("cancelled")
        error = {"code": "server_error", "message": "the response stopped unexpectedly"}
        self.push(s.event("error", code=error["code"], message=error["message"], param=None))
        failed = {**s.snapshot("failed"), "error": error}
        self.push(s.event("response.failed", response=failed))
        return failed


# ---------------------------------------------------------------------------- the store

@dataclass
class Stored:
    """One stored response: its owner (API key), the conversation it ended (chat messages,
    without instructions, ending with its reply when it has one), how many of those messages
    were its input (``inputs``; None: all but the last), its ``Response`` object, its
    :class:`Run` when it was a background one, and ``size``: the messages' size as
    ``--max-conversation-bytes`` counts it (kept as the chain grows, so continuing one checks
    the bound without re-reading its history)."""

    tenant: str
    messages: tuple[dict[str, Any], ...]
    response: dict[str, Any]
    inputs: int | None = None
    run: Run | None = field(default=None, compare=False)
    size: int = 0

    def current(self) -> dict[str, Any]:
        """The response now: a running background one's as it stands, else the stored one."""
        if self.run is not None and not self.run.done:
            return self.run.response()
        return self.response

    def input_items(self) -> list[dict[str, Any]]:
        """The items the response answered (the conversation before its reply) in the
        Responses shape, each with an id stable for this response (pagination)."""
        n = len(self.messages) - 1 if self.inputs is None else self.inputs
        return message_items(self.messages[:n], self.response["id"])


def message_items(messages: Sequence[dict[str, Any]], rid: str) -> list[dict[str, Any]]:
    """Chat messages as Responses input items (the inverse of :func:`input_messages`):
    messages with ``input_text`` parts (``output_text`` for the assistant's), a
    ``function_call`` per tool call and a ``function_call_output`` per tool message. Ids:
    ``<kind>_<tag>_<position>``, the tag being ``rid``'s part after its prefix (a response's,
    or a fresh one for items a conversation gains)."""
    tag = rid.split("_", 1)[-1]
    out: list[dict[str, Any]] = []

    def add(kind: str, item: dict[str, Any]) -> None:
        out.append({"id": f"{kind}_{tag}_{len(out)}", **item})

    for m in messages:
        if m["role"] == "tool":
            add("fco", {"type": "function_call_output", "call_id": m.get("tool_call_id"),
                        "output": m.get("content") or "", "status": "completed"})
            continue
        if m.get("content") or not m.get("tool_calls"):
            part = "output_text" if m["role"] == "assistant" else "input_text"
            add("msg", {"type": "message", "role": m["role"], "status": "completed",
                        "content": [{"type": part, "text": m.get("content") or "",
                                     **({"annotations": []} if part == "output_text"
                                        else {})}]})
        for c in m.get("tool_calls") or ():
            add("fc", {"type": "function_call", "call_id": c["id"],
                       "name": c["function"]["name"], "arguments": c["function"]["arguments"],
                       "status": "completed"})
    return out


def page(items: Sequence[dict[str, Any]], after: str | None, limit: int, order: str
         ) -> dict[str, Any]:
    """One page of ``items`` (oldest first) as an OpenAI list: ``order`` asc or desc,
    starting after the item whose id is ``after``, at most ``limit``."""
    ordered = list(items) if order == "asc" else list(reversed(items))
    start = 0
    if after is not None:
        ids = [it["id"] for it in ordered]
        if after not in ids:
            raise APIError(400, f"no item with id {after!r} in this list", param="after")
        start = ids.index(after) + 1
    data = ordered[start:start + limit]
    return {"object": "list", "data": data,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
            "has_more": start + limit < len(ordered)}


class ResponseStore:
    """The responses kept (``store: true``) for ``previous_response_id`` and ``GET``, the
    least recently used dropped past ``capacity`` (0: none kept; running background ones are
    kept until they end, :meth:`put`). Each is visible only to the
    API key that created it. A conversation's messages are shared between the responses of
    its turns (each holds references, not copies). Event-loop thread only."""

    def __init__(self, capacity: int = DEFAULT_STORE_SIZE) -> None:
        if capacity < 0:
            raise ValueError(f"the response store's capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self._items: OrderedDict[str, Stored] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def put(self, rid: str, entry: Stored) -> None:
        """Keep ``entry`` (now the most recently used), dropping the least recently used past
        ``capacity``, except background responses still running: their clients poll or
        cancel them by id, so they stay until they end (at most the server's admission
        window of them, since each holds an admitted request)."""
        if self.capacity == 0:
            return
        self._items[rid] = entry
        self._items.move_to_end(rid)
        if len(self._items) <= self.capacity:
            return
        over = len(self._items) - self.capacity
        for old in [k for k, e in self._items.items()
                    if e.run is None or e.run.done][:over]:
            del self._items[old]

    def get(self, tenant: str, rid: str, touch: bool = True) -> Stored | None:
        """The response ``rid`` if ``tenant`` stored it (``touch``: now the most recently
        used)."""
        entry = self._items.get(rid)
        if entry is None or entry.tenant != tenant:
            return None
        if touch:
            self._items.move_to_end(rid)
        return entry

    def delete(self, tenant: str, rid: str) -> bool:
        if self.get(tenant, rid) is None:
            return False
        del self._items[rid]
        return True


def not_found(rid: str, param: str | None = None) -> APIError:
    return APIError(404 if param is None else 400,
                    f"no stored response with id {rid!r} (store: false, dropped from the "
                    "store, or another API key's)", param=param, code="response_not_found")


__all__ = ["DEFAULT_STORE_SIZE", "EventStream", "ResponseStore", "Run", "Stored",
           "assistant_message", "chat_request", "chat_tool_choice", "chat_tools",
           "input_messages", "message_items", "new_id", "not_found", "output_items", "page",
           "response_body", "response_format", "response_param", "turn_starts", "usage",
           "without_turns"]
