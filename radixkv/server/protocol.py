"""Request models for the OpenAI-compatible endpoints (pydantic, mirroring OpenAI's schema).

Only what radixkv implements is declared; unknown fields are ignored (OpenAI clients send many
optional fields, e.g. ``user``, ``metadata``), except those we would silently get wrong, which
are rejected by :func:`radixkv.server.serving.sampling_params` with a 400 naming the field.
Range checks live here so a bad value never reaches the engine; the error handler turns a
``ValidationError`` into OpenAI's error JSON with ``param`` set to the offending field.
"""

from __future__ import annotations

import os
from typing import Any, ClassVar, Literal, Optional, Union

from pydantic import (BaseModel, ConfigDict, Field, PrivateAttr, StrictBool, StrictInt,
                      field_validator,
                      model_validator)

#: Request fields radixkv does not implement and would otherwise silently ignore (a 200 with
#: ordinary text where the client asked for something else): each is a 400 naming it when
#: given a value other than its "off" value (listed).
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "tools": (None, []), "tool_choice": (None, "none"), "functions": (None, []),
    "function_call": (None, "none"),
    "audio": (None,), "modalities": (None, ["text"]), "prediction": (None,),
    "web_search_options": (None,), "reasoning_effort": (None,),
    # OpenAI's (GPT-5 models): a shorter or longer answer than the model's own; no model here
    # was trained to follow it (the Responses API refuses text.verbosity likewise)
    "verbosity": (None, "medium"),
    # vLLM extensions with no radixkv equivalent yet
    "guided_whitespace_pattern": (None,),
    "add_generation_prompt": (None, True),
    "continue_final_message": (None, False), "chat_template": (None,),
    "chat_template_kwargs": (None, {}),
    "logits_processors": (None, []),
    "repetition_detection": (None,), "watermarking": (None,), "vllm_xargs": (None, {}),
    "kv_transfer_params": (None,), "ec_transfer_params": (None,),
    "mm_processor_kwargs": (None, {}), "media_io_kwargs": (None, {}),
    "return_token_offsets": (None, False),
    "prompt_embeds": (None,), "mm_payload": (None,), "return_mm_kwargs": (None, False),
    "routed_experts_prompt_start": (None,),
    "add_special_tokens": (None, False),   # chat's (completions' is implemented)
}


#: ``reasoning_effort`` values (vLLM's: OpenAI's and DeepSeek's ``max``). The server hands the
#: value to the chat template (``reasoning_effort``) and turns thinking on or off with it
#: (``enable_thinking``: false for ``none``), as vLLM does; a template that reads neither
#: variable makes it a 400 (radixkv/server/app.py, ``_reasoning_effort``).
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")

def stop_strings_limit(value: str | None) -> int:
    """The most stop strings a request may give: ``$VLLM_MAX_STOP_STRINGS`` (``value``) as
    vLLM 0.32 reads it, default 4 (OpenAI's and vLLM's); a deployment that raised it for its
    clients (evaluation harnesses and agent frameworks send more) keeps that. The search after
    each token is linear in it: on the project's Zen 5 EPYC 256 stop strings took ~31 us per
    sequence and token, 4 took ~1.3 us. Not a positive int: ``ValueError``."""
    if value is None or not value.strip():
        return 4
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(f"VLLM_MAX_STOP_STRINGS must be an int >= 1, got {value!r}")
    return n


#: Most stop strings one request may give (:func:`stop_strings_limit`, read at start-up).
MAX_STOP_STRINGS = stop_strings_limit(os.environ.get("VLLM_MAX_STOP_STRINGS"))

#: Longest id a request may name its response with (``X-Request-Id``, or vLLM's ``request_id``
#: field): the response's id is ``chatcmpl-<id>`` / ``cmpl-<id>``.
MAX_REQUEST_ID_CHARS = 128


def usable_request_id(v: str | None) -> bool:
    """Whether ``v`` can name a response: printable ASCII, 1 to ``MAX_REQUEST_ID_CHARS``."""
    return (v is not None and 0 < len(v) <= MAX_REQUEST_ID_CHARS and v.isascii()
            and v.isprintable())


#: Most documents one request may blend (each is a cache entry the blend locks).
MAX_DOCUMENTS = 256


