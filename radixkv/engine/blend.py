"""Documents as cache entries of their own, blended into a prompt at any position (CacheBlend).

A RAG prompt ``[head][doc a][doc b]...[question]`` lists its documents in whatever order the
retriever returned them, so only the leading ones are ever a cached prefix. This module reuses a
document's KV wherever it appears:

**Document entries.** A document's KV is computed right after a fixed *lead*, the prompt's
tokens before its first document when they fill whole blocks (a RAG prompt's system head; else
nothing: the document starts at position 0), and cached as ordinary radix-tree blocks under the
chain of lead + document tokens, in a namespace of its own. The lead gives the document the
attention sink it has in a real prompt (computed alone, a document's first token becomes the
sink, and its KV misleads every later query when blended: measured in docs/rag.md).
:func:`document_namespace` is the request namespace
(model fingerprint, tenant salt, adapter) with the domain tag ``extra="radixkv-document-v1"``.
So a document chain never matches a prefix chain, tenants never share documents, and a
document entry has everything a prefix block has: refcounts while a blend reads it, eviction
under the cache policy, every tier (device, host, disk, remote) and KV dtype. Entries are
computed by an ordinary request over the document's tokens under that namespace
(``Engine.submit(..., namespace_extra=DOCUMENT_EXTRA)``).

**Blending** (:func:`blend_context`, run on the engine thread between steps). For a prompt whose
document spans are known, with ``m`` tokens cached as a plain prefix:

1. lock the prefix (exact KV, positions ``[0, m)``) and each later document's entry (promoting
   host/disk blocks to the device as a request would). Before that, an entry the tree lacks is
   looked up in the remote tier, if there is one, all entries in one lookup
   (``RemoteLookup.fetch_now``: verified hits installed in the host tier, then
   promoted here); an entry that no tier has (or only in part), or whose lookup failed or found
   a corrupt value, is computed first, after the lead, and committed
   (``RAGHelper.warm_documents`` computes them as ordinary requests instead);
2. gather their K/V into dense per-layer buffers, re-rotating each document's keys from
   positions ``[l, l + n)`` (``l``: the lead) to ``[s, s + n)`` (:func:`rerotate`: RoPE is a
   rotation, ``R(d) R(p) = R(p + d)``, so a rotation by the offset ``s - l`` is exact up to
   rounding);
3. run the model over the tokens after the prefix (:func:`blend_forward`): on layers
   ``0 .. check_layer`` every token is computed, its fresh K/V replacing the cached ones; at
   ``check_layer`` the document tokens whose fresh K/V deviate most from the cached ones (sum of
   squared differences over heads and dims, K and V) are selected, the top ``blend_ratio`` share;
   on the later layers only those, and the tokens no entry covers, are computed. The others keep
   their cached (re-rotated) K/V: their cross-attention to the earlier documents is what is
   lost, and the selection recomputes the tokens where it mattered most (CacheBlend, EuroSys'25).
   ``blend_ratio=0`` is *plain reuse*: no layer recomputes a document token;
4. write the blended K/V of the prompt's full blocks into fresh blocks and commit them under the
   *blend namespace* (:func:`blend_namespace`): the request namespace with
   ``extra="radixkv-blend-v1:<digest>"``, the digest naming the ratio, the check layer and the
   document spans. The request then runs as an ordinary one in that namespace: it matches the
   blended blocks and computes only the rest (the question). The blended KV is approximate, so it
   never enters the exact prefix chain; a second identical prompt hits the blended blocks whole.

``blend_ratio >= 1`` recomputes every token on every layer, which is a full prefill: callers
run the ordinary request instead (:func:`blend_context` returns ``None``), so ratio 1 *is* the
full prefill, bit for bit.

**Quantized caches** (``kv_dtype="int8"`` / ``"fp8_e4m3"``, :mod:`radixkv.engine.kv_quant`):
a stored row is ``x H`` (``H`` the orthonormal Hadamard matrix) quantized with its own fp16
scale. Step 2 gathers the rows' bytes; a document's K rows are dequantized back to ``x``
(``(x H) H = x``), re-rotated by the RoPE offset as above and quantized again, row by row, in
the cache's format (:func:`rerotate_quantized`); V rows, the prefix's rows and a K row whose
offset is 0 keep their bytes. The blend forward then works in the stored (Hadamard) domain,
as the paged read path does: its buffers hold the rows dequantized as stored, every K/V row it
computes is quantized once (the bytes are kept for step 4) and read back dequantized, the query
is rotated by ``H`` before attention and the output after it, and the selection's deviation
compares dequantized rows (``H`` is orthonormal: the same distance as in the plain domain).
Step 4 writes the kept bytes: what a later request reads is exactly what the blend attended.

Where blending does not apply, the request keeps prefix-only reuse (``blend_unsupported`` names
why): models without the lean forward (:mod:`radixkv.engine.decoder_forward`: Llama, Mistral,
Qwen2, Qwen3 and radixkv's native tree), models without rotary position embeddings or with a
length-dependent (``dynamic``) rope, and a KV cache whose storage dtype is neither the model's
nor a quantized format of :data:`radixkv.engine.kv_quant.FORMATS` (no engine builds one).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
import xxhash

from radixkv.core.hashing import Namespace
from radixkv.engine import kv_quant
from radixkv.errors import InvalidRequestError, OutOfBlocks
from radixkv.kernels import fused
from radixkv.tiers.protocol import run_kv_ops

#: ``Namespace.extra`` of document entries (the domain tag of their hash chains).
DOCUMENT_EXTRA = "radixkv-document-v1"
#: Prefix of ``Namespace.extra`` of blended prompts.
BLEND_EXTRA = "radixkv-blend-v1"
#: Default share of document tokens recomputed on the layers after ``check_layer``
#: (from ``radixkv bench rag``: see docs/rag.md).
DEFAULT_BLEND_RATIO = 0.15
#: Default layer at which tokens are selected (layers ``0 .. check_layer`` recompute all).
DEFAULT_CHECK_LAYER = 1
#: Queries per dense attention call (bounds the ``[heads, queries, keys]`` score tensor).
_QUERY_CHUNK = 512


@dataclass(frozen=True)
class DocSpan:
    """A document's tokens in a prompt: ``prompt[start:end]`` (half-open token positions)."""

    start: int
    end: int


