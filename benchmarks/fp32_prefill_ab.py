"""Paired A/B of the engine's float32 prefill with and without the native float32 prefill
kernel (kernels/native.py), in one process, alternating per prompt: tokens/s of each and the
paired speed-up. The KV pool is pre-faulted so that page faults of fresh blocks do not enter
either side. Run: .venv/bin/python benchmarks/fp32_prefill_ab.py (numbers in docs/kernels.md).
"""
import torch, time, statistics
from radixkv import CacheConfig, SamplingParams
from radixkv.config import EngineConfig
from radixkv.engine.llm_engine import LLMEngine
from radixkv.models import load_model
from radixkv.kernels import native
import numpy as np
torch.set_num_threads(1)
m = load_model(dtype=torch.float32, model_impl="auto")
core = LLMEngine(m, None, CacheConfig(device_memory="1GiB", enable_prefix_caching=False), EngineConfig(max_num_batched_tokens=2048, dtype="float32"), model_id="x")
core._runner.kv_cache.view(torch.int32).fill_(0)   # pre-fault: not what is measured here
rng = np.random.default_rng(0)
def prompt(n): return [int(x) for x in rng.integers(100, 49000, n)]
one = SamplingParams(max_tokens=1)
k=[0]
def run(n):
    k[0]+=1; core.add_request(f"r{k[0]}", prompt(n), one)
    t=time.perf_counter()
    while core.has_unfinished_requests(): core.step()
    return time.perf_counter()-t
full = dict(native._PREFILL_ENTRIES)
def set_native(on):
    native._PREFILL_ENTRIES.clear(); native._PREFILL_ENTRIES.update(full if on else {torch.bfloat16: "prefill"})
run(256)
res = {}
for n in (256, 1024, 2048):
    ratios=[]; a=[]; b=[]
    for r in range(4):
        set_native(True); ta = run(n)
        set_native(False); tb = run(n)
        a.append(n/ta); b.append(n/tb); ratios.append(tb/ta)
    print(n, "tok/s native", round(statistics.median(a)), "torch flash", round(statistics.median(b)), "speed-up paired median", round(statistics.median(ratios), 3), [round(x,3) for x in ratios], flush=True)
