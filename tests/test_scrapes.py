"""A local run's linger for Prometheus' last scrape (runtime/scrapes.py, DriverMetrics.linger):
scrapes are seen in the kernel's connection table, a run waits for the first scrape after its
last figures, and nothing waits when nothing scrapes. Real sockets, the real metrics agent of a
local Ray."""

from __future__ import annotations

import http.server
import socket
import threading
import time
import urllib.request

import pytest

from silo_pfl.runtime import scrapes
from silo_pfl.runtime.metrics import (
    LOOK_EVERY_S,
    DriverMetrics,
    export_interval_s,
    local_metrics_port,
)

TAGS = {"federation": "f", "run_id": "scrapes", "algorithm": "fedavg"}


class _Once(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = b"up 1\n"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def test_a_scrape_is_listed_open_while_it_runs_then_closed():
    server = http.server.HTTPServer(("127.0.0.1", 0), _Once)  # HTTP/1.0: closes, as Ray's
    port = server.server_address[1]
    before = scrapes.connections(port)
    assert before is not None and not before  # listening only: no connection yet
    client = socket.create_connection(("127.0.0.1", port))
    opened = scrapes.connections(port)
    peer = f"0100007F:{client.getsockname()[1]:04X}"  # 127.0.0.1 as the kernel writes it
    assert opened == {peer: True}
    assert not scrapes.finished_since(before, opened)
    client.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
    server.handle_request()
    assert client.recv(4096).startswith(b"HTTP/1.0 200")
    client.close()
    server.server_close()
    closed = scrapes.connections(port)
    assert closed is not None and closed.get(peer) is False
    assert scrapes.finished_since(before, closed)
    assert not scrapes.finished_since(closed, closed)  # nothing new since


def _scrape(port: int) -> None:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
        assert answer.status == 200 and b"# TYPE" in answer.read()  # all of it, as Prometheus


@pytest.mark.usefixtures("ray_local")
def test_a_local_run_lingers_until_the_next_scrape_and_not_when_nothing_scrapes():
    port, exported = local_metrics_port(), export_interval_s() + 1.0
    _scrape(port)  # a closed connection the kernel still lists when the runs below start
    # Nothing scrapes during the run, watched for longer than two linger times: no wait at all.
    idle = DriverMetrics(TAGS, linger_s=5.0)
    idle.watch()  # as a run does once Ray is up, before its first round
    assert idle.port == port and idle.watched_since > 0
    assert idle.stale and not idle.scraped
    idle.looked -= LOOK_EVERY_S
    idle.round(1, 0.1, 1)
    assert not idle.scraped  # the leftover seen at the first look is not a scrape
    idle.watched_since -= 10.0
    idle.last -= exported  # its last figures have reached the agent
    began = time.monotonic()
    idle.linger()
    assert time.monotonic() - began < 2.5
    # A scraper: the run waits for the first scrape after its figures, not the whole linger.
    watched = DriverMetrics(TAGS, linger_s=5.0)
    watched.round(1, 0.1, 1)
    assert not watched.scraped
    _scrape(port)
    watched.round(2, 0.1, 1)
    assert not watched.scraped  # the rounds look only every LOOK_EVERY_S
    watched.looked -= LOOK_EVERY_S
    watched.round(3, 0.1, 1)
    assert watched.scraped
    watched.last -= exported
    later = threading.Timer(1.5, _scrape, args=(port,))
    began = time.monotonic()
    later.start()
    watched.linger()
    took = time.monotonic() - began
    later.join()
    assert 1.4 < took < 4.5
