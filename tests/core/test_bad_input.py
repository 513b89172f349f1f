"""Bad input at every public method of radixkv.core: a typed RadixKVError subclass with an
actionable message, and nothing changed. Also: the core imports no torch.

Tests decorated ``@bug4(...)`` reproduce BUG 4 (an untyped error escaped, or bad input was
accepted), found by these tests and fixed in 2028b62; they stay as regression tests.
"""

from __future__ import annotations

import math
import re
import subprocess
import sys

import pytest
from core_helpers import FakeClock, assert_unchanged, snapshot_manager, snapshot_pool, snapshot_tree

from radixkv.core.block_manager import BlockManager
from radixkv.core.hashing import Namespace, hash_token_blocks, token_bytes
from radixkv.core.policy import TTLPolicy
from radixkv.core.policy_registry import make_policy
from radixkv.core.pool import BlockPool
from radixkv.core.tree import RadixTree
from radixkv.errors import (
    ConfigError, InvalidBlockError, InvalidTokensError, OutOfBlocks, RadixKVError,
    SequenceExistsError, UnknownSequenceError,
)

NS = Namespace("m")
BAD_TOKENS = [
    ([], "empty"), ([-1], ">= 0"), ([3, -7], ">= 0"), ([2**31], "0, "), ([1, 2**63], "0, "),
    ([1.5], "integers"), (["a"], "integers"), ("abc", "sequence of ints"),
    (b"\x01\x02", "sequence"),
    ([None], "integers"),
]


def bug4(reason: str):
    """Regression of core BUG 4 (found here, fixed in 2028b62): ``reason`` was the symptom."""
    return lambda test: test


@pytest.fixture
def bm() -> BlockManager:
    m = BlockManager.create(6, block_size=2, lower_tier_blocks=[2], clock=FakeClock())
    m.allocate("live", [1, 1, 2, 2, 3], NS)
    m.commit("live", 5)
    m.allocate("gone", [4, 4], NS)
    m.free("gone")
    return m


def expect(bm: BlockManager, exc, fn, *args, match: str | None = None):
    """``fn(*args)`` raises ``exc`` (a RadixKVError) and the manager is unchanged."""
    before = snapshot_manager(bm)
    with pytest.raises(exc, match=match) as info:
        fn(*args)
    assert isinstance(info.value, RadixKVError)
    assert_unchanged(before, snapshot_manager(bm), fn.__name__)
    bm.check_invariants()
    return info.value


# ---------------------------------------------------------------- hashing
@pytest.mark.parametrize("tokens,msg", BAD_TOKENS)
def test_token_bytes_rejects(tokens, msg) -> None:
    with pytest.raises(InvalidTokensError, match=msg):
        token_bytes(tokens)


@bug4("token_bytes(None) raises a bare TypeError")
def test_token_bytes_none() -> None:
    with pytest.raises(InvalidTokensError):
        token_bytes(None)


@pytest.mark.parametrize("kwargs", [dict(model=""), dict(model=3), dict(model="m", cache_salt=1),
                                    dict(model="m", adapter_id=b"x"), dict(model="m", extra=[])])
def test_namespace_rejects(kwargs) -> None:
    with pytest.raises(ConfigError, match="Namespace"):
        Namespace(**kwargs)


# ---------------------------------------------------------------- pool
@pytest.mark.parametrize("n", [0, -3, 2.0, True, None])
def test_pool_capacity(n) -> None:
    with pytest.raises(ConfigError, match="positive integer number of blocks"):
        BlockPool(n)


def test_pool_errors_change_nothing() -> None:
    pool = BlockPool(4)
    a = pool.allocate(2)
    pool.ref_counts[a[0]] += 1
    cases = [
        (OutOfBlocks, pool.allocate, (3,), "need 3 blocks, 2 free"),
        (InvalidBlockError, pool.allocate, (-1,), ">= 0, got -1"),
        (InvalidBlockError, pool.free, ([a[0]],), "1 references"),
        (InvalidBlockError, pool.free, ([a[1], 3],), "already free"),   # all-or-nothing
        (InvalidBlockError, pool.free, ([a[1], a[1]],), "double free"),
        (InvalidBlockError, pool.free, ([4],), r"outside \[0, 4\)"),
        (InvalidBlockError, pool.free, ([-1],), "outside"),
        (InvalidBlockError, pool.free, (["0"],), "outside"),
        (InvalidBlockError, pool.is_free, (True,), "outside"),
    ]
    for exc, fn, args, msg in cases:
        before = snapshot_pool(pool)
        with pytest.raises(exc, match=msg):
            fn(*args)
        assert_unchanged(before, snapshot_pool(pool), f"{fn.__name__}{args}")
        pool.check_invariants()
    pool.allocate(2)
    with pytest.raises(OutOfBlocks, match="need 1 blocks, 0 free"):
        pool.allocate_one()


