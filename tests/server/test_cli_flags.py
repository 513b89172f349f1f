"""``radixkv serve`` flags reach the configs they name (``server/cli.py``'s ``configs``), and a bad
value is a usage error (exit 2) before any model loads."""

from __future__ import annotations

import pytest

from radixkv.config import EngineConfig
from radixkv.server.cli import build_parser, configs, main


def test_scheduling_flags_reach_the_engine_config() -> None:
    p = build_parser()
    _, ec = configs(p.parse_args(["--scheduling-policy", "fcfs", "--scheduling-max-wait", "0.5"]))
    assert ec.scheduling_policy == "fcfs" and ec.scheduling_max_wait_s == 0.5
    _, ec = configs(p.parse_args(["--scheduling-policy", "lpm"]))
    assert ec.scheduling_policy == "lpm"
    assert ec.scheduling_max_wait_s == EngineConfig().scheduling_max_wait_s
    _, ec = configs(p.parse_args([]))   # no flag: EngineConfig's defaults
    assert ec.scheduling_policy == EngineConfig().scheduling_policy
    assert ec.prefill_priority_steps == EngineConfig().prefill_priority_steps == 4
    _, ec = configs(p.parse_args(["--prefill-priority-steps", "0"]))
    assert ec.prefill_priority_steps == 0
    assert (ec.long_prefill_token_threshold, ec.long_prefill_token_threshold_adaptive) == (
        0, False)
    _, ec = configs(p.parse_args(["--long-prefill-token-threshold", "256",
                                  "--long-prefill-token-threshold-adaptive"]))
    assert (ec.long_prefill_token_threshold, ec.long_prefill_token_threshold_adaptive) == (
        256, True)


def test_vllms_human_readable_sizes_and_pool_aliases() -> None:
    """vLLM's int flags take '32k' (decimal) and '32K' (binary), --max-model-len also 'auto' /
    -1; --num-gpu-blocks-override and --kv-cache-memory-bytes size the pool as radixkv's own
    flags do."""
    from radixkv.server.cli import human_readable_int

    assert [human_readable_int(v) for v in ("1k", "1K", "25.6k", "4.35k", "2M", "3g", "77")] \
        == [1000, 1024, 25600, 4350, 2 * 2**20, 3 * 10**9, 77]
    p = build_parser()
    a = p.parse_args(["--max-model-len", "32k", "--max-num-batched-tokens", "8K",
                      "--num-gpu-blocks-override", "100"])
    cc, ec = configs(a)
    assert (ec.max_model_len, ec.max_num_batched_tokens, cc.num_device_blocks) == (
        32000, 8192, 100)
    for auto in ("auto", "-1", "AUTO"):
        assert configs(p.parse_args(["--max-model-len", auto]))[1].max_model_len is None
    cc, _ = configs(p.parse_args(["--kv-cache-memory-bytes", "64M"]))
    assert cc.device_memory == 64 * 2**20
    assert configs(p.parse_args(["--device-memory", "64MiB"]))[0].device_memory == "64MiB"


def test_a_vllm_config_file_and_underscored_flags(tmp_path) -> None:
    """vLLM's --config FILE.yaml (keys with - or _, true/false, lists, mappings as JSON; the
    command line wins) and option names with underscores."""
    cfg = tmp_path / "serve.yaml"
    cfg.write_text("max_model_len: 4096\nmax-num-seqs: 8\nenforce-eager: true\n"
                   "enable-prefix-caching: false\n"
                   "served-model-name: [main, alias]\n"
                   "default-chat-template-kwargs: {enable_thinking: false}\nport: 9001\n")
    p = build_parser()
    a = p.parse_args(["--config", str(cfg), "--max_num_seqs", "4", "--port=9002"])
    assert (a.max_model_len, a.max_num_seqs, a.enforce_eager, a.port) == (4096, 4, True, 9002)
    assert a.served_model_name == ["main", "alias"]
    assert a.default_chat_template_kwargs == '{"enable_thinking": false}'
    assert p.parse_args([f"--config={cfg}"]).max_num_seqs == 8
    assert p.parse_args(["some/model", "--config", str(cfg)]).model_tag == "some/model"


@pytest.mark.parametrize("text, words", [
    ("- a\n- b\n", "must map flag names"),
    ("max-model-len: [\n", "is not YAML"),
    ("max-model-len: lots\n", "invalid int value"),
    ("no-such-flag: 1\n", "unrecognized arguments: --no-such-flag"),
])
def test_a_bad_config_file_is_a_usage_error(tmp_path, capsys, text: str, words: str) -> None:
    cfg = tmp_path / "serve.yaml"
    cfg.write_text(text)
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["--config", str(cfg)])
    assert info.value.code == 2 and words in capsys.readouterr().err
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--config", str(tmp_path / "serve.json")])


