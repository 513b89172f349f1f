"""Engine configuration: frozen dataclasses passed to constructors (no module-level state).

``CacheConfig`` says how much KV the engine may keep and where (device blocks, optional host and
disk tiers, eviction policy); ``EngineConfig`` says how much work one step may do and on which
device. Both validate in ``__post_init__`` and raise :class:`radixkv.errors.ConfigError` with the
value that is wrong, so a bad configuration fails at construction, not in the middle of serving.

Sizes may be given in blocks or as memory strings (``"512MiB"``, ``"2GB"``, ``"1048576"``); memory
is turned into blocks once the model's KV layout is known (:meth:`CacheConfig.resolve_blocks`).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any

from radixkv.errors import ConfigError

#: Device KV memory used when neither ``num_device_blocks`` nor ``device_memory`` is given.
DEFAULT_DEVICE_MEMORY = "512MiB"

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_memory(value: str | int) -> int:
    """Bytes in a memory size: an int, or a string such as ``"512MiB"``, ``"1.5GB"``, ``"4096"``.

    >>> parse_memory("512MiB"), parse_memory("2GB"), parse_memory(100)
    (536870912, 2000000000, 100)
    """
    if isinstance(value, bool):
        raise ConfigError(f"memory size must be an int or a string like '512MiB', got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"memory size must be >= 0 bytes, got {value}")
        return value
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(value))
    if m is None or m.group(2).lower() not in _UNITS:
        raise ConfigError(f"cannot parse memory size {value!r}: use e.g. '512MiB', '2GB' or bytes")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def _check_count(name: str, value: int | None) -> None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
        raise ConfigError(f"CacheConfig.{name} must be a non-negative int or None, got {value!r}")


#: KV storage dtypes: the model's own, or int8 / fp8 (e4m3) rows with a per-row fp16 scale
#: (engine/kv_quant.py).
KV_DTYPES = ("auto", "int8", "fp8_e4m3")
#: Write policies of the remote tier (``CacheConfig.remote_write``).
REMOTE_WRITE_POLICIES = ("write_back", "write_through", "read_only")
#: Host-tier blocks added for a remote tier when no host tier is configured: its hits land
#: there before they are promoted into the device.
REMOTE_STAGING_BLOCKS = 64


@dataclass(frozen=True)
class CacheConfig:
    """Where KV blocks live and how many.

    Attributes:
        block_size: tokens per KV block (a power of two; only full blocks are shared).
        num_device_blocks / device_memory: device pool size, in blocks or bytes (blocks win);
            both None means: on CUDA, what ``gpu_memory_utilization`` leaves; elsewhere
            ``DEFAULT_DEVICE_MEMORY``.
        gpu_memory_utilization: on CUDA with no pool size given, the fraction of the card's
            memory radixkv may use in all (vLLM's setting, same default 0.9): the pool gets it
            less the memory in use after loading (weights, context, other processes) and the
            activation peak of a profiled forward at the largest batch (engine/memory.py).
        host_blocks / host_memory: CPU-RAM tier capacity (0/None: no host tier).
        disk_dir, disk_blocks / disk_memory: NVMe tier directory and capacity (None: no disk tier).
        policy: eviction policy name (``radixkv.core.policy_registry.POLICIES``): ``auto``, the
            default (``radixkv.core.policy_registry.DEFAULT_POLICY``, also ``RadixTree``'s and
            ``BlockManager.create``'s), is LRU, at LRU's cost, until a request says its
            session ends, then the next-use ``forecast``; ``duel`` set-duels LRU,
            ``lfu-ghost`` and ``forecast`` (pays on loops and RAG, for about 10x LRU's
            bookkeeping); ``lru``, ``lfu``, ``lfu-ghost``, ``lfu-da``, ``fifo``, ``mru``,
            ``priority``, ``ttl``, ``forecast`` (docs/eviction.md says when each pays).
        policy_options: keyword arguments of the policy (``{"then": "fifo"}`` for ``auto``,
            ``{"sample": 4}`` for the duel's sampled shadows, ``{"quantile": 0.9}`` for the
            forecast; docs/eviction.md); checked when the config is built.
        enable_prefix_caching: False makes every request its own namespace, so nothing is ever
            reused across requests (the "no cache" baseline; forks still share within a request).
        tail_blocks: how many partial last blocks of finished sequences the device keeps for
            the next request that continues them (``core/tails.py``: a chat's next turn then
            reuses the previous turn's last partial block instead of recomputing up to
            ``block_size - 1`` tokens). ``None``: an eighth of the device pool; 0: none. They
            are reclaimed before any cached whole block is evicted.
        write_through: lower tiers (``"host"``, ``"disk"``) that get a copy of every block as
            soon as it is computed, instead of only when it is evicted (write-back, the
            default ``()``). A copy makes the block's later demotion free and, on disk, makes
            it survive a crash without ``persist()``; it costs the copy traffic and capacity
            (copies compete with other blocks for the tier). Best effort: a copy that finds
            no room, or whose write fails, is skipped.
        disk_secret: makes the disk tier *authenticated*: every block file is signed with a
            HMAC-SHA256 of its header and payload, verified on every read; a block that
            fails (tampered, unsigned, another key) is a miss, counted, never served. None
            reads the environment variable ``RADIXKV_KV_SECRET`` (unset: checksums only, which
            catch accidents, not a writer who recomputes them). At least 16 bytes; share it
            between the processes that share ``disk_dir``. Never printed (``repr`` hides it).
        kv_dtype: ``"auto"`` (the model's dtype), ``"int8"`` or ``"fp8_e4m3"``: every K/V row
            is quantized once when written (Hadamard-rotated, symmetric, one fp16 scale per
            token and head stored in the row), so a block takes (head_dim + 2) / (2 head_dim)
            of its bf16 bytes in every tier, and attention reads it dequantized. Part of the
            cache namespace: never mixed with blocks of another dtype (engine/kv_quant.py,
            docs/quantization.md).
        remote_url: a Redis (>= 6) or Valkey server shared by replicas, the slowest tier
            (``redis://host:port/db``, ``rediss://``, ``valkey://``, ``redis+cluster://``);
            None: no remote tier. Blocks leave the host tier for it (write-back) and a new
            request's blocks missing locally are looked up there in one round trip before it
            is scheduled; hits land in the host tier (one of ``REMOTE_STAGING_BLOCKS`` blocks
            or a quarter of the device's blocks, whichever is more, is added when none is
            configured; it bounds how many remote blocks one request can take). A server that
            is down at start or dies later
            only costs misses (see docs/tiers.md). Keys are namespaced by model fingerprint,
            KV layout and tenant salt, values verified on every read; ``disk_secret`` signs
            them too.
        remote_write: ``"write_back"`` (default: a block is written when it leaves the host
            tier, demoted or dropped), ``"write_through"`` (also as soon as it is computed,
            so other replicas see it at once) or ``"read_only"``.
        remote_ttl_s: optional key TTL on the server (refreshed by every write of a block).
        remote_timeout_s: how long a new request waits for its remote lookup before it is
            scheduled without it; also bounds every call to the server.
        remote_shutdown_flush_s: at ``Engine.close()``, how long to spend writing the cached
            device and host blocks the remote server lacks (0: nothing), so that a replica
            started after this one (a rolling restart, a scale-down) finds them. Write-back
            alone writes a block only when it leaves the host tier.
        model_id: a name you pin for the model's cached blocks (their namespace in every
            tier, with the dtype and KV layout). None (default): a fingerprint of the weights
            themselves (``radixkv.api.engine.default_model_id``), so changed weights never
            reuse a block the old ones computed. Pin a name only if you rename it whenever
            the weights, tokenizer or config change.
        commit_device_pool: on the CPU, write the device pool's pages once when the engine
            is built, so that its memory is resident from the start (RSS = the whole pool)
            and no prefill pays the first touch of fresh pages. False (default, the library's):
            pages are committed as blocks are first written (``storage.device.lazy_cpu_zeros``),
            so a job using a few blocks stays small, at ~3 ms more for a 250-token prefill into
            fresh blocks of the embedded model (docs/benchmarks.md, "Committing the pool at
            start-up"). ``radixkv serve`` sets it (``--no-commit-kv-pool`` to keep it lazy).
    """

    block_size: int = 16
    num_device_blocks: int | None = None
    device_memory: str | None = None
    host_blocks: int | None = 0
    host_memory: str | None = None
    disk_dir: str | None = None
    disk_blocks: int | None = 0
    disk_memory: str | None = None
    policy: str = "auto"         # core.policy_registry.DEFAULT_POLICY (a test keeps them equal)
    policy_options: dict[str, Any] | None = None
    enable_prefix_caching: bool = True
    tail_blocks: int | None = None
    write_through: tuple[str, ...] = ()
    disk_secret: str | bytes | None = field(default=None, repr=False)
    kv_dtype: str = "auto"
    remote_url: str | None = field(default=None, repr=False)   # may carry a password
    remote_write: str = "write_back"
    remote_ttl_s: float | None = None
    remote_timeout_s: float = 1.0
    remote_shutdown_flush_s: float = 5.0
    model_id: str | None = None
    gpu_memory_utilization: float = 0.9
    commit_device_pool: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.commit_device_pool, bool):
            raise ConfigError(f"CacheConfig.commit_device_pool must be a bool, got "
                              f"{self.commit_device_pool!r}")
        u = self.gpu_memory_utilization
        if isinstance(u, bool) or not isinstance(u, (int, float)) or not 0.0 < u <= 1.0:
            raise ConfigError(f"CacheConfig.gpu_memory_utilization must be in (0, 1], got {u!r}")
        bs = self.block_size
        if not isinstance(bs, int) or isinstance(bs, bool) or bs <= 0 or bs & (bs - 1):
            raise ConfigError(f"CacheConfig.block_size must be a positive power of 2, got {bs!r}")
        for name in ("num_device_blocks", "host_blocks", "disk_blocks", "tail_blocks"):
            _check_count(name, getattr(self, name))
        if self.num_device_blocks == 0:
            raise ConfigError(
                "CacheConfig.num_device_blocks must be > 0 (or None to size from memory)")
        for name in ("device_memory", "host_memory", "disk_memory"):
            v = getattr(self, name)
            if v is not None:
                parse_memory(v)
        if self.disk_dir is not None:
            if not isinstance(self.disk_dir, (str, os.PathLike)) or not os.fspath(self.disk_dir):
                raise ConfigError("CacheConfig.disk_dir must be a directory path (str or "
                                  f"os.PathLike), got {self.disk_dir!r}")
            object.__setattr__(self, "disk_dir", os.fspath(self.disk_dir))
            if not isinstance(self.disk_dir, str):
                raise ConfigError(
                    f"CacheConfig.disk_dir must be a text path, got {self.disk_dir!r}")
        if (self.disk_blocks or self.disk_memory) and not self.disk_dir:
            raise ConfigError("a disk tier needs CacheConfig.disk_dir")
        if self.disk_secret is not None:
            from radixkv.storage.integrity import BlockSigner

            BlockSigner(self.disk_secret)   # raises ConfigError for a weak/odd secret
        if not isinstance(self.policy, str) or not self.policy:
            raise ConfigError(f"CacheConfig.policy must be a policy name, got {self.policy!r}")
        opts = self.policy_options
        if opts is not None:
            if not isinstance(opts, dict) or not all(isinstance(k, str) for k in opts):
                raise ConfigError("CacheConfig.policy_options must be a dict of keyword "
                                  f"arguments, got {opts!r}")
            from radixkv.core.policy_registry import make_policy

            make_policy(self.policy, **opts)   # ConfigError for an unknown or bad option
        wt = self.write_through
        if isinstance(wt, str) or not isinstance(wt, (tuple, list)) or \
                any(t not in ("host", "disk") for t in wt) or len(set(wt)) != len(wt):
            raise ConfigError("CacheConfig.write_through must be a tuple of distinct tier names "
                              f"from ('host', 'disk'), got {wt!r}")
        object.__setattr__(self, "write_through", tuple(wt))
        has = {"host": bool(self.host_blocks or self.host_memory),
               "disk": bool(self.disk_blocks or self.disk_memory)}
        missing = [t for t in self.write_through if not has[t]]
        if missing:
            raise ConfigError(f"CacheConfig.write_through names tier(s) {missing} that are not "
                              "configured (set host_blocks/host_memory, disk_dir + disk_blocks)")
        self._check_remote()
        if self.model_id is not None and (not isinstance(self.model_id, str)
                                          or not self.model_id.strip()):
            raise ConfigError(f"CacheConfig.model_id must be a non-empty string or None, got "
                              f"{self.model_id!r}")
        if self.kv_dtype not in KV_DTYPES:
            raise ConfigError(f"CacheConfig.kv_dtype must be one of {KV_DTYPES}, got "
                              f"{self.kv_dtype!r}")

    def _check_remote(self) -> None:
        if self.remote_url is not None:
            from radixkv.storage.remote_client import parse_url

            if not isinstance(self.remote_url, str) or not self.remote_url:
                raise ConfigError(f"CacheConfig.remote_url must be a URL string, got "
                                  f"{type(self.remote_url).__name__}")
            parse_url(self.remote_url)   # raises ConfigError naming what is wrong
        if self.remote_write not in REMOTE_WRITE_POLICIES:
            raise ConfigError(f"CacheConfig.remote_write must be one of "
                              f"{REMOTE_WRITE_POLICIES}, got {self.remote_write!r}")
        ttl = self.remote_ttl_s
        if ttl is not None and (isinstance(ttl, bool) or not isinstance(ttl, (int, float))
                                or not 0 < ttl < float("inf")):
            raise ConfigError(f"CacheConfig.remote_ttl_s must be > 0 seconds or None, got {ttl!r}")
        f = self.remote_shutdown_flush_s
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 <= f < float("inf"):
            raise ConfigError("CacheConfig.remote_shutdown_flush_s must be >= 0 seconds, got "
                              f"{f!r}")
        t = self.remote_timeout_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t <= 60:
            raise ConfigError(f"CacheConfig.remote_timeout_s must be in (0, 60] seconds, got {t!r}")

    def resolve_blocks(self, bytes_per_block: int) -> tuple[int, int, int]:
        """(device, host, disk) capacities in blocks for a model whose block takes
        ``bytes_per_block`` bytes (all layers, K and V). Raises ConfigError if the device gets 0."""
        if bytes_per_block <= 0:
            raise ConfigError(f"bytes_per_block must be > 0, got {bytes_per_block}")

        def blocks(n: int | None, mem: str | None, default: str | None) -> int:
            if n:
                return n
            mem = mem if mem is not None else default
            return parse_memory(mem) // bytes_per_block if mem is not None else 0

        device = blocks(self.num_device_blocks, self.device_memory, DEFAULT_DEVICE_MEMORY)
        if device <= 0:
            raise ConfigError(
                f"device memory {self.device_memory!r} holds no block of {bytes_per_block} bytes: "
                "raise device_memory or lower block_size")
        host = blocks(self.host_blocks, self.host_memory, None)
        if self.remote_url is not None and host == 0:
            # remote hits land in the host tier: room for a long prompt's run of them
            host = max(REMOTE_STAGING_BLOCKS, device // 4)
        disk = blocks(self.disk_blocks, self.disk_memory, None) if self.disk_dir else 0
        return device, host, disk


def resolve_device(spec: object, what: str = "device"):
    """``spec`` as a ``torch.device`` that exists on this machine; ``"auto"`` is CUDA when
    available, else the CPU.

    Raises ConfigError naming the device when it is not a device string, its backend is not
    available (``"cuda"`` on a machine without CUDA, where torch would otherwise fail with an
    AssertionError deep inside the first tensor allocation) or its index is out of range.
    """
    import torch

    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = spec if isinstance(spec, torch.device) else torch.device(spec)
    except (RuntimeError, TypeError, ValueError) as exc:
        raise ConfigError(f"{what} {spec!r} is not a torch device ('auto', 'cpu', 'cuda', "
                          "'cuda:1', ...)") from exc
    if dev.type == "cpu":
        return dev
    if dev.type == "meta":
        raise ConfigError(f"{what} {spec!r}: the meta device holds no data; use 'cpu' or 'cuda'")
    backend = getattr(torch, dev.type, None)
    if dev.type == "mps":
        backend = getattr(torch.backends, "mps", None)
    available = getattr(backend, "is_available", None)
    if available is None or not available():
        hint = ""
        if dev.type == "cuda":
            hint = (f" (torch {torch.__version__} is built without CUDA)" if torch.version.cuda
                    is None else " (no GPU is visible to torch)")
        raise ConfigError(f"{what} {spec!r}: {dev.type} is not available on this machine"
                          f"{hint}; use device='cpu' or 'auto'")
    count = getattr(backend, "device_count", None)
    if dev.index is not None and count is not None and dev.index >= count():
        raise ConfigError(f"{what} {spec!r}: this machine has {count()} {dev.type} device(s)")
    return dev


#: libgomp's spin counts when ``GOMP_SPINCOUNT`` is not set, by ``OMP_WAIT_POLICY`` (its env.c:
#: ~5 minutes of polling for ACTIVE, ~3 ms when the policy is unset, none for PASSIVE).
_GOMP_DEFAULT_SPINS = {"active": 30_000_000_000, "passive": 0, None: 300_000}
_GOMP_SUFFIX = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}


def openmp_spin_count(environ: dict[str, str] | None = None) -> int:
    """How many iterations an idle thread of GNU OpenMP (libgomp, the runtime of torch's Linux
    wheels) polls before it sleeps, as the environment tells the runtime: ``GOMP_SPINCOUNT``
    when it is a valid count (a number with an optional k/M/G/T suffix, or ``infinite``),
    else the default of ``OMP_WAIT_POLICY`` (PASSIVE: 0; ACTIVE: 3e10; unset: 300,000).

    Why the engine asks: a parallel region's threads that poll catch the next region at once,
    while sleeping ones pay a futex wake-up each, so whether a small forward gains from a
    second thread depends on it (``ModelRunner._cpu_threads``). The runtime reads the
    variables once, when torch loads it; reading them later is exact as long as nothing
    changed them since (``radixkv serve`` sets them before torch loads)."""
    env = os.environ if environ is None else environ
    raw = env.get("GOMP_SPINCOUNT", "").strip().lower()
    if raw in ("infinite", "infinity"):
        return 2**63 - 1
    m = re.fullmatch(r"([0-9]+)\s*([kmgt]?)", raw)
    if m:
        return int(m.group(1)) * _GOMP_SUFFIX[m.group(2)]
    policy = env.get("OMP_WAIT_POLICY", "").strip().lower() or None
    return _GOMP_DEFAULT_SPINS.get(policy, _GOMP_DEFAULT_SPINS[None])


def cpu_has_native_bf16() -> bool:
    """True when the CPU computes in bfloat16 natively (AVX512-BF16 or AMX-BF16 in
    ``/proc/cpuinfo``); elsewhere torch emulates bf16 matmuls through float32 conversions, which
    is slower than float32 itself. False where ``/proc/cpuinfo`` cannot be read."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return bool(flags & {"avx512_bf16", "amx_bf16"})
    except OSError:
        return False
    return False


def default_dtype(device: object):
    """The dtype :meth:`radixkv.Engine.from_pretrained` loads a model in when none is given:
    bfloat16 on a CPU with native bf16 (its bf16 agrees with float32 as often as transformers'
    own bf16 does: ``radixkv bench numerics``), else float32."""
    import torch

    dev = resolve_device(device, "device")
    if dev.type == "cpu" and cpu_has_native_bf16():
        return torch.bfloat16
    return torch.float32


@dataclass(frozen=True)
class EngineConfig:
    """How much one engine step may do, and where the model runs.

    Attributes:
        max_num_seqs: live sequences per step (each sample of ``n`` and each beam counts).
        max_num_batched_tokens: tokens computed per forward (prefill chunks + one per decode).
            Prompts longer than this are prefilled in chunks over several steps.
        device: ``"auto"`` (CUDA when available, else CPU), or any torch device string.
        dtype: model/KV dtype (``torch.dtype`` or a name like ``"float16"``); None keeps the
            model's own (``Engine.from_pretrained``: :func:`default_dtype`, bfloat16 on CPUs
            with native bf16, else float32).
        max_model_len: longest sequence (prompt + output) allowed; None takes the model's
            ``max_position_embeddings``.
        prefetch_requests: with host and disk tiers, the first this many waiting requests get
            their matched disk-tier blocks loaded disk -> host ahead of scheduling (0: off).
        async_loads: with a disk tier, promotions from disk into the device run while other
            requests compute; the request whose blocks are loading joins the batch once they
            have landed (False: the scheduler waits for each promotion). Host -> device
            promotions (memory copies) are always waited for.
        scheduling_policy: the order waiting requests are admitted in: ``"lpm"`` (default:
            longest cached prefix first; requests sharing an uncached prefix wait for one of
            them to compute it; an age limit keeps arrival order for requests that waited
            ``scheduling_max_wait_s``; see ``engine/admission_order.py``), ``"fcfs"``
            (arrival order) or ``"priority"`` (vLLM's: by each request's ``priority``, lower
            first, then arrival; the least urgent running request is preempted first; a
            non-zero ``priority`` is refused under the other two). lpm with a 2 s age limit was
            at least as good as fcfs in TTFT p50/p99 and better in hit rate on the rag and chat
            traces (docs/benchmarks.md).
        scheduling_window: lpm ranks only the this many oldest waiting requests each step
            (bounds its matching cost per step).
        scheduling_max_wait_s: lpm's age limit: a request waiting this many seconds or more is
            admitted in arrival order before any other (so lpm never starves a request).
        cuda_graphs: replay decode steps from CUDA graphs captured per batch-size bucket at
            start-up (engine/cuda_graphs.py). None (default): on wherever they can run (a CUDA
            device and a lean-forward model without sliding windows or quantized KV), off
            elsewhere; True: on, else a ConfigError naming why; False: eager decode (vLLM's
            ``--enforce-eager``). On an H200 they made decode 2.9-6.9x faster with the same
            tokens (docs/gpu.md), hence on by default.
        prefill_priority_steps: in a step where a newly admitted request gets a prefill
            chunk, running requests that only decode wait for the next step, at most this
            many steps in a row (``Scheduler``'s "Prefill priority": SGLang's prefill-first
            order, bounded); a decode row in a new turn's prefill step makes its TTFT longer.
            0: every step carries every running decode (vLLM's order). Four clients through
            ``radixkv serve``: mean later-turn TTFT 5-13% lower, same decode speed.
        long_prefill_token_threshold: vLLM's ``--long-prefill-token-threshold``: in a step
            shared with other requests (running or waiting), one request computes at most this
            many prompt tokens, so a long prompt cannot hold short turns back for a whole
            budget-sized step; alone it is not cut (``Scheduler``'s "Long prefills"). 0
            (default, as vLLM's): no cap. Trades the long prompt's TTFT for the others'.
        long_prefill_token_threshold_adaptive: vLLM's flag of that name: the cap is at least
            ``max_num_batched_tokens`` divided by the requests running and waiting.
        pack_weights: CPU only: run the linear layers on copies of their weights packed once
            for oneDNN (``engine/packed_linear.py``): faster GEMMs (whole forwards of the
            embedded model 0.45-0.90x the time in float32 on an AVX2 EPYC; docs/benchmarks.md,
            "Packed linears"), at the cost of a second copy of the linear weights (+544 MiB of
            RSS for the embedded model in float32, about half that in bf16). None (default):
            where this CPU packs the model's dtype (bf16 with native bf16, float32 on x86-64);
            False: ``F.linear`` on the weights as loaded (``radixkv serve --no-pack-weights``);
            True: packed, else a ConfigError naming why.
        warm_up: run one short prefill and one decode step at start-up, so that the first
            request does not pay the forward's one-time costs (weight packing, kernel
            generation, Triton's compilation on CUDA; ``ModelRunner.warm_up``): on the
            embedded model on the CPU ~0.13 s at start against 5-6x the TTFT of the first
            request through the server. With packed CPU GEMMs it then has oneDNN build its
            kernels for forwards of 1 to 128 rows at one thread and at the configured count,
            within 0.5 s (81 row counts on the 2-core Zen 5 EPYC at two threads): a prompt
            length not met before had paid ~2 ms for them.
        seed: vLLM's ``--seed``: requests that give no ``seed`` draw from generators seeded in
            turn from this one, so the same requests in the same order sample the same tokens
            after a restart. None (default): fresh entropy per request (OpenAI's behaviour).
        blend_ratio: the share of document tokens recomputed when a request's documents are
            blended from their cached entries (``add_request(documents=...)``, the server's
            ``documents``; docs/rag.md) and the request names no ratio. 0.15: the smallest
            measured ratio at the bf16 model's top-1 agreement with a full prefill.
    """

    max_num_seqs: int = 32
    max_num_batched_tokens: int = 2048
    device: str = "auto"
    dtype: object = None
    max_model_len: int | None = None
    prefetch_requests: int = 4
    async_loads: bool = True
    scheduling_policy: str = "lpm"
    scheduling_window: int = 32
    scheduling_max_wait_s: float = 2.0
    cuda_graphs: bool | None = None
    prefill_priority_steps: int = 4
    long_prefill_token_threshold: int = 0
    long_prefill_token_threshold_adaptive: bool = False
    pack_weights: bool | None = None
    warm_up: bool = True
    blend_ratio: float = 0.15
    seed: int | None = None

    def __post_init__(self) -> None:
        from radixkv.engine.admission_order import POLICIES, check_lpm_options

        if self.seed is not None and (not isinstance(self.seed, int)
                                      or isinstance(self.seed, bool)):
            raise ConfigError(f"EngineConfig.seed must be an int or None, got {self.seed!r}")
        r = self.blend_ratio
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0 <= r <= 1:
            raise ConfigError(f"EngineConfig.blend_ratio must be a number in [0, 1], got {r!r}")
        if self.scheduling_policy not in POLICIES:
            raise ConfigError(f"EngineConfig.scheduling_policy must be one of "
                              f"{', '.join(POLICIES)}, got {self.scheduling_policy!r}")
        check_lpm_options(self.scheduling_window, self.scheduling_max_wait_s)
        if self.cuda_graphs is not None and not isinstance(self.cuda_graphs, bool):
            raise ConfigError(f"EngineConfig.cuda_graphs must be None (where possible), True or "
                              f"False, got {self.cuda_graphs!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ConfigError(f"EngineConfig.{name} must be a positive int, got {v!r}")
        v = self.prefetch_requests
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ConfigError(f"EngineConfig.prefetch_requests must be an int >= 0, got {v!r}")
        v = self.prefill_priority_steps
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ConfigError(f"EngineConfig.prefill_priority_steps must be an int >= 0, "
                              f"got {v!r}")
        v = self.long_prefill_token_threshold
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ConfigError(f"EngineConfig.long_prefill_token_threshold must be an int >= 0 "
                              f"(0: no cap), got {v!r}")
        if not isinstance(self.long_prefill_token_threshold_adaptive, bool):
            raise ConfigError(f"EngineConfig.long_prefill_token_threshold_adaptive must be a "
                              f"bool, got {self.long_prefill_token_threshold_adaptive!r}")
        if self.pack_weights is not None and not isinstance(self.pack_weights, bool):
            raise ConfigError(f"EngineConfig.pack_weights must be None (where this CPU packs "
                              f"the dtype), True or False, got {self.pack_weights!r}")
        if not isinstance(self.warm_up, bool):
            raise ConfigError(f"EngineConfig.warm_up must be a bool, got {self.warm_up!r}")
        if not isinstance(self.async_loads, bool):
            raise ConfigError(f"EngineConfig.async_loads must be a bool, got {self.async_loads!r}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ConfigError(
                f"EngineConfig.max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_num_seqs ({self.max_num_seqs}) so every running sequence can decode each "
                "step")
        if self.max_model_len is not None and (
                not isinstance(self.max_model_len, int) or self.max_model_len <= 1):
            raise ConfigError(
                f"EngineConfig.max_model_len must be an int > 1, got {self.max_model_len!r}")
        if not isinstance(self.device, str) or not self.device:
            raise ConfigError(f"EngineConfig.device must be a device string, got {self.device!r}")
        if self.dtype is not None:
            self.torch_dtype(None)   # raises ConfigError for a non-float or unknown dtype
        if self.device != "auto":
            resolve_device(self.device, "EngineConfig.device")  # fail here, not 11 frames deep

    def torch_device(self):
        """The torch device to run on (``auto``: CUDA if available, else CPU); see
        :func:`resolve_device`."""
        return resolve_device(self.device, "EngineConfig.device")

    def torch_dtype(self, default):
        """The dtype to run in: ``dtype`` resolved (strings like ``"bfloat16"``), else
        ``default``."""
        import torch

        if self.dtype is None:
            return default
        if isinstance(self.dtype, torch.dtype):
            dt = self.dtype
        elif isinstance(self.dtype, str):
            dt = getattr(torch, self.dtype.replace("torch.", ""), None)
        else:
            dt = None
        if not isinstance(dt, torch.dtype):
            raise ConfigError(f"EngineConfig.dtype {self.dtype!r} is not a torch dtype")
        if not dt.is_floating_point:
            raise ConfigError(f"EngineConfig.dtype {self.dtype!r} is not a floating-point dtype: "
                              "the model and its KV run in float32, float16 or bfloat16")
        return dt


__all__ = ["CacheConfig", "EngineConfig", "parse_memory", "resolve_device", "default_dtype",
           "cpu_has_native_bf16", "DEFAULT_DEVICE_MEMORY"]
