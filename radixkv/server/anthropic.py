"""Anthropic's Messages API (``POST /v1/messages``, ``POST /v1/messages/count_tokens``) as a
view of the chat pipeline, as vLLM serves it beside the OpenAI routes.

Clients written for Anthropic (its SDKs, agents configured with a base URL) send a ``system``
prompt, ``messages`` whose content is a string or a list of blocks (``text``, the model's
``tool_use`` with an ``input`` object, the client's ``tool_result`` for it, ``thinking``),
``tools`` with an ``input_schema``, ``tool_choice`` (``auto``, ``any``, ``tool``, ``none``),
``stop_sequences`` and ``thinking``. As the Responses API does (:mod:`radixkv.server.responses`),
the endpoint translates the request into a chat request (:func:`chat_body`), runs exactly the
chat path (template, tools and their formats, grammars, the reasoning parser, admission, cache
breakpoints, the engine) and translates the answer back: a ``message`` (:func:`message_body`)
or, streamed, Anthropic's event sequence (:class:`MessageStream`: ``message_start``, per
content block ``content_block_start`` / ``_delta`` / ``_stop``, ``message_delta`` with the stop
reason and usage, ``message_stop``). Every chat feature then behaves the same on both APIs.

What maps to what:

* ``system`` (a string or text blocks) is the system message, without the block Claude Code
  adds that starts with ``x-anthropic-billing-header`` (a per-request hash that would keep
  every request from sharing a cached prefix; vLLM drops it too); a user message's
  ``tool_result`` blocks are ``tool`` messages (in order, before the message's text), an
  assistant's ``tool_use`` blocks its ``tool_calls`` (``input`` as the JSON arguments), its
  ``thinking`` blocks are dropped (chat templates leave earlier turns' thinking out);
  ``cache_control`` on a block (or on the system prompt) is a cache breakpoint on its message
  (docs/serve.md, "Cache breakpoints"); on a tool definition it is accepted and has nothing to
  do (every prefix is cached anyway). Images, documents and server tools are a 400.
* A last message from the assistant (text, no tool use) is Anthropic's *prefill*: the reply
  continues it (``continue_final_message``) and holds only what the model added.
* ``tool_choice`` ``any`` is ``required``, ``tool`` a named call, and
  ``disable_parallel_tool_use`` is ``parallel_tool_calls: false``.
* ``thinking: {"type": "enabled", "budget_tokens": N}`` is a thinking budget of N tokens
  (``thinking_token_budget``: it needs ``--reasoning-parser``), ``{"type": "disabled"}`` is
  ``reasoning_effort: "none"``, ``adaptive`` sets nothing (as vLLM maps them);
  ``output_config``'s ``effort`` is ``reasoning_effort`` and its ``json_schema`` format is
  ``response_format`` (structured output); a top-level ``cache_control`` is a breakpoint on
  the last message. The answer's thinking is a ``thinking`` block (with an empty
  ``signature``: radixkv signs nothing). ``temperature``, ``top_p`` and ``top_k`` (which
  Anthropic's newest SDKs no longer send) are taken when given.
* ``stop_reason``: ``max_tokens`` at the limit, ``tool_use`` when the reply made calls,
  ``stop_sequence`` (with ``stop_sequence`` set) when one of the request's ended it, else
  ``end_turn``; a request that cannot fit the KV pool is ``model_context_window_exceeded``.
* ``usage``: ``cache_read_input_tokens`` is what came from the cache,
  ``cache_creation_input_tokens`` what the prefill added to it (radixkv caches every prefix it
  computes, so most uncached tokens are written), ``input_tokens`` the rest, so the three add
  up to the prompt, as Anthropic defines them.
* Errors are Anthropic's body (``{"type": "error", "error": {"type": ..., "message": ...}}``,
  the type from the status); an error after a stream began is an ``error`` event.

The API key may come as ``x-api-key`` (Anthropic's documented header, what its older SDKs and
its curl examples send) as well as ``Authorization: Bearer`` (what its newest SDK sends). The
``anthropic-version`` and ``anthropic-beta`` headers are not read. Pure Python, no torch.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterable, AsyncIterator, Sequence
from typing import Any, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool

from radixkv.server.errors import APIError

#: vLLM's extensions of a Messages request: chat request fields, passed on when given.
PASSTHROUGH = ("cache_salt", "chat_template_kwargs", "vllm_xargs", "watermarking",
               "kv_transfer_params", "ec_transfer_params", "mm_payload", "return_mm_kwargs")

#: Chat request field -> the Messages field a 400 names.
_PARAMS = {"max_completion_tokens": "max_tokens", "stop": "stop_sequences",
           "reasoning_effort": "thinking", "thinking_token_budget": "thinking",
           "parallel_tool_calls": "tool_choice", "chat_template_kwargs": "thinking",
           "response_format": "output_config"}

#: HTTP status -> Anthropic's error type.
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                429: "rate_limit_error", 503: "overloaded_error", 529: "overloaded_error"}


#: OpenAI's error type (an error event of the chat stream) -> Anthropic's.
_STREAM_ERRORS = {"invalid_request_error": "invalid_request_error",
                  "service_unavailable": "overloaded_error",
                  "rate_limit_exceeded": "rate_limit_error"}


class CountTokensRequest(BaseModel):
    """``POST /v1/messages/count_tokens``: the prompt part of a Messages request."""

    model_config = ConfigDict(extra="ignore")   # metadata, service_tier, container, ...

    #: Anthropic requires it; like the chat endpoint, radixkv serves its model without it
    model: Optional[str] = None
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: Optional[Union[str, list[dict[str, Any]]]] = None
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Optional[dict[str, Any]] = None
    thinking: Optional[dict[str, Any]] = None
    #: ``{"effort": ..., "format": {"type": "json_schema", "schema": ...}}``
    output_config: Optional[dict[str, Any]] = None
    #: a breakpoint on the last message (Anthropic's automatic caching)
    cache_control: Optional[dict[str, Any]] = None
    #: vLLM's extensions of this API, handed to the chat request as they are
    #: (:data:`PASSTHROUGH`): the cache namespace, template variables, and fields the chat
    #: request refuses (so that they are refused here too, not ignored)
    cache_salt: Optional[str] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    vllm_xargs: Optional[Any] = None
    watermarking: Optional[Any] = None
    kv_transfer_params: Optional[Any] = None
    ec_transfer_params: Optional[Any] = None
    mm_payload: Optional[Any] = None
    return_mm_kwargs: Optional[Any] = None


class MessagesRequest(CountTokensRequest):
    """``POST /v1/messages``."""

    max_tokens: int = Field(ge=1)
    stop_sequences: Optional[list[str]] = None
    stream: StrictBool = False
    temperature: Optional[float] = Field(default=None, ge=0.0, le=1.0)
    top_p: Optional[float] = Field(default=None, gt=0.0, le=1.0)
    top_k: Optional[int] = Field(default=None, ge=0)


def new_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


def chat_param(param: str | None) -> str | None:
    """The Messages field a chat request's field came from (for an error's message)."""
    if param is None:
        return None
    head = param.split(".")[0]
    return _PARAMS.get(head, head)


# ---------------------------------------------------------------------------- the request

def _refuse(what: str, param: str) -> APIError:
    return APIError(400, what, param=param, code="unsupported_parameter")


#: How a system block of Claude Code's starts that carries a hash that changes with every
#: request: left out, as vLLM leaves it out, or no request would share even its system prompt
#: with the one before (the prefix cache would find nothing).
BILLING_HEADER = "x-anthropic-billing-header"


def _text_of(content: Any, where: str, sep: str = "", skip: str | None = None) -> str:
    """The text of a string or a list of ``text`` blocks, joined with ``sep`` (a tool
    result's blocks with a newline, as vLLM joins them); blocks whose text starts with
    ``skip`` are left out."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where} must be a string or a list of text blocks", param=where)
    parts = []
    for block in content:
        if not isinstance(block, dict) or block.get("type") != "text" \
                or not isinstance(block.get("text"), str):
            raise _refuse(f"{where}: only text blocks are supported here, got "
                          f"{block.get('type') if isinstance(block, dict) else block!r}", where)
        if skip is None or not block["text"].startswith(skip):
            parts.append(block["text"])
    return sep.join(parts)