@bug4("BlockPool.allocate(1.5) / ('1') raise a bare TypeError; allocate(True) takes a block")
@pytest.mark.parametrize("n", [1.5, "1", True])
def test_pool_allocate_non_int(n) -> None:
    with pytest.raises(RadixKVError):
        BlockPool(4).allocate(n)


# ---------------------------------------------------------------- policies and tree config
@pytest.mark.parametrize("bs", [0, -2, "16", 1.0, None])
def test_tree_block_size(bs) -> None:
    with pytest.raises(ConfigError, match="block_size"):
        RadixTree(bs, BlockPool(2))


@bug4("RadixTree(block_size=True) is accepted as block size 1")
def test_tree_block_size_bool() -> None:
    with pytest.raises(ConfigError):
        RadixTree(True, BlockPool(2))


def test_too_many_tiers() -> None:
    with pytest.raises(ConfigError, match="at most 3 tiers"):
        BlockManager.create(4, lower_tier_blocks=[1, 1, 1])
    with pytest.raises(ConfigError, match="positive integer"):
        BlockManager.create(4, lower_tier_blocks=[0])
    with pytest.raises(ConfigError, match="positive integer"):
        BlockManager.create(0)


@bug4("an unknown policy name / bad TTL raise a bare ValueError, not ConfigError")
@pytest.mark.parametrize("make", [lambda: make_policy("mfu"), lambda: TTLPolicy(-1),
                                  lambda: TTLPolicy(math.inf),
                                  lambda: BlockManager.create(4, policy="bogus")])
def test_bad_policy_is_config_error(make) -> None:
    with pytest.raises(ConfigError):
        make()


def test_bad_policy_message() -> None:
    from radixkv.core.policy_registry import POLICIES

    names = ", ".join(repr(n) for n in sorted(POLICIES))
    assert {"lru", "lfu", "lfu-da", "fifo", "mru", "priority", "ttl"} <= set(POLICIES)
    with pytest.raises(ValueError, match=re.escape(f"choose one of [{names}]")):
        make_policy("mfu")
    with pytest.raises(ValueError, match="positive number of seconds"):
        TTLPolicy(0)


# ---------------------------------------------------------------- tree
def test_tree_insert_rejects(bm) -> None:
    tree = bm.tree
    node0 = tree.device_block(bm.block_table("live")[0])
    tok = token_bytes([9, 9])
    h = hash_token_blocks([9, 9], 2, NS)[0]
    free_block = next(b for b in range(bm.pool.num_blocks) if bm.pool.is_free(b))
    private = bm.block_table("live")[-1]
    host_node = None
    cases = [
        ((None, node0.block_hash, node0.tokens, private), "already cached"),
        ((None, h, tok, node0.block_id), "already caches another hash"),
        ((None, h, tok, free_block), "is free; allocate it first"),
        ((None, h, tok[:4], private), "a block holds 2 tokens, got 1"),
    ]
    del host_node
    for args, msg in cases:
        before = snapshot_tree(tree)
        with pytest.raises(InvalidBlockError, match=msg):
            tree.insert(*args)
        assert_unchanged(before, snapshot_tree(tree), f"insert {msg}")
    tree.check_invariants()


def test_tree_insert_under_host_parent(bm) -> None:
    tree = bm.tree
    bm.free("live")
    tree.evict(0, 2)                                   # both cached blocks -> host
    parent = tree.get(hash_token_blocks([1, 1], 2, NS)[0])
    assert parent.tier == 1
    b = bm.pool.allocate_one()
    before = snapshot_tree(tree)
    with pytest.raises(InvalidBlockError, match="must be cached on the device"):
        tree.insert(parent.block_hash, hash_token_blocks([1, 1, 7, 7], 2, NS)[1],
                    token_bytes([7, 7]), b)
    assert_unchanged(before, snapshot_tree(tree), "insert under host parent")


