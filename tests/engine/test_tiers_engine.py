"""The engine over device + host + disk tiers, end to end, on tiny random-weight models.

* greedy output equals transformers' ``generate`` while a tiny device pool makes the tree demote
  and promote blocks constantly (and hits come from the host and disk tiers);
* restart: one process caches a conversation's prefix to disk and exits; a fresh interpreter on
  the same directory gets those blocks as disk hits, with byte-identical KV;
* faults: a file corrupted between two engines is a counted miss (recomputed, same output); a
  disk that fails every write (ENOSPC) degrades to misses, never a crash or a wrong block.

After every run the files on disk are exactly the disk tier's blocks.
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch


CHILD = Path(__file__).with_name("tiers_child.py")
sys.path.insert(0, str(CHILD.parent))
import tiers_child  # noqa: E402  (conversation and engine config shared with the child)
from tiers_helpers import (  # noqa: E402
    BS, check_tiers, hf_greedy, make_engine, rand_tokens, serve,
)



@pytest.fixture(scope="module")
def hf_llama(make_tiny):
    return make_tiny("llama")






_serve = serve






def _conversations(hf, eng, n_conv=3, turns=3, batched_last=True):
    """Interleaved multi-turn conversations: every turn's prompt extends the previous turn's
    prompt + reply, so its prefix was computed turns ago and sank through the tiers meanwhile.
    Checks every reply against HF; returns the final outputs."""
    prompts = [rand_tokens(21, 100 + c) for c in range(n_conv)]
    outs = {}
    for t in range(turns):
        batch = [(f"c{c}t{t}", prompts[c]) for c in range(n_conv)]
        if batched_last and t == turns - 1:
            outs.update(_serve(eng, batch))
        else:
            for item in batch:
                outs.update(_serve(eng, [item]))
        for c in range(n_conv):
            got = outs[f"c{c}t{t}"].outputs[0].token_ids
            assert got == hf_greedy(hf, prompts[c]), f"conversation {c} turn {t}"
            prompts[c] = prompts[c] + list(got) + rand_tokens(5, 1000 * t + c)
    return outs


@pytest.mark.parametrize("tiers,async_loads", [("host+disk", True), ("disk", True),
                                               ("host+disk", False)])
def test_greedy_matches_hf_while_blocks_move_through_tiers(hf_llama, tmp_path, tiers,
                                                           async_loads):
    host = 6 if tiers == "host+disk" else 0
    eng = make_engine(hf_llama, tmp_path, device=16, host=host, disk=64,
                      async_loads=async_loads)
    assert eng.tier_names == ["device", *(["host"] if host else []), "disk"]
    outs = _conversations(hf_llama, eng)
    st = eng.stats()
    disk_t = len(eng.tier_names) - 1
    # blocks went down and came back up through every lower tier, and requests hit them there
    assert all(st["demotions"][t] > 0 and st["promotions"][t] > 0 for t in range(1, disk_t + 1))
    assert all(st["cached_prompt_tokens_per_tier"][t] > 0 for t in range(1, disk_t + 1)), st
    assert sum(o.num_cached_tokens for o in outs.values()) == st["cached_prompt_tokens"] > 0
    assert st["bytes_moved"]["disk->device"] > 0
    assert st["bytes_moved"][f"{eng.tier_names[disk_t - 1]}->disk"] > 0
    assert st["load_failures"] == st["write_failures"] == 0
    assert st["tiers"] == eng.tier_names and st["tier_capacity_blocks"][0] == 16
    assert st["cached_blocks_per_tier"][disk_t] == st["disk"]["files"]
    # promotions ran behind the step (async) or inside the scheduler (sync)
    assert (st["async_load_batches"] > 0) == async_loads
    eng.close()


def _two_processes(tmp_path, first_mode: str) -> tuple[dict, dict]:
    """Run tiers_child.py in ``first_mode`` then in "read" mode on the same directory, each in
    a fresh interpreter; their saved results."""
    res = []
    for mode in (first_mode, "read"):
        out = tmp_path / f"{mode}.pt"
        child = subprocess.run([sys.executable, str(CHILD), mode, str(tmp_path / "kv"), str(out)],
                               capture_output=True, text=True, timeout=120)
        assert child.returncode == 0, child.stderr[-3000:]
        res.append(torch.load(out))
    return res[0], res[1]


def test_restart_second_process_gets_disk_hits_with_identical_kv(tmp_path):
    """Process 1 serves a conversation prefix, persists its cache to disk and exits; a fresh
    interpreter on the same directory gets the prefix from the disk tier, and the KV it loads
    into its device pool is byte-identical to what process 1 computed."""
    first, second = _two_processes(tmp_path, "write")
    n_blocks = (tiers_child.PROMPT_LEN - 1) // tiers_child.BLOCK
    assert first["num_cached"] == 0 and first["disk_files"] >= n_blocks
    assert second["restored"] == first["disk_files"]
    assert second["num_cached"] == n_blocks * tiers_child.BLOCK
    assert second["per_tier"] == [0, 0, n_blocks * tiers_child.BLOCK]   # all from disk
    assert second["tokens"] == first["tokens"]
    assert second["hashes"] == first["hashes"] and len(first["hashes"]) == n_blocks
    assert first["kv"].abs().sum() > 0
    assert torch.equal(second["kv"], first["kv"])   # bit for bit
    assert second["load_failures"] == 0


def test_write_through_to_disk_survives_a_process_exit_without_persist(tmp_path):
    """With write_through=("disk",) every computed block is copied to disk as soon as it is
    committed: a process that serves the conversation and dies (os._exit, no persist(), no
    close()) leaves the prefix on disk, and a fresh interpreter loads it bit-identically."""
    first, second = _two_processes(tmp_path, "wt-exit")
    n_blocks = (tiers_child.PROMPT_LEN - 1) // tiers_child.BLOCK
    assert first["num_cached"] == 0 and first["disk_files"] >= n_blocks
    assert second["restored"] == first["disk_files"]
    assert second["per_tier"] == [0, 0, n_blocks * tiers_child.BLOCK]
    assert second["tokens"] == first["tokens"]
    assert torch.equal(second["kv"], first["kv"])


@pytest.mark.parametrize("wt", [("host",), ("host", "disk")])
def test_write_through_matches_hf_with_free_demotions(hf_llama, tmp_path, wt):
    eng = make_engine(hf_llama, tmp_path, device=16, host=6, disk=64, write_through=wt)
    outs = _conversations(hf_llama, eng)
    st = eng.stats()
    assert st["write_through"] == list(wt)
    assert st["copies_made"] > 0 and st["free_demotions"] > 0
    assert st["bytes_moved"]["device->host"] > 0
    if "disk" in wt:
        assert st["bytes_moved"]["device->disk"] > 0    # copies written straight from the device
    assert st["load_failures"] == st["write_failures"] == 0
    assert sum(o.num_cached_tokens for o in outs.values()) == st["cached_prompt_tokens"] > 0
    assert all(st["cached_prompt_tokens_per_tier"][t] > 0 for t in (1, 2)), st
    eng.close()


def test_write_through_copy_whose_write_fails_is_dropped(hf_llama, tmp_path, monkeypatch):
    eng = make_engine(hf_llama, tmp_path, device=16, host=6, disk=64, write_through=("disk",))

    def enospc(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(eng.kv_mover.disk, "_write_file", enospc)
    _conversations(hf_llama, eng, n_conv=2, turns=2)    # outputs checked against HF inside
    st = eng.stats()
    assert st["failed_copy_writes"] > 0 and st["copies_per_tier"][2] == 0
    assert st["disk"]["files"] == 0 and st["cached_prompt_tokens_per_tier"][2] == 0
    eng.close()


def test_write_through_config_is_validated():
    from radixkv.config import CacheConfig
    from radixkv.errors import ConfigError
    for bad in ("host", ("gpu",), ("host", "host"), 1):
        with pytest.raises(ConfigError):
            CacheConfig(host_blocks=4, write_through=bad)
    with pytest.raises(ConfigError, match="not configured"):
        CacheConfig(host_blocks=4, write_through=("disk",))
    assert CacheConfig(host_blocks=4, write_through=["host"]).write_through == ("host",)


@pytest.mark.parametrize("fault", ["flip payload byte", "truncate"])
def test_corrupt_file_between_processes_is_a_counted_miss(hf_llama, tmp_path, fault):
    prompt = tiers_child.conversation()
    want = hf_greedy(hf_llama, prompt)
    a = make_engine(hf_llama, tmp_path, device=32, host=8, disk=64)
    assert _serve(a, [("r", prompt)])["r"].outputs[0].token_ids == want
    a.persist()
    check_tiers(a)
    bad = 4  # the 5th block of the prompt's chain
    from radixkv.core.hashing import token_bytes
    hashes = a.tree.match_hashes(token_bytes(prompt), a.namespace.seed)
    path = a.kv_mover.disk.path_of(hashes[bad])
    a.close()
    data = bytearray(path.read_bytes())
    if fault == "truncate":
        path.write_bytes(data[:len(data) // 2])
    else:
        data[-3] ^= 0x40
        path.write_bytes(data)

    b = make_engine(hf_llama, tmp_path, device=32, host=8, disk=64)
    check_tiers(b)
    out = _serve(b, [("r", prompt)])["r"]
    assert out.outputs[0].token_ids == want               # recomputed, not garbage
    assert out.num_cached_tokens == bad * BS              # hit up to the bad block only
    assert list(out.cached_tokens_per_tier) == [0, 0, bad * BS]
    st = b.stats()
    assert st["disk"]["corrupt"] == 1
    if fault == "truncate":   # caught by the index rebuild: never inserted, nor its subtree
        assert st["disk"]["restored_blocks"] == bad and st["load_failures"] == 0
        assert st["disk"]["orphan_files"] == len(hashes) + 1 - bad - 1
    else:                      # caught by the payload checksum on load: invalidated, retried
        assert st["load_failures"] == 1 == st["load_retries"]
    assert not path.exists()
    # the block is cached again (recomputed), and a second request hits the whole prefix
    out2 = _serve(b, [("r2", prompt)])["r2"]
    assert out2.outputs[0].token_ids == want and out2.num_cached_tokens == len(hashes) * BS
    b.close()


def test_failing_disk_writes_degrade_to_misses(hf_llama, tmp_path, monkeypatch):
    eng = make_engine(hf_llama, tmp_path, device=16, host=6, disk=64)
    disk = eng.kv_mover.disk

    def enospc(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(disk, "_write_file", enospc)
    _conversations(hf_llama, eng)             # outputs checked against HF inside
    st = eng.stats()
    # the writes ran behind the step (write-behind) and still degraded to misses
    assert st["async_batches"] > 0
    assert st["write_failures"] > 0 and st["disk"]["put_failures"] == st["write_failures"]
    assert st["disk"]["failures_by_errno"] == {"ENOSPC": st["write_failures"]}
    assert st["cached_blocks_per_tier"][2] == 0 and st["disk"]["files"] == 0
    assert st["cached_prompt_tokens_per_tier"][2] == 0
    # a block whose write failed may be promoted later in the same move list (its load then
    # fails too and the request recomputes it): counted as a load failure, never served
    assert st["load_failures"] == st["mover_load_failures"] <= st["write_failures"]
    assert st["cached_prompt_tokens_per_tier"][1] > 0   # the host tier still works
    # the disk recovers: demotions land again and later requests hit the disk tier
    monkeypatch.undo()
    eng2 = make_engine(hf_llama, tmp_path / "again", device=16, host=6, disk=64)
    _conversations(hf_llama, eng2, n_conv=2, turns=2, batched_last=False)
    assert eng2.stats()["write_failures"] == 0
    eng.close()
    eng2.close()


def test_adopting_a_recomputed_disk_block_removes_its_file(hf_llama, tmp_path):
    """Regression (found in session 4): a block that was on disk and then recomputed on the
    device (adopted, no load) left its file behind: the files on disk were no longer exactly
    the disk tier's blocks, and the store's usage grew past the tier. The adoption now queues
    a drop of the old residency."""
    eng = make_engine(hf_llama, tmp_path, device=12, host=6, disk=64, prefetch=0,
                      async_loads=False)
    convs = [rand_tokens(21, 100 + c) for c in range(4)]
    for rnd in range(2):
        serve(eng, [(f"r{rnd}{i}", p) for i, p in enumerate(convs)], max_tokens=8)  # checks
    assert eng.tree.stats.adopted > 0   # the scenario really adopted blocks


def test_reset_prefix_cache_empties_every_tier_and_leaves_running_requests_alone(
        hf_llama, tmp_path):
    """``LLMEngine.reset_prefix_cache`` (vLLM's): after conversations sank through host and
    disk, a reset drops every block of every tier and every file, and the next turn is cold
    with the same output; a reset while a request runs keeps that request's blocks and output."""
    from radixkv.engine.sampling import SamplingParams

    eng = make_engine(hf_llama, tmp_path, device=12, host=6, disk=64)
    convs = [rand_tokens(21, 300 + c) for c in range(3)]
    first = serve(eng, [(f"a{i}", p) for i, p in enumerate(convs)])   # checks the outputs
    assert eng.tree.num_resident(1) + eng.tree.num_resident(2) > 0   # blocks sank
    cached = len(eng.tree)
    assert eng.reset_prefix_cache() == cached and len(eng.tree) == 0
    check_tiers(eng)   # no file left behind
    again = serve(eng, [(f"b{i}", p) for i, p in enumerate(convs)])
    for i in range(3):
        assert again[f"b{i}"].num_cached_tokens == 0
        assert again[f"b{i}"].outputs[0].token_ids == first[f"a{i}"].outputs[0].token_ids
    # mid-request: its blocks are held and stay; the rest goes
    eng.add_request("live", convs[0], SamplingParams(max_tokens=8))
    eng.step()
    eng.step()
    assert 0 < eng.reset_prefix_cache() < cached + 1
    final = None
    while eng.has_unfinished_requests():
        for out in eng.step():
            final = out
    assert final.outputs[0].token_ids == hf_greedy(hf_llama, convs[0], 8)
    check_tiers(eng)
