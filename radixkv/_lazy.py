"""Lazy package exports: a package's ``__getattr__`` that imports a name's module on first use.

Why: ``import radixkv`` (and ``radixkv.api``, ``.engine``, ``.fleet``, ``.server``) must stay
cheap and must not pull in torch, FastAPI or Ray until a name that needs them is used; each
package lists ``name -> defining module`` in its ``_LAZY`` table and hands it to
:func:`lazy_getattr` (PEP 562 module ``__getattr__``).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping


def lazy_getattr(package: str, table: Mapping[str, str]) -> Callable[[str], object]:
    """The module ``__getattr__`` of ``package``: a name in ``table`` is looked up in its
    module (imported on first use); any other name is an ``AttributeError``."""

    def __getattr__(name: str) -> object:
        module = table.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(module), name)

    return __getattr__
