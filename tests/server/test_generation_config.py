"""``--generation-config auto`` (vLLM's default): the sampling defaults a checkpoint's
``generation_config.json`` sets apply to the fields a request leaves unset; ``vllm`` keeps
OpenAI's. Read from the file (radixkv/models.py ``generation_defaults``), mapped in
``serving.sampling_params``, and through the real server on a checkpoint directory that has
such a file."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from radixkv.models import generation_defaults
from radixkv.server.protocol import ChatCompletionRequest
from radixkv.server.serving import sampling_params

QWEN3_LIKE = {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20,
              "max_new_tokens": 48, "min_p": "x", "repetition_penalty": 0,
              "eos_token_id": [2]}


def _checkpoint(tmp: Path, generation: dict[str, Any] | None) -> Path:
    (tmp / "config.json").write_text("{}")
    if generation is not None:
        (tmp / "generation_config.json").write_text(json.dumps(generation))
    return tmp


def test_the_file_sets_what_it_writes_and_sampling_params_would_take(tmp_path: Path) -> None:
    got = generation_defaults(_checkpoint(tmp_path, QWEN3_LIKE))
    # min_p is not a number and repetition_penalty 0 is refused: both left out
    assert got == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_tokens": 48}
    bare = tmp_path / "bare"
    bare.mkdir()
    assert generation_defaults(_checkpoint(bare, None)) == {}
    assert generation_defaults() == {}   # the embedded GGUF has none


def test_overrides_are_checked_like_the_file() -> None:
    from radixkv.errors import ConfigError
    from radixkv.models import parse_generation_overrides

    assert parse_generation_overrides('{"temperature": 0.5, "max_new_tokens": 9}') == {
        "temperature": 0.5, "max_tokens": 9}
    assert parse_generation_overrides(None) == {}
    for bad in ("{nope", "[1]", '{"seed": 1}', '{"top_p": 2}', '{"temperature": true}'):
        with pytest.raises(ConfigError):
            parse_generation_overrides(bad)


def test_defaults_fill_only_what_the_request_leaves_unset() -> None:
    d = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_tokens": 48,
         "repetition_penalty": 1.1}

    def params(**kw: Any) -> Any:
        req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}],
                                    **kw)
        return sampling_params(req, 5, 1000, None, 100, None, d)

    p = params()
    assert (p.temperature, p.top_p, p.top_k, p.max_tokens, p.repetition_penalty) == (
        0.6, 0.95, 20, 48, 1.1)
    p = params(temperature=0, top_p=1.0, top_k=-1, max_tokens=7, repetition_penalty=1.0)
    assert (p.temperature, p.top_p, p.top_k, p.max_tokens, p.repetition_penalty) == (
        0.0, 1.0, 0, 7, 1.0)
    beam = params(use_beam_search=True, n=2, temperature=0)   # deterministic: no defaults
    assert beam.repetition_penalty == 1.0 and beam.top_k == 0
    req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}])
    p = sampling_params(req, 5, 1000, None, 100, None, None)   # --generation-config vllm
    assert (p.temperature, p.top_p, p.top_k, p.max_tokens) == (1.0, 1.0, 0, 995)


@pytest.mark.model
def test_the_server_applies_the_checkpoint_defaults(tmp_path: Path) -> None:
    """The embedded model's converted checkpoint, linked into a directory whose
    generation_config.json sets greedy decoding and 5 tokens: an unset request is greedy
    and 5 tokens long; --generation-config vllm gives OpenAI's defaults back."""
    pytest.importorskip("fastapi")
    openai = pytest.importorskip("openai")
    from radixkv.models import prepare_source
    from tests.server.test_openai_server import running_server

    src = Path(prepare_source().name_or_path)
    model = tmp_path / "m"
    model.mkdir()
    for f in src.iterdir():
        if f.name != "generation_config.json":
            os.symlink(f, model / f.name)
    (model / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.0, "max_new_tokens": 5, "eos_token_id": 2}))
    msgs = [{"role": "user", "content": "Tell me a story about a cat."}]
    args = ["--model", str(model), "--device-blocks", "128", "--threads", "1",
            "--dtype", "float32"]
    with running_server(args) as srv:
        client = openai.OpenAI(base_url=srv.base + "/v1", api_key="x", max_retries=0)
        name = client.models.list().data[0].id
        a = client.chat.completions.create(model=name, messages=msgs)
        b = client.chat.completions.create(model=name, messages=msgs)
        assert a.usage.completion_tokens == 5
        assert a.choices[0].message.content == b.choices[0].message.content   # greedy
        long = client.chat.completions.create(model=name, messages=msgs,
                                              max_tokens=9, temperature=0)
        assert long.usage.completion_tokens == 9
    with running_server([*args, "--generation-config", "vllm", "--default-max-tokens", "12"]
                        ) as srv:
        client = openai.OpenAI(base_url=srv.base + "/v1", api_key="x", max_retries=0)
        r = client.chat.completions.create(model=client.models.list().data[0].id,
                                           messages=msgs, seed=1)
        assert r.usage.completion_tokens == 12   # not the file's 5
    with running_server([*args, "--override-generation-config", '{"max_new_tokens": 7}']
                        ) as srv:   # over the file's 5, its greedy decoding kept
        client = openai.OpenAI(base_url=srv.base + "/v1", api_key="x", max_retries=0)
        r = client.chat.completions.create(model=client.models.list().data[0].id,
                                           messages=msgs)
        assert r.usage.completion_tokens == 7


def test_max_logprobs_caps_what_a_request_may_ask() -> None:
    """vLLM's --max-logprobs: a request asking more alternatives a token is a 400 naming the
    field; the flag itself is 0..20 (a usage error outside)."""
    from radixkv.errors import ConfigError
    from radixkv.server.cli import build_parser, check_flags
    from radixkv.server.errors import APIError

    req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}],
                                logprobs=True, top_logprobs=5)
    assert sampling_params(req, 5, 1000, None, 100, None, None, 5).logprobs == 5
    with pytest.raises(APIError) as info:
        sampling_params(req, 5, 1000, None, 100, None, None, 4)
    assert info.value.param == "top_logprobs"
    req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}],
                                prompt_logprobs=3)
    with pytest.raises(APIError):
        sampling_params(req, 5, 1000, None, 100, None, None, 2)
    assert build_parser().parse_args(["--max-logprobs", "5"]).max_logprobs == 5
    with pytest.raises(ConfigError):
        check_flags(build_parser().parse_args(["--max-logprobs", "21"]))


def test_a_generation_config_folder_of_its_own(tmp_path: Path, capsys) -> None:
    """vLLM's --generation-config FOLDER: that folder's generation_config.json, not the
    model's; a folder without one is a usage error at start-up."""
    from radixkv.errors import ConfigError
    from radixkv.server.cli import _generation_defaults, build_parser, check_flags

    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.25, "top_k": 7, "max_new_tokens": 11}))
    args = build_parser().parse_args(["--generation-config", str(tmp_path)])
    check_flags(args)
    assert _generation_defaults(args) == {"temperature": 0.25, "top_k": 7, "max_tokens": 11}
    assert "default sampling from the model's generation config" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match="a folder holding a generation_config.json"):
        check_flags(build_parser().parse_args(["--generation-config", str(empty)]))
