"""Headless Chromium for tests, driven over the DevTools protocol on a pipe
(--remote-debugging-pipe: JSON messages, NUL-terminated, on file descriptors 3 and 4), so no
websocket library is needed. Collects console errors, uncaught exceptions and failed loads."""

from __future__ import annotations

import base64
import fcntl
import json
import os
import select
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from processes import stop_group

CHROMIUM = Path("/usr/bin/chromium")
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--remote-debugging-pipe",
)
WIDTH, HEIGHT = 1280, 2000
BODY_TEXT = "document.body ? document.body.innerText : ''"
IMAGES_LOADED = "Array.from(document.images).every(i => i.complete && i.naturalWidth > 0)"


class Page:
    """One tab: navigate, read its text, screenshot it; `errors` lists what went wrong."""

    def __init__(self, process: subprocess.Popen, write: int, read: int) -> None:
        self.process, self.write, self.read = process, write, read
        self.buffer = b""
        self.next_id = 0
        self.events: list[dict[str, Any]] = []
        self.errors: list[str] = []
        target = self.call("Target.createTarget", {"url": "about:blank"})["targetId"]
        attached = self.call("Target.attachToTarget", {"targetId": target, "flatten": True})
        self.session = attached["sessionId"]
        for domain in ("Page", "Runtime", "Log", "Network"):
            self.call(f"{domain}.enable", session=True)
        self.resize(WIDTH, HEIGHT)

    def resize(self, width: int, height: int) -> None:
        """The window's size in CSS pixels."""
        metrics = {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False}
        self.call("Emulation.setDeviceMetricsOverride", metrics, session=True)

    def escape(self) -> None:
        """Press Escape, e.g. to close a dialog that covers the page."""
        key = {"key": "Escape", "code": "Escape", "windowsVirtualKeyCode": 27}
        for kind in ("keyDown", "keyUp"):
            self.call("Input.dispatchKeyEvent", {"type": kind, **key}, session=True)

    def _message(self, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while b"\0" not in self.buffer:
            left = deadline - time.monotonic()
            if left <= 0 or self.process.poll() is not None:
                raise TimeoutError("chromium sent nothing in time")
            if not select.select([self.read], [], [], min(left, 1.0))[0]:
                continue
            chunk = os.read(self.read, 1 << 20)
            if not chunk:
                raise EOFError("chromium closed its DevTools pipe")
            self.buffer += chunk
        raw, self.buffer = self.buffer.split(b"\0", 1)
        return json.loads(raw)

    def _note(self, event: dict[str, Any]) -> None:
        """Keep an event; record it in `errors` if it is one."""
        self.events.append(event)
        method, params = event.get("method"), event.get("params", {})
        if method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
            args = [str(a.get("value", a.get("description", ""))) for a in params.get("args", [])]
            self.errors.append("console: " + " ".join(args))
        elif method == "Runtime.exceptionThrown":
            self.errors.append("exception: " + params["exceptionDetails"].get("text", ""))
        elif method == "Log.entryAdded" and params["entry"].get("level") == "error":
            entry = params["entry"]
            self.errors.append(f"log: {entry.get('text')} {entry.get('url', '')}")
        elif method == "Network.loadingFailed" and not params.get("canceled"):
            self.errors.append(f"load failed: {params.get('errorText')}")

    def call(
        self,
        method: str,
        params: dict[str, Any] | None = None,
        session: bool | str = False,
        timeout: float = 60,
    ) -> dict[str, Any]:
        """Send a command and wait for its answer, keeping the events that arrive meanwhile.
        `session`: True for this tab, a session id for another target (e.g. an iframe's)."""
        self.next_id += 1
        message: dict[str, Any] = {"id": self.next_id, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = self.session if session is True else session
        os.write(self.write, json.dumps(message).encode() + b"\0")
        while True:
            answer = self._message(timeout)
            if answer.get("id") == self.next_id:
                if "error" in answer:
                    raise RuntimeError(f"{method}: {answer['error']}")
                return answer.get("result", {})
            if "method" in answer:
                self._note(answer)

    def wait_for(self, method: str, timeout: float = 60) -> None:
        """Wait for an event (e.g. Page.loadEventFired)."""
        deadline = time.monotonic() + timeout
        seen = len(self.events)
        while True:
            if any(e.get("method") == method for e in self.events[seen:]):
                return
            self._note(self._message(max(0.1, deadline - time.monotonic())))
            if time.monotonic() > deadline and self.events[-1].get("method") != method:
                raise TimeoutError(f"no {method} in {timeout} s")

    def open(self, url: str, timeout: float = 60) -> None:
        """Navigate; wait for the load, unless only the #fragment changed (same document)."""
        answer = self.call("Page.navigate", {"url": url}, session=True)
        if "errorText" in answer:
            raise RuntimeError(f"{url}: {answer['errorText']}")
        if answer.get("loaderId"):
            self.wait_for("Page.loadEventFired", timeout)

    def evaluate(self, expression: str) -> Any:
        params = {"expression": expression, "returnByValue": True}
        answer = self.call("Runtime.evaluate", params, session=True)
        return answer["result"].get("value")

    def text(self) -> str:
        return str(self.evaluate(BODY_TEXT))

    def in_frames(self, expression: str) -> list[Any]:
        """`expression`'s value in each out-of-process iframe (e.g. a sandboxed preview)."""
        values = []
        for target in self.call("Target.getTargets")["targetInfos"]:
            if target["type"] != "iframe":
                continue
            attach = {"targetId": target["targetId"], "flatten": True}
            session = self.call("Target.attachToTarget", attach)["sessionId"]
            params = {"expression": expression, "returnByValue": True}
            answer = self.call("Runtime.evaluate", params, session=session)
            values.append(answer["result"].get("value"))
        return values

    def wait_for_text(self, needles: list[str], timeout: float = 90) -> str:
        """Poll the page's text until it holds every needle (a JS app renders late)."""
        deadline = time.monotonic() + timeout
        while True:
            text = self.text()
            if all(n in text for n in needles) or time.monotonic() > deadline:
                return text
            time.sleep(0.5)

    def screenshot(self, path: Path, full_page: bool = True) -> Path:
        params = {"format": "png", "captureBeyondViewport": full_page}
        data = self.call("Page.captureScreenshot", params, session=True)["data"]
        path.write_bytes(base64.b64decode(data))
        return path


@contextmanager
def chromium() -> Iterator[Page]:
    """A headless Chromium in its own process group and profile; stopped by its group id."""
    profile = tempfile.mkdtemp(prefix="chromium-profile-")
    to_chromium_r, to_chromium_w = os.pipe()
    from_chromium_r, from_chromium_w = os.pipe()
    command = [str(CHROMIUM), *FLAGS, f"--user-data-dir={profile}", "about:blank"]

    def fds() -> None:
        high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 10) for fd in (to_chromium_r, from_chromium_w)]
        os.dup2(high[0], 3)
        os.dup2(high[1], 4)

    process = subprocess.Popen(
        command,
        preexec_fn=fds,
        pass_fds=(3, 4),
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    os.close(to_chromium_r)
    os.close(from_chromium_w)
    try:
        yield Page(process, to_chromium_w, from_chromium_r)
    finally:
        os.close(to_chromium_w)
        os.close(from_chromium_r)
        stop_group(process)
        shutil.rmtree(profile, ignore_errors=True)