def _mark(blocks: Sequence[Any]) -> dict[str, Any] | None:
    """The last ``cache_control`` among ``blocks`` (a breakpoint on their message)."""
    mark = None
    for block in blocks:
        if isinstance(block, dict) and block.get("cache_control") is not None:
            mark = block["cache_control"]
    return mark


def _message(m: Any, i: int) -> list[dict[str, Any]]:
    """The chat messages of Messages entry ``m`` (the ``i``-th)."""
    where = f"messages.{i}"
    if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
        raise APIError(400, f"{where}: each message needs role 'user' or 'assistant' and "
                       "content", param="messages")
    role, content = m["role"], m.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise APIError(400, f"{where}.content must be a string or a list of blocks",
                       param="messages")
    out: list[dict[str, Any]] = []
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    mark = None
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
            mark = block.get("cache_control") or mark
        elif kind == "tool_result" and role == "user":
            if texts:
                raise APIError(400, f"{where}: tool_result blocks come before the message's "
                               "text", param="messages")
            result = {"role": "tool", "tool_call_id": str(block.get("tool_use_id") or ""),
                      "content": _text_of(block.get("content", ""),
                                          f"messages.{i}.content.{j}.content", "\n")}
            if block.get("cache_control") is not None:
                result["cache_control"] = block["cache_control"]
            out.append(result)
        elif kind == "tool_use" and role == "assistant":
            if not isinstance(block.get("name"), str) or not isinstance(block.get("input"),
                                                                        dict):
                raise APIError(400, f"{where}.content.{j}: a tool_use block needs a name and "
                               "an input object", param="messages")
            calls.append({"id": str(block.get("id") or ""), "type": "function",
                          "function": {"name": block["name"],
                                       "arguments": json.dumps(block["input"])}})
            mark = block.get("cache_control") or mark
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            continue   # earlier turns' thinking: templates leave it out
        else:
            raise _refuse(f"{where}.content.{j}: {kind!r} blocks are not supported in a "
                          f"{role} message (text, tool_use, tool_result and thinking are)",
                          "messages")
    if texts or calls or not out:
        msg: dict[str, Any] = {"role": role, "content": "".join(texts)}
        if calls:
            msg["tool_calls"] = calls
            if not texts:
                msg["content"] = None
        if mark is not None:
            msg["cache_control"] = mark
        out.append(msg)
    return out


