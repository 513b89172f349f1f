"""The cache is keyed by the weights themselves (issue 33, item 1): a restart on replaced
weights in the same ``model_dir`` and ``disk_dir`` reuses no block the old weights computed,
while a restart on the same weights reuses them all; in-memory models are fingerprinted by their
tensors; a pinned ``model_id`` is the namespace as given."""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from radixkv import CacheConfig
from radixkv.api.engine import Engine, default_model_id
from radixkv.config import EngineConfig
from radixkv.errors import ConfigError

from .conftest import make_tiny_vocab_model

PROMPT = list(range(1000, 1080))   # 80 tokens: 5 full blocks of 16
GREEDY = {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True}


def _save(model_dir: Path, tok: Any, seed: int) -> None:
    make_tiny_vocab_model(len(tok), seed=seed).save_pretrained(str(model_dir))
    tok.save_pretrained(str(model_dir))


def _run(model_dir: Path, disk: Path | None) -> tuple[list[int], int, str]:
    cc = CacheConfig(block_size=16, num_device_blocks=64,
                     **({"disk_dir": str(disk), "disk_blocks": 256} if disk else {}))
    ec = EngineConfig(device="cpu", dtype="float32", max_model_len=512, max_num_seqs=4)
    eng = Engine.from_pretrained(str(model_dir), cache_config=cc, engine_config=ec,
                                 progress=False)
    try:
        out = eng.generate([PROMPT], GREEDY)[0]
        if disk is not None:
            eng.loop.call(eng.core.persist)   # what a restart finds on disk
        return list(out.outputs[0].token_ids), out.num_cached_tokens, eng.model_id
    finally:
        eng.close()


def test_replaced_weights_reuse_nothing_same_weights_reuse_all(
        tmp_path: Path, smol_tokenizer: Any, one_thread: Any, monkeypatch) -> None:
    monkeypatch.setenv("RADIXKV_CACHE_DIR", str(tmp_path / "cache"))   # digests.json here
    model_dir, disk = tmp_path / "model", tmp_path / "disk"
    _save(model_dir, smol_tokenizer, seed=0)
    first, cached, id_a = _run(model_dir, disk)
    assert cached == 0
    again, cached, id_again = _run(model_dir, disk)          # same weights: all of it reused
    assert (cached, again, id_again) == (64, first, id_a)   # the last block is computed
    # replace the weights in place, keeping the old file's size and mtime (cp -p, rsync -a)
    weights = model_dir / "model.safetensors"
    st = weights.stat()
    _save(model_dir, smol_tokenizer, seed=1)
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert weights.stat().st_size == st.st_size
    after, cached, id_b = _run(model_dir, disk)
    cold, _, _ = _run(model_dir, None)
    assert cached == 0 and id_b != id_a
    assert after == cold and after != first


def test_in_memory_models_are_named_by_their_tensors(tiny_model_shared: Any) -> None:
    model = copy.deepcopy(tiny_model_shared)
    base = default_model_id(model)
    assert base == default_model_id(copy.deepcopy(tiny_model_shared))   # same bytes, same id
    assert "float32" in base and default_model_id(model, torch.bfloat16) != base
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight[3, 5] += 1e-3        # one weight changed
    assert default_model_id(model) != base
    other = make_tiny_vocab_model(model.config.vocab_size, seed=7)       # same shapes
    assert default_model_id(other) != base
    same = copy.deepcopy(tiny_model_shared)
    same.config.rms_norm_eps *= 10                                       # same weights
    assert default_model_id(same) != default_model_id(tiny_model_shared)


def test_a_pinned_model_id_is_the_namespace(tiny_model_shared: Any, smol_tokenizer: Any,
                                            one_thread: Any) -> None:
    ec = EngineConfig(device="cpu", max_model_len=256)
    eng = Engine(tiny_model_shared, smol_tokenizer,
                 CacheConfig(block_size=16, num_device_blocks=8, model_id="acme-7b@v3"), ec)
    try:
        assert eng.model_id == "acme-7b@v3"
        assert eng.core.namespace.model.startswith("acme-7b@v3|")
    finally:
        eng.close()
    for bad in ("", "  ", 3):
        with pytest.raises(ConfigError, match="model_id"):
            CacheConfig(model_id=bad)