def check_documents(v: Any, texts: bool, spans: bool) -> Any:
    """``documents`` as given (before pydantic's typing), refused with a message that says
    what is accepted: document texts (``texts``: non-blank strings, or vLLM's
    ``{"title": str, "text": str}`` dicts) and/or ``[start, end)`` token spans (``spans``).
    One request uses one kind."""
    if v is None:
        return v
    kinds = ("document texts (non-blank strings or {\"text\": ..., \"title\": ...})"
             if texts else "") + (" or " if texts and spans else "") + (
        "[start, end) token spans" if spans else "")
    if not isinstance(v, list) or not v:
        raise FieldError("documents", f"documents must be a non-empty list of {kinds}")
    if len(v) > MAX_DOCUMENTS:
        raise FieldError("documents", f"at most {MAX_DOCUMENTS} documents per request, got "
                         f"{len(v)}")
    seen = set()
    for i, d in enumerate(v):
        if isinstance(d, str) or isinstance(d, dict):
            kind = "text"
            text = d if isinstance(d, str) else d.get("text")
            title = None if isinstance(d, str) else d.get("title")
            if not texts or not isinstance(text, str) or not text.strip() or (
                    title is not None and not isinstance(title, str)) or (
                    isinstance(d, dict) and set(d) - {"text", "title"}):
                raise FieldError("documents", f"document {i} must be one of {kinds}, got "
                                 f"{d!r:.80}")
        elif isinstance(d, list) and len(d) == 2 and all(
                isinstance(x, int) and not isinstance(x, bool) for x in d):
            kind = "span"
            if not spans:
                raise FieldError("documents", f"document {i} is a token span {d}, but here "
                                 f"documents are {kinds} (spans need a token-id prompt on "
                                 "/v1/completions)")
        else:
            raise FieldError("documents", f"document {i} must be one of {kinds}, got {d!r:.80}")
        seen.add(kind)
    if len(seen) > 1:
        raise FieldError("documents", "documents mixes texts and token spans: give one kind")
    return v


class StreamOptions(BaseModel):
    include_usage: bool = False
    #: vLLM's: (with ``include_usage``) every chunk carries the usage so far
    continuous_usage_stats: bool = False


class _PlacedDocuments(BaseModel):
    """A request that may carry RAG documents as texts: the endpoint records their token spans
    once it has placed (chat) or found (a text prompt) them (docs/serve.md)."""

    #: The documents' [start, end) token spans in the tokenized prompt.
    _document_spans: Optional[list[tuple[int, int]]] = PrivateAttr(default=None)

    def place_documents(self, spans: list[tuple[int, int]]) -> None:
        """Record where the endpoint placed (chat) or found (a text prompt) the documents'
        texts: their [start, end) token spans, which the engine blends."""
        self._document_spans = spans

    @property
    def document_spans(self) -> Optional[list[tuple[int, int]]]:
        """The spans :meth:`place_documents` recorded, None before (or for token spans)."""
        return self._document_spans


#: Names ``chat_template_kwargs`` may not set: the arguments of ``apply_chat_template`` that
#: the endpoint sets itself (or that would change what it returns) and the template's own
#: variables and helpers.
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "sanitize_control_tokens", "padding", "truncation",
    "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask",
    "tokenizer_kwargs", "raise_exception", "strftime_now"})


class _TemplateOptions(BaseModel):
    """vLLM's chat-template fields of a request with ``messages`` (chat, ``/tokenize``)."""

    #: end the prompt with the assistant's turn header (False: after the last message)
    add_generation_prompt: bool = True
    #: leave the last message open (no end of turn), for the model to continue it
    continue_final_message: bool = False
    #: more variables for the template (e.g. Qwen3's ``enable_thinking``)
    chat_template_kwargs: Optional[dict[str, Any]] = None
    #: vLLM's: a Jinja template for this request instead of the model's; served only with
    #: ``--trust-request-chat-template`` (a 400 otherwise: rendering a client's template can
    #: take any amount of CPU and memory)
    chat_template: Optional[str] = None

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs(cls, v: Any) -> Any:
        for k in v or ():
            if not k.isidentifier():
                raise ValueError(f"{k!r} is not a template variable name")
            if k in RESERVED_TEMPLATE_KWARGS:
                raise ValueError(f"{k!r} is set by the server (or is the template's own); "
                                 "use the request's field for it where there is one")
        return v

    @model_validator(mode="after")
    def _one_ending(self) -> Any:
        if self.continue_final_message and self.add_generation_prompt:
            raise FieldError("continue_final_message", "continue_final_message continues the "
                             "last message: set add_generation_prompt to false with it")
        return self

    def template_options(self) -> dict[str, Any]:
        """Keyword arguments of ``apply_chat_template`` (and of ``ChatTemplate``'s)."""
        return {"add_generation_prompt": self.add_generation_prompt,
                "continue_final_message": self.continue_final_message,
                **(self.chat_template_kwargs or {})}

    def default_ending(self) -> bool:
        """Whether the prompt ends the way it does without these fields (a generation
        prompt after a closed last message)."""
        return self.add_generation_prompt and not self.continue_final_message


