"""Sizing the device pool from the GPU's memory (engine/memory.py), checked on the CPU with
``torch.cuda``'s memory functions patched: the profiled forward really runs (on the CPU), the
allocator statistics and ``mem_get_info`` are what a card would report."""

from __future__ import annotations

import pytest
import torch

from radixkv.config import CacheConfig
from radixkv.engine import memory
from radixkv.engine.model_runner import model_kv_layout
from radixkv.errors import ConfigError

GIB = 1 << 30


def test_plan_pool_is_utilization_minus_use_minus_activations():
    s = memory.plan_pool(total_bytes=80 * GIB, free_bytes=77 * GIB,
                         activation_peak_bytes=2 * GIB, utilization=0.9,
                         bytes_per_block=2 * 1024 * 1024, block_size=16)
    budget = int(0.9 * 80 * GIB) - 3 * GIB - 2 * GIB
    assert s.budget_bytes == budget and s.num_blocks == budget // (2 << 20)
    assert s.num_tokens == s.num_blocks * 16
    line = s.describe()
    assert f"{s.num_blocks} blocks" in line and f"{s.num_tokens} tokens" in line
    assert "0.9 x 80.0 GiB" in line and "3.00 GiB in use" in line


def test_plan_pool_without_room_names_the_numbers_and_the_fix():
    with pytest.raises(ConfigError, match="gpu_memory_utilization.*num_device_blocks"):
        memory.plan_pool(total_bytes=8 * GIB, free_bytes=1 * GIB, activation_peak_bytes=GIB,
                         utilization=0.9, bytes_per_block=1 << 20, block_size=16)


def test_profile_batch_is_the_largest_the_scheduler_forms():
    chunks, blocks = memory.profile_batch_chunks(num_tokens=10, num_seqs=4, block_size=4)
    assert [c.num_new_tokens for c in chunks] == [3, 3, 2, 2]
    assert blocks == 4 and sorted(b for c in chunks for b in c.block_table) == [0, 1, 2, 3]
    chunks, _ = memory.profile_batch_chunks(num_tokens=3, num_seqs=8, block_size=4)
    assert len(chunks) == 3     # never more sequences than tokens


class FakeCuda:
    """``torch.cuda``'s memory statistics as a card of ``total`` bytes would report them while
    the process holds ``held`` bytes; the profiled forward 'allocates' ``peak`` bytes."""

    def __init__(self, total: int, held: int, peak: int) -> None:
        self.total, self.held, self.peak = total, held, peak
        self.calls: list[str] = []

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        c = torch.cuda
        monkeypatch.setattr(c, "synchronize", lambda device=None: None)
        monkeypatch.setattr(c, "empty_cache", lambda: self.calls.append("empty_cache"))
        monkeypatch.setattr(c, "reset_peak_memory_stats",
                            lambda device=None: self.calls.append("reset"))
        monkeypatch.setattr(c, "memory_allocated", lambda device=None: self.held)
        monkeypatch.setattr(c, "max_memory_allocated", lambda device=None: self.held + self.peak)
        monkeypatch.setattr(c, "mem_get_info",
                            lambda device=None: (self.total - self.held, self.total))


def test_size_device_pool_profiles_a_forward_and_sizes_from_what_is_left(make_tiny,
                                                                         monkeypatch):
    model = make_tiny("llama")
    layout = model_kv_layout(model, 4)
    fake = FakeCuda(total=16 * GIB, held=3 * GIB, peak=GIB // 2)
    fake.install(monkeypatch)
    ran = []
    from radixkv.engine.model_runner import ModelRunner
    execute = ModelRunner.execute

    def spy(self, batch):
        ran.append((batch.num_tokens, batch.num_seqs))
        return execute(self, batch)

    monkeypatch.setattr(ModelRunner, "execute", spy)
    sizing = memory.size_device_pool(model, layout, 4, "auto", 0.5, 64, 8,
                                     torch.device("cpu"))
    assert ran == [(64, 8)]                 # the largest batch, once
    assert fake.calls[:2] == ["empty_cache", "reset"]
    want = (int(0.5 * 16 * GIB) - 3 * GIB - GIB // 2) // layout.bytes_per_block
    assert sizing.num_blocks == want and sizing.activation_peak_bytes == GIB // 2


def test_cache_config_checks_utilization_and_the_cli_sets_it():
    assert CacheConfig().gpu_memory_utilization == 0.9
    for bad in (0, 1.5, -0.1, True, "0.9"):
        with pytest.raises(ConfigError, match="gpu_memory_utilization"):
            CacheConfig(gpu_memory_utilization=bad)
    from radixkv.server.cli import build_parser, configs

    args = build_parser().parse_args(["--gpu-memory-utilization", "0.75"])
    cc, _ = configs(args)
    assert cc.gpu_memory_utilization == 0.75


def test_cpu_engine_keeps_the_fixed_default(make_tiny):
    """Off CUDA the pool stays DEFAULT_DEVICE_MEMORY (no profiling, no torch.cuda call)."""
    from radixkv.config import DEFAULT_DEVICE_MEMORY, EngineConfig, parse_memory
    from radixkv.engine.llm_engine import LLMEngine

    model = make_tiny("llama")
    engine = LLMEngine(model, None, CacheConfig(block_size=4), EngineConfig(device="cpu"),
                       model_id="m")
    assert engine.pool_sizing is None
    per_block = model_kv_layout(model, 4).bytes_per_block
    assert engine.tier_capacity_blocks[0] == parse_memory(DEFAULT_DEVICE_MEMORY) // per_block
    engine.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_size_device_pool_on_cuda(make_tiny):
    """On CUDA, with the card's own numbers: a profiled forward, a positive pool, a line."""
    model = make_tiny("llama").cuda()
    layout = model_kv_layout(model, 16)
    free, total = torch.cuda.mem_get_info()
    utilization = min(1.0, (total - free) / total + 0.05)   # room for ~5% of the card
    sizing = memory.size_device_pool(model, layout, 16, "auto", utilization, 512, 8,
                                     torch.device("cuda"))
    assert sizing.activation_peak_bytes > 0 and sizing.num_blocks > 0
    assert sizing.total_bytes == total
    assert "blocks x 16 tokens" in sizing.describe()
