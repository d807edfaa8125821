"""Errors a user can act on. Each message is one line naming the key, silo or file at fault."""


class SiloPflError(Exception):
    """Base class: the CLI prints these as one line, without a traceback."""


class ConfigError(SiloPflError):
    """A configuration key is missing, unknown, mistyped or out of range."""


class DataError(SiloPflError):
    """A silo's data cannot be loaded: names the silo and the file."""


class FederationError(SiloPflError):
    """The federation could not run: a silo failed, the cluster is unreachable, ..."""


def one_line(exc: BaseException) -> str:
    """The first line of an exception's message, or its type."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def typed_line(exc: BaseException) -> str:
    """An exception as "TypeName: first line" (see one_line), as failures are reported."""
    return f"{type(exc).__name__}: {one_line(exc)}"