def _tools(tools: Sequence[Any]) -> list[dict[str, Any]]:
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") not in (None, "custom") \
                or not isinstance(t.get("name"), str):
            kind = t.get("type") if isinstance(t, dict) else t
            raise _refuse(f"tools.{i}: only custom (client) tools with a name and an "
                          f"input_schema are supported, got {kind!r}", "tools")
        fn: dict[str, Any] = {"name": t["name"],
                              "parameters": t.get("input_schema") or {"type": "object"}}
        if t.get("description") is not None:
            fn["description"] = t["description"]
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: dict[str, Any] | None, body: dict[str, Any]) -> None:
    if choice is None:
        return
    kind = choice.get("type")
    if kind == "auto":
        body["tool_choice"] = "auto"
    elif kind == "any":
        body["tool_choice"] = "required"
    elif kind == "tool":
        body["tool_choice"] = {"type": "function", "function": {"name": choice.get("name")}}
    elif kind == "none":
        body["tool_choice"] = "none"
    else:
        raise APIError(400, f"tool_choice type must be auto, any, tool or none, got {kind!r}",
                       param="tool_choice")
    if choice.get("disable_parallel_tool_use"):
        body["parallel_tool_calls"] = False


def _output_config(config: dict[str, Any] | None, body: dict[str, Any]) -> None:
    """``output_config``: its ``effort`` is ``reasoning_effort``, its JSON-schema ``format``
    the chat's ``response_format``."""
    if config is None:
        return
    for key in config:
        if key not in ("effort", "format"):
            raise _refuse(f"output_config.{key} is not supported (effort and format are)",
                          "output_config")
    if config.get("effort") is not None:
        body["reasoning_effort"] = config["effort"]
    fmt = config.get("format")
    if fmt is not None:
        if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" \
                or not isinstance(fmt.get("schema"), dict):
            raise APIError(400, "output_config.format must be {\"type\": \"json_schema\", "
                           "\"schema\": {...}}", param="output_config")
        body["response_format"] = {"type": "json_schema", "json_schema": {
            "name": "output", "schema": fmt["schema"]}}


