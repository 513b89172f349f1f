"""``radixkv serve``: start the OpenAI-compatible server (see docs/serve.md for every flag).

The HTTP socket opens first and ``/health`` answers 503 while the model loads in a background
thread (progress on stderr every few seconds); then 200, and the endpoints serve.
"""

from __future__ import annotations

import argparse
import decimal
import os
import re
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from radixkv.engine.grammar import DEFAULT_MAX_WHITESPACE


def _whitespace_bound(text: str) -> int | None:
    """``--structured-outputs-max-whitespace``: an integer >= 1, or ``none`` (unbounded)."""
    if text.strip().lower() == "none":
        return None
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1 or 'none', got {text!r}"
                                         ) from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1 or 'none', got {value}")
    return value


def _json_object(text: str) -> dict[str, Any]:
    """A JSON object flag value (argparse reports the error with the flag's name)."""
    import json

    try:
        value = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


class VLLMArgumentParser(argparse.ArgumentParser):
    """argparse with ``vllm serve``'s command-line conveniences, so a vLLM deployment's command
    works unchanged: ``--config FILE.yaml`` (its keys as flags, the command line winning) and
    underscores in option names (``--max_model_len`` is ``--max-model-len``)."""

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        argv = sys.argv[1:] if args is None else list(args)
        try:
            argv = vllm_argv(argv, lambda flag: flag in self._option_string_actions)
        except ValueError as exc:
            self.error(str(exc))
        return super().parse_known_args(argv, namespace)


def vllm_argv(argv: list[str], has_flag: Callable[[str], bool]) -> list[str]:
    """``argv`` as vLLM's parser reads it: the flags of ``--config``'s YAML file first (so the
    command line's own win), and option names with ``-`` for ``_``. The file's keys are flag
    names; ``true`` is the flag, ``false`` its ``--no-`` form where there is one (else
    nothing), a list the flag with each item, a mapping its JSON, anything else its text, as
    vLLM flattens them (``has_flag``: whether the parser defines a flag). ValueError for a file
    that cannot be read or is not a YAML mapping."""
    out = list(argv)
    where = [i for i, a in enumerate(out) if a == "--config" or a.startswith("--config=")]
    if len(where) > 1:
        raise ValueError("--config is given more than once")
    if where:
        i = where[0]
        if out[i] == "--config":
            if i + 1 >= len(out):
                raise ValueError("--config needs a YAML file")
            path, rest = out[i + 1], out[:i] + out[i + 2:]
        else:
            path, rest = out[i].split("=", 1)[1], out[:i] + out[i + 1:]
        out = config_file_args(path, has_flag) + rest
    named = []
    for a in out:
        if a.startswith("--") and len(a) > 2:
            key, eq, value = a.partition("=")
            a = "--" + key[2:].replace("_", "-") + eq + value
        named.append(a)
    return named


