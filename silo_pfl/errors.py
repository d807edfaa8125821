"""Errors a user can act on. Each message is one line naming the key, silo or file at fault."""

import re
import signal

# Query parameters whose values are secrets (e.g. ?token=..., ?sslpassword=..., &sig=...).
_SECRET_WORDS = "token|password|passwd|secret|key|sig|signature|auth|credential"
SECRET_QUERY = re.compile(f"({_SECRET_WORDS})", re.I)
# A URL's password, scheme://user:PASSWORD@host: from the first ':' after `scheme://` (with no
# '/' before it) up to the URL's LAST '@', wherever that is. Parsers disagree on where a
# password ends: urllib (and requests) end the authority at the first '/', '?' or '#' and take
# the password up to its last '@'; SQLAlchemy takes any '/', '?' or '#' into the password and
# ends it at the first '@' after the ':' (postgresql://admin:Tr0ub4dor/3xyz@db/mlflow has the
# password 'Tr0ub4dor/3xyz'), and the password meant may hold an '@' too. Masking up to the last
# '@' covers what each of them reads as a password, and what the user meant by one. The price: a
# URL with no password but an '@' after a host:port (http://h:5000/x?mail=a@b) is masked from
# the port on (http://h:***@b), which hides more than it has to, never less.
# In free text a URL ends at whitespace; URL_PASSWORD, for one URI, reads to the URI's end.
_URL_PASSWORD = re.compile(r"(\b[a-z][a-z0-9+.-]*://[^\s:/]*:)\S*@", re.I)
URL_PASSWORD = re.compile(r"(\b[a-z][a-z0-9+.-]*://[^:/]*:).*@", re.I | re.S)
PASSWORD_MASK = r"\1***@"
# ... and the values of its secret query parameters.
_URL_SECRET = re.compile(rf"([?&][^=&\s#]*(?:{_SECRET_WORDS})[^=&\s#]*=)[^&\s#]*", re.I)


class SiloPflError(Exception):
    """Base class: the CLI prints these as one line, without a traceback."""


class ConfigError(SiloPflError):
    """A configuration key is missing, unknown, mistyped or out of range."""


class DataError(SiloPflError):
    """A silo's data cannot be loaded: names the silo and the file."""


class FederationError(SiloPflError):
    """The federation could not run: a silo failed, the cluster is unreachable, ..."""


class SiloLost(FederationError):
    """A silo's worker restarted since the silo last answered (Ray brings a dead worker back
    empty), so it holds the silo no more: the driver counts the silo as died, and rejoins it."""


class Interrupted(KeyboardInterrupt):
    """Ctrl-C or SIGTERM stopped a run. Once the run has checkpointed a round, it names the run
    and that round, which `--resume` continues from."""

    def __init__(
        self, signum: int = signal.SIGINT, run_id: str | None = None, round_: int | None = None
    ) -> None:
        super().__init__(signum, run_id, round_)
        self.signum = signum
        self.run_id = run_id
        self.round = round_

    @property
    def exit_code(self) -> int:
        """What a process the signal ended exits with: 130 for SIGINT, 143 for SIGTERM."""
        return 128 + self.signum

    def __str__(self) -> str:
        said = "interrupted" if self.signum == signal.SIGINT else "stopped by SIGTERM"
        if self.run_id is None:
            return said
        where = "its last checkpoint" if self.round is None else f"its round {self.round}"
        return f"{said}; run {self.run_id} resumes from {where} with --resume {self.run_id}"


def interruption(exc: KeyboardInterrupt, signum: int | None = None) -> Interrupted:
    """What stopped the run: the first Interrupted that names a run, where a second Ctrl-C
    during the clean-up raised another KeyboardInterrupt over it; else `exc` as Interrupted, by
    `signum` (`stop_signals.cause`: Ray turns an interrupted wait into a plain
    KeyboardInterrupt, which would read as Ctrl-C's)."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, Interrupted) and seen.run_id is not None:
            return seen
        seen = seen.__context__
    if isinstance(exc, Interrupted):
        return exc
    return Interrupted() if signum is None else Interrupted(signum)


def scrub(text: str) -> str:
    """`text` with every URL's password and secret query values as ***: what an error says of a
    store (MLflow's "API request to http://user:password@host/... failed") is printed, logged and
    sent to the driver, and none of those may hold a credential."""
    return _URL_SECRET.sub(r"\1***", _URL_PASSWORD.sub(PASSWORD_MASK, text))


def one_line(exc: BaseException) -> str:
    """The first line of an exception's message, or its type; credentials scrubbed."""
    text = str(exc).strip()
    return scrub(text.splitlines()[0]) if text else type(exc).__name__


def typed_line(exc: BaseException) -> str:
    """An exception as "TypeName: first line" (see one_line), as failures are reported."""
    return f"{type(exc).__name__}: {one_line(exc)}"