@dataclass(frozen=True)
class BlendReport:
    """What :func:`blend_context` did for one prompt.

    Attributes:
        namespace_extra: the blend namespace's ``extra``: run the request with it.
        num_blended_tokens: tokens whose blended KV was committed (whole blocks).
        prefix_tokens: of those, served from the exact prefix cache.
        reused_tokens: document tokens whose cached KV was reused (re-rotated), before selection.
        recomputed_tokens: of the reused, the ones recomputed on the layers after the check.
        fresh_tokens: tokens no cache entry covered, computed on every layer.
        warm: the blended blocks were cached already (nothing was computed).
        seconds: wall time of the blend (gather, forward, write).
        remote_tokens: document entry tokens (lead included) fetched from the remote tier
            because the tree lacked them (installed in the host tier, then promoted).
        computed_entry_tokens: document entry tokens (lead included) computed by the blend
            because no tier had them.
    """

    namespace_extra: str
    num_blended_tokens: int
    prefix_tokens: int
    reused_tokens: int
    recomputed_tokens: int
    fresh_tokens: int
    warm: bool
    seconds: float
    remote_tokens: int = 0
    computed_entry_tokens: int = 0


def check_blend_ratio(ratio: object) -> float:
    """``ratio`` as a float in ``[0, 1]``; :class:`InvalidRequestError` otherwise."""
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 <= ratio <= 1:
        raise InvalidRequestError(f"blend_ratio must be a number in [0, 1], got {ratio!r}")
    return float(ratio)


def check_spans(spans: Sequence[Any], num_tokens: int) -> list[DocSpan]:
    """Validate document spans (``DocSpan`` or ``(start, end)`` pairs): sorted, disjoint,
    non-empty, inside ``[0, num_tokens)``. Raises :class:`InvalidRequestError` naming the span."""
    if isinstance(spans, (str, bytes)) or not isinstance(spans, Sequence):
        raise InvalidRequestError(f"document spans must be a list of (start, end) pairs, got "
                                  f"{type(spans).__name__}")
    out: list[DocSpan] = []
    prev = 0
    for i, sp in enumerate(spans):
        pair = (sp.start, sp.end) if isinstance(sp, DocSpan) else sp
        if (isinstance(pair, (str, bytes)) or not isinstance(pair, Sequence) or len(pair) != 2
                or not all(isinstance(x, int) and not isinstance(x, bool) for x in pair)):
            raise InvalidRequestError(f"document span {i} must be a (start, end) pair of ints, "
                                      f"got {sp!r}")
        s, e = pair
        if not prev <= s < e <= num_tokens:
            raise InvalidRequestError(
                f"document span {i} = [{s}, {e}) must be non-empty, after the previous span "
                f"(ends at {prev}) and inside the prompt ({num_tokens} tokens)")
        out.append(DocSpan(s, e))
        prev = e
    return out


def document_namespace(ns: Namespace) -> Namespace:
    """The namespace of document entries of requests in ``ns`` (same model, salt, adapter)."""
    return Namespace(ns.model, ns.cache_salt, ns.adapter_id, DOCUMENT_EXTRA)