def config_file_args(path: str, has_flag: Callable[[str], bool]) -> list[str]:
    """The flags a vLLM ``--config`` YAML file stands for (see :func:`vllm_argv`)."""
    import json

    import yaml

    if not path.endswith((".yaml", ".yml")):
        raise ValueError(f"--config {path!r}: a YAML file (.yaml or .yml), as vLLM's")
    try:
        with open(path, encoding="utf-8") as fh:
            config = yaml.safe_load(fh)
    except OSError as exc:
        raise ValueError(f"--config {path!r}: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise ValueError(f"--config {path!r} is not YAML: {exc}") from None
    if config is None:
        return []
    if not isinstance(config, dict):
        raise ValueError(f"--config {path!r}: the file must map flag names to values")
    args: list[str] = []
    for key, value in config.items():
        flag = "--" + str(key).replace("_", "-")
        if isinstance(value, bool):
            if value:
                args.append(flag)
            elif has_flag("--no-" + flag[2:]):
                args.append("--no-" + flag[2:])
        elif isinstance(value, list):
            if value:
                args += [flag, *(str(v) for v in value)]
        elif isinstance(value, dict):
            args += [flag, json.dumps(value)]
        elif value is not None:
            args += [flag, str(value)]
    return args


def build_parser() -> argparse.ArgumentParser:
    p = VLLMArgumentParser(
        prog="radixkv serve", description="OpenAI-compatible HTTP server over a radixkv engine "
        "(/v1/chat/completions, /v1/completions, /v1/models, /health, /metrics).")
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    g.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 = any free)")
    g.add_argument("--api-key", action="append", default=[], metavar="KEY",
                   help="accept this bearer key (repeatable); each key is its own cache tenant")
    g.add_argument("--api-key-file", action="append", default=[], metavar="PATH",
                   help="file with one API key per line (repeatable)")
    g.add_argument("--salt-secret", default=None, help="secret that derives each key's cache "
                   "salt (default: random per start; set it to reuse a disk cache across "
                   "restarts)")
    g.add_argument("--max-queued", type=int, default=256, metavar="N",
                   help="sequences (prompts x n) that may wait beyond a full batch; past it: "
                        "429 (default 256)")
    g.add_argument("--default-max-tokens", "--max-tokens-default", type=int, default=None,
                   metavar="N",
                   help="max_tokens when a request gives none (default: the rest of the context)")
    g.add_argument("--kv-events-endpoint", default=None, metavar="ENDPOINT",
                   help="publish the engine's KV events in vLLM's wire format on a ZMQ PUB "
                        "socket bound here, e.g. tcp://*:5557, for external KV-aware routers "
                        "(needs the events extra; single server only)")
    g.add_argument("--log-level", "--uvicorn-log-level", default="warning",
                   help="uvicorn log level (default warning; vLLM's --uvicorn-log-level too)")
    m = p.add_argument_group("model")
    m.add_argument("--model", default=None, metavar="DIR",
                   help="local model directory (default: the embedded SmolLM2-135M-Instruct)")
    m.add_argument("--gguf-file", default=None, help="GGUF file name inside --model")
    m.add_argument("--tokenizer", default=None, metavar="DIR|FILE|ID",
                   help="load the tokenizer from here instead of the model: a directory of "
                        "tokenizer files, a GGUF file or a cached hub id (vLLM's; e.g. a GGUF "
                        "model's original tokenizer)")
    m.add_argument("--revision", default=None, metavar="REV",
                   help="a hub id model's branch, tag or commit (vLLM's; default main), read "
                        "from the Hugging Face cache (downloaded only with --allow-download)")
    m.add_argument("--tokenizer-revision", default=None, metavar="REV",
                   help="the same for a hub id --tokenizer (vLLM's)")
    m.add_argument("--download-dir", default=None, metavar="DIR",
                   help="the Hugging Face cache folder hub models (and a hub id --tokenizer) "
                        "are read from, and downloaded into with --allow-download (vLLM's; "
                        "default: huggingface_hub's); a local model path ignores it")
    m.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="the name clients pass as 'model' (default: the model's name); with "
                        "several, any is accepted and the first is the one answers carry "
                        "(vLLM's)")
    m.add_argument("--device", default="auto", help="torch device (default auto)")
    m.add_argument("--dtype", default=None, help="model/KV dtype, e.g. float16 (default: "
                   "bfloat16 on a CPU with native bf16, else float32)")
    m.add_argument("--model-impl", default="auto", choices=["auto", "radixkv", "transformers"],
                   help="whose module tree holds the weights: radixkv's own for the Llama, "
                        "Mistral, Qwen2 and Qwen3 checkpoints it defines (faster start, same "
                        "logits), transformers' for the rest (auto, the default)")
    m.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: the CPUs this process may use: its "
                        "affinity mask capped by the cgroup CPU quota; idle threads poll "
                        "~20 us, then sleep: OMP_WAIT_POLICY=PASSIVE with GOMP_SPINCOUNT=2000, "
                        "unless the environment sets the policy)")
    m.add_argument("--model-id", default=None, metavar="NAME",
                   help="pin the name of the model's cached blocks in every tier (default: a "
                        "fingerprint of the weights, so changed weights reuse nothing; rename "
                        "it whenever the weights change)")
    c = p.add_argument_group("cache (CacheConfig)")
    c.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    c.add_argument("--device-blocks", "--num-gpu-blocks-override", type=int, default=None,
                   help="device pool size in blocks")
    c.add_argument("--device-memory", default=None, help="device pool size, e.g. 512MiB")
    c.add_argument("--kv-cache-memory-bytes", type=human_readable_int, default=None,
                   metavar="BYTES",
                   help="vLLM's: the device pool's size in bytes, written as vLLM's flags take "
                        "it ('4G' = 4 GiB, '4g' = 4e9); the same as --device-memory")
    c.add_argument("--no-commit-kv-pool", action="store_true",
                   help="CPU: leave the device pool's pages uncommitted until blocks are first "
                        "written (resident memory grows with use) instead of writing them once "
                        "at start-up, which keeps first-touch page faults out of prefills "
                        "(~3 ms a 250-token prefill of the embedded model)")
    c.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="CUDA, no pool size given: fraction of the card's memory to use in all; "
                        "the KV pool gets what weights and a profiled forward leave (0.9)")
    c.add_argument("--host-blocks", type=int, default=0, help="host (CPU RAM) tier, blocks")
    c.add_argument("--host-memory", default=None, help="host tier size, e.g. 2GiB")
    c.add_argument("--disk-dir", default=None, help="disk tier directory")
    c.add_argument("--disk-blocks", type=int, default=0, help="disk tier size in blocks")
    c.add_argument("--disk-memory", default=None, help="disk tier size, e.g. 20GiB")
    from radixkv.config import CacheConfig

    c.add_argument("--policy", default=CacheConfig.policy,
                   help=f"eviction policy (default {CacheConfig.policy}): one of "
                        "radixkv.core.policy_registry.POLICIES (docs/eviction.md)")
    c.add_argument("--policy-options", type=_json_object, default=None, metavar="JSON",
                   help="the policy's options as a JSON object, e.g. '{\"sample\": 4}' for the "
                        "duel's sampled shadows (docs/eviction.md)")
    c.add_argument("--no-prefix-caching", "--no-enable-prefix-caching", action="store_true",
                   help="never reuse blocks across requests (the no-cache baseline)")
    c.add_argument("--tail-blocks", type=int, default=None, metavar="N",
                   help="partial last blocks of finished requests kept for the next turn that "
                        "continues them (default: an eighth of the device blocks; 0: none; "
                        "docs/architecture.md, 'Partial tails')")
    c.add_argument("--write-through", action="append", default=[], choices=["host", "disk"],
                   help="tier that gets a copy of every block as it is computed (repeatable)")
    c.add_argument("--kv-dtype", "--kv-cache-dtype", default="auto",
                   choices=["auto", "int8", "fp8_e4m3", "fp8"],
                   help="KV block storage: the model's dtype, or int8 / fp8_e4m3 (vLLM's fp8) "
                        "with a per-row scale (about half the bytes in every tier)")
    c.add_argument("--remote-url", default=None, metavar="URL",
                   help="remote tier shared by replicas: redis://host:port/db, rediss://, "
                        "valkey://, redis+cluster:// (default: none)")
    c.add_argument("--remote-write", default="write_back",
                   choices=["write_back", "write_through", "read_only"],
                   help="when blocks are written to the remote tier (default write_back: as "
                        "they leave the host tier)")
    c.add_argument("--remote-ttl", type=float, default=None, metavar="SECONDS",
                   help="key TTL on the remote server (default: none)")
    c.add_argument("--remote-timeout", type=float, default=1.0, metavar="SECONDS",
                   help="bound on a request's remote lookup and on every server call")
    c.add_argument("--kv-secret-file", default=None, metavar="PATH",
                   help="file holding a secret (>= 16 bytes, surrounding whitespace ignored) "
                        "that signs every KV block written to the disk and remote tiers and "
                        "verifies every read, so a value forged into a shared server is a miss; "
                        "give every replica the same one (default: $RADIXKV_KV_SECRET, else "
                        "checksums only)")
    c.add_argument("--shutdown-flush", type=float, default=5.0, metavar="SECONDS",
                   help="at a graceful shutdown (SIGTERM, Ctrl-C), spend up to this long "
                        "writing the cached blocks the remote server lacks, so the replica "
                        "that replaces this one finds them (default 5; 0: off)")
    e = p.add_argument_group("engine (EngineConfig)")
    e.add_argument("--max-num-seqs", type=int, default=32, help="live sequences per step")
    e.add_argument("--max-num-batched-tokens", type=human_readable_int, default=2048,
                   help="tokens computed per forward ('8k' as vLLM's: 8000; '8K': 8192)")
    e.add_argument("--max-model-len", type=human_readable_int_or_auto, default=None,
                   help="context limit ('32k', '32K' as vLLM's; 'auto' or -1: the model's own, "
                        "the default)")
    e.add_argument("--prefetch-requests", type=int, default=4,
                   help="waiting requests whose disk blocks are prefetched to host")
    e.add_argument("--no-async-loads", action="store_true",
                   help="wait for disk -> device promotions instead of overlapping them")
    e.add_argument("--enforce-eager", action="store_true",
                   help="CUDA: run decode eagerly instead of replaying CUDA graphs (graphs are "
                        "on by default where the model allows; docs/gpu.md)")
    e.add_argument("--no-pack-weights", action="store_true",
                   help="CPU: run linear layers on the weights as loaded (F.linear) instead of "
                        "copies packed for oneDNN: saves a second copy of the linear weights, "
                        "slower GEMMs (docs/benchmarks.md, 'Packed linears')")
    e.add_argument("--scheduling-policy", default=None, choices=["lpm", "fcfs", "priority"],
                   help="order waiting requests are admitted in: lpm (longest cached prefix "
                        "first, with an age limit), fcfs, or priority (vLLM's: by each "
                        "request's priority field or X-Vllm-Priority header, lower first, and "
                        "the least urgent running request preempted first) (default: "
                        "EngineConfig's, lpm)")
    e.add_argument("--scheduling-max-wait", type=float, default=None, metavar="SECONDS",
                   help="lpm's age limit: a request waiting this long is admitted next "
                        "(default: EngineConfig's, 2)")
    e.add_argument("--prefill-priority-steps", type=int, default=None, metavar="N",
                   help="steps in a row that newly admitted prefills may run without the "
                        "running decodes (shorter time to first token under concurrency); 0: "
                        "every step carries every decode, as vLLM (default: EngineConfig's, 4)")
    e.add_argument("--long-prefill-token-threshold", type=int, default=None, metavar="N",
                   help="vLLM's: in a step shared with other requests, one request computes "
                        "at most N prompt tokens (a long prompt cannot hold short turns back); "
                        "alone it is not cut; 0: no cap (default: EngineConfig's, 0)")
    e.add_argument("--long-prefill-token-threshold-adaptive", action="store_true",
                   default=None,
                   help="vLLM's: the cap is at least --max-num-batched-tokens divided by the "
                        "requests running and waiting")
    e.add_argument("--blend-ratio", type=float, default=None, metavar="SHARE",
                   help="share of RAG document tokens recomputed when a request's "
                        "documents are blended (docs/rag.md; default: EngineConfig's, 0.15)")
    v = p.add_argument_group("vLLM compatibility and limits (docs/serve.md has vLLM's flags)")
    v.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="the model, as vllm serve takes it (same as --model)")
    v.add_argument("--enable-prefix-caching", action="store_true",
                   help="accepted for vLLM compatibility: prefix caching is on by default")
    v.add_argument("--generation-config", default="auto", metavar="auto|vllm|FOLDER",
                   help="auto (vLLM's default): the model's generation_config.json sets the "
                        "temperature, top_p, top_k, min_p, repetition_penalty and max_tokens "
                        "of requests that leave them unset; vllm: OpenAI's defaults; a folder: "
                        "its generation_config.json instead of the model's")
    v.add_argument("--override-generation-config", default=None, metavar="JSON",
                   help="sampling defaults over the model's generation config, as vLLM's: "
                        "e.g. '{\"temperature\": 0.5, \"max_new_tokens\": 256}' (keys: "
                        "temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens)")
    v.add_argument("--seed", type=int, default=None,
                   help="seed the sampling of requests that give no seed, in arrival order, "
                        "so a replay samples the same tokens after a restart (vLLM's; "
                        "default: fresh entropy per request)")
    v.add_argument("--max-logprobs", type=int, default=20, metavar="K",
                   help="most log-probabilities per token a request may ask for (logprobs, "
                        "top_logprobs, prompt_logprobs), as vLLM's; 0..20 (default 20)")
    v.add_argument("--stream-interval", type=int, default=1, metavar="N",
                   help="tokens per streamed chunk after the first (vLLM's; a request's "
                        "stream_interval may raise it): fewer, larger chunks for clients that "
                        "do not need every token at once (default 1)")
    v.add_argument("--responses-store-size", type=int, default=1024, metavar="N",
                   help="responses the Responses API keeps (store: true) for "
                        "previous_response_id and GET /v1/responses/{id}, and conversations "
                        "(/v1/conversations) it keeps, each the least recently used dropped "
                        "first; 0 keeps none (default 1024)")
    v.add_argument("--max-conversation-bytes", type=int, default=None, metavar="N",
                   help="the most a stored conversation (/v1/conversations, or a chain of "
                        "previous_response_id) holds, its items as JSON: adding past it, or a "
                        "response in one at or past it, is a 400 conversation_too_large "
                        "(default 4 MiB)")
    v.add_argument("--structured-outputs-max-whitespace", type=_whitespace_bound,
                   default=DEFAULT_MAX_WHITESPACE, metavar="N|none",
                   help="whitespace characters structured JSON output (response_format, "
                        "structured_outputs json, tool calls) may have between two tokens: "
                        "stops a model padding newlines until max_tokens; 'none' unbounded, "
                        "as vLLM (default 20)")
    v.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="accepted for vLLM compatibility: tool_choice auto is on for every "
                        "chat template that declares tools")
    v.add_argument("--tokenizer-mode", default="auto", metavar="MODE",
                   help="vLLM's: auto or hf, radixkv's one mode (transformers' tokenizer, the "
                        "fast one where there is one, and the model's chat template; vLLM's "
                        "auto would take mistral_common's for Mistral models); others refused")
    v.add_argument("--logprobs-mode", default="raw_logprobs",
                   choices=("raw_logprobs", "processed_logprobs", "raw_logits",
                            "processed_logits"),
                   help="vLLM's: what logprobs report; radixkv reports raw_logprobs (the "
                        "model's log-softmax before penalties, biases, temperature and top-k/p, "
                        "vLLM's default) and refuses the others")
    v.add_argument("--config", metavar="FILE.yaml",
                   help="vLLM's: flags from a YAML file (keys are flag names, with - or _; "
                        "true is the flag, a list its values); the command line's own win")
    v.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                   help="vLLM's: send a span per request (llm_request, vLLM's attributes) to "
                        "this OTLP collector, over gRPC, or HTTP/protobuf with "
                        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf; needs the tracing "
                        "extra")
    v.add_argument("--max-num-queued-reqs", type=int, default=None, metavar="N",
                   help="vLLM's: a request that would put more than N sequences (prompts x n) "
                        "in flight is a 503, for a load balancer to retry elsewhere (default: "
                        "none; --max-queued's 429 still applies)")
    v.add_argument("--max-num-queued-tokens", type=int, default=None, metavar="N",
                   help="vLLM's: while the prompts not yet past their first token add up to "
                        "N tokens or more, a new request is a 503 (a time-to-first-token "
                        "valve; default: none)")
    # (tools.PARSERS' names; not imported here: tools needs the serve extra, and this parser
    # must work without it to say so; tests/server/test_cli_flags.py keeps the two equal)
    v.add_argument("--tool-call-parser",
                   choices=("hermes", "mistral", "llama3_json", "llama4_json", "qwen3_coder",
                            "qwen3_xml", "pythonic", "llama4_pythonic"), default=None,
                   help="the format the model writes tool calls in, for every chat template "
                        "that declares tools: hermes (<tool_call> tags: Hermes, Qwen2/2.5/3, "
                        "SmolLM3), qwen3_coder (<tool_call><function=...><parameter=...>: "
                        "Qwen3-Coder, Qwen3.5; qwen3_xml is the same), mistral ([TOOL_CALLS]: "
                        "Mistral, Mixtral, Nemo, Ministral), llama3_json (JSON objects: "
                        "Llama 3.x; llama4_json is the same) or pythonic (a Python list of "
                        "calls: Llama 3.2's pythonic template, Llama 4; llama4_pythonic is the "
                        "same); default: read from the template")
    v.add_argument("--exclude-tools-when-tool-choice-none", action="store_true",
                   help="accepted for vLLM compatibility: with tool_choice none radixkv never "
                        "renders the tools")
    v.add_argument("--chat-template-content-format", choices=("auto", "string"),
                   default="auto",
                   help="how message content reaches the template: radixkv joins text parts "
                        "into one string (vLLM's 'string', what its 'auto' picks for text "
                        "templates); vLLM's 'openai' (parts as a list) is not supported")
    v.add_argument("--enable-chunked-prefill", action="store_true",
                   help="accepted for vLLM compatibility: prefills longer than "
                        "--max-num-batched-tokens are always chunked")
    v.add_argument("--enable-log-requests", action="store_true",
                   help="log each request reaching the engine (id, sampling parameters, prompt "
                        "length; prompt ids and text at --log-level debug) on stderr (vLLM's)")
    v.add_argument("--enable-log-outputs", action="store_true",
                   help="with --enable-log-requests: also each finished request's text and "
                        "finish reason (vLLM's)")
    v.add_argument("--max-log-len", type=int, default=None, metavar="N",
                   help="cut logged prompts, outputs and id lists to N characters / ids "
                        "(vLLM's; default: whole)")
    v.add_argument("--disable-log-requests", "--disable-log-stats", action="store_true",
                   help="accepted for vLLM compatibility: requests are logged only with "
                        "--enable-log-requests, periodic stats never (Prometheus /metrics has "
                        "them)")
    v.add_argument("--enable-request-id-headers", action="store_true",
                   help="every response carries X-Request-Id: the request's own, else a new "
                        "one (vLLM's)")
    v.add_argument("--default-chat-template-kwargs", default=None, metavar="JSON",
                   help="chat-template variables for requests that do not set them, e.g. "
                        "'{\"enable_thinking\": false}'; a request's chat_template_kwargs win "
                        "(vLLM's)")
    v.add_argument("--response-role", default="assistant", metavar="ROLE",
                   help="the role a chat reply is given in a new turn (vLLM's; default "
                        "assistant)")
    v.add_argument("--return-tokens-as-token-ids", action="store_true",
                   help="logprobs name tokens 'token_id:N' unless a request sets "
                        "return_tokens_as_token_ids (vLLM's)")
    v.add_argument("--enable-force-include-usage", action="store_true",
                   help="streamed responses end with a usage chunk even without "
                        "stream_options.include_usage (vLLM's)")
    v.add_argument("--enable-server-load-tracking", action="store_true",
                   help="GET /load counts the chat, completions and responses requests in "
                        "flight (vLLM's; without it /load answers 0)")
    v.add_argument("--disable-fastapi-docs", action="store_true",
                   help="serve no /docs, /redoc or /openapi.json (vLLM's)")
    v.add_argument("--disable-uvicorn-access-log", action="store_true",
                   help="no uvicorn access log lines (vLLM's; they show at --log-level info)")
    v.add_argument("--sse-keep-alive-interval", type=float, default=0.0, metavar="SECONDS",
                   help="send an SSE comment when a streamed response has been idle this long "
                        "(queued, prefilling, between tokens), so that a proxy's read timeout "
                        "does not close it (vLLM's; default 0: never)")
    v.add_argument("--allowed-origins", default=None, metavar="JSON",
                   help="CORS: origins allowed to call the server from a browser, a JSON list "
                        "(e.g. '[\"*\"]'; vLLM's; default none: no CORS headers)")
    v.add_argument("--allowed-methods", default=None, metavar="JSON",
                   help="CORS: allowed methods, a JSON list (default [\"*\"])")
    v.add_argument("--allowed-headers", default=None, metavar="JSON",
                   help="CORS: allowed request headers, a JSON list (default [\"*\"])")
    v.add_argument("--allow-credentials", action="store_true",
                   help="CORS: allow credentials (vLLM's)")
    v.add_argument("--root-path", default=None, metavar="PATH",
                   help="the path prefix a proxy in front routes to this server (e.g. /llm): "
                        "PATH/v1/... is served as /v1/... (vLLM's)")
    v.add_argument("--shutdown-timeout", type=float, default=None, metavar="SECONDS",
                   help="at SIGTERM / Ctrl-C, let requests in flight finish for up to this "
                        "long, then abort the rest, before the engine closes (and flushes to "
                        "the remote tier); 0 aborts at once (vLLM's default and radixkv's). "
                        "With --replicas the fleet's ingress drains: new requests are a 503 "
                        "meanwhile, and those left at the deadline end with one")
    v.add_argument("--uds", default=None, metavar="PATH",
                   help="listen on this Unix domain socket instead of --host/--port (vLLM's)")
    v.add_argument("--disable-access-log-for-endpoints", default=None, metavar="PATHS",
                   help="comma-separated paths whose uvicorn access log lines are dropped, "
                        "e.g. /health,/metrics,/ping (vLLM's; they show at --log-level info)")
    v.add_argument("--enable-tokenizer-info-endpoint", action="store_true",
                   help="serve GET /tokenizer_info: the tokenizer's configuration and the chat "
                        "template in use (vLLM's)")
    v.add_argument("--middleware", action="append", default=None, metavar="MODULE.NAME",
                   help="add an ASGI middleware class or an async http middleware function "
                        "by import path (repeatable; vLLM's)")
    v.add_argument("--ssl-keyfile", default=None, metavar="PATH",
                   help="serve HTTPS with this private key (with --ssl-certfile; vLLM's)")
    v.add_argument("--ssl-certfile", default=None, metavar="PATH",
                   help="the certificate chain for --ssl-keyfile")
    v.add_argument("--ssl-ca-certs", default=None, metavar="PATH",
                   help="CA certificates to verify client certificates with (vLLM's)")
    v.add_argument("--ssl-ciphers", default=None, metavar="CIPHERS",
                   help="the TLS ciphers to allow, in OpenSSL's cipher list format (vLLM's; "
                        "default uvicorn's)")
    v.add_argument("--enable-ssl-refresh", action="store_true",
                   help="reload the certificate, key and CA files when they change on disk "
                        "(a rotated certificate without a restart; vLLM's)")
    v.add_argument("--ssl-cert-reqs", type=int, default=0, choices=(0, 1, 2),
                   help="client certificates: 0 none, 1 optional, 2 required (Python ssl's "
                        "CERT_NONE/OPTIONAL/REQUIRED; vLLM's; default 0)")
    v.add_argument("--trust-request-chat-template", action="store_true",
                   help="render a chat or /tokenize request's own chat_template instead of "
                        "the model's (vLLM's; off: such a request is a 400). Only for "
                        "trusted clients: a template can take any CPU and memory to render")
    v.add_argument("--enable-prompt-tokens-details", action="store_true",
                   help="accepted for vLLM compatibility: usage.prompt_tokens_details "
                        "(cached_tokens) is always reported")
    v.add_argument("--trust-remote-code", action="store_true",
                   help="accepted for vLLM compatibility: radixkv never runs code that comes "
                        "with a checkpoint (a model that needs it fails to load, naming it)")
    v.add_argument("--chat-template", default=None, metavar="PATH",
                   help="a Jinja chat template file to use instead of the model's (e.g. one "
                        "that declares tools)")
    v.add_argument("--reasoning-parser", default=None, choices=("deepseek_r1", "qwen3"),
                   help="put chat replies' <think>...</think> in message.reasoning (and "
                        "reasoning_content), the rest in content, as vLLM's parsers of these "
                        "names (docs/serve.md)")
    v.add_argument("--enable-cache-reset", action="store_true",
                   help="serve POST /reset_prefix_cache (vLLM's development endpoint: drops "
                        "every cached block no request holds; also on with "
                        "VLLM_SERVER_DEV_MODE=1)")
    v.add_argument("--allow-download", action="store_true",
                   help="let a Hugging Face hub id that is not in the local cache be "
                        "downloaded (default: load only what is on disk)")
    v.add_argument("--hf-token", nargs="?", const=True, default=None, metavar="TOKEN",
                   help="vLLM's: the Hugging Face token for --allow-download's downloads (a "
                        "gated model); alone, the token huggingface-cli login stored (the "
                        "default anyway)")
    v.add_argument("--max-request-bytes", type=int, default=None, metavar="N",
                   help="largest request body; larger ones get 413 before they are read "
                        "(default 16 MiB)")
    f = p.add_argument_group("fleet (Ray Serve; needs the cluster extra, see docs/fleet.md)")
    f.add_argument("--replicas", type=int, default=None, metavar="N",
                   help="run N engine replicas on Ray Serve behind this endpoint")
    f.add_argument("--ray-address", default=None, metavar="ADDR",
                   help="deploy onto this Ray cluster (e.g. ray://head:10001 or auto) instead "
                        "of a local Ray instance")
    f.add_argument("--ray-cpus", type=int, default=None,
                   help="CPUs of the local Ray instance (default: this machine's)")
    f.add_argument("--replica-cpus", type=float, default=1.0,
                   help="CPUs Ray reserves per replica (default 1; also its torch threads "
                        "unless --threads)")
    f.add_argument("--router", default="kv", choices=["kv", "pow2"],
                   help="kv: route by cached prefix and load (default); pow2: Ray Serve's "
                        "default power-of-two-choices router")
    f.add_argument("--route-load-tokens", type=int, default=None, metavar="T",
                   help="prefill tokens one in-flight request is worth when the router "
                        "weighs a cached prefix against load (default 64)")
    return p