class _SamplingFields(_PlacedDocuments):
    """Fields shared by chat and text completions."""

    model_config = ConfigDict(extra="ignore")

    # OpenAI requires it; vLLM (and radixkv) serve the server's model when it is left out
    model: Optional[str] = None
    max_tokens: Optional[int] = Field(default=None, ge=1)
    temperature: Optional[float] = Field(default=None, ge=0.0, le=2.0)
    top_p: Optional[float] = Field(default=None, gt=0.0, le=1.0)
    top_k: Optional[int] = Field(default=None, ge=-1)   # vLLM extension; -1 or 0 = off
    n: int = Field(default=1, ge=1, le=128)
    stop: Optional[Union[str, list[str]]] = None
    #: vLLM's: the response's id is ``chatcmpl-<request_id>`` (an ``X-Request-Id`` header wins)
    request_id: Optional[str] = None
    seed: Optional[int] = Field(default=None, ge=-(2**63), lt=2**63)
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    # vLLM's: tokens per streamed chunk (raised to the server's --stream-interval)
    stream_interval: Optional[int] = Field(default=None, ge=1, le=1024)
    logprobs: Optional[Union[bool, int]] = None
    # radixkv / vLLM extensions
    use_beam_search: bool = False
    best_of: Optional[int] = Field(default=None, ge=1)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False   # vLLM's: the stop string that ended it, kept
    skip_special_tokens: bool = True   # vLLM's: false writes special tokens into the text
    # vLLM's: a space between special tokens written into the text. transformers 5's
    # tokenizers (slow ones too) never write one and ignore the keyword, so both values give
    # the same text here, as in vLLM over transformers 5
    spaces_between_special_tokens: bool = True
    # vLLM's: the prompt's and each choice's token ids in the answer (RL pipelines read them)
    return_token_ids: bool = False
    min_tokens: int = Field(default=0, ge=0)   # vLLM's: no stop before this many tokens
    #: vLLM's: a reasoning model thinks at most this many tokens, then its ``</think>`` is
    #: forced (with ``--reasoning-parser``); -1 is vLLM's "unlimited", the same as unset
    thinking_token_budget: Optional[int] = Field(default=None, ge=-1)
    # vLLM's: each prompt token's logprob, rank and this many alternatives (serve.md)
    prompt_logprobs: Optional[int] = Field(default=None, ge=0, le=20)
    # vLLM's token restrictions: only these tokens; never these strings (serve.md)
    allowed_token_ids: Optional[list[int]] = Field(default=None, min_length=1)
    bad_words: Optional[list[str]] = None
    # vLLM's: keep the prompt's last k tokens (-1: as many as fit beside max_tokens)
    truncate_prompt_tokens: Optional[int] = Field(default=None, ge=-1)
    truncation_side: Optional[Literal["left", "right"]] = None   # vLLM's: right keeps the first
    # vLLM's: logprobs name each token "token_id:N" instead of its text (unset: the server's
    # --return-tokens-as-token-ids)
    return_tokens_as_token_ids: Optional[bool] = None
    # vLLM's: these tokens' logprobs in every token's entry, instead of the most likely ones
    logprob_token_ids: Optional[list[int]] = Field(default=None, min_length=1, max_length=256)
    # vLLM's constrained output, and the guided_* fields it had before (serve.md)
    structured_outputs: Optional[StructuredOutputs] = None
    guided_json: Optional[Union[dict[str, Any], str]] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = Field(default=None, min_length=1)
    guided_grammar: Optional[str] = None

    length_penalty: float = 1.0
    cache_salt: Optional[str] = Field(default=None, min_length=1, max_length=256)
    # OpenAI: how long the prompt's prefix stays cached (radixkv: a TTL on it, see serve.md)
    prompt_cache_retention: Optional[Literal["in_memory", "24h"]] = None
    prompt_cache_key: Optional[str] = Field(default=None, min_length=1, max_length=256)
    # radixkv: eviction hints (docs/serve.md): the conversation / agent run the request belongs
    # to, and whether it is its last request
    session_id: Optional[str] = Field(default=None, min_length=1, max_length=256)
    end_session: StrictBool = False
    # vLLM: the scheduling priority under --scheduling-policy priority (lower is sooner; the
    # X-Vllm-Priority header overrides it); non-zero otherwise is a 400
    priority: StrictInt = Field(default=0, ge=-(2 ** 63), le=2 ** 63 - 1)
    # OpenAI's penalties (engine/sampling.adjust_logits) and logit_bias {"token id": bias}
    frequency_penalty: Optional[float] = Field(default=None, ge=-2.0, le=2.0)
    presence_penalty: Optional[float] = Field(default=None, ge=-2.0, le=2.0)
    logit_bias: Optional[dict[str, float]] = None
    response_format: Optional["ResponseFormat"] = None
    # vLLM extensions: its multiplicative penalty (prompt and output tokens), and token ids
    # that end a choice like the end-of-sequence token
    repetition_penalty: Optional[float] = Field(default=None, gt=0.0, le=100.0)
    min_p: Optional[float] = Field(default=None, ge=0.0, le=1.0)
    stop_token_ids: Optional[list[int]] = Field(default=None, max_length=64)
    # radixkv: RAG documents blended from their cached entries (docs/rag.md, docs/serve.md),
    # and the share of their tokens recomputed
    blend_ratio: Optional[float] = Field(default=None, ge=0.0, le=1.0)

    #: Fields of UNSUPPORTED this endpoint does implement (chat: tools).
    _implemented: ClassVar[frozenset[str]] = frozenset()

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name, off in UNSUPPORTED.items():
                if name in data and name not in cls._implemented and not any(
                        data[name] == o and type(data[name]) is type(o) for o in off):
                    raise UnsupportedField(name)
        return data

    @field_validator("thinking_token_budget")
    @classmethod
    def _budget(cls, v: Any) -> Any:
        return None if v == -1 else v

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v: Any) -> Any:
        if v is None:
            return v
        for k, b in v.items():
            try:
                tid = int(k)
            except ValueError:
                raise ValueError(f"keys must be token ids, got {k!r}") from None
            if tid < 0:
                raise ValueError(f"token id {tid} is negative")
            if not -100.0 <= b <= 100.0:
                raise ValueError(f"bias {b} for token {k} is outside [-100, 100]")
        return v

    @field_validator("request_id")
    @classmethod
    def _request_id(cls, v: Any) -> Any:
        if v is not None and not usable_request_id(v):
            raise ValueError(f"request_id must be 1 to {MAX_REQUEST_ID_CHARS} printable ASCII "
                             "characters (it names the response)")
        return v

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, v: Any) -> Any:
        items = [v] if isinstance(v, str) else (v or [])
        if len(items) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop sequences, got {len(items)} "
                             "(VLLM_MAX_STOP_STRINGS raises the limit, as for vLLM)")
        if any(not s for s in items):
            raise ValueError("stop sequences must be non-empty strings")
        return v

    @model_validator(mode="after")
    def _one_constraint(self) -> Any:
        self.output_constraint()
        if self.truncate_prompt_tokens == 0:
            raise FieldError("truncate_prompt_tokens", "truncate_prompt_tokens 0 would leave "
                             "no prompt: give k >= 1, or -1")
        return self

    def output_constraint(self) -> tuple[str, str, Any] | None:
        """``(field, kind, value)`` of the request's one output constraint (kind ``json``,
        ``json_object``, ``regex``, ``choice`` or ``grammar``), None without one; a
        ``FieldError`` naming the second field when two are given."""
        found: list[tuple[str, str, Any]] = []
        fmt = self.response_format
        if fmt is not None and fmt.type != "text":
            found.append(("response_format", fmt.type,
                          fmt.json_schema.schema_ if fmt.json_schema is not None else None))
        if self.structured_outputs is not None:
            found.append(("structured_outputs", *self.structured_outputs.constraint()))
        for name, kind in (("guided_json", "json"), ("guided_regex", "regex"),
                           ("guided_choice", "choice"), ("guided_grammar", "grammar")):
            value = getattr(self, name)
            if value is not None:
                found.append((name, kind, value))
        if len(found) > 1:
            raise FieldError(found[1][0], f"{found[0][0]} and {found[1][0]} both constrain "
                             "the output: give one")
        if not found:
            return None
        field, kind, value = found[0]
        return field, "json" if kind == "json_schema" else kind, value
    @field_validator("length_penalty")
    @classmethod
    def _finite(cls, v: float) -> float:
        if v != v or v in (float("inf"), float("-inf")):
            raise ValueError("must be a finite number")
        return v


