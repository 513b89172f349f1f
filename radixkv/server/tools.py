"""OpenAI tool calls for chat templates that declare tools, in the ``<tool_call>`` format.

A chat template that takes ``tools`` (it refers to the variable) renders their definitions into
the prompt; the model answers with calls written the way its template teaches. radixkv reads
the format of Hermes, Qwen2/2.5/3 and SmolLM3 templates, the common one::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

* ``tool_choice: "auto"``: the model may call; calls found in its text become OpenAI
  ``tool_calls`` (``arguments`` as a JSON string) and the rest is ``content``.
* ``"required"`` / ``{"type": "function", "function": {"name": ...}}``: the output is
  constrained by a grammar (:meth:`radixkv.engine.grammar.GrammarCompiler.tool_call`) to one call
  of one of the tools (of the named one), its arguments valid against the tool's JSON schema.
* ``"none"``: the tools are not rendered and nothing is parsed.

A template that does not declare tools, or writes calls in another format, gets a 400 naming
``tools`` rather than tool definitions silently dropped.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from radixkv.server.errors import APIError

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(CALL_OPEN) + r"\s*(.*?)\s*" + re.escape(CALL_CLOSE), re.S)


def check_template(template: str | None) -> None:
    """Raise a 400 naming ``tools`` unless ``template`` declares tools in the ``<tool_call>``
    format."""
    if not template or "tools" not in template:
        raise APIError(400, "this model's chat template does not declare tools, so the model "
                       "was not trained to call them", param="tools",
                       code="unsupported_parameter")
    if CALL_OPEN not in template:
        raise APIError(400, "this model's chat template writes tool calls in a format radixkv "
                       f"does not parse (it reads {CALL_OPEN} ... {CALL_CLOSE}: Hermes, Qwen, "
                       "SmolLM3)", param="tools", code="unsupported_parameter")


def parse(text: str, names: set[str]) -> tuple[str | None, list[dict[str, Any]]]:
    """``(content, tool_calls)`` from a reply: each well-formed ``<tool_call>`` whose JSON
    names one of ``names`` becomes an OpenAI tool call; anything else stays in the content
    (``None`` when nothing is left)."""
    calls: list[dict[str, Any]] = []
    kept: list[str] = []
    pos = 0
    for m in _CALL.finditer(text):
        try:
            obj = json.loads(m.group(1))
        except ValueError:
            continue
        if not isinstance(obj, dict) or obj.get("name") not in names:
            continue
        args = obj.get("arguments", obj.get("parameters", {}))
        kept.append(text[pos:m.start()])
        pos = m.end()
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": obj["name"],
                                   "arguments": args if isinstance(args, str)
                                   else json.dumps(args, ensure_ascii=False)}})
    kept.append(text[pos:])
    content = "".join(kept).strip()
    return (content or None), calls


def template_messages(messages: list[Any]) -> list[dict[str, Any]]:
    """The request's messages as the template reads them, tool calls and results included
    (an assistant call's ``arguments`` JSON string is given to the template as an object, as
    transformers' templates expect)."""
    out = []
    for m in messages:
        d: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role,
                             "content": m.text()}
        if m.tool_calls:
            calls = []
            for c in m.tool_calls:
                fn = dict(c.get("function") or {})
                if isinstance(fn.get("arguments"), str):
                    try:
                        fn["arguments"] = json.loads(fn["arguments"])
                    except ValueError:
                        raise APIError(400, "a tool call's arguments are not JSON",
                                       param="messages") from None
                calls.append({**c, "function": fn})
            d["tool_calls"] = calls
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            d["name"] = m.name
        out.append(d)
    return out


__all__ = ["CALL_CLOSE", "CALL_OPEN", "check_template", "parse", "template_messages"]
