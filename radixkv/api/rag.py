"""Retrieval-augmented generation over the prefix cache: documents as reusable prefixes.

A prefix cache shares *prefixes*, in whole blocks, and a block's hash chains everything before
it. So the helper lays every prompt out in one fixed shape::

    [head: chat template up to the documents][doc a][doc b]...[question + end of turn + gen prompt]

with the documents in a canonical order (ascending id by default), each tokenized once when it is
added. Any two questions over the same documents then share the whole head+documents prefix.

Block alignment (``align_blocks=True``, the default): the head and every document segment are
padded with a filler token (newline) to a multiple of the block size, so each document occupies
whole blocks of its own. Then questions over document sets that share a *leading run* in the
canonical order ({a, b} and {a, c}) share all of a's blocks, including its last one; without
padding a's last block also holds the start of b or c and is shared only by identical layouts.
Sets whose first documents differ ({a, b} vs {b, c}) share only the head: b's blocks hash
differently after a than at the front (chained hashes are what make a prefix match safe).

``order="priority"`` puts pinned documents first (highest priority first, then by id), so the
popular documents form the common leading run of many layouts.

**Blending** (``blend_ratio`` set; :mod:`radixkv.engine.blend`, docs/rag.md): each document's KV
is also cached as an entry of its own (computed right after the head, under the chain of
head + document tokens in a document namespace of the same tenant salt), and a prompt reuses
every document's entry wherever the document appears: keys re-rotated to their positions, the
``blend_ratio`` share of document tokens whose KV deviates most recomputed. The documents then
need no canonical order: ``order="given"`` keeps the caller's (the retriever's) order.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from radixkv.errors import InvalidRequestError, UnknownDocumentError

if TYPE_CHECKING:
    from radixkv.api.engine import Engine, ParamsLike
    from radixkv.engine.blend import BlendReport, DocSpan

DEFAULT_SYSTEM = ("Answer the question using only the documents provided. "
                  "If they do not contain the answer, say so.")
DEFAULT_DOC_FORMAT = "Document [{doc_id}]\n{text}\n"
_DOCS = "\u2063radixkv-docs\u2063"
_QUESTION = "\u2063radixkv-question\u2063"


@dataclass(frozen=True)
class DocumentPrompt:
    """A prompt whose documents' token spans are known exactly (for blending).

    Attributes:
        token_ids: the prompt's tokens.
        spans: ``(start, end)`` half-open token positions of each document, in prompt order
            (sorted, disjoint, non-empty): what ``add_request(documents=...)`` and the server's
            token-id ``documents`` take.
    """

    token_ids: list[int]
    spans: list[tuple[int, int]]


def document_text(doc: str | Mapping[str, Any]) -> str:
    """The text a server-placed document occupies in a chat prompt (before padding): a plain
    string as given, vLLM's ``{"title": ..., "text": ...}`` as RAGHelper writes a document
    (``Document [title]\\n{text}``), then a newline. Nothing depends on the document's position
    in the list, so its entry is the same in every order."""
    if isinstance(doc, str):
        return doc + "\n"
    title = doc.get("title")
    text = doc["text"]
    return DEFAULT_DOC_FORMAT.format(doc_id=title, text=text) if title else text + "\n"


def _filler(template: Any) -> int:
    """The padding token: a newline (as RAGHelper pads)."""
    nl = template.encode("\n")
    return nl[-1] if nl else 0


def chat_document_prompt(template: Any, messages: Sequence[Mapping[str, str]],
                         documents: Sequence[str | Mapping[str, Any]], block_size: int,
                         template_kwargs: Mapping[str, Any] | None = None) -> DocumentPrompt:
    """The chat prompt with ``documents`` placed the way :class:`RAGHelper` places them: at
    the start of the *last* user message, the conversation before them padded to whole
    blocks (the entries' lead, docs/rag.md), each document (:func:`document_text`) tokenized
    on its own and padded to whole blocks, then the message's own text and the rest of the
    template (end of turn, generation prompt)::

        [template up to the last user message's content | pad][doc 1 | pad]...[doc n | pad]
        [that message's text, end of turn, generation prompt]

    ``messages``: role/content dicts (the template's input); ``template_kwargs``: more
    variables for the template (the server's ``chat_template_kwargs``). Raises
    :class:`InvalidRequestError` when there is no user message or the template does not keep
    the message's text as given (the documents could not be placed exactly)."""
    users = [k for k, m in enumerate(messages) if m.get("role") == "user"]
    if not users:
        raise InvalidRequestError("documents are placed before the last user message's text; "
                                  "the messages have no user message")
    if not documents:
        raise InvalidRequestError("documents is empty")
    k = users[-1]
    msgs = [dict(m) for m in messages]
    msgs[k]["content"] = _DOCS + (msgs[k].get("content") or "")
    rendered = template.render(msgs, add_generation_prompt=True, **(template_kwargs or {}))
    head, sep, tail = rendered.partition(_DOCS)
    if not sep or _DOCS in tail:
        raise InvalidRequestError("the chat template does not render the last user message's "
                                  "text as given, so the documents cannot be placed in it")
    filler = _filler(template)

    def pad(ids: list[int]) -> list[int]:
        return ids + [filler] * (-len(ids) % block_size)

    ids = pad(template.encode(head))
    spans = []
    for doc in documents:
        seg = pad(template.encode(document_text(doc)))
        spans.append((len(ids), len(ids) + len(seg)))
        ids += seg
    return DocumentPrompt(ids + template.encode(tail), spans)


def text_document_prompt(encode_first: Callable[[str], list[int]],
                         encode_rest: Callable[[str], list[int]], text: str,
                         documents: Sequence[str]) -> DocumentPrompt:
    """A text prompt that contains ``documents`` (each found in it, in the order listed, not
    overlapping), tokenized piece by piece so that each document's span is exact: the text
    before the first document with ``encode_first`` (special tokens added, e.g. BOS), every
    other piece, documents included, with ``encode_rest`` (none added). The text itself is
    not changed. Raises :class:`InvalidRequestError` naming the document not found."""
    pieces: list[tuple[str, bool]] = []
    pos = 0
    for i, doc in enumerate(documents):
        if not isinstance(doc, str) or not doc.strip():
            raise InvalidRequestError(f"document {i} is empty")
        at = text.find(doc, pos)
        if at < 0:
            where = f" after document {i - 1} (which ends at character {pos})" if i else ""
            more = (" (it occurs earlier: list the documents in the order they appear, "
                    "without overlapping)" if text.find(doc) >= 0 else "")
            raise InvalidRequestError(f"document {i} was not found in the prompt{where}{more}; "
                                      "each document's text must appear in the prompt verbatim")
        pieces += [(text[pos:at], False), (doc, True)]
        pos = at + len(doc)
    pieces.append((text[pos:], False))
    ids = list(encode_first(pieces[0][0]))
    spans = []
    for piece, is_doc in pieces[1:]:
        seg = encode_rest(piece) if piece else []
        if is_doc:
            spans.append((len(ids), len(ids) + len(seg)))
        ids += seg
    return DocumentPrompt(ids, spans)


@dataclass(frozen=True)
class RAGAnswer:
    """One answer and what the cache did for it.

    Attributes:
        text, token_ids, finish_reason: the generated answer.
        doc_ids: the documents in the order they were laid out.
        prompt_tokens: tokens in the prompt; cached_tokens: of those, served from the cache.
        ttft: seconds to the first answer token (with blending: from before the blend).
        blend: what blending did (None: the prompt ran as an ordinary request).
    """

    text: str
    token_ids: list[int]
    finish_reason: str | None
    doc_ids: tuple[str, ...]
    prompt_tokens: int
    cached_tokens: int
    ttft: float | None
    blend: BlendReport | None = None

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


class RAGHelper:
    """Register documents once; ask questions over any subset with shared-prefix reuse.

    Args:
        engine: the :class:`radixkv.api.engine.Engine` to run on.
        system: system message placed before the documents.
        doc_format: how one document is written (``{doc_id}``, ``{text}``).
        order: ``"id"`` (ascending document id), ``"priority"`` (pinned first) or ``"given"``
            (the order the caller lists them in: for blending).
        align_blocks: pad the head and each document to whole blocks (see module docstring).
        cache_salt: tenant salt for every request and pin of this helper.
        blend_ratio: None (prefix-only reuse) or the share of document tokens to recompute when
            blending cached documents into a prompt (0: plain reuse; 1: a full prefill;
            :data:`radixkv.engine.blend.DEFAULT_BLEND_RATIO` is the measured default).

    >>> # rag = engine.rag()
    >>> # rag.add_document("paris", "Paris is the capital of France.")
    >>> # rag.ask("What is the capital of France?", ["paris"]).text
    """

    def __init__(self, engine: Engine, system: str | None = DEFAULT_SYSTEM,
                 doc_format: str = DEFAULT_DOC_FORMAT, order: str = "id",
                 align_blocks: bool = True, cache_salt: str | None = None,
                 blend_ratio: float | None = None) -> None:
        from radixkv.engine.blend import check_blend_ratio

        if order not in ("id", "priority", "given"):
            raise InvalidRequestError(f"order must be 'id', 'priority' or 'given', got {order!r}")
        self.blend_ratio = None if blend_ratio is None else check_blend_ratio(blend_ratio)
        self.engine = engine
        self.template = engine.chat_template
        self.doc_format = doc_format
        self.order = order
        self.align_blocks = align_blocks
        self.cache_salt = cache_salt
        self.block_size = engine.cache_config.block_size
        self._docs: dict[str, list[int]] = {}      # doc id -> its segment's token ids
        self._texts: dict[str, str] = {}
        self._priority: dict[str, int] = {}
        msgs = [{"role": "system", "content": system}] if system is not None else []
        rendered = self.template.render(
            msgs + [{"role": "user", "content": _DOCS + _QUESTION}], add_generation_prompt=True)
        head, _, rest = rendered.partition(_DOCS)
        between, _, tail = rest.partition(_QUESTION)
        if between != "" or _QUESTION not in rest:
            raise InvalidRequestError("could not locate the user message in the chat template")
        self._tail_text = tail
        nl = self.template.encode("\n")
        self.filler_id = nl[-1] if nl else 0   # padding token: a newline
        self.head_ids = self._pad(self.template.encode(head))

    # ------------------------------------------------------------------ documents
    def _pad(self, ids: list[int]) -> list[int]:
        if not self.align_blocks:
            return ids
        return ids + [self.filler_id] * (-len(ids) % self.block_size)

    def add_document(self, doc_id: str, text: str) -> int:
        """Register (or replace) a document; tokenized once here. Returns its segment's tokens.

        Replacing a document's text changes its blocks (old ones age out of the cache).
        """
        if not isinstance(doc_id, str) or not doc_id:
            raise InvalidRequestError(f"doc_id must be a non-empty str, got {doc_id!r}")
        if not isinstance(text, str) or not text.strip():
            raise InvalidRequestError(f"document {doc_id!r} has no text")
        ids = self._pad(self.template.encode(self.doc_format.format(doc_id=doc_id, text=text)))
        self._docs[doc_id] = ids
        self._texts[doc_id] = text
        return len(ids)

    def remove_document(self, doc_id: str) -> None:
        """Forget a document (its cached blocks age out). UnknownDocumentError if absent."""
        if not isinstance(doc_id, str) or doc_id not in self._docs:
            raise UnknownDocumentError(f"no document {doc_id!r} (known: {self.doc_ids})")
        self._docs.pop(doc_id)
        self._texts.pop(doc_id, None)
        self._priority.pop(doc_id, None)

    @property
    def doc_ids(self) -> list[str]:
        return sorted(self._docs)

    def num_tokens(self, doc_id: str) -> int:
        """Tokens of a document's segment (with format and padding)."""
        if not isinstance(doc_id, str) or doc_id not in self._docs:
            raise UnknownDocumentError(f"no document {doc_id!r} (known: {self.doc_ids})")
        return len(self._docs[doc_id])

    # ------------------------------------------------------------------ layout
    def layout(self, doc_ids: Sequence[str] | None = None) -> list[str]:
        """The canonical order of a set of documents (duplicates removed)."""
        ids = self.doc_ids if doc_ids is None else list(dict.fromkeys(doc_ids))
        missing = [d for d in ids if d not in self._docs]
        if missing:
            raise InvalidRequestError(f"unknown document(s) {missing}; add_document first")
        if self.order == "priority":
            return sorted(ids, key=lambda d: (-self._priority.get(d, 0), d))
        if self.order == "given":
            return ids
        return sorted(ids)

    def document_spans(self, doc_ids: Sequence[str] | None = None) -> list[DocSpan]:
        """Where each document's segment lies in :meth:`prompt_ids` (layout order)."""
        from radixkv.engine.blend import DocSpan

        pos, out = len(self.head_ids), []
        for d in self.layout(doc_ids):
            out.append(DocSpan(pos, pos + len(self._docs[d])))
            pos += len(self._docs[d])
        return out

    def prefix_ids(self, doc_ids: Sequence[str] | None = None) -> list[int]:
        """Head + documents in canonical order: the part shared by every question on them."""
        out = list(self.head_ids)
        for d in self.layout(doc_ids):
            out += self._docs[d]
        return out

    def prompt_ids(self, question: str, doc_ids: Sequence[str] | None = None) -> list[int]:
        """The full prompt of a question over ``doc_ids`` (None: all documents)."""
        if not isinstance(question, str) or not question.strip():
            raise InvalidRequestError("question must be a non-empty str")
        q = self.template.encode("Question: " + question + self._tail_text)
        return self.prefix_ids(doc_ids) + q

    # ------------------------------------------------------------------ asking
    def ask(self, question: str, doc_ids: Sequence[str] | None = None,
            params: ParamsLike = None) -> RAGAnswer:
        """Answer ``question`` from ``doc_ids`` (None: all documents)."""
        return self.ask_many([question], doc_ids, params)[0]

    def ask_many(self, questions: Sequence[str], doc_ids: Sequence[str] | None = None,
                 params: ParamsLike = None) -> list[RAGAnswer]:
        """Answer several questions over the same documents in one continuous batch.

        The first request to be admitted computes the shared prefix; the others reuse it
        once its blocks are committed (requests admitted in the same step may each compute it).
        """
        order = tuple(self.layout(doc_ids))
        prompts = [self.prompt_ids(q, order) for q in questions]
        if self.blend_ratio is None:
            outs = self.engine.generate(prompts, params, cache_salt=self.cache_salt)
            reports: list[BlendReport | None] = [None] * len(prompts)
            started = [None] * len(prompts)
        else:
            outs, reports, started = self._ask_blended(prompts, order, params)
        answers = []
        for prompt, out, rep, t0 in zip(prompts, outs, reports, started):
            c = out.outputs[0]
            ttft = out.ttft
            if t0 is not None and ttft is not None:
                ttft += t0   # the blend (and document warm-up) before the request counts
            answers.append(RAGAnswer(
                text=c.text or self.engine.decode(c.token_ids), token_ids=list(c.token_ids),
                finish_reason=c.finish_reason, doc_ids=order, prompt_tokens=len(prompt),
                cached_tokens=int(out.num_cached_tokens), ttft=ttft, blend=rep))
        return answers

    # ------------------------------------------------------------------ blending
    def _ask_blended(self, prompts: list[list[int]], order: tuple[str, ...],
                     params: ParamsLike) -> tuple[list[Any], list[Any], list[Any]]:
        """Blend each prompt's cached documents (engine thread), then run it in the blend
        namespace (or as an ordinary request where blending does not apply)."""
        import time

        from radixkv.api.engine import as_params
        from radixkv.engine.blend import blend_context

        sp = as_params(params)
        spans = self.document_spans(order)
        core, ratio = self.engine.core, self.blend_ratio
        rids: list[str] = []
        reports: list[BlendReport | None] = []
        started: list[float] = []   # seconds of warm-up + blend before each submit
        for prompt in prompts:
            t0 = time.perf_counter()
            self.warm_documents(order)
            rep = self.engine.loop.call(
                lambda p=prompt: blend_context(core, p, spans, self.cache_salt, ratio))
            extra = rep.namespace_extra if rep is not None else None
            started.append(time.perf_counter() - t0)
            rids.append(self.engine.submit(prompt, sp, cache_salt=self.cache_salt,
                                           namespace_extra=extra))
            reports.append(rep)
        outs = [self.engine.wait(r) for r in rids]
        return outs, reports, started

    def document_entry_ids(self, doc_id: str) -> list[int]:
        """The tokens of a document's entry: the head (the entry's lead, when it fills whole
        blocks, as ``align_blocks`` makes it) then the document's segment."""
        if not isinstance(doc_id, str) or doc_id not in self._docs:
            raise UnknownDocumentError(f"no document {doc_id!r} (known: {self.doc_ids})")
        lead = self.head_ids if len(self.head_ids) % self.block_size == 0 else []
        return list(lead) + list(self._docs[doc_id])

    def cached_document_tokens(self, doc_id: str) -> int:
        """Tokens of a document's own entry cached now (whole blocks, any tier; without the
        lead)."""
        from radixkv.core.hashing import token_bytes
        from radixkv.engine.blend import document_namespace

        ids = self.document_entry_ids(doc_id)
        lead = len(ids) - len(self._docs[doc_id])
        seed = document_namespace(self.engine.namespace(self.cache_salt)).seed
        tree = self.engine.core.tree
        n = len(self.engine.loop.call(
            lambda: tree.match_tokens(token_bytes(ids), seed))) * self.block_size
        return max(0, n - lead)

    def warm_documents(self, doc_ids: Sequence[str] | None = None) -> int:
        """Compute the entries of these documents that are not fully cached (one batch of
        ordinary requests in the document namespace, one token each). Returns how many ran."""
        from radixkv.engine.blend import DOCUMENT_EXTRA
        from radixkv.engine.sampling import SamplingParams

        todo = [d for d in self.layout(doc_ids)
                if self.cached_document_tokens(d) < len(self._docs[d]) // self.block_size
                * self.block_size]
        rids = [self.engine.submit(self.document_entry_ids(d), SamplingParams(max_tokens=1),
                                   cache_salt=self.cache_salt, namespace_extra=DOCUMENT_EXTRA)
                for d in todo]
        for r in rids:
            self.engine.wait(r)
        return len(todo)

    # ------------------------------------------------------------------ cache control
    def cached_tokens(self, doc_ids: Sequence[str] | None = None) -> int:
        """Tokens of the head+documents prefix cached right now (whole blocks, plus the rows of
        a kept partial tail that continues them: ``Engine.cached_prefix_tokens``)."""
        return self.engine.cached_prefix_tokens(self.prefix_ids(doc_ids), self.cache_salt)

    def pin(self, doc_ids: Sequence[str], priority: int | None = 1, ttl: float | None = None,
            warm: bool = True, persist: bool = False) -> int:
        """Keep the prefix of these documents cached longer: set priority and/or TTL hints.

        ``priority`` matters under ``CacheConfig(policy="priority")`` (higher survives longer);
        ``ttl`` (seconds after last use) expires the blocks under any policy. ``persist=True``
        also writes the prefix to the remote tier, when the engine has one, and keeps it there
        at least ``ttl`` after its last use: every replica sharing the server then starts with
        these documents cached. With ``warm=True`` the prefix is computed first if it is not
        fully cached (one prefill). Under ``order="priority"`` the documents also move to the
        front of every later layout. Returns the blocks hinted.
        """
        ids = self.layout(doc_ids)
        if priority is not None:
            for d in ids:
                self._priority[d] = int(priority)
        prefix = self.prefix_ids(ids)
        full = len(prefix) // self.block_size * self.block_size
        if warm and self.cached_tokens(ids) < full:
            from radixkv.engine.sampling import SamplingParams

            self.engine.generate([prefix], SamplingParams(max_tokens=1),
                                 cache_salt=self.cache_salt)
        return self.engine.set_prefix_hints(prefix, priority=priority, ttl=ttl, persist=persist,
                                            cache_salt=self.cache_salt)

    def describe(self) -> dict[str, Any]:
        """Sizes of the layout: head tokens and each document's segment tokens."""
        return {"head_tokens": len(self.head_ids), "block_size": self.block_size,
                "align_blocks": self.align_blocks,
                "documents": {d: len(self._docs[d]) for d in self.doc_ids}}