def _thinking(thinking: dict[str, Any] | None, body: dict[str, Any]) -> None:
    if thinking is None:
        return
    kind = thinking.get("type")
    if kind == "disabled":
        body["reasoning_effort"] = "none"   # (over output_config's effort: off is off)
    elif kind == "enabled":
        budget = thinking.get("budget_tokens")
        if type(budget) is not int or budget < 1:
            raise APIError(400, "thinking.budget_tokens must be an int >= 1",
                           param="thinking")
        body["thinking_token_budget"] = budget
    elif kind != "adaptive":   # adaptive: the model's own depth, nothing to set
        raise APIError(400, f"thinking type must be enabled, adaptive or disabled, got "
                       f"{kind!r}", param="thinking")


def chat_body(req: CountTokensRequest, model: str) -> dict[str, Any]:
    """The chat request body of a Messages (or count_tokens) request for the server's
    ``model`` (when the request names none)."""
    messages: list[dict[str, Any]] = []
    if req.system is not None:
        system: dict[str, Any] = {"role": "system", "content": _text_of(
            req.system, "system", skip=BILLING_HEADER)}
        mark = _mark(req.system) if isinstance(req.system, list) else None
        if mark is not None:
            system["cache_control"] = mark
        messages.append(system)
    for i, m in enumerate(req.messages):
        messages.extend(_message(m, i))
    if req.cache_control is not None and messages and "cache_control" not in messages[-1]:
        messages[-1]["cache_control"] = req.cache_control
    last = messages[-1] if messages else {}
    prefill = last.get("role") == "assistant" and not last.get("tool_calls") \
        and bool(last.get("content"))
    body: dict[str, Any] = {"model": req.model or model, "messages": messages}
    for key in PASSTHROUGH:
        if getattr(req, key) is not None:
            body[key] = getattr(req, key)
    if prefill:   # Anthropic's prefill: the reply continues the last assistant message
        body["add_generation_prompt"] = False
        body["continue_final_message"] = True
    if req.tools:
        body["tools"] = _tools(req.tools)
    _tool_choice(req.tool_choice, body)
    _output_config(req.output_config, body)
    _thinking(req.thinking, body)
    if isinstance(req, MessagesRequest):
        body["max_tokens"] = req.max_tokens
        for key in ("temperature", "top_p", "top_k"):
            if getattr(req, key) is not None:
                body[key] = getattr(req, key)
        if req.stop_sequences:
            body["stop"] = req.stop_sequences
        if req.stream:   # every chunk with the usage so far: message_start has the prompt's
            body["stream"] = True
            body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    return body


# ---------------------------------------------------------------------------- the answer