class FieldError(ValueError):
    """A whole-request check that fails because of one field: the 400 names it (``param``)."""

    code = "invalid_value"

    def __init__(self, name: str, message: str) -> None:
        super().__init__(message)
        self.name = name


class UnsupportedField(FieldError):
    """A request field radixkv does not implement (answered 400 naming it)."""

    code = "unsupported_parameter"

    def __init__(self, name: str) -> None:
        super().__init__(name, f"{name} is not supported by this server (radixkv answers an "
                         "error rather than ignoring it; docs/serve.md lists what is)")


class JSONSchemaFormat(BaseModel):
    name: Optional[str] = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: Optional[bool] = None
    description: Optional[str] = None


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``: plain text, any JSON object, or a JSON schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JSONSchemaFormat] = None

    @model_validator(mode="after")
    def _schema_given(self) -> "ResponseFormat":
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type json_schema needs a json_schema object with a schema")
        return self


class StructuredOutputs(BaseModel):
    """vLLM's ``structured_outputs``: exactly one constraint on the output (``json``: a JSON
    schema, as an object or its text; ``regex``; ``choice``: one of these strings;
    ``grammar``: EBNF or Lark; ``json_object``: any JSON object)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    json_: Optional[Union[dict[str, Any], str]] = Field(default=None, alias="json")
    regex: Optional[str] = None
    choice: Optional[list[str]] = Field(default=None, min_length=1)
    grammar: Optional[str] = None
    json_object: Optional[bool] = None
    disable_any_whitespace: bool = False
    # xgrammar never generates properties a schema does not list: True is how it runs anyway
    disable_additional_properties: bool = False
    whitespace_pattern: Optional[str] = None   # not supported (refused when given)
    structural_tag: Optional[Any] = None       # not supported (refused when given)

    @model_validator(mode="after")
    def _one(self) -> "StructuredOutputs":
        for name in ("whitespace_pattern", "structural_tag"):
            if getattr(self, name) is not None:
                raise ValueError(f"{name} is not supported by this server")
        given = [k for k, v in (("json", self.json_), ("regex", self.regex),
                                ("choice", self.choice), ("grammar", self.grammar),
                                ("json_object", self.json_object)) if v is not None]
        if len(given) != 1:
            raise ValueError("give exactly one of json, regex, choice, grammar and json_object"
                             + (f" (got {', '.join(given)})" if given else ""))
        return self

    def constraint(self) -> tuple[str, Any]:
        """``(kind, value)`` of the one constraint given."""
        for kind, value in (("json", self.json_), ("regex", self.regex),
                            ("choice", self.choice), ("grammar", self.grammar),
                            ("json_object", self.json_object)):
            if value is not None:
                return kind, value
        raise AssertionError("validated: one constraint")


class CacheControl(BaseModel):
    """Anthropic-style cache breakpoint on a message: keep the conversation up to and
    including it for ``ttl`` ("5m" default, "1h", or seconds) after its last use."""

    type: Literal["ephemeral"] = "ephemeral"
    ttl: Optional[Union[str, float]] = None

    @field_validator("ttl")
    @classmethod
    def _ttl(cls, v: Any) -> Any:
        if v is not None:
            from radixkv.engine.cache_points import parse_ttl
            from radixkv.errors import InvalidRequestError

            try:
                parse_ttl(v)
            except InvalidRequestError as exc:
                raise ValueError(str(exc)) from None
        return v


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Union[str, list[dict[str, Any]], None] = None
    cache_control: Optional[CacheControl] = None
    # an assistant turn's calls, and a tool result's call id / tool name (OpenAI's fields)
    tool_calls: Optional[list[dict[str, Any]]] = None
    tool_call_id: Optional[str] = None
    name: Optional[str] = None

    def text(self) -> str:
        """The message's text; OpenAI's list-of-parts form keeps its ``text`` parts."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError("only text content parts are supported")
            parts.append(part["text"])
        return "".join(parts)


