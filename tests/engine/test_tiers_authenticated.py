"""An authenticated disk tier end to end (issue 18, item 7): a restart over block files whose
payloads were swapped (checksums recomputed) recomputes them instead of serving wrong KV."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import xxhash

from radixkv.config import CacheConfig
from radixkv.engine.sampling import SamplingParams
from radixkv.errors import ConfigError
from radixkv.storage.disk_format import decode_header, encode_header

sys.path.insert(0, str(Path(__file__).parent))
from tiers_helpers import check_tiers, hf_greedy, make_engine, rand_tokens  # noqa: E402

SECRET = "a shared secret for the test"


@pytest.fixture(scope="module")
def hf(make_tiny):
    return make_tiny("llama")


def _forge(disk):
    """Swap the payloads of every pair of block files, recomputing the checksums; a signed
    header keeps its key id and (now wrong) MAC: the forger does not have the key."""
    paths = sorted(disk.dir.glob("*/*.kvb"))
    assert len(paths) >= 2
    files = []
    for p in paths:
        raw = p.read_bytes()
        hdr = decode_header(raw)
        files.append((p, hdr, raw[hdr.header_len:]))
    for (p, hdr, _), (_, _, payload) in zip(files, files[1:] + files[:1]):
        class Replay:
            key_id, mac = hdr.key_id, staticmethod(lambda *parts, _m=hdr.mac: _m)
        signer = Replay if hdr.key_id is not None else None
        p.write_bytes(encode_header(hdr.namespace, hdr.block_hash, hdr.parent_hash,
                                    hdr.token_ids, disk.layout,
                                    xxhash.xxh3_64_intdigest(payload), signer, payload) + payload)


def _gen(eng, prompt):
    eng.add_request("r", prompt, SamplingParams(max_tokens=6))
    out = None
    while eng.has_unfinished_requests():
        for o in eng.step():
            out = o
    return out


def test_restart_over_forged_files_recomputes_with_a_secret(hf, tmp_path):
    prompt = rand_tokens(30, seed=11)
    want = hf_greedy(hf, prompt)
    first = make_engine(hf, tmp_path, disk_secret=SECRET)
    assert _gen(first, prompt).outputs[0].token_ids == want
    assert first.persist() > 0
    first.close()
    _forge(first.kv_mover.disk)
    second = make_engine(hf, tmp_path, disk_secret=SECRET)
    out = _gen(second, prompt)
    assert out.outputs[0].token_ids == want
    assert second.stats()["disk"]["forged"] >= 1
    check_tiers(second)
    second.close()


def test_without_a_secret_the_same_forgery_is_served(hf, tmp_path):
    """Why the option exists (documents the limit of checksums)."""
    prompt = rand_tokens(30, seed=11)
    first = make_engine(hf, tmp_path)
    _gen(first, prompt)
    first.persist()
    first.close()
    _forge(first.kv_mover.disk)
    second = make_engine(hf, tmp_path)
    out = _gen(second, prompt)
    assert out.num_cached_tokens > 0 and second.stats()["disk"]["forged"] == 0
    second.close()


def test_weak_secret_is_a_config_error():
    with pytest.raises(ConfigError):
        CacheConfig(disk_dir="/tmp/x", disk_blocks=4, disk_secret="short")
    assert "secret" not in repr(CacheConfig(disk_dir="/tmp/x", disk_blocks=4,
                                            disk_secret="sixteen bytes or more"))
