"""vLLM's frontend options: how the HTTP server presents itself to clients, apart from the engine.

``vllm serve`` has a group of flags that change only the OpenAI-compatible layer: response
headers, defaults a request does not set, what a response names, which helper endpoints exist.
Deployment scripts written for vLLM pass them, so ``radixkv serve`` takes the same flags with
the same meaning (docs/serve.md, "vLLM compatibility"):

========================================  ==================================================
``--enable-request-id-headers``           every response carries ``X-Request-Id``: the
                                          request's own, else a new one (tracing across a
                                          proxy and the server's logs)
``--default-chat-template-kwargs JSON``   chat-template variables for requests that do not
                                          set them (e.g. Qwen3's ``{"enable_thinking":
                                          false}`` server-wide); a request's own win
``--response-role ROLE``                  the role a chat reply is given in a new turn
                                          (default ``assistant``)
``--return-tokens-as-token-ids``          logprobs name tokens ``token_id:N`` unless a request
                                          says otherwise (RL pipelines)
``--enable-force-include-usage``          streamed responses end with a usage chunk even
                                          without ``stream_options.include_usage``
``--enable-server-load-tracking``         ``GET /load`` counts the generation requests in
                                          flight (without it, it answers 0, as vLLM's)
``--disable-fastapi-docs``                no ``/docs``, ``/redoc``, ``/openapi.json``
``--trust-request-chat-template``         a chat or ``/tokenize`` request's ``chat_template``
                                          is rendered instead of the model's (without it, a
                                          400: a template can take any CPU and memory to
                                          render, so only for clients the operator trusts)
========================================  ==================================================

One frozen value carries them from the command line (``serve`` and the fleet's ingress alike)
into :func:`radixkv.server.app.create_app`, so a new one is a field here, not a new argument
threaded through every layer. Bad values are :class:`~radixkv.errors.ConfigError` at start-up.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

from radixkv.errors import ConfigError

#: Paths whose requests ``GET /load`` counts (vLLM's load-aware routes that radixkv serves).
LOAD_TRACKED = ("/v1/chat/completions", "/v1/completions", "/v1/responses")


@dataclasses.dataclass(frozen=True)
class FrontendOptions:
    """The OpenAI layer's vLLM options (module docstring); the defaults are vLLM's."""

    request_id_headers: bool = False
    default_chat_template_kwargs: Mapping[str, Any] | None = None
    response_role: str = "assistant"
    return_tokens_as_token_ids: bool = False
    force_include_usage: bool = False
    load_tracking: bool = False
    docs: bool = True
    trust_request_chat_template: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.response_role, str) or not self.response_role.strip():
            raise ConfigError(f"--response-role must be a non-empty name, got "
                              f"{self.response_role!r}")
        kwargs = self.default_chat_template_kwargs
        if kwargs is not None:
            from radixkv.server.protocol import RESERVED_TEMPLATE_KWARGS

            if not isinstance(kwargs, Mapping):
                raise ConfigError("--default-chat-template-kwargs must be a JSON object, got "
                                  f"{type(kwargs).__name__}")
            for k in kwargs:
                if not isinstance(k, str) or not k.isidentifier():
                    raise ConfigError(f"--default-chat-template-kwargs: {k!r} is not a "
                                      "template variable name")
                if k in RESERVED_TEMPLATE_KWARGS:
                    raise ConfigError(f"--default-chat-template-kwargs: {k!r} is set by the "
                                      "server (or is the template's own)")
            object.__setattr__(self, "default_chat_template_kwargs", dict(kwargs))

    @classmethod
    def from_args(cls, args: Any) -> FrontendOptions:
        """From ``radixkv serve``'s parsed arguments."""
        return cls(request_id_headers=args.enable_request_id_headers,
                   default_chat_template_kwargs=parse_template_kwargs(
                       args.default_chat_template_kwargs),
                   response_role=args.response_role,
                   return_tokens_as_token_ids=args.return_tokens_as_token_ids,
                   force_include_usage=args.enable_force_include_usage,
                   load_tracking=args.enable_server_load_tracking,
                   docs=not args.disable_fastapi_docs,
                   trust_request_chat_template=args.trust_request_chat_template)

    def as_dict(self) -> dict[str, Any]:
        """Plain values (the fleet passes them to its ingress replicas)."""
        return dataclasses.asdict(self)

    def template_kwargs(self, requested: Mapping[str, Any] | None) -> dict[str, Any] | None:
        """A request's ``chat_template_kwargs`` over the server's defaults (vLLM's merge: the
        request's own values win); None when neither has any."""
        if not self.default_chat_template_kwargs:
            return None if requested is None else dict(requested)
        return {**self.default_chat_template_kwargs, **(requested or {})}


def parse_template_kwargs(text: str | None) -> dict[str, Any] | None:
    """``--default-chat-template-kwargs``' JSON; a ConfigError names what is wrong."""
    if text is None:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--default-chat-template-kwargs is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ConfigError("--default-chat-template-kwargs must be a JSON object, got "
                          f"{type(value).__name__}")
    return value
