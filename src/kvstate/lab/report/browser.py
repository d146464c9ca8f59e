"""Open a report page in headless Chromium and read back what a reader would see (no extra dependency).

Drives Chromium through its DevTools protocol over ``--remote-debugging-pipe`` (JSON messages ending in a
NUL byte on file descriptors 3 and 4), so only the Debian ``chromium`` package is needed: no driver, no
websocket client. :func:`check_page` loads a page at a given window width and returns its height, every
image's natural size, the headline table's cells, anchors that point nowhere, and every console error,
uncaught exception and failed resource load; it can also save a screenshot of the first screen.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import select
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvstate.errors import KVStateError

INSTALL_HINT = ("install Chromium: `apt-get install -y chromium` on Debian/Ubuntu (`make setup` does this when run "
                "as root), or point KVSTATE_CHROMIUM at a Chromium or Chrome binary")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--hide-scrollbars", "--mute-audio", "--remote-debugging-pipe"]

_PROBE = """(async () => {
  const imgs = Array.from(document.images);
  await Promise.all(imgs.map(i => i.complete ? null : new Promise(r => { i.onload = i.onerror = r; })));
  const cells = tr => Array.from(tr.cells).map(c => c.textContent.trim());
  const ids = Array.from(document.querySelectorAll('a[href^="#"]')).map(a => a.getAttribute('href').slice(1));
  return JSON.stringify({
    title: document.title,
    height: Math.max(document.documentElement.scrollHeight, document.body.scrollHeight),
    scroll_width: Math.max(document.documentElement.scrollWidth, document.body.scrollWidth),
    images: imgs.map(i => ({src: i.getAttribute('src'), width: i.naturalWidth, height: i.naturalHeight})),
    headline: Array.from(document.querySelectorAll('#headline-table tbody tr')).map(cells),
    missing_anchors: ids.filter(id => !document.getElementById(id)),
  });
})()"""


_TRAMPOLINE = "import os, sys; os.dup2(int(sys.argv[1]), 3); os.dup2(int(sys.argv[2]), 4); os.execv(sys.argv[3], sys.argv[3:])"


class BrowserError(KVStateError):
    """Chromium is missing, did not start, or did not answer in time."""


@dataclass(frozen=True)
class PageCheck:
    title: str
    height: int  # page height in CSS pixels at the window width
    images: list[dict[str, Any]]  # {"src", "width", "height"}: natural size, 0 when it failed to load
    headline: list[list[str]]  # cells of each row of the headline table
    missing_anchors: list[str]  # in-page links whose target id does not exist
    errors: list[str] = field(default_factory=list)  # console errors, uncaught exceptions, failed loads
    scroll_width: int = 0  # page width in CSS pixels; above the window width the reader scrolls sideways

    @property
    def broken_images(self) -> list[str]:
        return [i["src"] for i in self.images if not (i["width"] > 0 and i["height"] > 0)]


def find_chromium() -> str | None:
    """``$KVSTATE_CHROMIUM``, else the first of chromium / chromium-browser / google-chrome on PATH."""
    env = os.environ.get("KVSTATE_CHROMIUM")
    if env:
        return env if Path(env).is_file() else None
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        path = shutil.which(name)
        if path:
            return path
    return None


class _DevTools:
    """A minimal DevTools client on the two pipe ends: commands wait for their answer, events are kept."""

    def __init__(self, write_fd: int, read_fd: int, deadline: float) -> None:
        self.write_fd, self.read_fd, self.deadline = write_fd, read_fd, deadline
        self.buffer = b""
        self.next_id = 0
        self.events: list[dict[str, Any]] = []

    def _read_message(self) -> dict[str, Any]:
        while b"\0" not in self.buffer:
            left = self.deadline - time.monotonic()
            if left <= 0 or not select.select([self.read_fd], [], [], left)[0]:
                raise BrowserError("Chromium did not answer in time; is the page very large, or the machine busy?")
            chunk = os.read(self.read_fd, 1 << 16)
            if not chunk:
                raise BrowserError("Chromium closed the DevTools pipe (it crashed or failed to start).")
            self.buffer += chunk
        raw, self.buffer = self.buffer.split(b"\0", 1)
        message: dict[str, Any] = json.loads(raw)
        return message

    def call(self, method: str, params: dict[str, Any] | None = None, session: str | None = None) -> dict[str, Any]:
        self.next_id += 1
        message: dict[str, Any] = {"id": self.next_id, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = session
        os.write(self.write_fd, json.dumps(message).encode() + b"\0")
        while True:
            reply = self._read_message()
            if reply.get("id") == self.next_id:
                if "error" in reply:
                    raise BrowserError(f"Chromium refused {method}: {reply['error'].get('message')}")
                result: dict[str, Any] = reply.get("result", {})
                return result
            self.events.append(reply)

    def wait_event(self, method: str) -> dict[str, Any]:
        for event in self.events:
            if event.get("method") == method:
                return event
        while True:
            event = self._read_message()
            self.events.append(event)
            if event.get("method") == method:
                return event


def _errors(events: list[dict[str, Any]]) -> list[str]:
    out = []
    for e in events:
        event, p = e.get("method"), e.get("params", {})
        if event == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert", "warning"):
            out.append(f"console.{p['type']}: " + " ".join(str(a.get("value", a.get("description", ""))) for a in p["args"]))
        elif event == "Runtime.exceptionThrown":
            d = p.get("exceptionDetails", {})
            out.append(f"exception: {d.get('exception', {}).get('description') or d.get('text')}")
        elif event == "Log.entryAdded" and p.get("entry", {}).get("level") == "error":
            entry = p["entry"]
            out.append(f"{entry.get('source')}: {entry.get('text')} {entry.get('url', '')}".strip())
    return out


def check_page(page: Path, width: int = 1400, height: int = 900, screenshot: Path | None = None,
               timeout_s: float = 90.0) -> PageCheck:
    """Load ``page`` (a local HTML file) in headless Chromium at ``width`` × ``height`` and report what it shows."""
    exe = find_chromium()
    if exe is None:
        raise BrowserError(f"no Chromium found to check {page}; {INSTALL_HINT}.")
    if not page.is_file():
        raise BrowserError(f"{str(page)!r} is not a file; build the report first (kvstate report --out DIR).")
    to_child, from_parent = os.pipe()  # we write, Chromium reads on fd 3
    to_parent, from_child = os.pipe()  # Chromium writes on fd 4, we read
    with tempfile.TemporaryDirectory(prefix="kvstate-chromium-") as tmp, open(Path(tmp) / "stderr.log", "wb+") as log:
        # a Python trampoline puts the pipe ends on fds 3 and 4, where --remote-debugging-pipe expects them
        # (a POSIX shell's redirections take single-digit fds only)
        cmd = [sys.executable, "-c", _TRAMPOLINE, str(to_child), str(from_child), exe, *FLAGS,
               f"--user-data-dir={Path(tmp) / 'profile'}", f"--window-size={width},{height}", "about:blank"]
        proc = subprocess.Popen(cmd, pass_fds=(to_child, from_child), stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=log)
        os.close(to_child)
        os.close(from_child)
        try:
            tools = _DevTools(from_parent, to_parent, time.monotonic() + timeout_s)
            target = tools.call("Target.createTarget", {"url": "about:blank"})["targetId"]
            session = tools.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
            for domain in ("Runtime.enable", "Log.enable", "Page.enable"):
                tools.call(domain, session=session)
            tools.call("Emulation.setDeviceMetricsOverride", {"width": width, "height": height,
                                                             "deviceScaleFactor": 1, "mobile": False}, session)
            tools.call("Page.navigate", {"url": page.resolve().as_uri()}, session)
            tools.wait_event("Page.loadEventFired")
            probe = tools.call("Runtime.evaluate", {"expression": _PROBE, "awaitPromise": True,
                                                    "returnByValue": True}, session)
            if "exceptionDetails" in probe:
                raise BrowserError(f"the page probe failed: {probe['exceptionDetails'].get('text')}")
            data = json.loads(probe["result"]["value"])
            if screenshot is not None:
                shot = tools.call("Page.captureScreenshot", {"format": "png"}, session)
                screenshot.write_bytes(base64.b64decode(shot["data"]))
            errors = _errors(tools.events)
            with contextlib.suppress(BrowserError):  # it may close the pipe before answering
                tools.call("Browser.close")
        except BrowserError as exc:
            log.seek(0)
            stderr = log.read().decode(errors="replace")[-2000:]
            raise BrowserError(f"{exc} Chromium's stderr: {stderr}".strip()) from exc
        finally:
            os.close(from_parent)
            os.close(to_parent)
            if proc.poll() is None:
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
    return PageCheck(data["title"], int(data["height"]), data["images"], data["headline"], data["missing_anchors"],
                     errors, int(data.get("scroll_width", 0)))