def blend_extra(spans: Sequence[DocSpan], ratio: float, check_layer: int) -> str:
    """``Namespace.extra`` of a blend: names everything besides the tokens that the blended
    KV depends on (the spans, the ratio, the check layer)."""
    desc = f"{ratio!r}|{check_layer}|" + ",".join(f"{s.start}:{s.end}" for s in spans)
    return f"{BLEND_EXTRA}:{xxhash.xxh3_128_hexdigest(desc.encode())}"


def blend_namespace(ns: Namespace, extra: str) -> Namespace:
    return Namespace(ns.model, ns.cache_salt, ns.adapter_id, extra)


# ---------------------------------------------------------------------------------- rotation
def rope_unsupported(rotary: Any) -> str | None:
    """Why keys cached at one position cannot be rotated to another (None: they can)."""
    if rotary is None or getattr(rotary, "inv_freq", None) is None:
        return "the model has no rotary position embedding"
    kind = str(getattr(rotary, "rope_type", "default"))
    if "dynamic" in kind:
        return f"rope_type {kind!r} changes its frequencies with the sequence length"
    return None


def rotation(rotary: Any, delta: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos``/``sin`` ``[D]`` (``like``'s dtype) of a rotation by ``delta`` positions, without
    the rope's attention scaling (yarn/longrope scale cos and sin once, at the first rotation;
    a second rotation must not scale again)."""
    pos = torch.tensor([[delta]], device=like.device)
    cos, sin = rotary(like, pos)
    scale = float(getattr(rotary, "attention_scaling", 1.0) or 1.0)
    if scale != 1.0:
        cos, sin = cos / scale, sin / scale
    return cos[0, 0].to(like.dtype), sin[0, 0].to(like.dtype)


def rerotate(k: torch.Tensor, rotary: Any, delta: int) -> torch.Tensor:
    """Keys ``k`` ``[..., T, Hkv, D]`` rotated at positions ``p`` -> the same keys at
    ``p + delta`` (any leading dims, e.g. every layer at once).

    RoPE rotates each pair of dims ``(i, i + D/2)`` by ``p * inv_freq[i]``; rotations of a plane
    compose by adding angles, so one more rotation by ``delta * inv_freq`` gives the keys at
    ``p + delta`` (exact up to rounding, tests/engine/test_blend.py). The angle is the same for
    every token, so one ``cos``/``sin`` row serves the whole tensor.
    """
    if delta == 0:
        return k
    cos, sin = rotation(rotary, delta, k)
    half = k.shape[-1] // 2
    k1, k2 = k[..., :half], k[..., half:]
    out = k * cos
    out[..., :half].sub_(k2 * sin[:half])      # rotate_half(k) = [-k2, k1]
    out[..., half:].add_(k1 * sin[half:])
    return out


def rerotate_quantized(rows: torch.Tensor, rotary: Any, delta: int) -> torch.Tensor:
    """Quantized K rows ``[..., T, Hkv, D + 2]`` (a cache's int8 / float8_e4m3fn rows, see
    :mod:`radixkv.engine.kv_quant`) at positions ``p`` -> the same keys at ``p + delta``,
    quantized again in the same format (same dtype and shape; ``delta == 0``: ``rows`` itself).

    A stored row is ``x H`` quantized with its own fp16 scale; ``H`` is its own inverse, so
    the dequantized row times ``H`` is ``x`` (up to the quantization error), which
    :func:`rerotate` moves to the new positions in float32; :func:`kv_quant.quantize_rows
    <radixkv.engine.kv_quant.quantize_rows>` then rotates by ``H`` again and picks each row's
    new scale, as the write path does. The error added is one more rounding to the format's
    grid (tests/engine/test_blend_quant.py bounds it). One pass over all the rows given.
    """
    fmt = kv_quant.format_of(rows.dtype)
    if fmt is None:
        raise TypeError(f"rerotate_quantized needs quantized rows, got {rows.dtype}")
    if delta == 0:
        return rows
    k = kv_quant.dequantize_rows(rows, torch.float32)        # [..., D]: x (H undone)
    return kv_quant.quantize_rows(rerotate(k, rotary, delta), fmt.name)


# ---------------------------------------------------------------------------------- forward
def window_unsupported(lean: Any, prompt_len: int) -> str | None:
    """Why a prompt of ``prompt_len`` tokens keeps prefix-only reuse on a model with sliding-
    window layers (None: it can blend). A window shorter than the prompt makes each document's
    KV depend on which tokens fall inside the window before it, which the entry (computed
    after its lead only) cannot know and the 15% recompute did not repair: on the tiny Mistral
    (window 512) blending at 15% agreed with a full prefill on 0.53 of the positions against
    the bf16 bar's 0.78 (docs/rag.md). A prompt inside the window attends as with full
    attention, and blends."""
    windows = [lay.window for lay in lean.layers if lay.window is not None]
    if windows and prompt_len > min(windows):
        return (f"the prompt ({prompt_len} tokens) is longer than the model's sliding window "
                f"({min(windows)})")
    return None


def blend_unsupported(runner: Any) -> str | None:
    """Why prompts on ``runner`` (a :class:`ModelRunner`) keep prefix-only reuse (None: they
    can blend)."""
    if runner.lean is None:
        return "the model has no lean forward (decoder_forward.py: Llama, Mistral, Qwen2/3)"
    cache_dtype = runner.kv_cache.dtype
    if kv_quant.format_of(cache_dtype) is None and cache_dtype != runner.lean.embed.weight.dtype:
        return (f"the KV cache holds {cache_dtype}, neither the model's dtype "
                f"({runner.lean.embed.weight.dtype}) nor a quantized format "
                f"({', '.join(kv_quant.FORMATS)})")
    return rope_unsupported(runner.lean.rotary)


@dataclass(frozen=True)
class StoredRows:
    """The quantized rows of a blend on an int8 / fp8 cache, next to its float buffers.

    Attributes:
        fmt: the cache's :class:`~radixkv.engine.kv_quant.QuantFormat`.
        rows: int8 ``[2, L, N, Hkv, D + 2]`` (K then V, per layer, per token): the rows'
            bytes as the cache stores them (viewed as int8 whatever the format; see
            :mod:`radixkv.engine.kv_quant`), each the quantized form of the matching row of
            the float buffers, which hold them dequantized in the stored (Hadamard) domain.
    """

    fmt: kv_quant.QuantFormat
    rows: torch.Tensor


@dataclass
class BlendStats:
    """Counts of one :func:`blend_forward` (tokens after the prefix)."""

    reused: int = 0
    recomputed: int = 0
    fresh: int = 0


@torch.inference_mode()
def blend_forward(lean: Any, token_ids: torch.Tensor, prefix_len: int, keys: list[torch.Tensor],
                  values: list[torch.Tensor], reuse: torch.Tensor, ratio: float,
                  check_layer: int = DEFAULT_CHECK_LAYER,
                  stored: StoredRows | None = None) -> BlendStats:
    """Blend the KV of ``token_ids[prefix_len:]`` into ``keys``/``values`` in place.

    Args:
        lean: the runner's :class:`~radixkv.engine.decoder_forward.DecoderForward`.
        token_ids: ``[N]`` int64, the context (prefix included).
        prefix_len: leading tokens whose K/V in the buffers are exact (never recomputed).
        keys, values: one ``[N, Hkv, D]`` buffer per layer, in the model's dtype: rows
            ``[0, prefix_len)`` exact, rows with ``reuse`` True the cached (re-rotated) K/V of
            document tokens, the other rows anything (they are computed on every layer).
        reuse: ``[N]`` bool, False on the prefix.
        ratio: share of the reused tokens recomputed after ``check_layer`` (0: plain reuse,
            no document token is recomputed on any layer).
        check_layer: layers ``0 .. check_layer`` compute every token; the selection uses the
            deviation on ``check_layer``.
        stored: on a quantized cache, the rows' bytes (:class:`StoredRows`); ``keys`` and
            ``values`` then hold them dequantized in the stored (Hadamard-rotated) domain, in
            the model's dtype. Every computed K/V row is quantized once into ``stored.rows``
            and read back dequantized into the buffers, and attention runs in that domain
            (query rotated by ``H`` before, output after), as the paged read path does: the
            rows attended are bit for bit the bytes that step 4 writes.

    Runtime: layers ``0 .. check_layer`` cost a prefill of ``N - prefix_len`` tokens, the others
    that of the fresh tokens plus ``ratio`` of the reused ones; attention is dense over
    ``[0, N)`` with a causal mask, ``_QUERY_CHUNK`` queries at a time.
    """
    n = int(token_ids.shape[0])
    dev = token_ids.device
    num_layers = len(lean.layers)
    reuse_idx = torch.nonzero(reuse[prefix_len:], as_tuple=False)[:, 0] + prefix_len
    stats = BlendStats(reused=int(reuse_idx.numel()),
                       fresh=n - prefix_len - int(reuse_idx.numel()))
    if ratio > 0:
        active = torch.arange(prefix_len, n, device=dev)
        select_at = min(check_layer, num_layers - 1)
    else:
        active = torch.nonzero(~reuse[prefix_len:], as_tuple=False)[:, 0] + prefix_len
        select_at = -1
    if active.numel() == 0:
        return stats
    x = lean.embed(token_ids.index_select(0, active))          # [A, hidden]
    delta: torch.Tensor | None = None
    hq, hkv, d = lean.num_heads, lean.num_kv_heads, lean.head_dim
    key_pos = torch.arange(n, device=dev)
    rope: tuple[torch.Tensor, torch.Tensor] | None = None
    for li, lay in enumerate(lean.layers):
        if delta is None:
            h = fused.rms_norm(x, lay.in_norm, lay.in_eps)
        else:
            h, x = fused.add_rms_norm(delta, x, lay.in_norm, lay.in_eps)
        t = int(active.numel())
        qkv = lay.qkv_cat(h).view(t, hq + 2 * hkv, d)
        q, k, v = qkv[:, :hq], qkv[:, hq:hq + hkv], qkv[:, hq + hkv:]
        if lay.q_norm is not None:
            q = fused.rms_norm(q, lay.q_norm.weight, float(lay.q_norm.variance_epsilon))
            k = fused.rms_norm(k, lay.k_norm.weight, float(lay.k_norm.variance_epsilon))
        if rope is None:   # the rows change only at the check layer
            rope = lean.rotary(x, active[None, :])
        cos, sin = rope[0][0], rope[1][0]
        q = fused.rope_ref(q, cos, sin)
        k = fused.rope_ref(k, cos, sin)
        kb, vb = keys[li], values[li]
        if stored is not None:   # quantize once; attend over the rows as they are stored
            k, v, q = _store_rows(stored, li, active, k, v, q)
        # the deviation is measured before the fresh rows overwrite the cached ones
        keep = _select(active, k, v, kb, vb, reuse, ratio) if li == select_at else None
        kb.index_copy_(0, active, k)
        vb.index_copy_(0, active, v)
        if li == num_layers - 1:
            break   # the last layer's K/V are written; its output is never read
        out = _attend(q, kb, vb, active, key_pos, lay.scaling, lay.window, hq, hkv)
        if stored is not None and stored.fmt.rotated:
            out = kv_quant.rotate(out)
        delta = lay.o.forward(out.reshape(-1, hq * d))
        h, x = fused.add_rms_norm(delta, x, lay.post_norm, lay.post_eps)
        delta = lay.down.forward(fused.silu_mul(lay.gate_up_cat(h)))
        if keep is not None:   # from the next layer on, only the kept rows
            x, delta = x.index_select(0, keep), delta.index_select(0, keep)
            active = active.index_select(0, keep)
            rope = None
            stats.recomputed = int(reuse.index_select(0, active).sum())
    return stats


def _store_rows(stored: StoredRows, layer: int, active: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor, q: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize a layer's fresh K/V rows ``[A, Hkv, D]`` (positions ``active``) into
    ``stored.rows`` and return them dequantized in the stored domain (what attention reads),
    with the query ``[A, Hq, D]`` rotated into that domain (unchanged for an unrotated
    format): one quantization of K and V together, as ``kv_quant.write_quantized`` does."""
    rows = kv_quant.quantize_rows(torch.stack([k, v]), stored.fmt.name)   # [2, A, Hkv, D+2]
    stored.rows[:, layer].index_copy_(1, active, rows.view(torch.int8))
    kv = kv_quant.dequantize_rows(rows, k.dtype, rotated=True)
    if stored.fmt.rotated:
        q = kv_quant.rotate(q)
    return kv[0], kv[1], q


def _select(active: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kb: torch.Tensor,
            vb: torch.Tensor, reuse: torch.Tensor, ratio: float
            ) -> torch.Tensor:
    """Indices into ``active`` of the rows kept after the check layer: every row not reused,
    plus the ``ceil(ratio * reused)`` reused rows whose fresh K/V (``k``, ``v`` ``[A, Hkv, D]``
    for rows ``active``) deviate most from the cached ones in ``kb``/``vb``, ascending."""
    was_reused = reuse.index_select(0, active)
    idx = torch.nonzero(was_reused, as_tuple=False)[:, 0]
    n_pick = min(int(idx.numel()), int(-(-ratio * idx.numel() // 1)))
    if idx.numel():
        rows = active.index_select(0, idx)
        dk = (k.index_select(0, idx).float() - kb.index_select(0, rows).float()).pow(2)
        dv = (v.index_select(0, idx).float() - vb.index_select(0, rows).float()).pow(2)
        dev = dk.sum((1, 2)) + dv.sum((1, 2))
        picked = idx.index_select(0, torch.topk(dev, n_pick).indices) if n_pick else idx[:0]
    else:
        picked = idx
    keep = torch.cat([torch.nonzero(~was_reused, as_tuple=False)[:, 0], picked])
    return torch.sort(keep).values


def _attend(q: torch.Tensor, kb: torch.Tensor, vb: torch.Tensor, rows: torch.Tensor,
            key_pos: torch.Tensor, scaling: float | None, window: int | None, hq: int,
            hkv: int) -> torch.Tensor:
    """Causal attention of queries ``q`` ``[A, Hq, D]`` at positions ``rows`` over the keys
    ``kb``/``vb`` ``[N, Hkv, D]`` at positions ``key_pos``; ``[A, Hq, D]`` out."""
    d = q.shape[-1]
    scale = scaling if scaling is not None else d ** -0.5
    top = int(rows.max()) + 1
    kt = kb[:top].transpose(0, 1)[None]     # [1, Hkv, K, D]
    vt = vb[:top].transpose(0, 1)[None]
    out = torch.empty_like(q)
    kp = key_pos[:top]
    for c in range(0, int(rows.numel()), _QUERY_CHUNK):
        r = rows[c:c + _QUERY_CHUNK]
        mask = kp[None, :] <= r[:, None]                    # [a, K]
        if window is not None:
            mask &= kp[None, :] > r[:, None] - window
        qc = q[c:c + _QUERY_CHUNK].transpose(0, 1)[None]    # [1, Hq, a, D]
        o = F.scaled_dot_product_attention(qc, kt, vt, attn_mask=mask[None, None],
                                           scale=scale, enable_gqa=hq != hkv)
        out[c:c + _QUERY_CHUNK] = o[0].transpose(0, 1)
    return out


# ---------------------------------------------------------------------------------- engine op
def entry_lead(spans: Sequence[DocSpan], block_size: int) -> int:
    """Tokens of the prompt before its first document when they fill whole blocks (the *lead*:
    the system head of a RAG prompt), else 0. Document entries are computed after the lead."""
    first = spans[0].start if spans else 0
    return first if first % block_size == 0 else 0


@dataclass(frozen=True)
class _EntryTokens:
    token_ids: list[int]


@dataclass(frozen=True)
class _EntryLookup:
    """What :meth:`RemoteLookup.lookup <radixkv.tiers.remote_lookup.RemoteLookup.lookup>` reads
    of a request, for one document entry (its tokens plus one, so that every full block of the
    entry is looked up: the last token of a prompt is never a cached block)."""

    request_id: str
    namespace: Namespace
    seqs: tuple[_EntryTokens, ...]


def _fetch_remote_entries(core: Any, entries: list[tuple[int, list[int]]], dns: Namespace,
                          tag: str) -> int:
    """Find the blocks of document entries (``(index, lead + document tokens)``) that the tree
    lacks on the remote tier, and install the hits in the host tier; the allocation that
    follows promotes them like any host hit. Returns the tokens installed.

    All entries in one lookup (``RemoteLookup.fetch_now``): one EXISTS batch over their
    distinct blocks (the shared lead once) and one MGET of every entry's leading run of hits,
    waited for at most ``remote_timeout_s`` in all, whatever the number of entries; the store
    verifies each value (a bad one is a miss). A miss, a failed or a timed-out lookup
    installs nothing, and the blend computes that entry; an entry whose local match already
    covers it asks nothing."""
    remote = getattr(core, "remote_tier", None)
    if remote is None or not entries:
        return 0
    got = remote.fetch_now([_EntryLookup(f"{tag}-doc-{i}", dns, (_EntryTokens(ent + ent[:1]),))
                            for i, ent in entries],
                           lambda ops: run_kv_ops(core.kv_mover, ops))
    return sum(got.values())


def _complete_entries(core: Any, entries: list[list[int]], docs: list[tuple[DocSpan, Any, int]],
                      lead: int) -> tuple[list[tuple[DocSpan, Any, int]], int]:
    """Compute the full blocks of every document entry (``entries[i]``: lead + document) that
    is not fully cached, in one forward over all of them, and commit them under the document
    namespace; returns ``docs`` with each entry's cached token count updated, and the tokens
    computed. A document's
    partial last block is never an entry (only full blocks are cached): the blend computes
    those tokens fresh."""
    from radixkv.engine.batch import SequenceChunk

    bm, runner = core.block_manager, core.model_runner
    bs = bm.block_size
    chunks, done = [], []
    for (sp, a, cached), ent in zip(docs, entries):
        full = lead + (sp.end - sp.start) // bs * bs
        if cached < full:
            table = list(a.block_ids)
            slots = [table[p // bs] * bs + p % bs for p in range(cached, full)]
            chunks.append(SequenceChunk(ent[cached:full], cached, table, slots, ()))
            done.append((a.seq_id, full))
    if not chunks:
        return docs, 0
    runner.execute(runner.build_batch(chunks))
    for seq_id, full in done:
        bm.commit(seq_id, full)
    run_kv_ops(core.kv_mover, bm.take_moves())
    return ([(sp, a, max(cached, lead + (sp.end - sp.start) // bs * bs))
             for sp, a, cached in docs], sum(len(c.token_ids) for c in chunks))


def blend_context(core: Any, token_ids: Sequence[int], spans: Sequence[DocSpan],
                  cache_salt: str | None, ratio: float,
                  check_layer: int = DEFAULT_CHECK_LAYER) -> BlendReport | None:
    """Blend the cached KV of a prompt's documents (see the module docstring); run on the
    engine thread between steps (``Engine.loop.call``).

    Returns the report whose ``namespace_extra`` the request must run under, or ``None`` when
    the ordinary request is what to run: ``ratio >= 1`` (a full prefill), blending unsupported
    here (:func:`blend_unsupported`, or a sliding window shorter than the prompt:
    :func:`window_unsupported`), the plain prefix already covers every full block of the
    documents (no document starts after it), a promotion failed, or the blocks to do it are
    not free now. Never leaves a block locked or a structure half-changed.
    """
    runner, bm = core.model_runner, core.block_manager
    bs = bm.block_size
    if ratio >= 1 or not spans or blend_unsupported(runner) is not None:
        return None
    if not core.cache_config.enable_prefix_caching:
        return None
    t0 = time.perf_counter()
    toks = list(token_ids)
    n_full = spans[-1].end // bs * bs
    if n_full == 0 or n_full >= len(toks):
        return None   # needs a token after the blended blocks (the question)
    if window_unsupported(runner.lean, len(toks)) is not None:
        return None
    ns = core.namespace.with_salt(cache_salt)
    extra = blend_extra(spans, ratio, check_layer)
    bns = blend_namespace(ns, extra)
    tree = core.tree
    from radixkv.core.hashing import token_bytes
    if len(tree.match_tokens(token_bytes(toks[:n_full]), bns.seed)) * bs >= n_full:
        return BlendReport(extra, n_full, 0, 0, 0, 0, True, time.perf_counter() - t0)
    dns = document_namespace(ns)
    held: list[Any] = []
    tag = f"radixkv-blend-{id(toks)}-{t0}"
    lead = entry_lead(spans, bs)
    try:
        # 0. entries only the remote tier has: into the host tier (before anything is locked:
        # making room there evicts host blocks, never one a pending promotion reads)
        m_est = len(tree.match_tokens(token_bytes(toks[:n_full]), ns.seed)) * bs
        remote_tokens = _fetch_remote_entries(
            core, [(i, toks[:lead] + toks[sp.start:sp.end]) for i, sp in enumerate(spans)
                   if m_est <= sp.start < n_full], dns, tag)
        # 1. lock the exact prefix and the document entries after it (promotions included)
        pre = bm.allocate((tag, "prefix"), toks[:n_full + 1], ns)
        held.append(pre.seq_id)
        m = min(pre.num_cached_tokens, n_full)
        moves = list(pre.moves)
        docs: list[tuple[DocSpan, Any, int]] = []
        entries: list[list[int]] = []
        for i, sp in enumerate(spans):
            if sp.start < m or sp.start >= n_full:
                continue
            entry = toks[:lead] + toks[sp.start:sp.end]
            a = bm.allocate((tag, "doc", i), entry + entry[:1], dns)
            held.append(a.seq_id)
            moves += a.moves
            docs.append((sp, a, a.num_cached_tokens))
            entries.append(entry)
        if not docs:
            return None
        out = bm.allocate((tag, "out"), toks[:n_full + 1], bns)
        held.append(out.seq_id)
        moves += out.moves
        run_kv_ops(core.kv_mover, moves)
        core.kv_mover.wait_loads()
        bad = {n.block_id for n in map(tree.get, core.kv_mover.failed_loads) if n is not None}
        used = set(pre.block_ids) | {b for _, a, _ in docs for b in a.block_ids}
        if not bad.isdisjoint(used):
            return None   # the scheduler recovers the failed loads at its next step
        docs, computed = _complete_entries(core, entries, docs, lead)
        # document tokens with cached KV: entry positions [lead, c) -> prompt [start, ...).
        # The tables are read again: committing an entry another sequence of this blend
        # committed first (a document listed twice) switches it to that copy.
        tables = {a.seq_id: bm.block_table(a.seq_id) for _, a, _ in docs}
        docs = [(sp, a, max(0, min(c - lead, n_full - sp.start))) for sp, a, c in docs]
        # a document with no cached row inside the blended region (shorter than a block past
        # its lead, or starting in the last partial block) reuses nothing: computed as text
        docs = [d for d in docs if d[2] > 0]
        # 2. dense per-layer buffers: prefix exact, documents re-rotated
        kv = runner.kv_cache                                  # [L, 2, nb, B, Hkv, D (+2)]
        num_layers, hkv, width = kv.shape[0], kv.shape[4], kv.shape[5]
        dev = kv.device
        fmt = kv_quant.format_of(kv.dtype)                    # int8 / fp8 rows, or None
        reuse = torch.zeros(n_full, dtype=torch.bool, device=dev)
        # slot-major rows per layer (a quantized cache's as int8 bytes)
        flat = (kv if fmt is None else kv.view(torch.int8)).view(num_layers, 2, -1, hkv, width)
        buf = torch.zeros(2, num_layers, n_full, hkv, width, dtype=flat.dtype, device=dev)

        def slots(block_ids: Sequence[int], count: int, skip: int = 0) -> torch.Tensor:
            """Slots of positions ``[skip, skip + count)`` of a block table."""
            ids = torch.tensor(block_ids[:-(-(skip + count) // bs)], dtype=torch.long,
                               device=dev)
            every = (ids[:, None] * bs + torch.arange(bs, device=dev)[None]).reshape(-1)
            return every[skip:skip + count]

        with torch.inference_mode():
            if m:
                buf[:, :, :m] = flat.index_select(2, slots(pre.block_ids, m)).transpose(0, 1)
            rotary = runner.lean.rotary
            for sp, a, usable in docs:
                rows = flat.index_select(2, slots(tables[a.seq_id], usable, lead))  # [L,2,n,..]
                k = (rerotate(rows[:, 0], rotary, sp.start - lead) if fmt is None else
                     rerotate_quantized(rows[:, 0].view(fmt.storage), rotary, sp.start - lead
                                        ).view(torch.int8))
                buf[0, :, sp.start:sp.start + usable] = k
                buf[1, :, sp.start:sp.start + usable] = rows[:, 1]
                reuse[sp.start:sp.start + usable] = True
            stored = None
            if fmt is not None:   # the bytes stay in `stored`; the forward reads them as floats
                stored = StoredRows(fmt, buf)
                buf = kv_quant.dequantize_rows(buf.view(fmt.storage),
                                               runner.lean.embed.weight.dtype, rotated=True)
            # 3. the blend forward over the tokens after the prefix
            ids = torch.tensor(toks[:n_full], dtype=torch.long, device=dev)
            stats = blend_forward(runner.lean, ids, m, list(buf[0]), list(buf[1]), reuse, ratio,
                                  check_layer, stored)
            # 4. write [k0, n_full) into the output sequence's blocks, then commit them
            k0 = out.num_cached_tokens
            if k0 < n_full:
                s = slots(out.block_ids, n_full)[k0:]
                rows = buf if stored is None else stored.rows
                flat.index_copy_(2, s, rows[:, :, k0:].transpose(0, 1))
        bm.commit(out.seq_id, n_full)
        run_kv_ops(core.kv_mover, bm.take_moves())
        return BlendReport(extra, n_full, m, stats.reused, stats.recomputed, stats.fresh,
                           False, time.perf_counter() - t0, remote_tokens, computed)
    except OutOfBlocks:
        return None
    finally:
        for sid in held:
            bm.free(sid)


def prompt_logits(core: Any, token_ids: Sequence[int], namespace: Namespace, first: int
                  ) -> torch.Tensor:
    """Teacher-forced next-token logits after positions ``[first, N)`` of ``token_ids``, over
    the KV the cache holds for its prefix in ``namespace`` (a blended prompt's blend namespace,
    or a fresh salt for a full prefill); float32 ``[N - first, vocab]``. Run on the engine
    thread. Nothing is committed: the positions computed here leave no cache entry. Raises
    :class:`InvalidRequestError` if more than ``first`` tokens are cached (their logits
    would not be computed), :class:`OutOfBlocks` if the pool cannot hold the prompt."""
    from radixkv.engine.batch import SequenceChunk

    bm, runner = core.block_manager, core.model_runner
    toks = list(token_ids)
    a = bm.allocate(("radixkv-prompt-logits", id(toks)), toks, namespace)
    try:
        run_kv_ops(core.kv_mover, a.moves)
        core.kv_mover.wait_loads()
        c = a.num_cached_tokens
        if c > first:
            raise InvalidRequestError(f"{c} tokens are cached, more than first={first}")
        bs = bm.block_size
        table = list(a.block_ids)
        slots = [table[p // bs] * bs + p % bs for p in range(c, len(toks))]
        chunk = SequenceChunk(toks[c:], c, table, slots, list(range(first - c, len(toks) - c)))
        return runner.execute(runner.build_batch([chunk]))
    finally:
        bm.free(a.seq_id)


__all__ = [
    "prompt_logits",
    "BLEND_EXTRA",
    "DEFAULT_BLEND_RATIO",
    "DEFAULT_CHECK_LAYER",
    "DOCUMENT_EXTRA",
    "BlendReport",
    "DocSpan",
    "blend_context",
    "blend_extra",
    "blend_forward",
    "blend_namespace",
    "blend_unsupported",
    "check_blend_ratio",
    "check_spans",
    "document_namespace",
    "rerotate",
    "rerotate_quantized",
    "rope_unsupported",
    "window_unsupported",
    "StoredRows",
]