def read_secret_file(path: str | None) -> bytes | None:
    """The secret in ``path`` (its bytes without surrounding whitespace, so a trailing newline
    does not matter), None for no path; ConfigError naming the file when it cannot be read or
    holds nothing (CacheConfig checks the length)."""
    from radixkv.errors import ConfigError

    if path is None:
        return None
    try:
        with open(path, "rb") as f:
            secret = f.read().strip()
    except OSError as exc:
        raise ConfigError(f"--kv-secret-file {path!r}: {exc.strerror or exc}") from None
    if not secret:
        raise ConfigError(f"--kv-secret-file {path!r} is empty")
    return secret


def human_readable_int(value: str) -> int:
    """An int as vLLM's flags read one: digits, or a number with a suffix, decimal in lower
    case (``k`` 1e3, ``m``, ``g``, ``t``; ``25.6k`` = 25600) and binary in upper case (``K``
    1024, ``M``, ``G``, ``T``; whole numbers only). Deployment scripts written for vLLM pass
    ``--max-model-len 32k``."""
    text = value.strip()
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmMgGtT])", text)
    if m is None:
        try:
            return int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"invalid int value: {value!r} (digits, or e.g. 32k / 32K)") from None
    number, suffix = m.groups()
    power = "kmgt".index(suffix.lower()) + 1
    if suffix.islower():
        # (exact: float arithmetic makes 4.35k 4349)
        return int(decimal.Decimal(number) * 1000 ** power)
    if "." in number:
        raise argparse.ArgumentTypeError(
            f"invalid int value: {value!r}: a binary suffix ({suffix}) takes a whole number "
            f"(did you mean {number}{suffix.lower()}?)")
    return int(number) * (1 << (10 * power))