class FunctionDef(BaseModel):
    name: str = Field(min_length=1, max_length=64)
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None


class ToolDef(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionDef


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(_SamplingFields, _TemplateOptions):
    _implemented: ClassVar[frozenset[str]] = frozenset({
        "tools", "tool_choice", "add_generation_prompt", "continue_final_message",
        "chat_template_kwargs", "echo", "return_prompt_text", "chat_template",
        "reasoning_effort"})

    messages: list[ChatMessage] = Field(min_length=1)
    #: vLLM's: the template's ``reasoning_effort`` variable, and thinking off for ``none`` /
    #: on otherwise (``enable_thinking``) unless ``chat_template_kwargs`` sets it
    reasoning_effort: Optional[Literal["none", "minimal", "low", "medium", "high", "xhigh",
                                       "max"]] = None
    max_completion_tokens: Optional[int] = Field(default=None, ge=1)
    top_logprobs: Optional[int] = Field(default=None, ge=0, le=20)
    tools: Optional[list[ToolDef]] = None
    tool_choice: Optional[Union[Literal["none", "auto", "required"], NamedToolChoice]] = None
    #: false: at most one call per reply (the reply ends after its first ``</tool_call>``)
    parallel_tool_calls: Optional[bool] = None
    #: vLLM's: false leaves the thinking out of the answer (with ``--reasoning-parser``)
    include_reasoning: bool = True
    #: vLLM's: the reply's content starts with the last message's when the reply continues
    #: it (``add_generation_prompt: false``, or a last message of the assistant)
    echo: Optional[bool] = None
    #: vLLM's: the answer carries ``prompt_text``, the prompt's tokens as text
    return_prompt_text: Optional[bool] = None
    # radixkv (vLLM's field, placed by the server rather than the template): the retrieved
    # documents' texts, placed before the last user message's text (docs/serve.md)
    documents: Optional[list[Union[str, dict[str, Any]]]] = None

    @field_validator("documents", mode="before")
    @classmethod
    def _documents(cls, v: Any) -> Any:
        return check_documents(v, texts=True, spans=False)

    @model_validator(mode="after")
    def _documents_combine(self) -> "ChatCompletionRequest":
        if self.blend_ratio is not None and self.documents is None:
            raise FieldError("blend_ratio", "blend_ratio needs documents")
        if self.documents is not None:
            if any(m.cache_control for m in self.messages):
                raise FieldError("documents", "documents are not supported together with "
                                 "cache_control yet (prompt_cache_retention is)")
            if not self.default_ending():
                raise FieldError("documents", "documents are placed before the last user "
                                 "message's text, ahead of the generation prompt: they are "
                                 "not supported with add_generation_prompt false or "
                                 "continue_final_message")
        return self

    @model_validator(mode="after")
    def _tool_choice_names_a_tool(self) -> "ChatCompletionRequest":
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice) and choice.function.name not in {
                t.function.name for t in self.tools or []}:
            raise FieldError("tool_choice", f"tool_choice names {choice.function.name!r}, "
                             "which is not in tools")
        if choice == "required" and not self.tools:
            raise FieldError("tool_choice", "tool_choice 'required' needs tools")
        return self


