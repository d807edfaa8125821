"""Who scrapes this machine's metrics endpoint: its TCP connections, read from /proc/net/tcp.

Ray's metrics agent answers each scrape over HTTP/1.0 and closes the connection, which then
stays in the kernel's table (TIME_WAIT) for a minute. So the connections to the endpoint's port
tell whether anything scraped it lately, and a connection that was not there before is a new
scrape. Linux only; elsewhere `connections` returns None (unknown).
"""

from __future__ import annotations

from pathlib import Path

TABLES = (Path("/proc/net/tcp"), Path("/proc/net/tcp6"))
ESTABLISHED = "01"  # the state column of a connection that is still open


def connections(port: int) -> dict[str, bool] | None:
    """Every TCP connection with `port` at one end: its other end (address:port, as the kernel
    writes it) -> whether it is still open. None where the tables cannot be read."""
    seen: dict[str, bool] = {}
    readable = False
    for table in TABLES:
        try:
            lines = table.read_text().splitlines()[1:]
        except OSError:
            continue
        readable = True
        for line in lines:
            fields = line.split()
            if len(fields) < 4:
                continue
            local, remote, state = fields[1], fields[2], fields[3]
            if _port(remote) == 0:
                continue  # a listening socket
            if _port(local) == port:
                seen[remote] = state == ESTABLISHED
            elif _port(remote) == port:
                seen[local] = state == ESTABLISHED
    return seen if readable else None


def _port(endpoint: str) -> int:
    """The port of an `ADDRESS:PORT` endpoint of /proc/net/tcp (both in hex)."""
    return int(endpoint.rpartition(":")[2], 16)


def finished_since(before: dict[str, bool], now: dict[str, bool]) -> bool:
    """Whether a scrape that `before` did not list has ended (its connection closed) by `now`."""
    return any(not open_ for peer, open_ in now.items() if peer not in before)