def test_hf_token_reaches_huggingface_hub(monkeypatch) -> None:
    """vLLM's --hf-token TOKEN: huggingface_hub's calls use it (HF_TOKEN, read at each call);
    the bare flag keeps the stored login."""
    from huggingface_hub import get_token

    from radixkv.server.cli import check_flags

    monkeypatch.setenv("HF_TOKEN", "")    # (recorded: what check_flags sets is undone after)
    monkeypatch.delenv("HF_TOKEN")
    monkeypatch.setenv("HF_TOKEN_PATH", "/nonexistent/token")   # no stored login here
    check_flags(build_parser().parse_args(["--hf-token"]))
    assert get_token() is None
    check_flags(build_parser().parse_args(["--hf-token", "hf_test123"]))
    assert get_token() == "hf_test123"


def test_enforce_eager_turns_cuda_graphs_off() -> None:
    """vLLM's --enforce-eager: graphs off; without it EngineConfig decides (on where possible)."""
    p = build_parser()
    assert configs(p.parse_args(["--enforce-eager"]))[1].cuda_graphs is False
    assert configs(p.parse_args([]))[1].cuda_graphs is None


def test_no_pack_weights_reaches_the_engine_config() -> None:
    p = build_parser()
    assert configs(p.parse_args(["--no-pack-weights"]))[1].pack_weights is False
    assert configs(p.parse_args([]))[1].pack_weights is None


def test_a_vllm_tool_calling_command_line_parses() -> None:
    """The flags vLLM's tool-calling recipes pass are taken (most are no-ops that name
    radixkv's behaviour); a tool-call parser radixkv does not read is a usage error."""
    p = build_parser()
    args = p.parse_args(["--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                         "--enable-chunked-prefill", "--disable-log-requests",
                         "--disable-log-stats", "--trust-remote-code",
                         "--uvicorn-log-level", "info"])
    assert args.log_level == "info" and args.tool_call_parser == "hermes"
    from radixkv.server.tools import PARSERS

    action = next(a for a in p._actions if a.dest == "tool_call_parser")
    assert sorted(action.choices) == sorted(PARSERS)   # the flag takes every format read
    for name in ("llama3_json", "llama4_json", "mistral", "qwen3_coder", "pythonic"):
        assert p.parse_args(["--tool-call-parser", name]).tool_call_parser == name
    with pytest.raises(SystemExit) as info:
        p.parse_args(["--tool-call-parser", "granite"])
    assert info.value.code == 2


@pytest.mark.parametrize("argv, words", [
    (["--scheduling-policy", "sjf"], "invalid choice"),
    (["--scheduling-max-wait", "-1"], "max_wait_s"),
    (["--scheduling-max-wait", "soon"], "invalid float"),
    (["--prefill-priority-steps", "-1"], "prefill_priority_steps"),
    (["--prefill-priority-steps", "2.5"], "invalid int"),
    (["--long-prefill-token-threshold", "-1"], "long_prefill_token_threshold"),
    (["--max-model-len", "2.5K"], "did you mean 2.5k"),
    (["--logprobs-mode", "processed_logits"], "raw_logprobs only"),
    (["--tokenizer-mode", "mistral"], "auto or hf"),
    (["--hf-token", " "], "--hf-token is empty"),
    (["--max-num-batched-tokens", "lots"], "invalid int value"),
    (["--kv-cache-memory-bytes", "1G", "--device-memory", "1GiB"], "give one"),
    (["--responses-store-size", "-1"], "--responses-store-size"),
    (["--max-conversation-bytes", "0"], "--max-conversation-bytes"),
    (["--stream-interval", "0"], "--stream-interval"),
    (["--structured-outputs-max-whitespace", "0"], "--structured-outputs-max-whitespace"),
    (["--structured-outputs-max-whitespace", "lots"], "integer >= 1 or 'none'"),
    (["--default-chat-template-kwargs", "{nope"], "is not JSON"),
    (["--default-chat-template-kwargs", "[1]"], "must be a JSON object"),
    (["--default-chat-template-kwargs", '{"tools": []}'], "is set by the server"),
    (["--default-chat-template-kwargs", '{"a b": 1}'], "not a template variable name"),
    (["--response-role", " "], "--response-role"),
    (["--allowed-origins", '"*"'], "--allowed-origins must be a JSON list"),
    (["--allowed-methods", "GET"], "--allowed-methods is not JSON"),
    (["--root-path", "llm"], "--root-path must start with /"),
    (["--sse-keep-alive-interval", "-1"], "--sse-keep-alive-interval"),
    (["--ssl-keyfile", "k.pem"], "go together"),
    (["--enable-ssl-refresh"], "--enable-ssl-refresh reloads"),
    (["--enable-log-outputs"], "needs --enable-log-requests"),
    (["--middleware", "nodot"], "MODULE.NAME"),
    (["--chat-template-content-format", "openai"], "invalid choice"),
    (["--served-model-name", "a", " "], "names must not be empty"),
    (["--shutdown-timeout", "-1"], "--shutdown-timeout must be >= 0"),
    (["--uds", "/tmp/radixkv-test.sock", "--replicas", "2"], "--uds serves one server"),
    (["--ssl-ciphers", "ECDHE", "--replicas", "2"], "--ssl-ciphers is a single server's"),
    (["--ssl-cert-reqs", "2", "--replicas", "2"], "--ssl-cert-reqs is a single server's"),
    (["--enable-log-requests", "--max-log-len", "-1"], "--max-log-len"),
    (["--ssl-keyfile", "/nonexistent/k.pem", "--ssl-certfile", "/nonexistent/c.pem"],
     "no such file"),
])
def test_a_bad_scheduling_value_is_a_usage_error(argv: list[str], words: str, capsys,
                                                 monkeypatch) -> None:
    monkeypatch.setenv("OMP_WAIT_POLICY", "")   # main() must not set it for this process
    try:
        rc = main(argv)
    except SystemExit as exc:   # argparse's own usage error
        rc = exc.code
    assert rc == 2
    assert words in capsys.readouterr().err