def usage(chat_usage: dict[str, Any] | None) -> dict[str, int]:
    """Anthropic's usage of a chat usage object: input + cache read + cache creation = the
    prompt's tokens."""
    u = chat_usage or {}
    prompt = u.get("prompt_tokens") or 0
    read = (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    written = (u.get("radixkv") or {}).get("cache_write_tokens") or 0
    written = max(0, min(written, prompt - read))
    return {"input_tokens": max(0, prompt - read - written),
            "output_tokens": u.get("completion_tokens") or 0,
            "cache_read_input_tokens": read, "cache_creation_input_tokens": written}


def stop_reason(finish: str | None, stopped_by: Any, made_calls: bool,
                stop_sequences: Sequence[str] | None) -> tuple[str | None, str | None]:
    """``(stop_reason, stop_sequence)`` of a chat choice's ``finish_reason`` and vLLM's
    ``stop_reason`` (the stop string or token that ended it)."""
    if finish == "length":
        return "max_tokens", None
    if finish == "capacity":
        return "model_context_window_exceeded", None
    if made_calls or finish == "tool_calls":
        return "tool_use", None
    if finish == "stop" and isinstance(stopped_by, str) and stopped_by in (stop_sequences
                                                                           or ()):
        return "stop_sequence", stopped_by
    if finish == "stop":
        return "end_turn", None
    return None, None


def _tool_use(call: dict[str, Any]) -> dict[str, Any]:
    fn = call.get("function") or {}
    try:
        args = json.loads(fn.get("arguments") or "{}")
    except ValueError:
        args = {}
    return {"type": "tool_use", "id": call.get("id"), "name": fn.get("name"),
            "input": args if isinstance(args, dict) else {}}


def message_body(mid: str, model: str, chat: dict[str, Any],
                 stop_sequences: Sequence[str] | None) -> dict[str, Any]:
    """The ``message`` of a non-streamed chat answer."""
    choice = chat["choices"][0]
    msg = choice.get("message") or {}
    content: list[dict[str, Any]] = []
    if msg.get("reasoning"):
        content.append({"type": "thinking", "thinking": msg["reasoning"], "signature": ""})
    if msg.get("content"):
        content.append({"type": "text", "text": msg["content"]})
    calls = msg.get("tool_calls") or []
    content.extend(_tool_use(c) for c in calls)
    reason, seq = stop_reason(choice.get("finish_reason"), choice.get("stop_reason"),
                              bool(calls), stop_sequences)
    return {"id": mid, "type": "message", "role": "assistant", "model": model,
            "content": content, "stop_reason": reason, "stop_sequence": seq,
            "usage": usage(chat.get("usage"))}


def error_body(status: int, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": _ERROR_TYPES.get(status, "api_error"),
                                       "message": message}}


def _sse(kind: str, data: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, separators=(',', ':'))}" \
           "\n\n"


def _chat_events(text: str) -> list[Any]:
    out: list[Any] = []
    for line in text.split("\n"):
        if line.startswith("data: "):
            data = line[6:]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def _starts(data: Any, chat_usage: dict[str, Any] | None) -> bool:
    """Whether a chat stream's chunk is where the Messages stream starts: the usage has the
    prompt's cache split (the first token is in), or the chunk carries more than the reply's
    role (a chat stream without the split: start before its first content)."""
    if (chat_usage or {}).get("prompt_tokens_details") is not None:
        return True
    for choice in data.get("choices") or ():
        delta = choice.get("delta") or {}
        if choice.get("finish_reason") or any(k != "role" and v for k, v in delta.items()):
            return True
    return False


