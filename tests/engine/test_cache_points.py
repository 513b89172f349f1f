"""TTLs that expire in a running engine, cache breakpoints, and cache read/write accounting
(issue 15). The tree's clock is replaced by a fake one, so "an hour later" takes no time.

* the TTL policy: a block unused for longer than its TTL leaves the cache at the next step,
  without any memory pressure (before, ``evict_expired`` was called only by tests);
* a cache point with ``ttl`` expires its prefix under the default LRU policy too, and only it;
* ``cache_write_tokens`` / ``num_cached_tokens`` report what a request wrote and read;
* bad cache points are typed errors that change nothing.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from radixkv.engine.cache_points import CachePoint, parse_ttl
from radixkv.errors import InvalidRequestError

sys.path.insert(0, str(Path(__file__).parent))
from tiers_helpers import BS, hf_greedy, make_engine, rand_tokens  # noqa: E402


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture(scope="module")
def hf_llama(make_tiny):
    return make_tiny("llama")


def _run(eng, rid, prompt, max_tokens=2, **kw):
    eng.add_request(rid, prompt, {"max_tokens": max_tokens}, **kw)
    final = None
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                final = out
    return final


def _engine(hf, tmp_path, clock, **kw):
    eng = make_engine(hf, tmp_path, device=64, host=0, disk=0, **kw)
    eng.tree.clock = clock
    return eng


def test_ttl_policy_expires_idle_blocks_without_memory_pressure(hf_llama, tmp_path):
    clock = FakeClock()
    eng = _engine(hf_llama, tmp_path, clock, policy="ttl")   # default TTL 300 s
    a, b = rand_tokens(17, 1), rand_tokens(17, 2)
    first = _run(eng, "a", a)
    assert first.cache_write_tokens == 4 * BS and first.num_cached_tokens == 0
    assert _run(eng, "a2", a).num_cached_tokens == 4 * BS      # still cached
    clock.t += 301                                             # a's blocks are now past TTL
    out = _run(eng, "b", b)                                    # any step expires them
    assert eng.stats()["cached_blocks_per_tier"][0] == out.cache_write_tokens // BS
    again = _run(eng, "a3", a)
    assert again.num_cached_tokens == 0 and again.cache_write_tokens == 4 * BS
    assert again.outputs[0].token_ids == hf_greedy(hf_llama, a, 2)
    assert eng.tree.stats.expired >= 4


def test_a_cache_point_ttl_expires_its_prefix_under_lru(hf_llama, tmp_path):
    clock = FakeClock()
    eng = _engine(hf_llama, tmp_path, clock)                   # LRU: no TTL of its own
    sys_prompt = rand_tokens(16, 3)                            # 4 blocks: the breakpoint
    a = sys_prompt + rand_tokens(9, 4)
    other = rand_tokens(17, 5)
    out = _run(eng, "a", a, cache_points=[CachePoint(len(sys_prompt), ttl="5m")])
    assert out.cache_write_tokens == 6 * BS
    _run(eng, "o", other)
    clock.t += 200
    assert _run(eng, "a2", a).num_cached_tokens == 6 * BS      # used again at +200 s: re-armed
    clock.t += 250                                             # 250 s after that use: alive
    _run(eng, "o2", other)
    assert _run(eng, "a3", sys_prompt + rand_tokens(9, 6)).num_cached_tokens == 4 * BS
    clock.t += 301
    _run(eng, "o3", other)                                     # a step past the TTL expires it
    after = _run(eng, "a4", sys_prompt + rand_tokens(9, 7))
    assert after.num_cached_tokens == 0                        # the marked prefix is gone
    assert _run(eng, "o4", other).num_cached_tokens == 4 * BS  # an unmarked one stays (LRU)


def test_cache_point_priority_survives_pressure_under_the_priority_policy(hf_llama, tmp_path):
    clock = FakeClock()
    eng = make_engine(hf_llama, tmp_path, device=12, host=0, disk=0, policy="priority")
    eng.tree.clock = clock
    keep = rand_tokens(17, 8)
    _run(eng, "k", keep, cache_points=[{"position": 16, "priority": 5}])
    for i in range(4):                                         # fill the pool several times
        clock.t += 1
        _run(eng, f"f{i}", rand_tokens(17, 20 + i))
    assert _run(eng, "k2", keep).num_cached_tokens == 4 * BS


def test_bad_cache_points_are_typed_errors_and_change_nothing(hf_llama, tmp_path):
    eng = _engine(hf_llama, tmp_path, FakeClock())
    prompt = rand_tokens(9, 9)
    for bad in ([CachePoint(5)] * 0 + [{"position": 50}], [{"position": 0}], "all",
                [{"position": 4, "ttl": "soon"}], [{"position": 4, "ttl": -1}],
                [{"position": 4, "priority": "high"}], [{"where": 4}]):
        with pytest.raises(InvalidRequestError):
            eng.add_request("x", prompt, {"max_tokens": 1}, cache_points=bad)
        assert not eng.has_unfinished_requests()
    assert parse_ttl("1h") == 3600.0 and parse_ttl("90s") == 90.0 and parse_ttl(2.5) == 2.5
