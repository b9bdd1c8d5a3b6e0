"""Strict construction of config dataclasses from plain dicts (JSON, YAML, vLLM extra_config).

Every component keeps one dataclass for its configuration; this module turns
a user's dict into it and names the exact offending key on any mistake.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, TypeVar

T = TypeVar("T")


class ConfigError(ValueError):
    """A configuration key is unknown, missing or has a bad value; the message names it."""


def _accepts(annotation: Any, value: Any) -> bool:
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return any(_accepts(arg, value) for arg in typing.get_args(annotation))
    if origin is typing.Literal:
        return value in typing.get_args(annotation)
    if annotation is type(None):
        return value is None
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if origin is not None:
        return isinstance(value, origin)
    return isinstance(value, annotation)


def from_dict(cls: type[T], data: dict[str, Any] | None, where: str) -> T:
    """Build dataclass ``cls`` from ``data``; ``where`` prefixes key names in errors.

    The dataclass may define ``validate(self)`` raising :class:`ConfigError`
    for cross-field rules; it is called once here.
    """
    data = dict(data or {})
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(
            f"unknown key {where}{unknown[0]!r}; valid keys: {', '.join(sorted(fields))}"
        )
    for name, field in fields.items():
        if name not in data:
            if field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
                raise ConfigError(f"missing required key {where}{name!r}")
            continue
        if not _accepts(hints[name], data[name]):
            shown = "<redacted>" if "secret" in name else repr(data[name])
            raise ConfigError(f"bad value for {where}{name!r}: {shown} is not {hints[name]}")
    obj = cls(**data)
    validate = getattr(obj, "validate", None)
    if validate is not None:
        validate()
    return obj


def refuse_secret(section: Any, where: str, shown_by: str) -> None:
    """Refuse a ``secret_key`` anywhere in a config section that ``shown_by`` (a log, a command line) shows.

    Nested too: s3agg's ``s3``, a tiered store's ``tiers``.
    """
    found = _find_secret(section, "")
    if found:
        raise ConfigError(
            f"{where}{found} would be written to {shown_by}; put the credentials in "
            "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or another AWS credential source"
        )


def _find_secret(section: Any, path: str) -> str:
    if isinstance(section, dict):
        for name, value in section.items():
            if name == "secret_key" and value is not None:
                return f"{path}.{name}"
            found = _find_secret(value, f"{path}.{name}")
            if found:
                return found
    elif isinstance(section, list):
        for i, value in enumerate(section):
            found = _find_secret(value, f"{path}[{i}]")
            if found:
                return found
    return ""