class MessageStream:
    """Turns one chat request's SSE chunks into Anthropic's stream: ``message_start``; per
    content block (``thinking`` from the reasoning deltas, ``text`` from the content,
    ``tool_use`` per call) ``content_block_start``, its deltas (``thinking_delta``,
    ``text_delta``, ``input_json_delta``) and ``content_block_stop`` when the next block starts
    or the reply ends; ``message_delta`` with the stop reason and the usage; ``message_stop``.
    An error the chat stream reports becomes an ``error`` event."""

    def __init__(self, mid: str, model: str, stop_sequences: Sequence[str] | None) -> None:
        self.mid, self.model, self.stops = mid, model, stop_sequences
        self.index = -1
        self.open: str | None = None     # the type of the block being written
        self.finish: str | None = None
        self.stopped_by: Any = None
        self.calls = 0
        self.usage: dict[str, Any] | None = None

    def _start(self, block: dict[str, Any]) -> list[str]:
        out = self._close()
        self.index += 1
        self.open = block["type"]
        out.append(_sse("content_block_start", {"index": self.index, "content_block": block}))
        return out

    def _close(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        return [_sse("content_block_stop", {"index": self.index})]

    def _delta(self, kind: str, delta: dict[str, Any]) -> str:
        return _sse("content_block_delta", {"index": self.index, "delta": {"type": kind,
                                                                            **delta}})

    def _choice(self, choice: dict[str, Any]) -> list[str]:
        out: list[str] = []
        delta = choice.get("delta") or {}
        if delta.get("reasoning"):
            if self.open != "thinking":
                out += self._start({"type": "thinking", "thinking": "", "signature": ""})
            out.append(self._delta("thinking_delta", {"thinking": delta["reasoning"]}))
        if delta.get("content"):
            if self.open != "text":
                out += self._start({"type": "text", "text": ""})
            out.append(self._delta("text_delta", {"text": delta["content"]}))
        for call in delta.get("tool_calls") or ():
            fn = call.get("function") or {}
            if call.get("id"):
                self.calls += 1
                out += self._start({"type": "tool_use", "id": call["id"],
                                    "name": fn.get("name", ""), "input": {}})
            if fn.get("arguments") and self.open == "tool_use":
                out.append(self._delta("input_json_delta", {"partial_json": fn["arguments"]}))
        if choice.get("finish_reason"):
            self.finish = choice["finish_reason"]
            self.stopped_by = choice.get("stop_reason")
        return out

    async def adapt(self, chat: AsyncIterable[Any]) -> AsyncIterator[str]:
        """The Messages events of the chat SSE stream ``chat`` (closed when this ends)."""
        started = False
        try:
            async for chunk in chat:
                text = chunk.decode() if isinstance(chunk, bytes) else chunk
                for data in _chat_events(text):
                    if data != "[DONE]" and "error" not in data and data.get("usage"):
                        self.usage = data["usage"]
                    if not started and "error" not in data and (
                            data == "[DONE]" or _starts(data, self.usage)):
                        # at the first token (the chat stream's usage then has the prompt's
                        # cache split, as Anthropic's message_start does), or before the end
                        started = True
                        yield _sse("message_start", {"message": {
                            "id": self.mid, "type": "message", "role": "assistant",
                            "model": self.model, "content": [], "stop_reason": None,
                            "stop_sequence": None, "usage": usage(self.usage)}})
                    if data == "[DONE]":
                        for e in self._close():
                            yield e
                        reason, seq = stop_reason(self.finish, self.stopped_by,
                                                  self.calls > 0, self.stops)
                        yield _sse("message_delta", {
                            "delta": {"stop_reason": reason, "stop_sequence": seq},
                            "usage": usage(self.usage)})
                        yield _sse("message_stop", {})
                        return
                    if "error" in data:   # (OpenAI's error body: its type says the kind)
                        err = data["error"]
                        yield _sse("error", {"error": {
                            "type": _STREAM_ERRORS.get(err.get("type"), "api_error"),
                            "message": err.get("message") or ""}})
                        return
                    for choice in data.get("choices") or ():
                        for e in self._choice(choice):
                            yield e
        finally:
            aclose = getattr(chat, "aclose", None)
            if aclose is not None:
                await aclose()


__all__ = ["CountTokensRequest", "MessagesRequest", "MessageStream", "chat_body",
           "chat_param", "error_body", "message_body", "new_id", "stop_reason", "usage"]
