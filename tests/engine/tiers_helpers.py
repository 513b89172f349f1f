"""Helpers shared by the tier tests (test_tiers_engine.py, test_tiers_async.py): a tiny tiered
engine, the transformers reference, seeded prompts, and the tier consistency check."""

from __future__ import annotations

import copy

import torch

from radixkv.config import CacheConfig, EngineConfig
from radixkv.engine.llm_engine import LLMEngine
from radixkv.tiers.mover import TieredKVMover

BS = 4     # tokens per block: small so a short prompt spans many blocks
GEN = 6    # tokens generated per request


def make_engine(hf, tmp_path, device=16, host=6, disk=64, max_num_seqs=4, prefetch=4,
                async_loads=True, scheduling_policy="lpm", **cache_kw) -> LLMEngine:
    """A tiny tiered engine over a copy of ``hf`` (no disk tier when ``disk`` is 0)."""
    return LLMEngine(copy.deepcopy(hf), None,
                     CacheConfig(block_size=BS, num_device_blocks=device, host_blocks=host,
                                 disk_dir=str(tmp_path / "kv") if disk else None,
                                 disk_blocks=disk, **cache_kw),
                     EngineConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=128,
                                  prefetch_requests=prefetch, async_loads=async_loads,
                                  scheduling_policy=scheduling_policy),
                     model_id="tiny")


def hf_greedy(hf, prompt, max_new=GEN) -> list[int]:
    """transformers' own greedy continuation of ``prompt`` (the reference output)."""
    ids = torch.tensor([prompt])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                      do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def rand_tokens(n, seed) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), generator=g).tolist()


def check_tiers(eng: LLMEngine) -> None:
    """Tree, pools and tables agree; an idle tiered engine has drained every write, and the
    files on disk are exactly the disk tier's blocks."""
    eng.block_manager.check_invariants()
    mover = eng.kv_mover
    if not isinstance(mover, TieredKVMover):
        return
    assert mover.num_pending == 0, f"{mover.num_pending} disk batches pending while idle"
    if mover.disk is None:
        return
    tree, disk_t = eng.tree, mover.disk_tier
    on_disk = {h for h, n in tree.block_index().items()      # primaries and write-through copies
               if n.tier == disk_t or tree.copy_block_id(h, disk_t) is not None}
    indexed = {e.block_hash for e in mover.disk.entries()}
    files = {bytes.fromhex(p.stem) for p in mover.disk.dir.glob("*/*.kvb")}
    assert on_disk == indexed == files, (len(on_disk), len(indexed), len(files))


def serve(eng: LLMEngine, batch, max_tokens=GEN, in_flight=None) -> dict:
    """Add [(rid, prompt)], step to completion; rid -> final RequestOutput. ``in_flight`` (a
    list) collects the mover's pending batch count after each step. Checks the tiers at the end."""
    from radixkv.engine.sampling import SamplingParams

    for rid, prompt in batch:
        eng.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens))
    final = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                final[out.request_id] = out
        if in_flight is not None:
            in_flight.append(eng.kv_mover.num_pending)
    check_tiers(eng)
    return final
