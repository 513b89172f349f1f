"""The lean forward (engine/decoder_forward.py) computes exactly what transformers' modules do.

For every supported architecture (Llama, Qwen2 with biases, tied embeddings and windowed upper
layers, Qwen3's q/k norms, Mistral's window) and both dtypes, two runners over two copies of one
model take the same steps: cold prefill chunks of several sequences, chunks that extend a cached
prefix, and decode steps. The lean runner's logits and everything it wrote into its KV pool must
be *bit-identical* to the transformers-module runner's (``lean_forward=False``). bf16 covers the
fused, pre-packed q/k/v and gate/up GEMMs, also on a 300-token chunk (past the 256 rows up to
which packed and plain GEMMs are checked equal in test_packed_linear.py).
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch

from radixkv.engine import decoder_forward
from radixkv.engine.model_runner import ModelRunner
from radixkv.errors import ConfigError

sys.path.insert(0, str(Path(__file__).parent))
from test_model_families import make_family_model  # noqa: E402

LEAN_FAMILIES = ["llama", "qwen2", "qwen2_window", "qwen3", "mistral_window"]


def _runners(family: str, dtype: torch.dtype, num_blocks: int = 256):
    model = make_family_model(family).to(dtype)
    lean = ModelRunner.for_model(copy.deepcopy(model), num_blocks, 4, lean_forward=True)
    hf = ModelRunner.for_model(model, num_blocks, 4, lean_forward=False)
    assert lean.lean is not None and hf.lean is None
    return lean, hf


def _step(runners, pagers, plan):
    """One step on both runners; ``plan`` = [(seq_id, num_tokens or None)]."""
    outs = []
    for runner, pager in zip(runners, pagers):
        chunks = [pager.chunk(s, n) for s, n in plan]
        outs.append(runner.execute(runner.build_batch(chunks)))
    a, b = outs
    assert a.dtype == b.dtype == torch.float32 and a.shape == b.shape
    assert torch.equal(a, b), (a - b).abs().max()
    return a


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", LEAN_FAMILIES)
def test_lean_forward_is_bit_identical_to_transformers_modules(family, dtype, toy_pager):
    runners = _runners(family, dtype)
    pagers = [toy_pager(256, 4, seed=1), toy_pager(256, 4, seed=1)]
    g = torch.Generator().manual_seed(5)
    lengths = {0: 23, 1: 9, 2: 31}
    for pager in pagers:
        for s, n in lengths.items():
            pager.add(s, torch.randint(0, 256, (n,), generator=g).tolist())
        g.manual_seed(5)
    _step(runners, pagers, [(0, 12), (1, None), (2, 16)])     # cold chunks
    _step(runners, pagers, [(0, None), (2, None)])             # extends a cached prefix
    for i in range(6):                                          # decode steps
        for pager in pagers:
            for s in lengths:
                pager.append(s, 3 + 7 * s + i)
        _step(runners, pagers, [(0, None), (1, None), (2, None)])
    assert torch.equal(runners[0].kv_cache, runners[1].kv_cache)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_last_layer_runs_past_attention_only_for_the_wanted_rows(dtype, toy_pager):
    """The lean forward computes every row's K/V in every layer but the last layer's output
    projection and MLP only for the rows whose logits are wanted: a chunk that wants none (a
    prefill chunk before the prompt's last), some rows, every row (prompt log-probabilities) or
    a row twice gives the module runner's logits and the same KV pool, to the bit."""
    runners = _runners("llama", dtype)
    pagers = [toy_pager(256, 4, seed=3), toy_pager(256, 4, seed=3)]
    g = torch.Generator().manual_seed(7)
    prompts = {0: torch.randint(0, 256, (40,), generator=g).tolist(),
               1: torch.randint(0, 256, (19,), generator=g).tolist()}
    for pager in pagers:
        for s, toks in prompts.items():
            pager.add(s, toks)
    rows_down = []   # the rows each forward's last down projection multiplied
    down = runners[0].lean.layers[-1].down
    plain = down.forward

    def spy(x):
        rows_down.append(int(x.shape[0]))
        return plain(x)

    down.forward = spy   # the lean forward calls module.forward (no hooks)
    try:
        none = [[pager.chunk(0, 16, logit_offsets=()), pager.chunk(1, 8, logit_offsets=())]
                for pager in pagers]
        outs = [r.execute(r.build_batch(c)) for r, c in zip(runners, none)]
        assert outs[0].shape == outs[1].shape == (0, 256)
        mixed = [[pager.chunk(0, 12, logit_offsets=(0, 5, 5, 11)),
                  pager.chunk(1, 11, logit_offsets=tuple(range(11)))] for pager in pagers]
        a, b = (r.execute(r.build_batch(c)) for r, c in zip(runners, mixed))
        assert a.shape == (15, 256) and torch.equal(a, b), (a - b).abs().max()
        _step(runners, pagers, [(0, None)])
    finally:
        del down.forward
    assert rows_down == [15, 1]   # of 23 and 12 (none at all for the chunks wanting none)
    assert torch.equal(runners[0].kv_cache, runners[1].kv_cache)


def test_long_bf16_chunk_is_packed_and_bit_identical(toy_pager):
    """A chunk of more than 256 rows takes the fused packed GEMMs in the lean forward and the
    separately packed projections in the module path: the same bits."""
    runners = _runners("qwen2", torch.bfloat16)
    pagers = [toy_pager(256, 4, seed=2), toy_pager(256, 4, seed=2)]
    tokens = torch.randint(0, 256, (300,),
                           generator=torch.Generator().manual_seed(1)).tolist()
    for pager in pagers:
        pager.add(0, tokens)
    _step(runners, pagers, [(0, None)])
    assert torch.equal(runners[0].kv_cache, runners[1].kv_cache)


def test_fused_weights_follow_an_in_place_weight_edit(toy_pager):
    """The fused, packed copy is rebuilt when a projection's weight changes in place."""
    lean, hf = _runners("llama", torch.bfloat16)
    pagers = [toy_pager(256, 4), toy_pager(256, 4)]
    for pager in pagers:
        pager.add(0, list(range(10)))
    _step((lean, hf), pagers, [(0, 5)])
    with torch.no_grad():
        for runner in (lean, hf):
            runner.model.model.layers[0].self_attn.k_proj.weight.mul_(1.5)
            runner.model.model.layers[1].mlp.up_proj.weight.mul_(0.5)
    _step((lean, hf), pagers, [(0, None)])
    # a part replaced by a new Parameter (what assigning a weight does), and one whose data
    # is swapped under the same Parameter: both are new pointers, both are noticed
    with torch.no_grad():
        for runner in (lean, hf):
            attn = runner.model.model.layers[1].self_attn
            attn.v_proj.weight = torch.nn.Parameter(attn.v_proj.weight * 0.75)
            mlp = runner.model.model.layers[0].mlp
            mlp.gate_proj.weight.data = mlp.gate_proj.weight.data * 1.25
    for pager in pagers:
        pager.append(0, 11)
    _step((lean, hf), pagers, [(0, None)])


def test_unsupported_architectures_keep_transformers_modules():
    gemma = make_family_model("gemma3")
    assert "Gemma3ForCausalLM" in decoder_forward.unsupported_reason(gemma)
    runner = ModelRunner.for_model(copy.deepcopy(gemma), 16, 4)
    assert runner.lean is None            # lean_forward=None: falls back
    with pytest.raises(ConfigError, match="lean_forward=True but Gemma3ForCausalLM"):
        ModelRunner.for_model(gemma, 16, 4, lean_forward=True)
    llama = make_family_model("llama")
    llama.model.layers[1].mlp.act_fn = torch.nn.GELU()
    assert "activation GELU" in decoder_forward.unsupported_reason(llama)

    class QuantLinear(torch.nn.Linear):   # e.g. a quantized linear: another .weight meaning
        pass

    llama = make_family_model("llama")
    llama.model.layers[0].self_attn.k_proj.__class__ = QuantLinear
    assert "other than nn.Linear" in decoder_forward.unsupported_reason(llama)
    llama = make_family_model("llama")
    llama.model.layers[0].mlp._hf_hook = object()   # what accelerate's offloading attaches
    assert "accelerate hooks" in decoder_forward.unsupported_reason(llama)


def test_cpu_calls_the_ops_implementations_directly_with_the_same_logits(toy_pager,
                                                                         monkeypatch):
    """On the CPU the lean forward calls the ``radixkv::`` ops' implementations as plain
    functions (a custom op's dispatch costs ~25 us a call, 150 calls a decode step of the
    embedded model); under a dispatch mode, ``torch.compile`` or on CUDA it calls the ops.
    Both paths give bit-identical logits and KV."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Seen(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.names: set[str] = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.add(str(func))
            return func(*args, **(kwargs or {}))

    x = torch.zeros(2, 8)
    assert decoder_forward._layer_ops(x) is decoder_forward._DIRECT_OPS
    with Seen():
        assert decoder_forward._layer_ops(x) is decoder_forward._CUSTOM_OPS
    assert decoder_forward._layer_ops(torch.zeros(2, 8, device="meta")) is \
        decoder_forward._CUSTOM_OPS

    model = make_family_model("llama").to(torch.bfloat16)
    runners = {"direct": ModelRunner.for_model(copy.deepcopy(model), 256, 4, lean_forward=True),
               "custom": ModelRunner.for_model(model, 256, 4, lean_forward=True)}
    ops = {"direct": decoder_forward._DIRECT_OPS, "custom": decoder_forward._CUSTOM_OPS}
    pagers = {name: toy_pager(256, 4, seed=3) for name in runners}
    for pager in pagers.values():
        pager.add(0, list(range(3, 30)))
        pager.add(1, list(range(40, 49)))

    def step(plan):
        logits = {}
        for name, runner in runners.items():
            monkeypatch.setattr(decoder_forward, "_layer_ops", lambda t, o=ops[name]: o)
            logits[name] = runner.execute(runner.build_batch(
                [pagers[name].chunk(s, n) for s, n in plan]))
        assert torch.equal(logits["direct"], logits["custom"])

    step([(0, 20), (1, None)])   # a cold chunk and a whole prompt
    step([(0, None)])            # extends a cached prefix
    for i in range(3):           # decode steps
        for pager in pagers.values():
            pager.append(0, 5 + i)
            pager.append(1, 9 + i)
        step([(0, None), (1, None)])
    assert torch.equal(runners["direct"].kv_cache, runners["custom"].kv_cache)
