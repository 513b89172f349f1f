"""ModelRunner's CPU thread choice per forward: where idle OpenMP threads sleep at once, few
tokens of a small model on one thread and the rest on the configured count; where they poll,
every forward on the configured count. The choice depends only on the batch, and a runner
configured with one thread never changes it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from radixkv.engine import decoder_forward, model_runner, packed_linear
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
        runner.threads_poll = False   # sleeping OpenMP threads (OMP_WAIT_POLICY=PASSIVE alone)
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


class _Probe:
    """A RunQueueProbe stand-in: contended or not, as the test says."""

    available = True

    def __init__(self, contended: bool) -> None:
        self.value = contended

    def contended(self) -> bool:
        return self.value


def test_polling_threads_run_small_forwards_on_every_thread_unless_contended(
        monkeypatch, toy_pager):
    """GOMP_SPINCOUNT >= SPIN_FOR_SMALL_FORWARDS (radixkv serve's default) and a forward whose
    bits do not depend on the thread count: a one-token forward of a small model uses both
    threads, until the process's threads are kept waiting for CPUs; then every forward runs on
    one. Without a readable probe, or where bits could change, the sleeping-threads rule."""
    before = torch.get_num_threads()
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    try:
        torch.set_num_threads(2)
        monkeypatch.setenv("GOMP_SPINCOUNT", str(model_runner.SPIN_FOR_SMALL_FORWARDS))
        runner = ModelRunner.for_model(make_family_model("llama"), 64, 4, lean_forward=True,
                                       pack_weights=False)
        assert runner.threads_poll
        monkeypatch.setenv("GOMP_SPINCOUNT", str(model_runner.SPIN_FOR_SMALL_FORWARDS - 1))
        assert not ModelRunner.for_model(make_family_model("llama"), 64, 4,
                                         lean_forward=True).threads_poll
        assert not runner.thread_invariant   # unpacked: F.linear's rows depend on the threads
        monkeypatch.setattr(model_runner, "SMALL_FORWARD_WORK", 6 * runner.layer_work)
        monkeypatch.setattr(model_runner, "SMALL_LAYER_WEIGHTS", 0)
        seen = _spy_threads(monkeypatch)
        pager = toy_pager(64, 4, seed=4)
        probe = _Probe(False)
        runner.contention = probe
        pager.add(0, list(range(3, 8)))           # 5 tokens: one thread (not invariant)
        runner.execute(runner.build_batch([pager.chunk(0, None)]))
        runner.thread_invariant = True
        pager.append(0, 7)                        # one token: both threads
        runner.execute(runner.build_batch([pager.chunk(0, None)]))
        probe.value = True                        # contended: one thread
        pager.append(0, 8)
        runner.execute(runner.build_batch([pager.chunk(0, None)]))
        pager.add(1, list(range(20, 30)))         # 10 tokens, large: one thread too
        runner.execute(runner.build_batch([pager.chunk(1, None)]))
        probe.value = False
        probe.available = False                   # cannot tell: one thread
        pager.append(0, 9)
        runner.execute(runner.build_batch([pager.chunk(0, None)]))
        pager.add(2, list(range(40, 50)))         # cannot tell: large ones by the batch
        runner.execute(runner.build_batch([pager.chunk(2, None)]))
        assert seen == [(5, 1), (1, 2), (1, 1), (10, 1), (1, 1), (10, 2)]
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_the_packed_forward_gives_the_same_bits_on_one_and_two_threads(toy_pager, dtype):
    """What lets small forwards follow the machine's load (ModelRunner.thread_invariant):
    every row of the packed lean forward is the same at one and two threads."""
    model = make_family_model("llama").to(dtype)
    if not packed_linear.packing_supported(dtype, torch.device("cpu")):
        pytest.skip(f"no packed {dtype} linears on this CPU")
    before = torch.get_num_threads()
    try:
        runner = ModelRunner.for_model(model, 64, 4, lean_forward=True)
        assert runner.thread_invariant
        runner.threads_poll = True
        runner.contention = _Probe(False)
        got = {}
        for threads in (1, 2):
            torch.set_num_threads(threads)
            runner._configured_threads = threads
            pager = toy_pager(64, 4, seed=5)
            outs = []
            for sid, n in enumerate((1, 3, 9, 24)):
                pager.add(sid, [(7 * i + sid) % 90 + 3 for i in range(n)])
                outs.append(runner.execute(runner.build_batch([pager.chunk(sid, None)])))
            got[threads] = outs
        for a, b in zip(got[1], got[2]):
            assert torch.equal(a, b)
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


def test_a_cpu_runner_prepares_the_native_norm_rope_and_silu_when_created(monkeypatch):
    from radixkv.kernels import native_fused

    seen = []
    monkeypatch.setattr(native_fused, "prepare", lambda *a: seen.append(a) or True)
    model = make_family_model("llama")
    runner = ModelRunner.for_model(model, 16, 4, lean_forward=True)
    hidden = model.config.hidden_size
    assert seen == [((hidden,), runner.lean.head_dim, next(model.parameters()).dtype,
                     (model.config.intermediate_size,))]


def test_a_model_with_small_layers_keeps_one_thread_up_to_its_own_limit(monkeypatch, toy_pager):
    """Small layers (under SMALL_LAYER_WEIGHTS) get SMALL_MODEL_FORWARD_WORK: here 10 tokens
    of the model stay on one thread where the large-model limit (3 tokens) would split them;
    a model whose layers are not small keeps the large-model limit."""
    before, real = torch.get_num_threads(), model_runner.SMALL_LAYER_WEIGHTS
    try:
        torch.set_num_threads(2)
        runner = ModelRunner.for_model(make_family_model("llama"), 64, 4, lean_forward=True)
        runner.threads_poll = False   # sleeping OpenMP threads (OMP_WAIT_POLICY=PASSIVE alone)
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


@pytest.mark.skipif(torch.float32 not in packed_linear.PACKED_DTYPES,
                    reason="float32 linears are packed on x86-64 with oneDNN only")
@pytest.mark.parametrize("threads", [1, 2])
def test_single_row_float32_forwards_take_f_linear_only_with_one_configured_thread(
        monkeypatch, toy_pager, threads):
    """On one thread MKL's F.linear beats the packed float32 GEMMs for a single row
    (DecoderForward.plain_single_row); with more configured threads every forward stays packed,
    whatever count it runs on, so the rows do not depend on the load."""
    packed_calls = []
    fused_call = decoder_forward._Fused.__call__
    module_call = packed_linear.PackedLinear.forward
    monkeypatch.setattr(decoder_forward._Fused, "__call__",
                        lambda self, x: packed_calls.append(1) or fused_call(self, x))
    monkeypatch.setattr(packed_linear.PackedLinear, "forward",
                        lambda self, x: packed_calls.append(1) or module_call(self, x))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        runner = ModelRunner.for_model(make_family_model("llama"), 64, 4, lean_forward=True)
        assert runner.lean.pack and not runner.lean.plain_single_row
        pager = toy_pager(64, 4, seed=6)
        pager.add(0, list(range(3, 9)))                  # 6 tokens: packed
        runner.execute(runner.build_batch([pager.chunk(0, None)]))
        assert packed_calls and runner.lean.plain_single_row is (threads == 1)
        packed_calls.clear()
        pager.append(0, 9)                               # one token
        runner.execute(runner.build_batch([pager.chunk(0, None)]))
        assert bool(packed_calls) is (threads != 1)
        packed_calls.clear()
        pager.add(1, [4, 5])
        pager.append(0, 10)                              # two rows: packed again
        runner.execute(runner.build_batch([pager.chunk(0, None), pager.chunk(1, None)]))
        assert packed_calls
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_the_first_forward_checks_the_packed_gemms_on_this_cpu(toy_pager, dtype):
    """thread_invariant is checked where the engine runs, not only where the tests ran: the
    first forward of a runner configured with two threads multiplies layer 0's packed weights
    on one and two threads and keeps the claim (the same bits here); one configured thread
    has no count to change and checks nothing."""
    if not packed_linear.packing_supported(dtype, torch.device("cpu")):
        pytest.skip(f"no packed {dtype} linears on this CPU")
    before = torch.get_num_threads()
    try:
        for threads, expected in ((2, ""), (1, None)):
            torch.set_num_threads(threads)
            runner = ModelRunner.for_model(make_family_model("llama").to(dtype), 64, 4,
                                           lean_forward=True)
            assert runner.thread_invariant and runner.thread_check is None
            pager = toy_pager(64, 4, seed=7)
            pager.add(0, list(range(3, 9)))
            runner.execute(runner.build_batch([pager.chunk(0, None)]))
            assert runner.thread_check == expected
            assert runner.thread_invariant
            assert torch.get_num_threads() == threads
            assert (runner.thread_check_s > 0) is (threads == 2)
    finally:
        torch.set_num_threads(before)


def test_gemms_whose_bits_follow_the_thread_count_clear_thread_invariant(toy_pager):
    """A CPU whose packed GEMMs change with the thread count (simulated on the o projection):
    the first forward finds it, warns, and the runner's thread count goes back to following
    the batch, however idle the machine."""
    dtype = next(iter(packed_linear.PACKED_DTYPES), None)
    if dtype is None:
        pytest.skip("no packed linears on this CPU")
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        runner = ModelRunner.for_model(make_family_model("llama").to(dtype), 64, 4,
                                       lean_forward=True)
        runner.threads_poll = True
        runner.contention = _Probe(False)
        o = runner.lean.layers[0].o
        real = type(o).forward.__get__(o)
        o.forward = lambda x: real(x) + (torch.get_num_threads() - 1) * 2.0 ** -4
        assert runner.load_mode() == "split"
        pager = toy_pager(64, 4, seed=8)
        pager.add(0, list(range(3, 9)))
        with pytest.warns(RuntimeWarning, match="not thread-invariant"):
            runner.execute(runner.build_batch([pager.chunk(0, None)]))
        assert runner.thread_check.startswith("o on 1 rows")
        assert not runner.thread_invariant and runner.load_mode() == "batch"
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
