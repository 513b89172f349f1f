"""Request models for the OpenAI-compatible endpoints (pydantic, mirroring OpenAI's schema).

Only what radixkv implements is declared; unknown fields are ignored (OpenAI clients send many
optional fields, e.g. ``user``, ``metadata``), except those we would silently get wrong, which
are rejected by :func:`radixkv.server.serving.sampling_params` with a 400 naming the field.
Range checks live here so a bad value never reaches the engine; the error handler turns a
``ValidationError`` into OpenAI's error JSON with ``param`` set to the offending field.
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, field_validator


class StreamOptions(BaseModel):
    include_usage: bool = False


class _SamplingFields(BaseModel):
    """Fields shared by chat and text completions."""

    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: Optional[int] = Field(default=None, ge=1)
    temperature: Optional[float] = Field(default=None, ge=0.0, le=2.0)
    top_p: Optional[float] = Field(default=None, gt=0.0, le=1.0)
    top_k: Optional[int] = Field(default=None, ge=-1)   # vLLM extension; -1 or 0 = off
    n: int = Field(default=1, ge=1, le=128)
    stop: Optional[Union[str, list[str]]] = None
    seed: Optional[int] = Field(default=None, ge=-(2**63), lt=2**63)
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    logprobs: Optional[Union[bool, int]] = None
    # radixkv / vLLM extensions
    use_beam_search: bool = False
    best_of: Optional[int] = Field(default=None, ge=1)
    ignore_eos: bool = False
    length_penalty: float = 1.0
    cache_salt: Optional[str] = Field(default=None, min_length=1, max_length=256)
    # OpenAI: how long the prompt's prefix stays cached (radixkv: a TTL on it, see serve.md)
    prompt_cache_retention: Optional[Literal["in_memory", "24h"]] = None
    prompt_cache_key: Optional[str] = Field(default=None, min_length=1, max_length=256)
    # radixkv: eviction hints (docs/serve.md): the conversation / agent run the request belongs
    # to, and whether it is its last request
    session_id: Optional[str] = Field(default=None, min_length=1, max_length=256)
    end_session: StrictBool = False

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, v: Any) -> Any:
        items = [v] if isinstance(v, str) else (v or [])
        if len(items) > 4:
            raise ValueError("at most 4 stop sequences")
        if any(not s for s in items):
            raise ValueError("stop sequences must be non-empty strings")
        return v

    @field_validator("length_penalty")
    @classmethod
    def _finite(cls, v: float) -> float:
        if v != v or v in (float("inf"), float("-inf")):
            raise ValueError("must be a finite number")
        return v


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


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(default=None, ge=1)
    top_logprobs: Optional[int] = Field(default=None, ge=0, le=20)


class CompletionRequest(_SamplingFields):
    # A string, a list of token ids, or (OpenAI's batch form) a list of one of those.
    prompt: Union[str, list[int], list[str], list[list[int]]]
    echo: bool = False
    suffix: Optional[str] = None

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, v: Any) -> Any:
        if isinstance(v, str) and v == "":
            raise ValueError("the prompt is empty")
        if isinstance(v, list) and (not v or any(
                (isinstance(x, (str, list)) and len(x) == 0) for x in v)):
            raise ValueError("the prompt is empty")
        return v


__all__ = ["CacheControl", "ChatCompletionRequest", "CompletionRequest", "ChatMessage", "StreamOptions"]
