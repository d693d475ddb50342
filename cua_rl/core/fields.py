"""Documented config fields: ``doc(default, help)`` for ``field(default=..., metadata={"help": ...})``.

Every config dataclass documents each field where it is declared, under the metadata key
``"help"`` that AReaL's own config classes use, so what reads AReaL's configs (its loader builds
OmegaConf structured configs from the dataclass fields, help printers read ``fields(cls)``)
reads ours alike. ``doc`` is that ``dataclasses.field`` call written once: it returns the same
``Field`` (same default or factory, same metadata) and refuses an empty help text.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import MISSING, field
from typing import Any


def doc(default: Any = MISSING, help: str = "", *, factory: Callable[[], Any] | None = None) -> Any:
    """A dataclass field with ``default`` (or ``factory``, for mutable defaults; neither: a
    required field) and ``metadata={"help": help}``."""
    if not help.strip():
        raise ValueError("doc(): every config field needs a help text (what it does, its units)")
    if factory is not None:
        if default is not MISSING:
            raise ValueError("doc(): give a default or a factory, not both")
        return field(default_factory=factory, metadata={"help": help})
    return field(default=default, metadata={"help": help})