def test_tree_evict_too_many(bm) -> None:
    tree = bm.tree
    before = snapshot_tree(tree)
    with pytest.raises(OutOfBlocks, match="need 1 blocks.*0 evictable.*in use by a live sequence"):
        tree.evict(0, 1)                               # both cached blocks are held by "live"
    with pytest.raises(OutOfBlocks, match="need 3 blocks"):
        tree.evict(1, 3)                               # host holds nothing
    assert_unchanged(before, snapshot_tree(tree), "evict")


@bug4("evict(tier out of range) raises IndexError (or evicts from the wrong tier)")
@pytest.mark.parametrize("args", [(5, 1), (-4, 1)])
def test_tree_evict_bad_args(bm, args) -> None:
    expect(bm, RadixKVError, bm.tree.evict, *args)


# ---------------------------------------------------------------- manager
@pytest.mark.parametrize("tokens,msg", BAD_TOKENS)
def test_allocate_bad_tokens(bm, tokens, msg) -> None:
    expect(bm, InvalidTokensError, bm.allocate, "new", tokens, NS, match=msg)
    with pytest.raises(InvalidTokensError, match=msg):
        bm.can_allocate(tokens, NS)


@pytest.mark.parametrize("tokens,msg", BAD_TOKENS)
def test_append_slots_bad_tokens(bm, tokens, msg) -> None:
    expect(bm, InvalidTokensError, bm.append_slots, "live", tokens, match=msg)


@pytest.mark.parametrize("token", [-1, 2**31, 1.0, "1", None, True, [1]])
def test_append_slot_bad_token(bm, token) -> None:
    expect(bm, InvalidTokensError, bm.append_slot, "live", token, match=r"token id must be an int")


def test_allocate_existing(bm) -> None:
    expect(bm, SequenceExistsError, bm.allocate, "live", [1], NS,
           match="already live; free it first")


def test_out_of_blocks_is_actionable(bm) -> None:
    err = expect(bm, OutOfBlocks, bm.allocate, "big", list(range(40)), NS)
    assert (err.needed, err.free) == (20, bm.num_free_blocks)
    assert "need 20 blocks" in str(err) and "raise the number of device blocks" in str(err)
    assert not bm.can_allocate(list(range(40)), NS)


def test_append_out_of_blocks(bm) -> None:
    bm.allocate("filler", [5] * (2 * bm.num_available_blocks), NS)   # takes every block
    bm.append_slot("live", 3)                           # fills the partial tail: no new block
    err = expect(bm, OutOfBlocks, bm.append_slot, "live", 3, match="preempt a sequence")
    assert err.needed == 1
    expect(bm, OutOfBlocks, bm.append_slots, "live", [1, 2, 3])


@pytest.mark.parametrize("op", ["append_slot", "append_slots", "commit", "fork", "free",
                                "block_table", "num_tokens", "num_computed_tokens", "token_ids",
                                "blocks_needed_to_append"])
@pytest.mark.parametrize("sid", ["gone", "never", 12345, None])
def test_unknown_sequence(bm, op, sid) -> None:
    args = {"append_slot": (sid, 1), "append_slots": (sid, [1]), "commit": (sid, 0),
            "fork": (sid, "child")}.get(op, (sid,))
    err = expect(bm, UnknownSequenceError, getattr(bm, op), *args)
    assert repr(sid) in str(err) and "not live" in str(err)


def test_double_free_and_fork_of_freed(bm) -> None:
    bm.fork("live", "kid")
    bm.free("kid")
    expect(bm, UnknownSequenceError, bm.free, "kid", match="already freed")
    expect(bm, UnknownSequenceError, bm.fork, "kid", "grandkid")


def test_fork_into_live_id(bm) -> None:
    bm.fork("live", "kid")
    expect(bm, SequenceExistsError, bm.fork, "live", "kid", match="already live")
    expect(bm, SequenceExistsError, bm.fork, "live", "live")


@pytest.mark.parametrize("n", [-1, 2, 6, 100, 5.0, "5", None])
def test_commit_out_of_range(bm, n) -> None:
    # "live" has 5 tokens, 5 computed: only commit(live, 5) is valid
    expect(bm, InvalidTokensError, bm.commit, "live", n,
           match=r"num_computed_tokens must be in \[5, 5\]")


@bug4("commit(seq, True) is accepted and stores num_computed=True")
def test_commit_bool(bm) -> None:
    bm.allocate("s2", [1, 2, 3], NS)
    expect(bm, InvalidTokensError, bm.commit, "s2", True)


