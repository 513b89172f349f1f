"""``radixkv serve --kv-secret-file`` (issue 33, item 10): a value forged into the shared
server, its payload swapped for another block's and both checksums recomputed, is served
without a secret and refused (a miss, counted and deleted; the output equals a cold run's)
with one; a remote tier without a secret warns at start. A real ``redis-server``."""

from __future__ import annotations

import logging
import struct
import sys
from pathlib import Path

import pytest

from radixkv.api.engine import Engine
from radixkv.errors import ConfigError
from radixkv.server.cli import build_parser, configs

from .conftest import BLOCK_SIZE

pytest.importorskip("redis")
sys.path.insert(0, str(Path(__file__).parent.parent / "storage"))
from redis_server import RedisServer  # noqa: E402

PROMPT = list(range(3000, 3000 + 5 * BLOCK_SIZE + 3))
GREEDY = {"max_tokens": 6, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def redis_srv(tmp_path_factory):
    with RedisServer(tmp_path_factory.mktemp("redis")).start() as srv:
        yield srv


def _forge_all(r) -> int:
    """What a writer without the secret can do: every value gets the next value's payload
    (a real block's KV, in the right place) with both xxh3 checksums recomputed."""
    import xxhash

    from radixkv.storage.remote_format import header_len

    keys = sorted(r.keys("*"))
    values = [bytearray(r.get(k)) for k in keys]

    def span(v: bytearray) -> tuple[int, int]:
        hl = header_len(struct.unpack_from("<I", v, 12)[0])
        return hl, hl + struct.unpack_from("<Q", v, 88)[0]

    payloads = [bytes(v[slice(*span(v))]) for v in values]
    for i, (k, v) in enumerate(zip(keys, values)):
        start, end = span(v)
        v[start:end] = payloads[(i + 1) % len(payloads)]
        struct.pack_into("<Q", v, 96, xxhash.xxh3_64_intdigest(bytes(v[start:end])))
        struct.pack_into("<Q", v, start - 8, xxhash.xxh3_64_intdigest(bytes(v[:start - 8])))
        r.set(k, bytes(v))
    return len(keys)


def _engine(model, tok, url, secret_file):
    argv = ["--remote-url", url, "--device", "cpu", "--device-blocks", "64",
            "--max-model-len", "1024", "--max-num-seqs", "4"]
    if secret_file is not None:
        argv += ["--kv-secret-file", str(secret_file)]
    cc, ec = configs(build_parser().parse_args(argv))
    return Engine(model, tok, cc, ec, model_id="tiny-llama-test")


@pytest.mark.parametrize("signed", [False, True])
def test_a_forged_value_is_refused_with_a_secret(tiny_model_shared, smol_tokenizer, one_thread,
                                                 redis_srv, tmp_path, caplog, signed) -> None:
    r = redis_srv.client()
    r.flushall()
    secret = None
    if signed:
        secret = tmp_path / "kv.secret"
        secret.write_text("correct horse battery staple\n")
    with caplog.at_level(logging.WARNING, logger="radixkv.tiers.remote"):
        a = _engine(tiny_model_shared, smol_tokenizer, redis_srv.url, secret)
    warned = any("not authenticated" in m for m in caplog.messages)
    assert warned is not signed
    cold = a.generate([PROMPT], GREEDY)[0]
    assert a.close()["written"] == 5            # the shutdown flush writes the prompt's blocks
    assert _forge_all(r) == 5
    b = _engine(tiny_model_shared, smol_tokenizer, redis_srv.url, secret)
    try:
        out = b.generate([PROMPT], GREEDY)[0]
        server = b.stats()["remote"]["server"]
    finally:
        b.close(remote_flush_s=0)
    if not signed:   # the hazard: forged KV served as a hit
        assert out.cached_tokens_per_tier[-1] == 5 * BLOCK_SIZE
        return
    assert out.num_cached_tokens == 0 and server["corrupt"] >= 1
    assert out.outputs[0].token_ids == cold.outputs[0].token_ids


def test_secret_file_errors_name_the_file(tmp_path) -> None:
    p = build_parser()
    for content, match in ((b"", "is empty"), (b"short\n", "at least 16")):
        f = tmp_path / "s"
        f.write_bytes(content)
        with pytest.raises(ConfigError, match=match):
            configs(p.parse_args(["--kv-secret-file", str(f)]))
    with pytest.raises(ConfigError, match="missing"):
        configs(p.parse_args(["--kv-secret-file", str(tmp_path / "missing")]))
    f = tmp_path / "ok"
    f.write_bytes(b"  0123456789abcdef0123\n")
    cc, _ = configs(p.parse_args(["--kv-secret-file", str(f)]))
    assert cc.disk_secret == b"0123456789abcdef0123" and "0123" not in repr(cc)
