"""ModelRunner's CPU thread choice per forward: few tokens of a small model on one thread, the
rest on the configured count; the choice depends only on the batch, and a runner configured
with one thread never changes it."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from radixkv.engine import decoder_forward, model_runner
from radixkv.engine.model_runner import ModelRunner

sys.path.insert(0, str(Path(__file__).parent))
from test_model_families import make_family_model  # noqa: E402


def _spy_threads(monkeypatch):
    seen: list[tuple[int, int]] = []
    original = decoder_forward.DecoderForward.__call__

    def spy(self, ctx):
        seen.append((int(ctx.batch.input_ids.shape[-1]), torch.get_num_threads()))
        return original(self, ctx)

    monkeypatch.setattr(decoder_forward.DecoderForward, "__call__", spy)
    return seen


def test_small_forwards_run_on_one_thread_and_large_ones_on_the_configured_count(
        monkeypatch, toy_pager):
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        runner = ModelRunner.for_model(make_family_model("llama"), 64, 4, lean_forward=True)
        # the threshold at 6 tokens of this model's layers (a "large" model's limit: every
        # layer counts as large here)
        monkeypatch.setattr(model_runner, "SMALL_FORWARD_WORK", 6 * runner.layer_work)
        monkeypatch.setattr(model_runner, "SMALL_LAYER_WEIGHTS", 0)
        seen = _spy_threads(monkeypatch)
        pager = toy_pager(64, 4, seed=1)
        pager.add(0, list(range(3, 23)))          # 20 tokens: two threads
        runner.execute(runner.build_batch([pager.chunk(0, None)]))
        pager.append(0, 7)                        # one token: one thread
        runner.execute(runner.build_batch([pager.chunk(0, None)]))
        pager.add(1, list(range(30, 35)))         # 5 tokens: one thread
        runner.execute(runner.build_batch([pager.chunk(1, None)]))
        pager.add(2, list(range(40, 46)))         # 6 tokens: two threads again
        runner.execute(runner.build_batch([pager.chunk(2, None)]))
        assert seen == [(20, 2), (1, 1), (5, 1), (6, 2)]
    finally:
        torch.set_num_threads(before)


def test_a_one_thread_runner_never_changes_the_count(monkeypatch, toy_pager):
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        runner = ModelRunner.for_model(make_family_model("llama"), 64, 4, lean_forward=True)
        seen = _spy_threads(monkeypatch)
        pager = toy_pager(64, 4, seed=2)
        pager.add(0, list(range(3, 40)))
        runner.execute(runner.build_batch([pager.chunk(0, None)]))
        pager.append(0, 9)
        runner.execute(runner.build_batch([pager.chunk(0, None)]))
        assert [n for _, n in seen] == [1, 1]
        assert runner.layer_work > 0
    finally:
        torch.set_num_threads(before)


def test_a_cpu_runner_prepares_the_native_norm_and_rope_when_created(monkeypatch):
    from radixkv.kernels import native_fused

    seen = []
    monkeypatch.setattr(native_fused, "prepare", lambda *a: seen.append(a) or True)
    model = make_family_model("llama")
    runner = ModelRunner.for_model(model, 16, 4, lean_forward=True)
    hidden = model.config.hidden_size
    assert seen == [((hidden,), runner.lean.head_dim, next(model.parameters()).dtype)]


def test_a_model_with_small_layers_keeps_one_thread_up_to_its_own_limit(monkeypatch, toy_pager):
    """Small layers (under SMALL_LAYER_WEIGHTS) get SMALL_MODEL_FORWARD_WORK: here 10 tokens
    of the model stay on one thread where the large-model limit (3 tokens) would split them;
    a model whose layers are not small keeps the large-model limit."""
    before, real = torch.get_num_threads(), model_runner.SMALL_LAYER_WEIGHTS
    try:
        torch.set_num_threads(2)
        runner = ModelRunner.for_model(make_family_model("llama"), 64, 4, lean_forward=True)
        w = runner.layer_work
        monkeypatch.setattr(model_runner, "SMALL_FORWARD_WORK", 3 * w)
        monkeypatch.setattr(model_runner, "SMALL_MODEL_FORWARD_WORK", 12 * w)
        monkeypatch.setattr(model_runner, "SMALL_LAYER_WEIGHTS", w + 1)     # small layers
        seen = _spy_threads(monkeypatch)
        pager = toy_pager(64, 4, seed=3)
        pager.add(0, list(range(3, 13)))          # 10 tokens: one thread (small layers)
        runner.execute(runner.build_batch([pager.chunk(0, None)]))
        pager.add(1, list(range(20, 32)))         # 12 tokens: two threads
        runner.execute(runner.build_batch([pager.chunk(1, None)]))
        monkeypatch.setattr(model_runner, "SMALL_LAYER_WEIGHTS", w)         # not small
        pager.add(2, list(range(40, 50)))         # 10 tokens: two threads now
        runner.execute(runner.build_batch([pager.chunk(2, None)]))
        assert seen == [(10, 1), (12, 2), (10, 2)]
        # the real limits: the embedded model's layers (3.5M weights) are small, a 1B
        # model's (~67M) are not
        assert 3_500_000 < real < 60_000_000
    finally:
        torch.set_num_threads(before)