def human_readable_int_or_auto(value: str) -> int | None:
    """:func:`human_readable_int`, or None for ``auto`` / ``-1`` (vLLM's "find it out"; for
    ``--max-model-len``, radixkv's default: the model's own limit)."""
    if value.strip().lower() in ("auto", "-1"):
        return None
    return human_readable_int(value)


def configs(args: argparse.Namespace) -> tuple[Any, Any]:
    """(CacheConfig, EngineConfig) from the parsed flags (ConfigError on a bad combination)."""
    from radixkv.config import CacheConfig, EngineConfig
    from radixkv.errors import ConfigError

    device_memory = args.device_memory
    by_bytes = getattr(args, "kv_cache_memory_bytes", None)
    if by_bytes is not None:
        if device_memory is not None:
            raise ConfigError("--kv-cache-memory-bytes and --device-memory both size the "
                              "device pool: give one")
        device_memory = by_bytes
    cc = CacheConfig(block_size=args.block_size, num_device_blocks=args.device_blocks,
                     device_memory=device_memory, host_blocks=args.host_blocks,
                     host_memory=args.host_memory, disk_dir=args.disk_dir,
                     disk_blocks=args.disk_blocks, disk_memory=args.disk_memory,
                     policy=args.policy, policy_options=args.policy_options,
                     enable_prefix_caching=not args.no_prefix_caching,
                     tail_blocks=args.tail_blocks,
                     write_through=tuple(args.write_through), kv_dtype=args.kv_dtype,
                     remote_url=args.remote_url,
                     remote_write=args.remote_write, remote_ttl_s=args.remote_ttl,
                     remote_timeout_s=args.remote_timeout, model_id=args.model_id,
                     remote_shutdown_flush_s=args.shutdown_flush,
                     disk_secret=read_secret_file(args.kv_secret_file),
                     gpu_memory_utilization=args.gpu_memory_utilization,
                     commit_device_pool=not args.no_commit_kv_pool)
    ec = EngineConfig(max_num_seqs=args.max_num_seqs,
                      max_num_batched_tokens=args.max_num_batched_tokens, device=args.device,
                      dtype=args.dtype, max_model_len=args.max_model_len,
                      prefetch_requests=args.prefetch_requests,
                      async_loads=not args.no_async_loads,
                      cuda_graphs=False if args.enforce_eager else None, seed=args.seed,
                      pack_weights=False if args.no_pack_weights else None,
                      **_scheduling(args))
    return cc, ec


