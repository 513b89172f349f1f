"""LLMEngine: requests in, one scheduled forward per ``step()``, ``RequestOutput`` snapshots out.

A step is three moves (nano-vllm's shape): ``schedule`` (pure Python: who computes which tokens,
which blocks move), ``run`` (KV moves and copies through the mover, then ONE packed forward of
every prefill chunk and decode token together), ``postprocess`` (commit the computed blocks to
the prefix cache, sample, detect stops, fork/free sequences, build outputs).

Why one mixed forward rather than separate prefill and decode forwards: decodes never wait behind
a long prefill (the chunk budget bounds the step), and the model runs once per step. The model
runner picks its decode kernel when every sequence computes one token.

Commit happens strictly after the forward that wrote the KV, so a block is visible to other
requests only once its bytes are valid.
"""

from __future__ import annotations

import atexit
import collections
import itertools
import random
import time
import weakref
from collections.abc import Callable, Mapping, Sequence as Seq
from typing import Any, NamedTuple

import torch

from radixkv.config import CacheConfig, EngineConfig
from radixkv.core.block_manager import BlockManager
from radixkv.core.events import KVEventCounts
from radixkv.core.hashing import Namespace
from radixkv.core.policy_registry import make_policy
from radixkv.core.tree import RadixTree
from radixkv.engine.batch import SequenceChunk
from radixkv.tiers import setup as tiering
from radixkv.engine.beam_search import BeamSearch
from radixkv.engine.cache_points import (
    cached_chain, check_points, inherit_ttl, prefilled, retain_remote,
)
from radixkv.engine.detokenizer import IncrementalDetokenizer
from radixkv.engine.engine_stats import engine_stats
from radixkv.tiers.protocol import DeviceOnlyMover, KVMover, run_kv_ops
from radixkv.engine.memory import PoolSizing, size_device_pool
from radixkv.engine import packed_linear
from radixkv.engine.model_runner import ModelRunner, model_kv_layout
from radixkv.engine.outputs import (
    FINISH_ABORT, FINISH_CAPACITY, RequestOutput, TokenLogprob, check_stop, request_output,
)
from radixkv.engine.grammar import accept as grammar_accept
from radixkv.engine.sampling import (OUTPUT_CUMULATIVE, SamplingParams, StepReads,
                                     choice_logits, draw_tokens, eos_token_ids,
                                     filtered_probs_rows, greedy_and_logsumexp, make_generator,
                                     to_device)
from radixkv.engine.schedule_types import drive
from radixkv.engine.admission_order import make_admission_order
from radixkv.engine.scheduler import Scheduler, SchedulerOutput
from radixkv.engine.validation import bad_words_ids, check_priority, check_request
from radixkv.engine.sequence import Request, Sequence, check_session
from radixkv.errors import ConfigError, EngineClosedError, InvalidRequestError


#: A request's sampled (token, raw log-probability) pairs of one step, in the order its
#: sequences take them (LLMEngine._queue_draws).
Drawn = collections.deque[tuple[int, float]]


class _Draws(NamedTuple):
    """A step's sampled rows as queued (:meth:`LLMEngine._queue_draws`): ``order`` of
    ``(request, logits row, adjusted, generator)``, the fork generators per request, and the
    indices of the drawn tokens and their log-probabilities in the step's read (-1: none)."""
    order: list[tuple[Request, int, bool, torch.Generator | None]]
    forks: dict[str, list[torch.Generator]]
    k_tok: int
    k_val: int


def namespace_model(model_id: str, layout: Any) -> str:
    """The ``Namespace.model`` string that seeds every block's chain hash: the model id (by
    default a fingerprint of the weights: ``radixkv.api.engine.default_model_id``) + KV dtype +
    KV layout + block size, so blocks of different weights, precisions or geometries never
    match."""
    return (f"{model_id}|{layout.dtype}|L{layout.num_layers}-kv{layout.num_kv_heads}"
            f"-d{layout.head_dim}|B{layout.block_size}")


#: Seconds between two TTL expiry passes of a step (expiry is lazy: an idle engine does none).
EXPIRY_PERIOD_S = 1.0


def _pack_weights(want: bool | None, dtype: torch.dtype, device: torch.device) -> bool | None:
    """``EngineConfig.pack_weights`` checked before anything loads: True where this CPU does
    not pack ``dtype`` is a ConfigError (None leaves the choice to the runner)."""
    if want and not packed_linear.packing_supported(dtype, device):
        where = (f"a {device.type} device" if device.type != "cpu"
                 else f"{dtype} on this CPU ({torch.backends.cpu.get_cpu_capability()})")
        raise ConfigError(f"EngineConfig.pack_weights=True but linear weights are not packed "
                          f"for {where}: packing is for bf16 on CPUs with native bf16 and "
                          "float32 on x86-64")
    return want


