"""OpenAI tool calls through the real server, with a chat template that declares tools.

The embedded model's own template declares none (tests/server/test_openai_server.py checks the
400), so this module's server takes a Hermes-style template with ``--chat-template`` (the format
Qwen2.5, Hermes and SmolLM3 templates use). The 135M model was not trained on tools, so the
tests rely on what does not depend on its skill: ``required`` and named choices are enforced by
a grammar, and parsing is checked on its own.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from radixkv.server.tools import parse  # noqa: E402
from tests.server.test_openai_server import MODEL, Server, _free_port, running_server  # noqa: E402

TEMPLATE = """{%- if tools %}<|im_start|>system
You may call these functions:
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
Call one as <tool_call>{"name": ..., "arguments": ...}</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant
{%- for tc in message.tool_calls %}
<tool_call>
{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"type": "string", "maxLength": 10}},
        "required": ["zone"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Any:
    path = tmp_path_factory.mktemp("tpl") / "tools.jinja"
    path.write_text(TEMPLATE)
    with running_server(["--chat-template", str(path), "--device-blocks", "256", "--threads",
                         "1", "--device", "cpu", "--dtype", "float32"]) as server:
        yield server


def _chat(srv: Server, **kw: Any) -> Any:
    client = openai.OpenAI(base_url=srv.base + "/v1", api_key="x", max_retries=0, timeout=300)
    return client.chat.completions.create(model=MODEL, **{"temperature": 0, "max_tokens": 60,
                                                          **kw})


@pytest.mark.model
def test_a_named_tool_choice_is_one_valid_call_of_that_tool(srv: Server) -> None:
    r = _chat(srv, messages=ASK, tools=[WEATHER, TIME],
              tool_choice={"type": "function", "function": {"name": "get_weather"}})
    c = r.choices[0]
    assert c.finish_reason == "tool_calls", c
    (call,) = c.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    args = json.loads(call.function.arguments)
    assert set(args) == {"city", "unit"} and args["unit"] in ("celsius", "fahrenheit")


@pytest.mark.model
def test_required_calls_one_of_the_tools_and_the_result_goes_back(srv: Server) -> None:
    r = _chat(srv, messages=ASK, tools=[WEATHER, TIME], tool_choice="required", n=2,
              temperature=1.0, seed=5)
    for c in r.choices:
        (call,) = c.message.tool_calls
        assert call.function.name in ("get_weather", "get_time")
        json.loads(call.function.arguments)
    call = r.choices[0].message.tool_calls[0]
    follow = ASK + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                    {"role": "tool", "tool_call_id": call.id, "content": "18 C, sunny"}]
    r2 = _chat(srv, messages=follow, tools=[WEATHER, TIME], tool_choice="none", max_tokens=8)
    assert r2.choices[0].message.tool_calls is None
    # the call and its result were rendered into the prompt (tools not offered: "none")
    alone = _chat(srv, messages=ASK, tools=[WEATHER, TIME], tool_choice="none", max_tokens=1)
    assert r2.usage.prompt_tokens >= alone.usage.prompt_tokens + 20


@pytest.mark.model
def test_auto_and_none(srv: Server) -> None:
    auto = _chat(srv, messages=ASK, tools=[WEATHER], tool_choice="auto", max_tokens=40)
    c = auto.choices[0]
    assert c.message.tool_calls or c.message.content   # the model's own choice, well-formed
    none = _chat(srv, messages=ASK, tools=[WEATHER], tool_choice="none", max_tokens=4)
    assert none.choices[0].message.tool_calls is None
    assert none.usage.prompt_tokens < auto.usage.prompt_tokens   # tools not rendered
    status, err = srv.raw("POST", "/v1/chat/completions", {
        "model": MODEL, "messages": ASK, "tools": [WEATHER], "stream": True}, key=None)
    assert status == 400 and err["error"]["param"] == "stream"
    status, err = srv.raw("POST", "/v1/chat/completions", {
        "model": MODEL, "messages": ASK, "tools": [WEATHER],
        "tool_choice": {"type": "function", "function": {"name": "nope"}}}, key=None)
    assert status == 400 and err["error"]["param"] == "tool_choice"


def test_parse_takes_well_formed_calls_of_known_tools_and_leaves_the_rest() -> None:
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}'
            '\n</tool_call>\n<tool_call>{"name": "unknown", "arguments": {}}</tool_call>'
            '<tool_call>{not json}</tool_call>')
    content, calls = parse(text, {"get_weather"})
    assert [c["function"]["name"] for c in calls] == ["get_weather"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo"}
    assert content.startswith("Let me check.") and "unknown" in content and "not json" in content
    assert parse("plain answer", {"f"}) == ("plain answer", [])


def test_the_template_file_must_exist() -> None:
    proc = subprocess.run([sys.executable, "-m", "radixkv.server.cli", "--chat-template",
                           str(Path("/nonexistent/t.jinja")), "--port", str(_free_port())],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--chat-template" in proc.stderr