def _scheduling(args: argparse.Namespace) -> dict[str, Any]:
    """The scheduling flags given, as EngineConfig keywords (absent: EngineConfig's default);
    EngineConfig raises ConfigError on a bad age limit."""
    out: dict[str, Any] = {}
    if args.scheduling_policy is not None:
        out["scheduling_policy"] = args.scheduling_policy
    if args.scheduling_max_wait is not None:
        out["scheduling_max_wait_s"] = args.scheduling_max_wait
    if getattr(args, "prefill_priority_steps", None) is not None:
        out["prefill_priority_steps"] = args.prefill_priority_steps
    if getattr(args, "blend_ratio", None) is not None:
        out["blend_ratio"] = args.blend_ratio
    if getattr(args, "long_prefill_token_threshold", None) is not None:
        out["long_prefill_token_threshold"] = args.long_prefill_token_threshold
    if getattr(args, "long_prefill_token_threshold_adaptive", None):
        out["long_prefill_token_threshold_adaptive"] = True
    return out


def engine_loader(args: argparse.Namespace, cc: Any, ec: Any, prog: str = "radixkv serve"
                  ) -> Any:
    """The function that loads the model and engine ``args`` name (``prog``: who says so on
    stderr)."""
    def load() -> Any:
        from radixkv.api.engine import Engine

        what = args.model or "the embedded SmolLM2-135M-Instruct"
        t0 = time.perf_counter()
        done = threading.Event()

        def progress() -> None:
            while not done.wait(5.0):
                print(f"{prog}: loading {what} ... {time.perf_counter() - t0:.0f} s",
                      file=sys.stderr, flush=True)

        print(f"{prog}: loading {what}", file=sys.stderr, flush=True)
        threading.Thread(target=progress, daemon=True).start()
        try:
            engine = Engine.from_pretrained(args.model, args.gguf_file, cc, ec,
                                            model_impl=args.model_impl,
                                            allow_download=args.allow_download,
                                            tokenizer=args.tokenizer)
            if args.chat_template:
                engine.tokenizer.chat_template = _read_template(args.chat_template)
            engine.chat_template   # analyse the chat template now, not in the first request
        finally:
            done.set()
        backend = _with_kv_events(engine, args.kv_events_endpoint, cc.block_size)
        backend.sampling_defaults = _generation_defaults(args, prog)
        print(f"{prog}: ready in {time.perf_counter() - t0:.1f} s "
              f"(model {engine.model_id}, {engine.core.tier_capacity_blocks[0]} device blocks "
              f"= {engine.core.tier_capacity_blocks[0] * cc.block_size} tokens)",
              file=sys.stderr, flush=True)
        sizing = getattr(engine.core, "pool_sizing", None)
        if sizing is not None:
            print(f"{prog}: {sizing.describe()}", file=sys.stderr, flush=True)
        return backend

    return load