class LLMEngine:
    """Continuous-batching engine over a transformers model with a prefix-cached paged KV pool.

    Args:
        model: a transformers or radixkv-native ``*ForCausalLM`` (to ``engine_config``'s dtype).
        tokenizer: its tokenizer (for text and stop strings), or None (token ids only).
        cache_config, engine_config: see :mod:`radixkv.config`.
        model_id: name used in the cache namespace (with dtype and KV layout).
        kv_mover: a :class:`KVMover`, or a callable ``kv_cache -> KVMover`` (a tiered mover is
            built around the engine's cache tensor); None = :class:`DeviceOnlyMover`, or, when
            ``cache_config`` has host/disk tiers, a
            :class:`~radixkv.tiers.mover.TieredKVMover` over a ``HostPool`` and a
            ``DiskStore`` built here (the tree is then rebuilt from the disk tier's files).
    """

    def __init__(self, model: Any, tokenizer: Any, cache_config: CacheConfig,
                 engine_config: EngineConfig, model_id: str,
                 kv_mover: KVMover | Callable[[torch.Tensor], KVMover] | None = None) -> None:
        if not isinstance(model_id, str) or not model_id:
            raise ConfigError("model_id must be a non-empty string")
        param = next(model.parameters())
        device = engine_config.torch_device()
        dtype = engine_config.torch_dtype(param.dtype)
        pack_weights = _pack_weights(engine_config.pack_weights, dtype, device)
        if param.device != device or param.dtype != dtype:
            model = model.to(device=device, dtype=dtype)
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.cache_config = cache_config
        self.engine_config = engine_config
        self.model_id = model_id
        bs = cache_config.block_size
        layout = model_kv_layout(model, bs, cache_config.kv_dtype)
        if cache_config.kv_dtype == "fp8_e4m3":   # measured below bf16's quality (issue 31)
            import warnings

            from radixkv.engine.kv_quant import QuantizedKVWarning, fp8_warning
            warnings.warn(fp8_warning(getattr(getattr(model, "config", None), "model_type",
                                              None)), QuantizedKVWarning, stacklevel=2)
        n_dev, n_host, n_disk = cache_config.resolve_blocks(layout.bytes_per_block)
        #: how the device pool was sized from the GPU's memory (None: given, or not CUDA)
        self.pool_sizing: PoolSizing | None = None
        if (device.type == "cuda" and cache_config.num_device_blocks is None
                and cache_config.device_memory is None):
            self.pool_sizing = size_device_pool(
                model, layout, bs, cache_config.kv_dtype, cache_config.gpu_memory_utilization,
                engine_config.max_num_batched_tokens, engine_config.max_num_seqs, device)
            n_dev = self.pool_sizing.num_blocks
        lower = [n for n in (n_host, n_disk) if n]
        self.layout = layout
        self.tier_names = ["device"] + (["host"] if n_host else []) + (["disk"] if n_disk else [])
        self.tier_capacity_blocks = [n_dev, *lower]
        wt = [self.tier_names.index(t) for t in cache_config.write_through
              if t in self.tier_names]
        policy = make_policy(cache_config.policy, **(cache_config.policy_options or {}))
        self._bm = BlockManager.create(
            n_dev, bs, policy, lower_tier_blocks=lower, write_through=wt,
            tail_blocks=cache_config.tail_blocks if cache_config.enable_prefix_caching else 0)
        self._runner = ModelRunner.for_model(model, n_dev, bs, cache_config.kv_dtype,
                                             commit_pool=cache_config.commit_device_pool,
                                             pack_weights=pack_weights)
        #: seconds the start-up forwards took (``EngineConfig.warm_up``; 0.0: not run)
        self.warm_up_s = self._runner.warm_up() if engine_config.warm_up else 0.0
        graphs = engine_config.cuda_graphs
        if graphs is None:   # where possible: CUDA and a step without host-side decisions
            graphs = device.type == "cuda" and self._runner.decode_graphs_unsupported() is None
        if graphs:
            if device.type != "cuda":
                raise ConfigError(f"EngineConfig.cuda_graphs needs a CUDA device, got {device}")
            limit = getattr(model.config, "max_position_embeddings", None)
            longest = min(x for x in (limit, engine_config.max_model_len, n_dev * bs) if x)
            self._runner.enable_decode_graphs(engine_config.max_num_seqs, -(-longest // bs))
        self.restore_report: dict[str, Any] | None = None
        if kv_mover is None and lower:
            kv_mover = self._tiered_mover(n_host, n_disk, model_id)
        elif kv_mover is None:
            kv_mover = DeviceOnlyMover(self._runner.kv_cache)
        elif not isinstance(kv_mover, KVMover) and callable(kv_mover):
            kv_mover = kv_mover(self._runner.kv_cache)
        if not isinstance(kv_mover, KVMover):
            raise ConfigError(f"kv_mover must be a radixkv.tiers.KVMover (or a callable "
                              f"returning one), got {type(kv_mover).__name__}")
        self.kv_mover: KVMover = kv_mover
        self._remote = tiering.build_remote(   # None without remote_url
            cache_config, layout, self._bm, kv_mover, self.tier_names,
            self._runner.kv_cache, model_id)
        #: Names of ``RequestOutput.cached_tokens_per_tier``'s entries: the tree's tiers, then
        #: "remote" when a remote tier is configured.
        self.output_tier_names = self.tier_names + (["remote"] if self._remote else [])
        self._namespace = Namespace(namespace_model(model_id, layout))
        self._eos = eos_token_ids(model, tokenizer)
        limits = [getattr(model.config, "max_position_embeddings", None),
                  engine_config.max_model_len]
        self.max_model_len = min(x for x in limits if x) if any(limits) else 2**31 - 1
        self.vocab_size = model.get_input_embeddings().num_embeddings
        loads = tiering.MoverLoads(kv_mover) if kv_mover.async_loads else None
        self._loads = loads
        self._scheduler = Scheduler(self._bm, engine_config.max_num_seqs,
                                    engine_config.max_num_batched_tokens, loads=loads,
                                    immediate=True, admission=make_admission_order(
                                        engine_config.scheduling_policy, self._bm,
                                        engine_config.scheduling_window,
                                        engine_config.scheduling_max_wait_s),
                                    prefill_priority_steps=engine_config.prefill_priority_steps,
                                    long_prefill_token_threshold=(
                                        engine_config.long_prefill_token_threshold),
                                    long_prefill_adaptive=(
                                        engine_config.long_prefill_token_threshold_adaptive))
        self._requests: dict[str, Request] = {}
        self._ids = itertools.count()
        #: session ends the client announced (``end_session``: a request's flag, or the call)
        self.session_ends = 0
        self._pending: list[RequestOutput] = []   # outputs produced outside step (aborts)
        self._num_forwards = 0
        self._prompt_rows = False   # the step's forward returns prompt positions' logits too
        # EngineConfig.seed: the seeds of requests that give none, in arrival order
        self._seeds = (random.Random(engine_config.seed)
                       if engine_config.seed is not None else None)
        # Close (join the tier threads) before the interpreter finalizes: a daemon thread in a
        # CUDA copy at finalization aborts the process (see api/engine_loop.py).
        self._at_exit = _close_at_exit(weakref.ref(self))
        atexit.register(self._at_exit)
        self._next_expiry = float("-inf")   # the next time _expire may run
        #: blocks stored/removed per tier from the KV events, once ``count_kv_events`` asked
        self.kv_event_counts: KVEventCounts | None = None
        self._closed = False

    # ------------------------------------------------------------------ tiers
    def _tiered_mover(self, n_host: int, n_disk: int, model_id: str) -> KVMover:
        mover, self.restore_report = tiering.build_mover(
            self._runner.kv_cache, self.layout, self.cache_config, self._bm,
            self.engine_config.async_loads, n_host, n_disk, model_id)
        return mover

    def _run_ops(self, ops: Seq[Any]) -> list[bytes]:
        """The scheduler's executor: run KV ops now; hashes of failed promotions."""
        run_kv_ops(self.kv_mover, ops)
        return self.kv_mover.take_failed_loads()

    def persist(self) -> int:
        """Demote every unreferenced cached block to the slowest tier (disk when configured),
        so that another process on the same ``disk_dir`` gets them as hits. Blocks that do not
        fit there are dropped, oldest first (the tier's eviction order). Call between steps;
        blocks of running sequences stay where they are. Returns the blocks moved."""
        tree = self._bm.tree
        if tree.num_tiers == 1:
            return 0  # nowhere slower to go: demoting would drop the cache
        self._drain_kv()   # settle batches in flight before the tree changes
        moves = self._bm.evict(0, tree.num_evictable(0))
        for t in range(1, tree.num_tiers - 1):
            moves += self._bm.evict(t, tree.num_evictable(t))
        failed = self._run_ops(moves)
        assert not failed, "demotions cannot fail a load"
        self._drain_kv()   # the files are written when this returns
        return sum(1 for m in moves if m.dst_tier is not None)

    def flush_remote(self, timeout_s: float) -> dict[str, Any] | None:
        """Write the cached device and host blocks the remote server lacks, for at most about
        ``timeout_s`` (``RemoteTier.flush_resident``); call between steps, e.g. at shutdown.
        None without a remote tier or once closed."""
        if self._remote is None or self._closed:
            return None
        self._drain_kv()   # host slots hold their blocks' bytes once moves have landed
        return self._remote.flush_resident(timeout_s)

    def close(self) -> None:
        """Stop the mover's threads; add_request/step then raise EngineClosedError. Idempotent."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self._at_exit)
        self.kv_mover.close()
        if self._remote is not None:
            self._remote.close()

    # ------------------------------------------------------------------ properties
    @property
    def remote_tier(self) -> Any:
        """The remote tier (:class:`radixkv.tiers.remote.RemoteTier`), or None."""
        return self._remote

    @property
    def block_manager(self) -> BlockManager:
        return self._bm

    @property
    def closed(self) -> bool:
        """Whether ``close()`` ran (a closed engine takes no requests)."""
        return self._closed

    @property
    def num_forwards(self) -> int:
        """Forward passes run so far (``stats()["forwards"]``)."""
        return self._num_forwards

    def has_request(self, request_id: str) -> bool:
        """Whether ``request_id`` is in flight (added, not finished or aborted). O(1)."""
        return request_id in self._requests

    @property
    def tree(self) -> RadixTree:
        return self._bm.tree

    @property
    def model_runner(self) -> ModelRunner:
        return self._runner

    @property
    def namespace(self) -> Namespace:
        return self._namespace

    @property
    def scheduler(self) -> Scheduler:
        return self._scheduler

    # ------------------------------------------------------------------ requests
    def is_prefilling(self, request_id: str) -> bool:
        """Whether ``request_id`` is in the engine and has not produced its first token yet
        (waiting, or computing its prompt). Safe to call from any thread while another steps
        the engine: it reads one dict entry and one attribute, which the step writes whole (a
        server's ``--max-num-queued-tokens`` sums the prompts still in this phase)."""
        req = self._requests.get(request_id)
        return req is not None and req.first_token_time is None

    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams | Mapping[str, Any] | None = None,
                    cache_salt: str | None = None, arrival_time: float | None = None,
                    cache_points: Seq[Any] | None = None, session: str | int | None = None,
                    end_session: bool = False, namespace_extra: str | None = None,
                    documents: Seq[Any] | None = None, blend_ratio: float | None = None,
                    priority: int = 0) -> None:
        """Queue a request. Everything is validated first: a bad request raises
        InvalidRequestError and leaves the engine (and requests in flight) untouched.

        ``arrival_time`` (``perf_counter`` seconds, default now) starts the request's TTFT
        clock: a caller that queued the request while a step was running passes the time it
        asked, so the wait for that step counts as engine time, as vLLM's TTFT does.
        ``cache_points``: :class:`~radixkv.engine.cache_points.CachePoint` s (or dicts) marking
        prefixes of the prompt to keep with a TTL and/or priority once it is computed.
        ``session`` (str or int) / ``end_session`` (its last request): eviction hints.
        ``namespace_extra``: a cache domain of the same model and salt (``Namespace.extra``):
        a document entry or a blended prompt (:mod:`radixkv.engine.blend`).
        ``documents``: ``(start, end)`` token spans of the prompt's documents: their cached
        entries are blended in now, at admission, recomputing the ``blend_ratio`` share
        (default ``EngineConfig.blend_ratio``), and the request runs over the result.
        ``priority``: its scheduling priority under ``scheduling_policy="priority"`` (lower is
        sooner, vLLM's convention; :mod:`radixkv.engine.admission_order`); must be 0 under the
        other policies."""
        params = check_request(self, request_id, prompt_token_ids, params, cache_salt)
        priority = check_priority(priority, self.engine_config.scheduling_policy)
        bad_words = bad_words_ids(self.tokenizer, params.bad_words) if params.bad_words else ()
        check_session(session, end_session)
        points = check_points(cache_points, len(prompt_token_ids))
        ns = self._namespace.with_salt(cache_salt)
        if documents is not None or blend_ratio is not None:
            namespace_extra = self._blend(prompt_token_ids, documents, blend_ratio, cache_salt,
                                          namespace_extra)
        if namespace_extra is not None:
            if not isinstance(namespace_extra, str) or not namespace_extra:
                raise InvalidRequestError(f"namespace_extra must be a non-empty str, got "
                                          f"{namespace_extra!r}")
            ns = Namespace(ns.model, cache_salt, ns.adapter_id, namespace_extra)
        if params.prompt_logprobs is not None:
            if documents is not None or blend_ratio is not None:
                raise InvalidRequestError("prompt_logprobs needs the whole prompt computed: "
                                          "not with documents (their entries are blended)")
            # every position's logits: nothing is read from the cache, and its blocks stay
            # private (a private namespace, as with prefix caching off)
            ns = Namespace(ns.model, cache_salt, extra=f"prompt-logprobs:{next(self._ids)}")
        if not self.cache_config.enable_prefix_caching:
            ns = Namespace(ns.model, cache_salt, extra=f"no-prefix-cache:{next(self._ids)}")
        req = Request(request_id, list(prompt_token_ids), params, ns, arrival_time=arrival_time)
        req.cache_points = points
        req.bad_words_ids = bad_words
        if params.seed is not None:
            req.seed = params.seed
        elif self._seeds is not None and not params.greedy:
            req.seed = self._seeds.getrandbits(63)
        req.session, req.end_session = session, end_session
        req.priority = priority
        n_first = 1 if params.n > 1 or params.use_beam_search else params.n
        for i in range(n_first):
            req.seqs.append(self._new_seq(req, i, list(req.prompt_token_ids)))
        if params.use_beam_search:
            max_new = min(params.max_tokens, self.max_model_len - len(req.prompt_token_ids))
            eos = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self._eos))
            req.beam = BeamSearch(params.beam_width, max_new, sorted(eos), params.length_penalty,
                                  params.early_stopping)
        self._requests[request_id] = req
        self.session_ends += end_session
        if self._remote is not None and self.cache_config.enable_prefix_caching:
            self._remote.lookup(req)   # scheduled once its lookup is done (or timed out)
        else:
            self._scheduler.add(req)

    def _blend(self, prompt: Seq[int], documents: Seq[Any] | None, ratio: float | None,
               cache_salt: str | None, namespace_extra: str | None) -> str | None:
        """Blend a request's documents (``add_request``'s ``documents``); the namespace extra
        it then runs under (unchanged where blending does not apply)."""
        from radixkv.engine import blend

        if namespace_extra is not None or documents is None:
            raise InvalidRequestError("documents (with an optional blend_ratio) and "
                                      "namespace_extra exclude each other; blend_ratio needs "
                                      "documents")
        spans = blend.check_spans(documents, len(prompt))
        r = blend.check_blend_ratio(self.engine_config.blend_ratio if ratio is None else ratio)
        rep = blend.blend_context(self, prompt, spans, cache_salt, r)
        return rep.namespace_extra if rep is not None else None

    def persist_blocks(self, block_hashes: Seq[bytes], ttl: float | None = None) -> int:
        """Keep these cached device blocks in the remote tier at least ``ttl`` seconds after
        their last use, written now (a pinned RAG document). Returns how many it took: 0
        without one, or when it is read-only."""
        return retain_remote(self._remote, block_hashes, ttl, now=True)

    def end_session(self, session: str | int) -> None:
        """``session`` is over: its blocks go first (``forecast``/``duel``; others ignore it)."""
        if session is None:
            raise InvalidRequestError("end_session needs a session id (a str or int)")
        check_session(session, False)
        self._bm.end_session(session)
        self.session_ends += 1

    def _new_seq(self, req: Request, index: int, token_ids: list[int],
                 generator: torch.Generator | None = None) -> Sequence:
        p = req.params
        gen = generator
        if gen is None and not p.greedy:
            gen = self._generator(req, index)
        seq = Sequence(next(self._ids), index, token_ids, len(req.prompt_token_ids),
                       IncrementalDetokenizer(self.tokenizer, p.stop + p.stop_after,
                                              p.skip_special_tokens), gen)
        if p.logprobs is not None:
            seq.logprobs = []
        return seq

    def abort_request(self, request_id: str) -> None:
        """Stop a request now; its final output (finish_reason "abort") comes from the next
        ``step()``. Unknown or finished ids are ignored."""
        req = self._requests.get(request_id)
        if req is None or req.is_finished:
            return
        if self._remote is not None:
            self._remote.forget(request_id)
        drive(self._scheduler.remove_plan(req), self._run_ops, self._loads)
        for seq in req.seqs:
            seq.finish_reason = FINISH_ABORT
            req.done.append(seq)
        req.seqs = []
        if req.beam is not None:
            req.beam = None  # no finished hypotheses to report; outputs are the aborted beams
        self._pending.append(self._output(req, finished=True))
        del self._requests[request_id]

    def has_unfinished_requests(self) -> bool:
        return self._scheduler.has_unfinished() or bool(self._pending) or (
            self._remote is not None and self._remote.has_arrivals())

    # ------------------------------------------------------------------ the step
    def step(self) -> list[RequestOutput]:
        """One engine step: settle the tiers, schedule, apply the plan, run the model,
        postprocess. Returns the outputs of requests that changed."""
        if self._closed:
            raise EngineClosedError("the engine is closed; build a new one")
        outputs, self._pending = self._pending, []
        self._settle_tiers()
        sched = drive(self._scheduler.plan(), self._run_ops, self._loads)
        outputs.extend(self._apply_plan(sched))
        if sched.chunks:
            logits = self._run(sched)
            outputs.extend(self._postprocess(sched, logits))
        self._after_step()
        return outputs

    def _settle_tiers(self) -> None:
        """Before the scheduler touches the tree: settle last step's write-behind/prefetch
        batches (their failures are then filed against nodes that are still where they went;
        promotions still running stay so, their requests are loading and the scheduler knows),
        expire TTLs, and queue the requests whose remote lookup is done."""
        self._drain_kv(loads=False)
        self._expire()
        if self._remote is not None:
            for req in self._remote.admit(self._run_ops, not self._scheduler.has_unfinished()):
                req.remote_tokens = self._remote.take_remote_tokens(req.request_id)
                self._scheduler.add(req)

    def _apply_plan(self, sched: SchedulerOutput) -> list[RequestOutput]:
        """Make the schedule so: finish what can never fit, run the KV moves and copies it
        planned (the mover), start prefetches that overlap the forward."""
        outputs = []
        for req in sched.unschedulable:
            self._finish_all(req, FINISH_CAPACITY)
            outputs.append(self._output(req, finished=True))
        run_kv_ops(self.kv_mover, sched.kv_ops)
        self._prefetch()   # disk -> host loads for waiting requests, while the forward runs
        return outputs

    def _after_step(self) -> None:
        if self._remote is not None:
            self._remote.after_step()   # write-through of the blocks computed this step
        if self.kv_event_counts is not None:
            self.kv_event_counts.drain()   # O(this step's events): no backlog in the queue
        if not self.has_unfinished_requests():
            self._drain_kv()   # idle: the disk tier's files are exactly its blocks

    def _expire(self) -> None:
        """TTLs are driven lazily, here: at most every ``EXPIRY_PERIOD_S`` under the TTL
        policy, and when a per-block TTL hint is due under any other."""
        tree = self.tree
        now = tree.clock()
        if now < self._next_expiry:
            return
        due = tree.next_expiry()
        if tree.policy.name == "ttl" or (due is not None and due <= now):
            self._next_expiry = now + EXPIRY_PERIOD_S
            self._run_ops(self._bm.expire(now))

    def _drain_kv(self, loads: bool = True) -> None:
        # a mover without async loads has no promotion in flight: drain everything
        self.kv_mover.drain(loads=loads or not self.kv_mover.async_loads)

    def _prefetch(self) -> None:
        tiering.prefetch(self._bm, self.kv_mover, self._scheduler.waiting, self.tier_names,
                         self.tier_capacity_blocks, self.engine_config.prefetch_requests)

    def _run(self, sched: SchedulerOutput) -> torch.Tensor:
        bm, bs = self._bm, self._bm.block_size
        chunks = []
        prompt_rows = False   # some chunk wants logits of prompt positions (prompt_logprobs)
        for c in sched.chunks:
            seq, start = c.seq, c.start
            table = bm.block_table(seq.seq_id)
            if c.num_tokens == 1 and (c.wants_logits or c.request.prompt_logprobs is None):
                # a decode token (the common case: no range, no slice)
                chunks.append(SequenceChunk(
                    [seq.token_ids[start]], start, table,
                    [table[start // bs] * bs + start % bs], None if c.wants_logits else ()))
                continue
            end = start + c.num_tokens
            slots = [table[p // bs] * bs + p % bs for p in range(start, end)]
            offsets: list[int] | tuple[()] | None = None if c.wants_logits else ()
            k = _prompt_rows(c) if c.request.prompt_logprobs is not None else 0
            if k:
                prompt_rows = True
                offsets = [*range(k), *((c.num_tokens - 1,) if c.wants_logits else ())]
            chunks.append(SequenceChunk(seq.token_ids[start:end], start, table, slots, offsets))
        self._prompt_rows = prompt_rows
        tiering.fence(self.kv_mover, self.tree, chunks)
        self._num_forwards += 1
        return self._runner.execute(self._runner.build_batch(chunks))

    def _postprocess(self, sched: SchedulerOutput, logits: torch.Tensor) -> list[RequestOutput]:
        rows: dict[int, int] = {}
        reqs: dict[str, Request] = {}
        commit = self._bm.commit
        for c in sched.chunks:
            seq_id = c.seq.seq_id
            commit(seq_id, c.start + c.num_tokens)
            if c.wants_logits:
                rows[seq_id] = len(rows)
                reqs[c.request.request_id] = c.request
        copies = self._bm.take_moves()   # write-through copies of the blocks just committed
        if copies:
            run_kv_ops(self.kv_mover, copies)
        if self._prompt_rows:   # rows of prompt positions first: read them, keep the others
            logits = self._take_prompt_logprobs(sched, logits)
        if not rows:
            return []
        # Everything the host needs from the device this step (greedy tokens, their
        # log-probabilities, adjusted argmaxes, sampled tokens and theirs) is queued first and
        # read back in one transfer: on CUDA each read is a stream sync (StepReads).
        need_top = any(r.params.logprobs or r.params.logprob_token_ids for r in reqs.values())
        fast = None if need_top else greedy_and_logsumexp(logits)   # CPU: native, host lists
        reads = StepReads()
        lse: list[float] | None = None
        logp: torch.Tensor | None = None
        if fast is not None:
            argmax, lse = fast
            k_argmax = -1
            picked = logits.gather(1, torch.tensor(argmax)[:, None])[:, 0]
        else:
            logp = torch.log_softmax(logits, dim=-1)
            best = logits.max(dim=-1).indices      # ties -> lowest id (greedy_tokens)
            k_argmax = reads.add(best)
            picked = logp.gather(1, best[:, None])[:, 0]
        k_lp = reads.add(picked)
        adjusted = [(rows[s.seq_id], r, s) for r in reqs.values() if r.params.adjusts_logits
                    for s in r.seqs]
        source = logp if logp is not None else logits   # raw log-probs (or logits - lse)
        # penalties, biases, min_tokens' mask, grammars
        adj = choice_logits(logits, adjusted, self._eos) if adjusted else None
        k_pick = k_pick_lp = -1
        if adj is not None:   # adjusted greedy: argmax of the adjusted logits, raw log-prob
            adj_best = adj.max(dim=-1).indices
            k_pick = reads.add(adj_best)
            k_pick_lp = reads.add(source.gather(1, adj_best[:, None])[:, 0])
        draws = self._queue_draws(reqs, rows, logits, adj, logp, reads)
        top_rows = sorted({rows[s.seq_id] for r in reqs.values()
                           if r.params.logprobs and r.params.logprob_token_ids is None
                           and r.beam is None for s in r.seqs})
        # logprob_token_ids: each such request's rows, at its tokens (one gather a request)
        named: list[tuple[list[int], tuple[int, ...], int]] = []
        for r in reqs.values():
            ids_ = r.params.logprob_token_ids
            if ids_ is not None and r.beam is None:
                rr = [rows[s.seq_id] for s in r.seqs]
                assert logp is not None   # need_top: the native pass did not run
                named.append((rr, ids_, reads.add(logp[to_device(rr, logp.device, torch.long)][
                    :, to_device(list(ids_), logp.device, torch.long)])))
        k_top = -1
        if top_rows:   # the most likely tokens of every row that reports them, one topk
            assert logp is not None   # need_top: the native pass did not run
            k = max(r.params.logprobs or 0 for r in reqs.values())
            vals, ids = torch.topk(logp.index_select(
                0, to_device(top_rows, logp.device, torch.long)), k, dim=-1)
            k_top = reads.add(ids)
            reads.add(vals)
        got = reads.read()

        def minus_lse(vals: list[float]) -> list[float]:
            return vals if lse is None else [v - lse[r] for r, v in enumerate(vals)]

        if k_argmax >= 0:
            argmax = [int(v) for v in got[k_argmax]]
        greedy_lp = minus_lse(got[k_lp])
        pick = None if adj is None else (adj, [int(v) for v in got[k_pick]],
                                         minus_lse(got[k_pick_lp]))
        tops: dict[int, tuple[list[float], list[float]]] = {}
        if k_top >= 0:
            w = len(got[k_top]) // len(top_rows)
            tops = {r: (got[k_top][i * w:(i + 1) * w], got[k_top + 1][i * w:(i + 1) * w])
                    for i, r in enumerate(top_rows)}
        for rr, ids_, k in named:
            w = len(ids_)
            for i, row_ in enumerate(rr):
                tops[row_] = ([float(t) for t in ids_], got[k][i * w:(i + 1) * w])
        drawn, forks = self._drawn(draws, got, lse)
        now = time.perf_counter()
        outputs = []
        host = self.tier_names.index("host") if self._remote is not None else None
        tokenizer = self.tokenizer
        for req in reqs.values():
            if req.first_token_time is None:
                req.first_token_time = now
                self._prefilled(req)
            seqs = req.seqs
            p = req.params
            if req.beam is not None:
                self._beam_step(req, logits[[rows[s.seq_id] for s in seqs]])
            elif len(seqs) == 1 and p.n == 1 and not p.logprobs and not p.logprob_token_ids:
                # one sequence, no fork, no top-k: the token alone (the decode step's common
                # case, once per sequence per step)
                seq = seqs[0]
                row = rows[seq.seq_id]
                if not p.greedy:
                    tok, lp = drawn[req.request_id].popleft()
                elif pick is not None and p.adjusts_logits:
                    tok, lp = pick[1][row], pick[2][row]
                else:
                    tok, lp = argmax[row], None
                self._accept(req, seq, tok, row, logits, argmax, logp, lse, greedy_lp, None, lp)
            else:
                idx = [rows[s.seq_id] for s in seqs]
                self._sample_step(req, idx, logits, argmax, logp, lse, greedy_lp, pick,
                                  drawn.get(req.request_id), forks.get(req.request_id), tops)
            if not req.seqs:
                for seq in req.done:   # reply blocks under a TTL'd prefix inherit its TTL
                    inherit_ttl(self._bm, cached_chain(self._bm, req, seq.token_ids))
                drive(self._scheduler.remove_plan(req), self._run_ops, self._loads)
                del self._requests[req.request_id]
                outputs.append(self._output(req, finished=True))
            elif req.beam is None and p.output_kind == OUTPUT_CUMULATIVE:
                outputs.append(request_output(req, False, tokenizer, host))   # (= _output)
        return outputs

    def _generator(self, req: Request, index: int) -> torch.Generator:
        """Sample ``index`` of a request draws from its own generator (``seed + index``; the
        request's seed, or one drawn from ``EngineConfig.seed``'s sequence)."""
        seed = req.seed
        return make_generator(None if seed is None else seed + index, self._runner.device)

    def _prefilled(self, req: Request) -> None:
        """The prompt is computed: count what it wrote to the cache, apply its cache points
        (hints in the tree; ``persist`` ones also to the remote tier, when there is one)."""
        if self.cache_config.enable_prefix_caching:
            for hashes, ttl in prefilled(self._bm, req):
                retain_remote(self._remote, hashes, ttl)

    # ------------------------------------------------------------------ sampling
    def _queue_draws(self, reqs: Mapping[str, Request], rows: Mapping[int, int],
                     logits: torch.Tensor, adj: torch.Tensor | None,
                     logp: torch.Tensor | None, reads: StepReads) -> _Draws:
        """Queue every sampled token of the step, drawn together on the logits' device, and
        their raw log-probabilities (or logits, where ``logp`` is None) on ``reads``;
        :meth:`_drawn` turns what was read into each request's tokens.

        Why: drawing one sequence at a time read each token (``.item()``) and each sampled
        token's log-probability back from the device separately, two syncs per sequence per
        step on CUDA; here the filters run on all rows at once (``filtered_probs_rows``),
        each row draws with its own generator (``draw_tokens``: seeded requests are
        reproducible whatever the batch), and nothing is read until the step's one
        transfer. Greedy and beam-search requests take no part. ``adj``: the adjusted logits
        (penalties, biases, grammars) the requests that adjust theirs draw from."""
        order: list[tuple[Request, int, bool, torch.Generator | None]] = []
        forks: dict[str, list[torch.Generator]] = {}
        for req in reqs.values():
            p = req.params
            if p.greedy or req.beam is not None:
                continue
            adjusted = adj is not None and p.adjusts_logits
            seqs = req.seqs
            if p.n > 1 and len(seqs) == 1 and seqs[0].num_output_tokens == 0 and not req.done:
                # the first token of n samples: the parent and its n - 1 children-to-be draw
                # from the one prompt row, each with its own generator
                gens = [self._generator(req, i) for i in range(1, p.n)]
                forks[req.request_id] = gens
                row = rows[seqs[0].seq_id]
                order += [(req, row, adjusted, g) for g in (seqs[0].generator, *gens)]
            else:
                order += [(req, rows[s.seq_id], adjusted, s.generator) for s in seqs]
        if not order:
            return _Draws(order, forks, -1, -1)
        dev = logits.device
        idx = to_device([row for _, row, _, _ in order], dev, torch.long)
        x = logits.index_select(0, idx)
        pos = [i for i, o in enumerate(order) if o[2]]
        if pos:   # penalties, biases, grammars: those rows draw from the adjusted logits
            assert adj is not None
            x[to_device(pos, dev, torch.long)] = adj.index_select(
                0, to_device([order[i][1] for i in pos], dev, torch.long)).to(x.dtype)
        toks = draw_tokens(filtered_probs_rows(x, [o[0].params for o in order]),
                           [o[3] for o in order])
        source = logp if logp is not None else logits   # raw model log-probs (or logits - lse)
        return _Draws(order, forks, reads.add(toks), reads.add(source[idx, toks]))

    @staticmethod
    def _drawn(draws: _Draws, got: list[list[float]], lse: list[float] | None
               ) -> tuple[dict[str, Drawn], dict[str, list[torch.Generator]]]:
        """``({request id: deque of (token, raw log-probability)}, {request id: generators
        of the samples a first-token fork makes})`` from the step's read (``got``), each
        deque in the order the request's sequences take them."""
        drawn: dict[str, Drawn] = {}
        if draws.k_tok < 0:
            return drawn, draws.forks
        for (req, row, _, _), tok, val in zip(draws.order, got[draws.k_tok], got[draws.k_val]):
            lp = val if lse is None else val - lse[row]
            drawn.setdefault(req.request_id, collections.deque()).append((int(tok), lp))
        return drawn, draws.forks

    def _sample_step(self, req: Request, idx: list[int], logits: torch.Tensor,
                     argmax: list[int], logp: torch.Tensor | None,
                     lse: list[float] | None, greedy_lp: list[float],
                     pick: Any = None, drawn: Drawn | None = None,
                     fork_gens: list[torch.Generator] | None = None,
                     tops: Mapping[int, tuple[list[float], list[float]]] | None = None
                     ) -> None:
        """``greedy_lp``: the log-probability of each row's argmax of the raw ``logits``
        (read for the whole batch at once). ``pick``: (adjusted logits, their argmax, its raw
        log-probability) when some request adjusts its logits; greedy tokens are chosen from
        them, log-probabilities come from the raw ``logits``. ``drawn``: this request's sampled
        (token, log-probability) pairs from :meth:`_queue_draws`; ``fork_gens``: its
        children's generators there; ``tops``: ``{row: (token ids, log-probabilities)}`` of
        the most likely tokens of every row that reports them (read with the step)."""
        p = req.params
        raw, raw_argmax = logits, argmax
        picked_lp: list[float] | None = None
        if pick is not None and p.adjusts_logits:
            logits, argmax, picked_lp = pick

        def choose(row: int) -> tuple[int, float | None]:
            if p.greedy:
                return argmax[row], None if picked_lp is None else picked_lp[row]
            assert drawn is not None   # _queue_draws drew for every non-greedy request
            return drawn.popleft()

        if p.n > 1 and len(req.seqs) == 1 and req.seqs[0].num_output_tokens == 0 and not req.done:
            # First token of n samples: one prompt forward, then fork n-1 children that share
            # every prompt block (the partial tail is copied on the first append: CoW).
            parent, row = req.seqs[0], idx[0]
            picks = [(parent, choose(row))]
            for i in range(1, p.n):
                child = self._new_seq(req, i, list(parent.token_ids),
                                      fork_gens[i - 1] if fork_gens else None)
                self._scheduler.fork(req, parent, child)
                picks.append((child, choose(row)))
            rows_for = [row] * p.n
        else:
            picks = [(s, choose(r)) for s, r in zip(req.seqs, idx)]
            rows_for = idx
        top = None
        if (p.logprobs or p.logprob_token_ids) and tops:
            # this request's k most likely tokens of each of its rows, or its named tokens
            k = len(p.logprob_token_ids) if p.logprob_token_ids else p.logprobs
            top = {r: tuple(zip((int(t) for t in tops[r][0][:k]), tops[r][1][:k]))
                   for r in set(rows_for)}
        for (seq, (tok, lp)), row in zip(picks, rows_for):
            self._accept(req, seq, tok, row, raw, raw_argmax, logp, lse, greedy_lp, top, lp)

    def _take_prompt_logprobs(self, sched: SchedulerOutput, logits: torch.Tensor
                              ) -> torch.Tensor:
        """Record the prompt log-probabilities of this step's ``prompt_logprobs`` chunks (their
        first rows, see :meth:`_run`) and return the rows that choose tokens, one per chunk
        that wants logits, in chunk order. Each position is recorded once (a recomputation
        after a preemption, or a second sequence of the request, adds nothing)."""
        import torch

        keep: list[int] = []
        row = 0
        for c in sched.chunks:
            req = c.request
            k = _prompt_rows(c) if req.prompt_logprobs is not None else 0
            if k:
                _record_prompt_logprobs(req, c.start, logits[row:row + k])
                row += k
            if c.wants_logits:
                keep.append(row)
                row += 1
        return logits.index_select(0, torch.tensor(keep, dtype=torch.long, device=logits.device))

    def _accept(self, req: Request, seq: Sequence, tok: int, row: int, raw: torch.Tensor,
                raw_argmax: list[int], logp: torch.Tensor | None, lse: list[float] | None,
                greedy_lp: list[float], top: dict[int, Any] | None,
                lp: float | None = None) -> None:
        """``tok`` (chosen from logits row ``row``) joins ``seq``: its grammar, its
        log-probability from the raw logits (``lp`` where the caller read it already), the stop
        checks, and the sequence's end."""
        p = req.params
        if p.grammar is not None:
            grammar_accept(req, seq, tok)
        if lp is None:   # a greedy (or adjusted-greedy) token: no sampled read to reuse
            if tok == raw_argmax[row]:
                lp = greedy_lp[row]
            elif logp is not None:
                lp = float(logp[row, tok])
            else:
                lp = float(raw[row, tok]) - lse[row]   # type: ignore[index]
        seq.cumulative_logprob += lp
        if seq.logprobs is not None:
            seq.logprobs.append(TokenLogprob(tok, lp, top[row] if top else ()))
        seq.token_ids.append(tok)
        check_stop(seq, p, tok, self._eos, self.max_model_len)
        if seq.finished:
            self._scheduler.free_seq(req, seq)
            req.done.append(seq)

    def _beam_step(self, req: Request, logits: torch.Tensor) -> None:
        step = req.beam.step(logits)
        old = req.seqs
        if step.done:
            for seq in old:
                self._scheduler.bm.free(seq.seq_id)
            req.seqs = []
            return
        used: set[int] = set()
        new: list[Sequence] = []
        for parent_i in step.parents:
            parent = old[parent_i]
            if parent_i not in used:
                used.add(parent_i)
                new.append(parent)
            else:
                child = self._new_seq(req, 0, list(parent.token_ids))
                self._bm.fork(parent.seq_id, child.seq_id)
                new.append(child)
        for i, seq in enumerate(old):
            if i not in used:
                self._bm.free(seq.seq_id)
        for seq, tok, score in zip(new, step.tokens, step.raw_scores):
            seq.token_ids.append(tok)
            seq.cumulative_logprob = score
        req.seqs = new

    def _finish_all(self, req: Request, reason: str) -> None:
        for seq in req.seqs:
            seq.finish_reason = reason
            req.done.append(seq)
        req.seqs = []
        req.beam = None
        self._requests.pop(req.request_id, None)

    # ------------------------------------------------------------------ outputs
    def _output(self, req: Request, finished: bool) -> RequestOutput:
        host = self.tier_names.index("host") if self._remote is not None else None
        return request_output(req, finished, self.tokenizer, host)

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """The model's end-of-sequence token ids (what ends a sequence unless ``ignore_eos``;
        a grammar allows them once its value is complete)."""
        return frozenset(self._eos)

    # ------------------------------------------------------------------ cache control
    def reset_prefix_cache(self) -> int:
        """Drop every cached block no running request holds, in every tier this engine owns
        (device, host, disk files) and every kept partial tail, so that what follows runs on a
        cold cache (vLLM's ``reset_prefix_cache``; benchmarks between runs). The remote tier,
        shared with other replicas, is left alone. Safe while requests run: their blocks stay,
        and copies in flight into slower tiers land first. Returns the blocks dropped."""
        self._drain_kv(loads=False)   # no prefetch or write-behind may land in a freed block
        before = len(self.tree)
        run_kv_ops(self.kv_mover, self._bm.reset_cache())
        self._drain_kv(loads=False)
        return before - len(self.tree)

    # ------------------------------------------------------------------ stats
    def stats(self) -> dict[str, Any]:
        """Cache and scheduling figures since construction (see docs/api.md)."""
        if self.kv_event_counts is not None:
            self.kv_event_counts.drain()   # events of aborts between steps, too
        return engine_stats(self)

    def count_kv_events(self) -> KVEventCounts:
        """Count the blocks stored in and removed from each tier from now on (a reader of the
        tree's KV event queue, drained after every step; the counts appear in ``stats()`` as
        ``kv_blocks_stored`` / ``kv_blocks_removed``). Call it on the engine loop. Turning the
        queue on makes the tree build events, a cost per block entering or leaving; the
        server does it for ``/metrics``. Idempotent; returns the counter."""
        if self.kv_event_counts is None:
            self.kv_event_counts = KVEventCounts(self._bm.event_queue().subscribe(),
                                                 self.tree.num_tiers)
        return self.kv_event_counts


__all__ = ["LLMEngine", "namespace_model"]


def _prompt_rows(chunk: Any) -> int:
    """Rows of prompt log-probabilities a chunk of a ``prompt_logprobs`` request computes: one
    per position whose next token is a prompt token (its first ``k`` offsets)."""
    return max(0, min(chunk.start + chunk.num_tokens, chunk.seq.prompt_len - 1) - chunk.start)


def _record_prompt_logprobs(req: Request, start: int, logits: torch.Tensor) -> None:
    """Append the ``TokenLogprob`` (with rank and top-k) of prompt tokens ``start + 1 ..``
    from the logits of positions ``start ..``, those not recorded yet (in order)."""
    import torch

    lps = req.prompt_logprobs
    assert lps is not None
    skip = len(lps) - 1 - start   # positions already recorded (a recomputed chunk)
    if skip >= logits.shape[0]:
        return
    assert skip >= 0, f"prompt logprobs of {req.request_id} skipped a position"
    logp = torch.log_softmax(logits[skip:].float(), dim=-1)
    first = start + skip + 1
    target = torch.tensor(req.prompt_token_ids[first:first + logp.shape[0]],
                          device=logp.device)
    chosen = logp.gather(1, target[:, None])[:, 0]
    rank = (logp > chosen[:, None]).sum(dim=1) + 1
    k = req.params.prompt_logprobs or 0
    if k:
        vals, ids = torch.topk(logp, k, dim=-1)
        tops = [tuple(zip(i, v)) for i, v in zip(ids.tolist(), vals.tolist())]
    else:
        tops = [()] * logp.shape[0]
    for tok, lp, r, top in zip(target.tolist(), chosen.tolist(), rank.tolist(), tops):
        lps.append(TokenLogprob(tok, lp, top, r))


def _close_at_exit(engine_ref: Any) -> Callable[[], None]:
    """An ``atexit`` hook closing the engine if it still exists (weakly referenced)."""
    def close() -> None:
        engine = engine_ref()
        if engine is not None:
            engine.close()
    return close
