"""Child process of the engine restart test (run as a script, not collected by pytest).

    python tiers_child.py write DIR OUT   serve the conversation, save its prompt's KV, persist
    python tiers_child.py read DIR OUT    fresh engine on DIR: serve it again, save what it loaded
    python tiers_child.py wt-exit DIR OUT  write-through to disk: serve, save, then os._exit(0)
                                           (no persist(), no close(): a process that dies)

Both write ``OUT`` (``torch.save`` of plain tensors and lists): the output tokens, the cache hit
figures, and the KV bytes ``[n_blocks, L, 2, block_size, h, d]`` of the prompt's cached blocks
as they sit in the device pool (process 1: computed; process 2: loaded from disk).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import torch

from radixkv.config import CacheConfig, EngineConfig  # noqa: E402
from radixkv.core.hashing import token_bytes  # noqa: E402
from radixkv.engine.llm_engine import LLMEngine  # noqa: E402
from radixkv.engine.sampling import SamplingParams  # noqa: E402



def _engine_conftest():
    """tests/engine/conftest.py under its own name (``conftest`` may be another directory's)."""
    spec = importlib.util.spec_from_file_location("_radixkv_engine_conftest",
                                                  Path(__file__).with_name("conftest.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


BLOCK = 4
PROMPT_LEN = 33        # 8 full blocks can be cached (the last token is always computed)
MAX_TOKENS = 6


def conversation() -> list[int]:
    g = torch.Generator().manual_seed(7)
    return torch.randint(0, 256, (PROMPT_LEN,), generator=g).tolist()


def make_engine(disk_dir: str, write_through: tuple[str, ...] = ()) -> LLMEngine:
    return LLMEngine(_engine_conftest().make_tiny_model("llama"), None,
                     CacheConfig(block_size=BLOCK, num_device_blocks=32, host_blocks=8,
                                 disk_dir=disk_dir, disk_blocks=64, write_through=write_through),
                     EngineConfig(max_num_seqs=4, max_num_batched_tokens=128), model_id="tiny")


def serve(eng: LLMEngine, rid: str, prompt: list[int]):
    eng.add_request(rid, prompt, SamplingParams(max_tokens=MAX_TOKENS))
    final = None
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                final = out
    return final


def prompt_kv(eng: LLMEngine, prompt: list[int]) -> tuple[list[bytes], torch.Tensor]:
    """Hashes and device KV of the prompt's cached blocks (all on the device now)."""
    nodes = eng.tree.match_tokens(token_bytes(prompt), eng.namespace.seed)

    hashes = [n.block_hash for n in nodes]
    assert all(n.tier == 0 for n in nodes), [n.tier for n in nodes]
    kv = eng.model_runner.kv_cache
    return hashes, torch.stack([kv[:, :, n.block_id].clone() for n in nodes])


def main(argv: list[str]) -> int:
    mode, disk_dir, out = argv
    eng = make_engine(disk_dir, ("disk",) if mode == "wt-exit" else ())
    prompt = conversation()
    res = serve(eng, "conv", prompt)
    hashes, kv = prompt_kv(eng, prompt)
    if mode == "write":
        moved = eng.persist()
        assert moved > 0 and eng.tree.num_resident(0) == 0
    stats = eng.stats()
    torch.save({"tokens": list(res.outputs[0].token_ids), "num_cached": res.num_cached_tokens,
                "per_tier": list(res.cached_tokens_per_tier), "hashes": hashes, "kv": kv,
                "restored": (eng.restore_report or {}).get("restored_blocks"),
                "disk_files": stats["disk"]["files"], "load_failures": stats["load_failures"]},
               out)
    if mode == "wt-exit":
        os._exit(0)   # the engine is idle, so its write-through writes have landed
    eng.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