def _generation_defaults(args: argparse.Namespace, prog: str = "radixkv serve"
                         ) -> dict[str, Any]:
    """``--generation-config auto`` (vLLM's default): the sampling defaults the model's
    ``generation_config.json`` sets, said on stderr; ``vllm``: none (OpenAI's defaults)."""
    from radixkv.models import generation_defaults, parse_generation_overrides

    from radixkv.models import generation_defaults_in

    if args.generation_config == "vllm":
        found = {}
    elif args.generation_config == "auto":
        found = generation_defaults(args.model, args.gguf_file,
                                    allow_download=args.allow_download)
    else:   # a folder of its own (checked by check_flags)
        found = generation_defaults_in(args.generation_config)
    found.update(parse_generation_overrides(args.override_generation_config))
    if found:
        print(f"{prog}: default sampling from the model's generation config for what "
              f"a request leaves unset: {found} (--generation-config vllm: OpenAI's defaults)",
              file=sys.stderr, flush=True)
    return found


def _with_kv_events(engine: Any, endpoint: str | None, block_size: int) -> Any:
    """The backend serving ``engine``: with ``endpoint``, one that also publishes its KV events
    there (from a snapshot of the cache, so a subscriber starts from ``AllBlocksCleared``)
    until shutdown. A bind failure stops the engine and raises ConfigError (the server exits
    non-zero, as for a model that fails to load)."""
    from radixkv.server.backend import LocalBackend

    if endpoint is None:
        return LocalBackend(engine)
    import zmq

    from radixkv.errors import ConfigError
    from radixkv.fleet.zmq_events import ZmqEventPublisher

    try:   # before any request: the snapshot reads the tree while nothing steps it
        publisher = ZmqEventPublisher(engine.core.tree, endpoint, block_size)
    except zmq.ZMQError as exc:
        engine.close(remote_flush_s=0)
        raise ConfigError(f"--kv-events-endpoint {endpoint!r}: {exc}") from None
    print(f"radixkv serve: KV events on {publisher.endpoint} (ZMQ PUB, topic "
          f"{publisher.topic.decode()!r}, vLLM's KVEventBatch)", file=sys.stderr, flush=True)
    return LocalBackend(engine, kv_events=publisher.start())