class CompletionRequest(_SamplingFields):
    _implemented: ClassVar[frozenset[str]] = frozenset({"echo", "add_special_tokens"})

    # A string, a list of token ids, or (OpenAI's batch form) a list of one of those.
    prompt: Union[str, list[int], list[str], list[list[int]]]
    # 0 with echo: the prompt alone comes back (with its logprobs), as OpenAI's and vLLM's
    max_tokens: Optional[int] = Field(default=None, ge=0)
    echo: bool = False
    # vLLM's: a text prompt tokenized with the tokenizer's special tokens (BOS) or without
    add_special_tokens: bool = True
    suffix: Optional[str] = None
    # radixkv: RAG documents blended from their cached entries (docs/rag.md): with a text
    # prompt their texts (found in it), with token ids their [start, end) token spans
    documents: Optional[Union[list[tuple[int, int]], list[str]]] = None

    @field_validator("documents", mode="before")
    @classmethod
    def _documents(cls, v: Any) -> Any:
        check_documents(v, texts=True, spans=True)
        if isinstance(v, list) and any(isinstance(d, dict) for d in v):
            raise FieldError("documents", "documents of a completion are the texts found in "
                             "its prompt (strings) or token spans; {title, text} objects are "
                             "for chat, where the server places them")
        return v

    @model_validator(mode="after")
    def _nothing_needs_echo(self) -> "CompletionRequest":
        if self.max_tokens == 0 and not self.echo:
            raise FieldError("max_tokens", "max_tokens 0 generates nothing: it returns the "
                             "prompt with echo (and its logprobs with logprobs)")
        return self

    @model_validator(mode="after")
    def _documents_fit_the_prompt(self) -> "CompletionRequest":
        docs, p = self.documents, self.prompt
        if self.blend_ratio is not None and docs is None:
            raise FieldError("blend_ratio", "blend_ratio needs documents")
        if docs and isinstance(docs[0], str) and not isinstance(p, str):
            raise FieldError("documents", "documents as texts need one text prompt (a "
                             "string); with token ids give [start, end) token spans")
        if docs and not isinstance(docs[0], str) and (
                isinstance(p, str) or (p and isinstance(p[0], str))):
            raise FieldError("documents", "document spans are token positions: they need a "
                             "token-id prompt; with a text prompt give the documents' texts")
        return self

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, v: Any) -> Any:
        if isinstance(v, str) and v == "":
            raise ValueError("the prompt is empty")
        if isinstance(v, list) and (not v or any(
                (isinstance(x, (str, list)) and len(x) == 0) for x in v)):
            raise ValueError("the prompt is empty")
        return v


