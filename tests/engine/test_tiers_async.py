"""Tier moves off the critical path: write-behind disk writes and disk -> host prefetch.

* with tiny device/host pools and a disk tier, host -> disk writes run behind the step (batches
  are still in flight while the forward runs) and greedy output still equals transformers';
* a request waiting in the queue gets its disk blocks loaded into the host tier before it is
  scheduled, so its hit comes from the host tier;
* a disk that fails every write (ENOSPC) under write-behind, and a prefetch whose file is
  corrupt, degrade to misses with the right output.

After every run the files on disk are exactly the disk tier's blocks.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from radixkv.core.hashing import token_bytes
from radixkv.engine.sampling import SamplingParams
from radixkv.tiers.mover import TieredKVMover

sys.path.insert(0, str(Path(__file__).parent))
from tiers_helpers import (  # noqa: E402
    BS, GEN, check_tiers, hf_greedy, make_engine, rand_tokens, serve,
)


@pytest.fixture(scope="module")
def hf_llama(make_tiny):
    return make_tiny("llama")










_serve = serve


def _conversations(hf, eng, n_conv=3, turns=3, in_flight=None):
    prompts = [rand_tokens(21, 100 + c) for c in range(n_conv)]
    for t in range(turns):
        for c in range(n_conv):
            out = _serve(eng, [(f"c{c}t{t}", prompts[c])], in_flight=in_flight)[f"c{c}t{t}"]
            got = out.outputs[0].token_ids
            assert got == hf_greedy(hf, prompts[c]), f"conversation {c} turn {t}"
            prompts[c] = prompts[c] + list(got) + rand_tokens(5, 1000 * t + c)


def test_write_behind_overlaps_steps_and_matches_hf(hf_llama, tmp_path):
    eng = make_engine(hf_llama, tmp_path, device=16, host=6, disk=64)
    in_flight: list[int] = []
    _conversations(hf_llama, eng, in_flight=in_flight)
    st = eng.stats()
    assert st["async_batches"] > 0 and st["bytes_moved"]["host->disk"] > 0
    assert max(in_flight) > 0          # writes not yet drained when step() returned (overlap)
    assert st["cached_prompt_tokens_per_tier"][2] > 0 and st["bytes_moved"]["disk->device"] > 0
    assert st["load_failures"] == st["write_failures"] == 0
    assert st["cached_blocks_per_tier"][2] == st["disk"]["files"]
    eng.close()


def _prefetch_scenario(hf, tmp_path, prefetch, corrupt=None):
    """Cache prompt P, persist it to disk; then a long request A runs alone
    (max_num_seqs=1) while B (P plus a tail) waits; B is scheduled once A is done. In arrival
    order (fcfs): lpm would admit B, the longer cached prefix, first, and nothing would wait."""
    eng = make_engine(hf, tmp_path, device=32, host=8, disk=64, max_num_seqs=1, prefetch=prefetch,
                      scheduling_policy="fcfs")
    p = rand_tokens(33, 7)
    _serve(eng, [("warm", p)])
    assert eng.persist() > 0 and eng.tree.num_resident(0) == 0
    check_tiers(eng)
    if corrupt is not None:
        from radixkv.core.hashing import token_bytes
        hashes = eng.tree.match_hashes(token_bytes(p), eng.namespace.seed)
        path = eng.kv_mover.disk.path_of(hashes[corrupt])
        data = bytearray(path.read_bytes())
        data[-3] ^= 0x40
        path.write_bytes(data)
    b_prompt = p + rand_tokens(3, 8)
    outs = _serve(eng, [("A", rand_tokens(9, 9)), ("B", b_prompt)], max_tokens=GEN)
    assert outs["B"].outputs[0].token_ids == hf_greedy(hf, b_prompt)
    return eng, outs["B"]


def test_waiting_request_is_prefetched_disk_to_host(hf_llama, tmp_path):
    eng, b = _prefetch_scenario(hf_llama, tmp_path, prefetch=4)
    n = 32 // BS   # blocks of B's prefix cached on disk
    assert b.num_cached_tokens == n * BS
    assert list(b.cached_tokens_per_tier) == [0, n * BS, 0]     # served from the host tier
    st = eng.stats()
    assert st["prefetched_blocks"] == n == st["prefetch_hits"]
    assert st["bytes_moved"]["disk->host"] > 0 and "disk->device" not in st["bytes_moved"]
    eng.close()
    # without prefetch the same request hits the disk tier
    eng0, b0 = _prefetch_scenario(hf_llama, tmp_path / "off", prefetch=0)
    assert list(b0.cached_tokens_per_tier) == [0, 0, n * BS]
    assert eng0.stats()["prefetched_blocks"] == 0
    eng0.close()


def test_corrupt_block_under_prefetch_is_a_miss(hf_llama, tmp_path):
    bad = 3
    eng, b = _prefetch_scenario(hf_llama, tmp_path, prefetch=4, corrupt=bad)
    assert b.num_cached_tokens == bad * BS                  # hit up to the bad block only
    assert list(b.cached_tokens_per_tier) == [0, bad * BS, 0]
    st = eng.stats()
    assert st["prefetch_failures"] == 1 and st["disk"]["corrupt"] == 1
    assert st["mover_load_failures"] == st["load_failures"] == 0
    # the blocks after the bad one were loaded too, then dropped with its subtree
    assert st["prefetched_blocks"] == 32 // BS - 1 and st["prefetch_hits"] == bad
    eng.close()


def test_failed_prefetch_of_a_node_moved_before_the_drain_is_never_copied(tmp_path, monkeypatch):
    """Mover level: a prefetch load fails, but the tree promoted the node host -> device before
    the drain (the engine never does this; the mover must still not copy garbage). The host
    copy is poisoned: the promotion is reported as a failed load, the device block untouched."""
    from radixkv.core.block_manager import BlockManager
    from radixkv.core.hashing import Namespace
    from radixkv.storage.disk import DiskStore
    from radixkv.storage.host import HostPool
    from radixkv.storage.layout import KVLayout

    layout = KVLayout(1, 1, 2, BS, "float32")
    bm = BlockManager.create(4, BS, lower_tier_blocks=[2, 4])
    tree = bm.tree
    kv = torch.zeros(layout.cache_shape(4), dtype=torch.float32)
    mover = TieredKVMover(kv, layout, HostPool(layout, 2),
                          DiskStore(tmp_path / "kv", layout, b"n" * 16, scan=False), tree)
    ns = Namespace("m")
    bm.allocate("a", [1, 2, 3, 4, 5], ns)
    kv[:, :, bm.block_table("a")[0]] = 7.0
    bm.commit("a", 5)
    bm.free("a")
    moves = tree.evict(0, tree.num_evictable(0)) + tree.evict(1, tree.num_evictable(1))
    mover.apply_moves(moves)                   # device -> host -> disk (a pending write)
    mover.drain()
    [h] = list(tree.block_index())
    assert tree.get(h).tier == 2 and mover.num_pending == 0
    monkeypatch.setattr(mover.disk, "read_into", lambda h, out: False)
    mover.apply_moves(tree.promote_lower(h, 1))          # prefetch left running
    assert mover.num_pending == 1
    kv[:, :, 3] = -1.0
    bm.pool._free.remove(3)                             # device block 3, taken for the load
    bm.pool._is_free[3] = 0
    mover.apply_moves(tree.promote_nodes([tree.block_index()[h]], [3], 0.0))   # before the drain
    assert mover.take_failed_loads() == [h]
    assert torch.all(kv[:, :, 3] == -1.0)                # garbage never copied on
    assert mover.stats.prefetch_failures == 1 and mover.stats.load_failures == 1
    mover.close()


def _loading_scenario(hf, tmp_path, tails, corrupt=None):
    """Cache prompt P and persist it to disk; a long request A decodes while requests
    P + tail (for each tail) arrive: their disk -> device loads run while A computes."""
    p = rand_tokens(32, 7)
    eng = make_engine(hf, tmp_path, device=48, host=8, disk=64, prefetch=0)
    _serve(eng, [("warm", p)])
    eng.persist()
    if corrupt is not None:
        hashes = eng.tree.match_hashes(token_bytes(p), eng.namespace.seed)
        path = eng.kv_mover.disk.path_of(hashes[corrupt])
        data = bytearray(path.read_bytes())
        data[-5] ^= 0x10
        path.write_bytes(data)
    a_prompt = rand_tokens(9, 8)
    eng.add_request("A", a_prompt, SamplingParams(max_tokens=12))
    eng.step()                                     # A prefills
    prompts = {f"B{i}": p + tail for i, tail in enumerate(tails)}
    for rid, q in prompts.items():
        eng.add_request(rid, q, SamplingParams(max_tokens=GEN))
    eng.step()                                     # A decodes; the B's are admitted, loading
    loading = set(eng.scheduler.loading)
    final = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                final[out.request_id] = out
    check_tiers(eng)
    assert final["A"].outputs[0].token_ids == hf_greedy(hf, a_prompt, 12)
    for rid, q in prompts.items():
        assert final[rid].outputs[0].token_ids == hf_greedy(hf, q), rid
    return eng, final, loading


def test_promotions_run_while_another_request_computes(hf_llama, tmp_path):
    eng, final, loading = _loading_scenario(hf_llama, tmp_path, [[5, 6, 7]])
    assert loading == {"B0"}                       # held out of the forward A ran in
    assert list(final["B0"].cached_tokens_per_tier) == [0, 0, 32]
    st = eng.stats()
    assert st["async_load_batches"] > 0 and st["loading_request_steps"] >= 1
    assert st["bytes_moved"]["disk->device"] > 0 and st["load_failures"] == 0
    eng.close()


def test_corrupt_block_under_an_async_load_sends_both_holders_back(hf_llama, tmp_path):
    """B0 promotes P's blocks, B1 matches them in the same step; block 2's file is corrupt:
    both are sent back and recompute from block 2, and the outputs are still HF's."""
    eng, final, loading = _loading_scenario(hf_llama, tmp_path, [[5, 6, 7], [9, 9]], corrupt=2)
    assert loading == {"B0", "B1"}
    st = eng.stats()
    assert st["load_failures"] == 1 and st["disk"]["corrupt"] == 1
    assert st["load_retries"] >= 2
    assert final["B0"].num_cached_tokens == 2 * BS
    assert list(final["B0"].cached_tokens_per_tier) == [0, 0, 2 * BS]
    eng.close()