def served_name(args: argparse.Namespace) -> str:
    """The model name answers carry: ``--served-model-name``'s (first), else the model
    directory's last part, else the embedded model's."""
    if args.served_model_name:
        return str(args.served_model_name)
    if args.model:
        return str(args.model).rstrip("/").rsplit("/", 1)[-1]
    from radixkv.models import EMBEDDED_NAME

    return EMBEDDED_NAME


def app_options(args: argparse.Namespace) -> dict[str, Any]:
    """The :func:`~radixkv.server.app.create_app` arguments that ``radixkv serve`` and
    ``radixkv run-batch`` both take from the command line (the model's name, admission,
    sampling and output limits, vLLM's frontend options), written once so that the two cannot
    drift apart; serve adds what only a listening server has (keys, body limit, the load)."""
    from radixkv.server import conversations as cv
    from radixkv.server.frontend import FrontendOptions

    return dict(model_name=served_name(args), max_queued=args.max_queued,
                default_max_tokens=args.default_max_tokens,
                reasoning_parser=args.reasoning_parser, max_logprobs=args.max_logprobs,
                responses_store_size=args.responses_store_size,
                max_conversation_bytes=args.max_conversation_bytes or cv.DEFAULT_MAX_BYTES,
                stream_interval=args.stream_interval,
                json_max_whitespace=args.structured_outputs_max_whitespace,
                frontend=FrontendOptions.from_args(args))


def install_request_log(args: argparse.Namespace) -> None:
    """``--enable-log-requests``: the request log's handler on stderr (DEBUG lines at
    ``--log-level debug``)."""
    if args.enable_log_requests:
        from radixkv.server import request_log

        request_log.install(debug=args.log_level == "debug")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from radixkv.server.cpu import prepare_openmp

    wait_policy = prepare_openmp()   # before anything loads torch's OpenMP runtime
    from radixkv.errors import ConfigError

    try:
        import uvicorn

        from radixkv.server.app import create_app
        from radixkv.server.tenants import read_keys
    except ImportError as exc:
        print(f"radixkv serve needs the serve extra ({exc}): pip install 'radixkv[serve]'",
              file=sys.stderr)
        return 2
    try:
        check_flags(args)
        cc, ec = configs(args)
        keys = read_keys(args.api_key, args.api_key_file)
        if args.max_queued < 0:
            raise ConfigError(f"--max-queued must be >= 0, got {args.max_queued}")
        _check_kv_events(args)
    except ConfigError as exc:
        print(f"radixkv serve: {exc}", file=sys.stderr)
        return 2
    if args.threads is not None and args.threads < 1:
        print(f"radixkv serve: --threads must be >= 1, got {args.threads}", file=sys.stderr)
        return 2
    name = served_name(args)
    if args.replicas is not None or args.ray_address:
        try:
            from radixkv.fleet.deploy import run as run_fleet
        except ImportError as exc:
            print(f"radixkv serve --replicas needs the cluster extra ({exc}): "
                  "pip install 'radixkv[cluster]'", file=sys.stderr)
            return 2
        try:
            return run_fleet(args, cc, ec, keys, name)
        except ConfigError as exc:
            print(f"radixkv serve: {exc}", file=sys.stderr)
            return 2
    from radixkv.server.cpu import apply_threads

    print(f"radixkv serve: {apply_threads(args.threads)}; OMP_WAIT_POLICY {wait_policy}",
          file=sys.stderr, flush=True)
    failed: list[str] = []
    server: Any = None

    def stop(message: str) -> None:
        """The model failed to load: stop serving and exit non-zero, as ``vllm serve`` does
        (a server answering 503 forever looks alive to a supervisor)."""
        failed.append(message)
        if "allow_download" in message:
            print("radixkv serve: pass --allow-download to fetch it", file=sys.stderr,
                  flush=True)
        if server is not None:
            server.should_exit = True

    from radixkv.server.app import DEFAULT_MAX_REQUEST_BYTES, UVICORN_LOOP

    install_request_log(args)
    app = create_app(load=engine_loader(args, cc, ec), api_keys=keys,
                     salt_secret=args.salt_secret,
                     max_request_bytes=args.max_request_bytes or DEFAULT_MAX_REQUEST_BYTES,
                     on_load_error=stop,
                     cache_reset=args.enable_cache_reset
                     or os.environ.get("VLLM_SERVER_DEV_MODE") == "1",
                     freeze_heap=True, **app_options(args))
    where = f"unix:{args.uds}" if args.uds else \
        f"{'https' if args.ssl_certfile else 'http'}://{args.host}:{args.port}"
    print(f"radixkv serve: {where} (model name {name!r}"
          f"{', %d API key(s)' % len(keys) if keys else ''}"
          f"{' from $VLLM_API_KEY' if keys and not args.api_key and not args.api_key_file else ''}"
          ")", file=sys.stderr, flush=True)
    config = uvicorn.Config(app, host=args.host, port=args.port, uds=args.uds,
                            timeout_graceful_shutdown=args.shutdown_timeout or 0,
                            log_level=args.log_level, loop=UVICORN_LOOP,
                            access_log=not args.disable_uvicorn_access_log,
                            ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile,
                            ssl_ca_certs=args.ssl_ca_certs, ssl_cert_reqs=args.ssl_cert_reqs,
                            **({"ssl_ciphers": args.ssl_ciphers} if args.ssl_ciphers else {}))
    if args.disable_access_log_for_endpoints:   # after Config, which sets uvicorn's loggers up
        import logging

        from radixkv.server.frontend import AccessLogFilter

        logging.getLogger("uvicorn.access").addFilter(
            AccessLogFilter(args.disable_access_log_for_endpoints))
    if args.enable_ssl_refresh:
        from radixkv.server.tls import RefreshingServer

        server = RefreshingServer(config, args.ssl_keyfile, args.ssl_certfile,
                                  args.ssl_ca_certs)
    elif args.ssl_certfile:
        from radixkv.server.tls import TLSServer

        server = TLSServer(config)
    else:
        server = uvicorn.Server(config)
    if failed:   # failed before the server object existed
        server.should_exit = True
    server.run()
    return 1 if failed else 0


def _check_kv_events(args: argparse.Namespace) -> None:
    """ConfigError unless ``--kv-events-endpoint`` can be served: the events extra is
    installed and the server is a single one (each fleet replica would need its own socket)."""
    from radixkv.errors import ConfigError

    if args.kv_events_endpoint is None:
        return
    if args.replicas is not None or args.ray_address:
        raise ConfigError("--kv-events-endpoint serves a single server's events; it is not "
                          "available with --replicas or --ray-address")
    try:
        import msgspec  # noqa: F401
        import zmq  # noqa: F401
    except ImportError as exc:
        raise ConfigError(f"--kv-events-endpoint needs the events extra ({exc}): "
                          "pip install 'radixkv[events]'") from None