class TokenizeRequest(_PlacedDocuments, _TemplateOptions):
    """vLLM's ``/tokenize`` body: ``prompt`` or chat ``messages``."""

    model_config = ConfigDict(extra="ignore")

    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = Field(default=None, min_length=1)
    add_special_tokens: bool = True
    #: vLLM's: the tools the chat template renders into the prompt (as a chat request's)
    tools: Optional[list[ToolDef]] = None
    #: vLLM's: each token's string too (``token_strs``)
    return_token_strs: bool = False
    # radixkv: the documents as chat or completions would take them; the answer then also
    # has their token spans (``document_spans``)
    documents: Optional[list[Union[str, dict[str, Any]]]] = None


    @field_validator("documents", mode="before")
    @classmethod
    def _documents(cls, v: Any) -> Any:
        return check_documents(v, texts=True, spans=False)


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: Optional[str] = None
    tokens: list[int]


_SamplingFields.model_rebuild()
ChatCompletionRequest.model_rebuild()
CompletionRequest.model_rebuild()

#: Responses API fields radixkv does not implement, with their "off" values (as UNSUPPORTED).
RESPONSES_UNSUPPORTED = {
    "prompt": (None,),
    "n": (None, 1),
    # vLLM's: its Responses id is the request's request_id; here an id keys the store that
    # every tenant's responses share, so a client may not choose one
    "request_id": (None,),
    # vLLM's harmony-format (gpt-oss) message views
    "enable_response_messages": (None, False), "previous_input_messages": (None,),
}

#: The one ``include`` value radixkv produces.
RESPONSES_LOGPROBS = "message.output_text.logprobs"

#: Chat request fields a Responses request may also carry (vLLM's sampling extensions and
#: radixkv's cache fields): passed to the chat request as they are, validated there.
RESPONSES_PASSTHROUGH = (
    "top_k", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty",
    "logit_bias", "seed", "stop", "stop_token_ids", "ignore_eos", "min_tokens", "bad_words",
    "allowed_token_ids", "skip_special_tokens", "include_stop_str_in_output", "priority",
    "cache_salt", "prompt_cache_key", "prompt_cache_retention", "session_id", "end_session",
    "chat_template_kwargs", "structured_outputs", "user", "thinking_token_budget",
    # vLLM's include_reasoning (false: the reasoning item is left out), and the vLLM fields the
    # chat request refuses (UNSUPPORTED), so that they are refused here too, not ignored
    "include_reasoning", "vllm_xargs", "watermarking", "kv_transfer_params",
    "ec_transfer_params", "media_io_kwargs", "mm_processor_kwargs", "mm_payload",
    "return_mm_kwargs",
)


