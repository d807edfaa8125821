"""OmegaConf's errors as one line that names the key and says what is allowed."""

from __future__ import annotations

import dataclasses
import re
import typing
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from silo_pfl.errors import ConfigError, one_line


class KeyedError(ConfigError):
    """A config error of one key (relative to the schema merged; '' for the whole): its key and
    its reason, apart, for a caller that names the key its own way."""

    def __init__(self, key: str, reason: str) -> None:
        super().__init__(f"{key}: {reason}" if key else reason)
        self.key, self.reason = key, reason

    def __reduce__(self) -> tuple[type[KeyedError], tuple[str, str]]:
        """Pickled whole, as Ray sends an actor's error to the driver."""
        return KeyedError, (self.key, self.reason)


def as_literal(value: Any) -> Any:
    r"""Plain Python values (a mapping, a list, a string) as OmegaConf takes them as written: every
    `${` escaped, and numpy's scalars (np.int64(5)) as the numbers they hold. A value already
    merged once holds `${` only as a literal: an escaped `\${NAME}` of the job (a node's variable
    in a data path, say), which a second merge, an actor's or a section's, must not read as an
    interpolation."""
    if isinstance(value, dict):
        return {key: as_literal(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [as_literal(item) for item in value]
    if type(value).__module__ == "numpy" and getattr(value, "ndim", None) == 0:
        return value.item()  # without importing numpy here: a scalar of it has come already
    return value.replace("${", "\\${") if isinstance(value, str) else value


def merge_structured(schema: Any, *parts: Any) -> DictConfig:
    """`parts` merged over the dataclass `schema`; any error is one KeyedError naming its key.
    A part that is a DictConfig (a job's YAML, its overrides) may hold interpolations; a plain
    mapping is taken literally (`as_literal`)."""
    base = OmegaConf.structured(schema)
    parts = tuple(part if OmegaConf.is_config(part) else as_literal(part) for part in parts)
    try:
        return OmegaConf.merge(base, *parts)
    except (OmegaConfBaseException, TypeError) as exc:
        if isinstance(exc, OmegaConfBaseException) and getattr(exc, "full_key", None):
            raise omegaconf_error(exc, schema) from None
        clash = first_clash(base, parts)  # OmegaConf's error names no key
        if clash is not None:
            raise clash from None
        if isinstance(exc, TypeError):
            raise
        raise omegaconf_error(exc, schema) from None


def _known_keys(schema: Any, key: str) -> str:
    """The keys allowed beside `key` in the dataclass `schema`, as '; allowed: a, b' (or '')."""
    kind: Any = schema if isinstance(schema, type) else type(schema)
    parts = key.split(".")[:-1]
    while parts and dataclasses.is_dataclass(kind):
        hint = typing.get_type_hints(kind).get(parts.pop(0))
        if typing.get_origin(hint) is dict and parts:
            parts.pop(0)
            hint = typing.get_args(hint)[1]
        kind = hint
    if parts or not dataclasses.is_dataclass(kind):
        return ""
    return "; allowed: " + ", ".join(f.name for f in dataclasses.fields(kind))


def omegaconf_error(exc: OmegaConfBaseException, schema: Any = None) -> KeyedError:
    """Turn OmegaConf's multi-line error into one line that names the key."""
    key = getattr(exc, "full_key", None) or ""
    reason = one_line(exc)
    value = getattr(exc, "value", None)
    to_section = "is not a subclass" in reason or (
        reason.startswith("Cannot assign") and "to Dict" in reason
    )
    converted = re.search(r"Value '(.*)' of type '\w+' could not be converted to (\w+)", reason)
    if converted:
        reason = (
            f"got {converted.group(1)!r}, expected a value of type {converted.group(2).lower()}"
        )
    elif reason.startswith("Cannot convert 'DictConfig' to "):
        reason = "got a mapping, expected a single value (quote it if it holds a colon)"
    elif reason.startswith("Cannot convert 'ListConfig' to "):
        reason = "got a list, expected a single value (quote it if it holds brackets)"
    elif "is not a ListConfig" in reason:
        reason = f"got {value!r}, expected a list, e.g. [{value}]"
    elif "is not a valid bool" in reason:
        reason = f"got {value!r}, expected true or false"
    elif to_section:
        reason = f"got {value!r}, expected a mapping, e.g. {{name: value}}"
    elif "is not Optional" in reason or reason.startswith("Incompatible value 'None'"):
        reason = "got null, expected a value"
    elif "Key '" in reason and "not in" in reason:
        reason = "unknown key" + (_known_keys(schema, key) if schema is not None else "")
    elif "issing mandatory value" in reason:
        reason = "required value is missing"
    return KeyedError(key, reason)


def _nested(path: list[str], value: Any) -> dict[str, Any]:
    """`value` under the keys of `path`: {"a": {"b": value}} for a.b."""
    for name in reversed(path):
        value = {name: value}
    return value


def _merges(base: DictConfig, probe: Any) -> bool:
    """Whether `probe` merges into `base` without an error."""
    try:
        OmegaConf.merge(base, probe)
    except (OmegaConfBaseException, TypeError):
        return False
    return True


def _kind(value: Any) -> str:
    """A container's kind as an error says it ('' for a plain value)."""
    return "a mapping" if isinstance(value, dict) else "a list" if isinstance(value, list) else ""


def first_clash(base: DictConfig, parts: tuple[Any, ...]) -> KeyedError | None:
    """The first key, from the top, where a part puts a mapping, a list or a value in place of
    another of these (OmegaConf's merge then names no key): found by merging each key alone,
    an empty container for a container, into what the parts before it made."""

    def takes(path: list[str]) -> str:
        kinds = (("a mapping", {}), ("a list", []))
        return next((kind for kind, empty in kinds if _merges(base, _nested(path, empty))), "")

    def walk(node: dict[Any, Any], path: list[str]) -> KeyedError | None:
        for key, value in node.items():
            here = [*path, str(key)]
            empty = {} if isinstance(value, dict) else [] if isinstance(value, list) else value
            if not _merges(base, _nested(here, empty)):
                expected = takes(here)
                if expected and expected != _kind(value):
                    got = _kind(value) or f"{value!r}"
                    return KeyedError(".".join(here), f"got {got}, expected {expected}")
                continue
            if isinstance(value, dict) and (found := walk(value, here)) is not None:
                return found
        return None

    for part in parts:
        if isinstance(part, DictConfig):
            part = OmegaConf.to_container(part, resolve=False)
        if isinstance(part, dict) and (clash := walk(part, [])) is not None:
            return clash
        if not _merges(base, part):
            return None
        base = OmegaConf.merge(base, part)
    return None