def _read_template(path: str) -> str:
    from radixkv.errors import ConfigError

    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as exc:
        raise ConfigError(f"--chat-template: {exc}") from None


def hub_files(args: argparse.Namespace) -> None:
    """``--revision`` / ``--download-dir`` / ``--tokenizer-revision``: a hub id ``MODEL`` (and
    ``--tokenizer``) becomes the local folder of that revision in that cache
    (:func:`radixkv.models.hub_snapshot`: offline unless ``--allow-download``), so that every
    loader after this (the server's engine, run-batch's, a fleet's ingress and replicas on this
    machine) reads a local directory. The answers keep the hub id's name (its last part), as
    without the flags. A local path ignores them, as vLLM's loaders do."""
    from radixkv import models

    if args.model and (args.revision or args.download_dir) \
            and not models.looks_like_local(args.model):
        if not args.served_model_name:
            args.served_model_name = str(args.model).rstrip("/").rsplit("/", 1)[-1]
        args.model = str(models.hub_snapshot(args.model, revision=args.revision,
                                             cache_dir=args.download_dir,
                                             allow_download=args.allow_download,
                                             gguf_file=args.gguf_file))
    if args.tokenizer and (args.tokenizer_revision or args.download_dir) \
            and not models.looks_like_local(args.tokenizer):
        args.tokenizer = str(models.hub_snapshot(args.tokenizer, revision=args.tokenizer_revision,
                                                 cache_dir=args.download_dir,
                                                 allow_download=args.allow_download,
                                                 what="tokenizer"))


def check_flags(args: argparse.Namespace) -> None:
    """Fold vLLM's spellings into radixkv's flags (ConfigError on a contradiction)."""
    from radixkv.errors import ConfigError

    names = args.served_model_name
    if isinstance(names, list):   # vLLM's aliases: the first names answers, all are accepted
        if any(not n.strip() for n in names):
            raise ConfigError("--served-model-name: names must not be empty")
        args.served_model_name, args.served_model_aliases = names[0], tuple(names[1:])

    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            raise ConfigError(f"the model is given twice: {args.model_tag!r} and --model "
                              f"{args.model!r}")
        args.model = args.model_tag
    hub_files(args)
    token = getattr(args, "hf_token", None)
    if isinstance(token, str):
        if not token.strip():
            raise ConfigError("--hf-token is empty")
        # huggingface_hub reads HF_TOKEN at every call; the fleet's Ray processes inherit it
        os.environ["HF_TOKEN"] = token
    if getattr(args, "tokenizer_mode", "auto") not in ("auto", "hf"):
        raise ConfigError(f"--tokenizer-mode {args.tokenizer_mode}: radixkv tokenizes with "
                          "transformers' tokenizer and the model's chat template (auto or hf)")
    if getattr(args, "logprobs_mode", "raw_logprobs") != "raw_logprobs":
        raise ConfigError(f"--logprobs-mode {args.logprobs_mode}: radixkv reports raw_logprobs "
                          "only (the model's log-probabilities before any processing, vLLM's "
                          "default)")
    if args.enable_prefix_caching and args.no_prefix_caching:
        raise ConfigError("--enable-prefix-caching and --no-prefix-caching contradict")
    if args.kv_dtype == "fp8":
        args.kv_dtype = "fp8_e4m3"
    if args.chat_template:
        _read_template(args.chat_template)   # a missing file fails now, not after loading
    if args.generation_config not in ("auto", "vllm") and not os.path.isfile(
            os.path.join(args.generation_config, "generation_config.json")):
        raise ConfigError(f"--generation-config {args.generation_config!r}: 'auto', 'vllm' or "
                          "a folder holding a generation_config.json")
    if args.override_generation_config is not None:
        from radixkv.models import parse_generation_overrides

        parse_generation_overrides(args.override_generation_config)   # a usage error now
    if not 1 <= args.stream_interval <= 1024:
        raise ConfigError(f"--stream-interval must be in [1, 1024], got {args.stream_interval}")
    if args.responses_store_size < 0:
        raise ConfigError(f"--responses-store-size must be >= 0, got "
                          f"{args.responses_store_size}")
    if not 0 <= args.max_logprobs <= 20:
        raise ConfigError(f"--max-logprobs must be in [0, 20] (radixkv returns at most 20 "
                          f"alternatives a token), got {args.max_logprobs}")
    if args.max_conversation_bytes is not None and args.max_conversation_bytes < 1:
        raise ConfigError(f"--max-conversation-bytes must be >= 1, got "
                          f"{args.max_conversation_bytes}")
    if args.max_request_bytes is not None and args.max_request_bytes < 1:
        raise ConfigError(f"--max-request-bytes must be >= 1, got {args.max_request_bytes}")
    from radixkv.server.frontend import FrontendOptions

    FrontendOptions.from_args(args)   # a bad --default-chat-template-kwargs / --response-role
    if args.enable_ssl_refresh and not args.ssl_certfile:
        raise ConfigError("--enable-ssl-refresh reloads --ssl-keyfile / --ssl-certfile: give "
                          "them")
    if bool(args.ssl_keyfile) != bool(args.ssl_certfile):
        raise ConfigError("--ssl-keyfile and --ssl-certfile go together")
    for flag, path in (("--ssl-keyfile", args.ssl_keyfile), ("--ssl-certfile", args.ssl_certfile),
                       ("--ssl-ca-certs", args.ssl_ca_certs)):
        if path is not None and not os.path.isfile(path):
            raise ConfigError(f"{flag}: no such file {path!r}")
    if args.shutdown_timeout is not None and args.shutdown_timeout < 0:
        raise ConfigError(f"--shutdown-timeout must be >= 0, got {args.shutdown_timeout}")
    if args.uds and (args.replicas is not None or args.ray_address):
        raise ConfigError("--uds serves one server; a fleet's endpoint is Ray Serve's proxy")
    if args.replicas is not None or args.ray_address:
        # a fleet's HTTPS is Ray Serve's proxy's: key, certificate and CA file only
        for flag, unsupported in (("--ssl-ciphers", args.ssl_ciphers),
                                  ("--ssl-cert-reqs", args.ssl_cert_reqs),
                                  ("--enable-ssl-refresh", args.enable_ssl_refresh)):
            if unsupported:
                raise ConfigError(f"{flag} is a single server's: a fleet's HTTPS is Ray Serve's "
                                  "proxy, which takes --ssl-keyfile, --ssl-certfile and "
                                  "--ssl-ca-certs only (docs/fleet.md)")


if __name__ == "__main__":
    sys.exit(main())