class ResponsesRequest(BaseModel):
    """OpenAI's ``POST /v1/responses`` body, as far as radixkv implements it
    (radixkv/server/responses.py turns it into a chat request). Unknown fields are ignored as
    in the chat models, except :data:`RESPONSES_UNSUPPORTED` (a 400 naming the field) and
    :data:`RESPONSES_PASSTHROUGH` (handed to the chat request)."""

    model_config = ConfigDict(extra="allow")

    model: Optional[str] = None
    input: Union[str, list[dict[str, Any]]]
    instructions: Optional[str] = None
    previous_response_id: Optional[str] = Field(default=None, min_length=1, max_length=256)
    store: StrictBool = True
    stream: StrictBool = False
    #: run apart from this HTTP request: poll, follow or cancel it by id (needs ``store``)
    background: Optional[StrictBool] = None
    #: ``auto``: drop the conversation's earliest turns until the prompt and
    #: ``max_output_tokens`` fit the context (``disabled``: a 400 instead)
    truncation: Optional[Literal["auto", "disabled"]] = None
    #: a conversation (``/v1/conversations``) whose items are the history, and which the
    #: response's input and output items join: its id, or ``{"id": id}``
    conversation: Optional[Union[str, dict[str, Any]]] = None
    #: OpenAI's bound on calls of its built-in tools; radixkv has none (function calls are
    #: the client's), so it bounds nothing here and is echoed
    max_tool_calls: Optional[int] = Field(default=None, ge=0)
    max_output_tokens: Optional[int] = Field(default=None, ge=1)
    temperature: Optional[float] = Field(default=None, ge=0.0, le=2.0)
    top_p: Optional[float] = Field(default=None, gt=0.0, le=1.0)
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Optional[Union[str, dict[str, Any]]] = None
    parallel_tool_calls: Optional[bool] = None
    text: Optional[dict[str, Any]] = None
    reasoning: Optional[dict[str, Any]] = None
    #: extra output: only ``message.output_text.logprobs`` (each text token's log-probability,
    #: with ``top_logprobs`` alternatives); anything else is a 400
    include: Optional[list[str]] = None
    top_logprobs: Optional[int] = Field(default=None, ge=0, le=20)

    @field_validator("include")
    @classmethod
    def _include(cls, v: Any) -> Any:
        for item in v or ():
            if item != RESPONSES_LOGPROBS:
                raise UnsupportedField("include")
        return v
    metadata: Optional[dict[str, str]] = Field(default=None, max_length=16)

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name, off in RESPONSES_UNSUPPORTED.items():
                if name in data and not any(
                        data[name] == o and type(data[name]) is type(o) for o in off):
                    raise UnsupportedField(name)
            r = data.get("reasoning")
            if isinstance(r, dict):
                for k, v in r.items():   # the effort, as chat's reasoning_effort; no summaries
                    if k == "effort" and (v is None or v in REASONING_EFFORTS):
                        continue
                    if k in ("summary", "generate_summary") and v in (None, "auto"):
                        continue   # auto: the server's choice, which is none
                    raise UnsupportedField("reasoning")
        return data

    def reasoning_effort(self) -> str | None:
        """``reasoning.effort`` (chat's ``reasoning_effort``), None when not given."""
        return (self.reasoning or {}).get("effort")

    def passthrough(self) -> dict[str, Any]:
        """The chat request fields this request carries (:data:`RESPONSES_PASSTHROUGH`)."""
        extra = self.model_extra or {}
        return {k: extra[k] for k in RESPONSES_PASSTHROUGH if k in extra}


class ConversationCreate(BaseModel):
    """``POST /v1/conversations``: its first items and metadata (server/conversations.py)."""

    model_config = ConfigDict(extra="forbid")

    items: Optional[list[Any]] = None
    metadata: Optional[Any] = None


class ConversationUpdate(BaseModel):
    """``POST /v1/conversations/{id}``: new metadata."""

    model_config = ConfigDict(extra="forbid")

    metadata: Any


class ConversationItemsCreate(BaseModel):
    """``POST /v1/conversations/{id}/items``."""

    model_config = ConfigDict(extra="forbid")

    items: list[Any]


__all__ = ["FieldError", "MAX_DOCUMENTS", "check_documents", "TokenizeRequest",
           "DetokenizeRequest", "UNSUPPORTED", "UnsupportedField",
           "ResponseFormat", "CacheControl", "ChatCompletionRequest", "CompletionRequest",
           "ChatMessage", "StreamOptions", "ToolDef", "NamedToolChoice", "ResponsesRequest",
           "RESPONSES_UNSUPPORTED", "RESPONSES_PASSTHROUGH", "REASONING_EFFORTS",
           "MAX_STOP_STRINGS", "stop_strings_limit", "MAX_REQUEST_ID_CHARS", "usable_request_id",
           "ConversationCreate", "ConversationUpdate", "ConversationItemsCreate"]