@bug4("unhashable sequence ids raise a bare TypeError in allocate/fork")
@pytest.mark.parametrize("call", ["allocate", "fork"])
def test_unhashable_seq_id(bm, call) -> None:
    if call == "allocate":
        expect(bm, RadixKVError, bm.allocate, ["x"], [1, 2], NS)
    else:
        expect(bm, RadixKVError, bm.fork, "live", ["x"])


@bug4("allocate(seq, None, ns) raises a bare TypeError")
def test_allocate_none_tokens(bm) -> None:
    expect(bm, InvalidTokensError, bm.allocate, "new", None, NS)


@bug4("allocate(seq, tokens, 'm') (namespace not a Namespace) raises AttributeError")
def test_allocate_bad_namespace(bm) -> None:
    expect(bm, RadixKVError, bm.allocate, "new", [1, 2], "m")


# ---------------------------------------------------------------- layering
def test_core_imports_no_torch() -> None:
    code = ("import sys\n"
            "import radixkv.core.hashing, radixkv.core.policy, radixkv.core.pool\n"
            "import radixkv.core.tree, radixkv.core.block_manager, radixkv.errors\n"
            "bad = sorted(m for m in sys.modules\n"
            "             if m.split('.')[0] in ('torch', 'triton', 'numpy', 'transformers'))\n"
            "assert not bad, bad\n"
            "print('ok')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_tail_flag_and_limit_reject_bad_values_and_change_nothing() -> None:
    """``allocate(..., tail=...)`` takes a bool only; a kept tail survives the refusal."""
    from radixkv.config import CacheConfig
    from radixkv.errors import InvalidRequestError

    bm = BlockManager.create(8, block_size=4, tail_blocks=2)
    ns = Namespace("m")
    bm.allocate("a", [1, 2, 3, 4, 5, 6], ns, tail=True)
    bm.commit("a", 6)
    bm.free("a")
    assert len(bm.tails) == 1
    before = snapshot_manager(bm)
    for bad in ("yes", 1, None):
        with pytest.raises(InvalidRequestError, match="tail"):
            bm.allocate("b", [1, 2, 3, 4, 5, 6, 7], ns, tail=bad)
    assert_unchanged(before, snapshot_manager(bm), "allocate(tail=bad)")
    assert bm.allocate("b", [1, 2, 3, 4, 5, 6, 7], ns, tail=True).num_cached_tokens == 6
    for bad in (-1, 2.5, True):
        with pytest.raises(ConfigError, match="tail_blocks"):
            CacheConfig(tail_blocks=bad)


def test_tail_tokens_after_reads_what_a_request_would_take_and_changes_nothing() -> None:
    """``tail_tokens_after``: the rows of a kept tail that continue a matched chain (as
    ``allocate(tail=True)`` would take them), 0 where the chain left the device, no tail
    follows it or the tokens differ; a non-namespace is refused; nothing changes."""
    from radixkv.core.hashing import token_bytes

    bm = BlockManager.create(8, block_size=4, tail_blocks=2, lower_tier_blocks=[8])
    ns = Namespace("m")
    bm.allocate("a", [1, 2, 3, 4, 5, 6], ns, tail=True)
    bm.commit("a", 6)
    bm.free("a")                                   # block [1..4] cached, tail rows [5, 6]
    before = snapshot_manager(bm)
    prompt = [1, 2, 3, 4, 5, 6, 9]
    chain = bm.tree.match_tokens(token_bytes(prompt), ns.seed)
    assert len(chain) == 1
    assert bm.tail_tokens_after(prompt, ns, chain) == 2
    assert bm.tail_tokens_after([1, 2, 3, 4, 5, 8], ns, chain) == 1    # common rows only
    assert bm.tail_tokens_after([1, 2, 3, 4], ns, chain) == 0           # nothing past it
    assert bm.tail_tokens_after([7, 7], ns, []) == 0                    # no tail at the root
    assert bm.tail_tokens_after(prompt, Namespace("m", "salt"), chain) == 0
    lower = [chain[0]._replace(tier=1)]                                 # chain off the device
    assert bm.tail_tokens_after(prompt, ns, lower) == 0
    assert bm.tail_tokens_after(prompt, Namespace("other-model"), chain) == 0
    with pytest.raises(InvalidTokensError, match="namespace"):
        bm.tail_tokens_after(prompt, "m", chain)   # type: ignore[arg-type]
    assert_unchanged(before, snapshot_manager(bm), "tail_tokens_after")
    assert bm.allocate("b", prompt, ns, tail=True).num_cached_tokens == 6
