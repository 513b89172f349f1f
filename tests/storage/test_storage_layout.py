"""KVLayout sizing, parsing and fingerprints."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest

from radixkv.errors import ConfigError
from radixkv.storage.layout import KVLayout, dtype_name, parse_capacity, parse_size


def test_smollm2_sizes_match_design_doc():
    # DESIGN.md §1: SmolLM2-135M, 30 layers x 3 kv heads x 64 dims, fp32 = 46 KB per token
    cfg = SimpleNamespace(num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                          hidden_size=576, torch_dtype="float32")
    lay = KVLayout.from_model_config(cfg, block_size=16)
    assert (lay.num_layers, lay.num_kv_heads, lay.head_dim, lay.dtype) == (30, 3, 64, "float32")
    assert lay.bytes_per_token == 2 * 30 * 3 * 64 * 4 == 46080
    assert lay.bytes_per_block == 16 * 46080
    assert lay.block_shape == (30, 2, 16, 3, 64)
    assert lay.cache_shape(7) == (30, 2, 7, 16, 3, 64)


def test_from_real_llama_config_with_and_without_head_dim():
    from transformers import LlamaConfig
    cfg = LlamaConfig(hidden_size=256, num_attention_heads=8, num_key_value_heads=2,
                      num_hidden_layers=3)
    assert KVLayout.from_model_config(cfg, 16, "bf16").head_dim == 32
    cfg.head_dim = 48  # explicit head_dim wins over hidden_size // heads
    lay = KVLayout.from_model_config(cfg, 16, "float16")
    assert (lay.head_dim, lay.num_kv_heads, lay.dtype) == (48, 2, "float16")
    no_gqa = SimpleNamespace(num_hidden_layers=2, num_attention_heads=4, hidden_size=64)
    assert KVLayout.from_model_config(no_gqa, 8).num_kv_heads == 4


def test_parse_size_and_capacity():
    lay = KVLayout(2, 1, 8, 4, "float16")  # 256 bytes per block
    assert parse_size("4GiB") == 4 << 30 and parse_size("512MiB") == 512 << 20
    assert parse_size("1.5GB") == 1_500_000_000 and parse_size(" 2 kib ") == 2048
    assert parse_capacity("1MiB", lay) == (1 << 20) // 256
    assert parse_capacity(12, lay) == parse_capacity("12", lay) == parse_capacity("12 blocks", lay)
    assert lay.blocks_in(255) == 0
    for bad in ("4 parsecs", "", "-3GiB", "GiB"):
        with pytest.raises(ConfigError):
            parse_size(bad)
    with pytest.raises(ConfigError):
        parse_capacity(-1, lay)


def test_validation_and_dtype_names():
    assert dtype_name("torch.bfloat16") == "bfloat16" and dtype_name("half") == "float16"
    assert KVLayout(1, 1, 1, 1, "fp16") == KVLayout(1, 1, 1, 1, "float16")
    with pytest.raises(ConfigError):
        KVLayout(0, 1, 1, 1, "float16")
    with pytest.raises(ConfigError):
        KVLayout(1, 1, 1, 1, "int4")   # int8 is a KV dtype now (quantized rows, kv_quant)
    assert KVLayout(2, 1, 8, 4, "int8").block_shape == (2, 2, 4, 1, 10)   # + a 2-byte scale


def test_fingerprint_separates_models_layouts_and_salts():
    a = KVLayout(2, 2, 8, 4, "float16")
    prints = {a.fingerprint("m"), a.fingerprint("m2"), a.fingerprint("m", salt="tenant"),
              KVLayout(2, 2, 8, 8, "float16").fingerprint("m"),
              KVLayout(2, 2, 8, 4, "bfloat16").fingerprint("m")}
    assert len(prints) == 5 and all(len(p) == 16 for p in prints)
    assert a.fingerprint("m") == KVLayout(2, 2, 8, 4, "fp16").fingerprint("m")


def test_layout_module_does_not_import_torch():
    code = ("import sys, radixkv.storage, radixkv.storage.layout; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