def test_async_load_is_waited_for_before_its_host_slot_is_rewritten(tmp_path):
    """Mover level: an allocation promotes x host -> device (left running: it reads host slot
    0) and, to make room for its tail, demotes y device -> host into that same slot. The
    demotion must wait for the load, or x would be promoted with y's bytes."""
    from radixkv.core.block_manager import BlockManager
    from radixkv.core.hashing import Namespace
    from radixkv.storage.host import HostPool
    from radixkv.storage.layout import KVLayout

    layout = KVLayout(1, 1, 2, BS, "float32")
    bm = BlockManager.create(3, BS, lower_tier_blocks=[1])
    tree = bm.tree
    kv = torch.zeros(layout.cache_shape(3), dtype=torch.float32)
    host = HostPool(layout, 1)
    mover = TieredKVMover(kv, layout, host, None, tree, async_host_loads=True)
    ns = Namespace("m")
    for sid, tok, val in (("x", [1, 2, 3, 4], 3.0), ("y", [5, 6, 7, 8], 5.0)):
        bm.allocate(sid, tok + [9], ns)
        kv[:, :, bm.block_table(sid)[0]] = val
        bm.commit(sid, 4)
        bm.free(sid)
    mover.apply_moves(tree.evict(0, 1))            # LRU x -> host slot 0 (a sync copy)
    a = bm.allocate("x2", [1, 2, 3, 4] + [9] * 5, ns)   # 3 blocks: x host -> device, and
    # y device -> host slot 0 to make room for the tail
    kinds = [(m.src_tier, m.dst_tier, m.src_block_id if m.src_tier else m.dst_block_id)
             for m in a.moves]
    assert kinds == [(1, 0, 0), (0, 1, 0)], kinds
    mover.apply_moves(a.moves)
    assert not mover.inflight_device_blocks()      # the demotion waited for the load
    assert torch.all(kv[:, :, bm.block_table("x2")[0]] == 3.0)
    assert torch.all(host.blocks[0] == 5.0)
    assert mover.stats.async_loads == 1 and mover.take_failed_loads() == []
    mover.close()