def test_the_json_whitespace_bound_reaches_the_server() -> None:
    """``--structured-outputs-max-whitespace``: an integer, or ``none`` for unbounded; the
    server's grammar compiler is built with it (server/app.py's ``_compiler``)."""
    from radixkv.engine.grammar import DEFAULT_MAX_WHITESPACE

    p = build_parser()
    assert p.parse_args([]).structured_outputs_max_whitespace == DEFAULT_MAX_WHITESPACE
    assert p.parse_args(["--structured-outputs-max-whitespace", "none"]
                        ).structured_outputs_max_whitespace is None
    assert p.parse_args(["--structured-outputs-max-whitespace", "4"]
                        ).structured_outputs_max_whitespace == 4


def test_serve_runs_uvicorn_on_asyncios_event_loop(monkeypatch) -> None:
    """Not uvloop, whatever is installed: uvloop re-takes the GIL in every libuv callback and
    loses each hand-over to the engine thread on a busy machine (app.UVICORN_LOOP)."""
    import uvicorn

    from radixkv.server import cpu

    seen = {}

    class Server:   # built, not run: no socket, no model
        def __init__(self, config: uvicorn.Config) -> None:
            seen["loop"], self.should_exit = config.loop, False

        def run(self) -> None:
            seen["ran"] = True

    monkeypatch.setenv("OMP_WAIT_POLICY", "")   # main() must not set it for this process
    monkeypatch.setattr(uvicorn, "Server", Server)
    monkeypatch.setattr(cpu, "apply_threads", lambda n: "threads untouched by this test")
    assert main(["--port", "0"]) == 0
    assert seen == {"loop": "asyncio", "ran": True}


def test_a_vllm_frontend_command_line_parses_into_the_options() -> None:
    """vllm serve's frontend flags, as a deployment script passes them, reach FrontendOptions
    (their effects: tests/server/test_frontend_options.py)."""
    from radixkv.server.cli import check_flags
    from radixkv.server.frontend import FrontendOptions

    args = build_parser().parse_args([
        "--enable-request-id-headers", "--default-chat-template-kwargs",
        '{"enable_thinking": false}', "--response-role", "bot",
        "--return-tokens-as-token-ids", "--enable-force-include-usage",
        "--enable-server-load-tracking", "--disable-fastapi-docs",
        "--disable-uvicorn-access-log", "--enable-prompt-tokens-details",
        "--trust-request-chat-template", "--sse-keep-alive-interval", "15",
        "--allowed-origins", '["https://a.example"]', "--allowed-methods", '["POST"]',
        "--allow-credentials", "--root-path", "/llm", "--enable-log-requests",
        "--enable-log-outputs", "--max-log-len", "100", "--middleware", "json.JSONDecoder",
        "--exclude-tools-when-tool-choice-none", "--chat-template-content-format", "string",
        "--disable-access-log-for-endpoints", "/health",
        "--served-model-name", "main-name", "alias-a", "alias-b"])
    check_flags(args)
    assert args.served_model_name == "main-name"
    o = FrontendOptions.from_args(args)
    assert o == FrontendOptions(
        request_id_headers=True, default_chat_template_kwargs={"enable_thinking": False},
        response_role="bot", return_tokens_as_token_ids=True, force_include_usage=True,
        load_tracking=True, docs=False, trust_request_chat_template=True,
        sse_keep_alive_interval=15.0, allowed_origins=("https://a.example",),
        allowed_methods=("POST",), allowed_headers=("*",), allow_credentials=True,
        root_path="/llm", log_requests=True, log_outputs=True, max_log_len=100,
        middleware=("json.JSONDecoder",), model_aliases=("alias-a", "alias-b"))


def test_json_flags_nested_too_deep_are_usage_errors() -> None:
    """A JSON flag nested deeper than Python's ``json`` goes (RecursionError) is the flag's
    error, as any value that is not JSON, not a traceback."""
    from radixkv.errors import ConfigError
    from radixkv.server.frontend import parse_list

    deep = "[" * 100_000 + "]" * 100_000
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["--policy-options", deep])
    assert info.value.code == 2
    with pytest.raises(ConfigError, match="--allowed-origins is not JSON"):
        parse_list(deep, "--allowed-origins")
