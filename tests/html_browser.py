"""A real headless Chromium driven over the DevTools protocol on a pipe (no extra package).

`chromium --remote-debugging-pipe` reads JSON commands on fd 3 and writes replies and
events on fd 4, each message ending in a NUL byte. Enough of the protocol to load a
page, read what its images decoded to, collect console errors, exceptions and every
network request, and take a full-page screenshot at a given width.
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

IMAGES_JS = """JSON.stringify({
  images: [...document.images].map(i => ({figure: i.dataset.figure || '', src: i.src.slice(0, 40),
                                          w: i.naturalWidth, h: i.naturalHeight, complete: i.complete,
                                          shown: i.getBoundingClientRect().width})),
  scrollWidth: document.documentElement.scrollWidth, innerWidth: window.innerWidth,
  height: document.documentElement.scrollHeight, text: document.body.innerText})"""


def chromium_binary() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


@dataclass
class PageResult:
    images: list[dict]
    scroll_width: int
    inner_width: int
    text: str
    console_errors: list[str] = field(default_factory=list)
    requests: list[str] = field(default_factory=list)


def _high(fd: int) -> int:
    """The same pipe end at a number >= 10, so the shell's 3<& and 4>& never clobber it."""
    high = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10)
    os.close(fd)
    return high


class Browser:
    def __init__(self) -> None:
        binary = chromium_binary()
        if binary is None:
            raise RuntimeError("chromium not found")
        self.profile = tempfile.mkdtemp(prefix="autotune-cdp-")
        to_child_r, self._w = (_high(fd) for fd in os.pipe())
        self._r, from_child_w = (_high(fd) for fd in os.pipe())
        args = [binary, "--headless", "--no-sandbox", "--disable-gpu", "--remote-debugging-pipe",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--no-first-run", "--hide-scrollbars", f"--user-data-dir={self.profile}", "about:blank"]
        # the protocol wants fds 3 (commands in) and 4 (replies out): the shell puts them there
        wrap = f'exec "$0" "$@" 3<&{to_child_r} 4>&{from_child_w} {to_child_r}<&- {from_child_w}>&-'
        self.proc = subprocess.Popen([shutil.which("bash") or "/bin/bash", "-c", wrap, *args], pass_fds=(to_child_r, from_child_w),
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=open(os.environ.get("AUTOTUNE_CDP_LOG", os.devnull), "wb"))
        os.close(to_child_r)
        os.close(from_child_w)
        self._buf = b""
        self._id = 0
        self.events: list[dict] = []

    def _send(self, method: str, params: dict | None = None, session: str | None = None) -> int:
        self._id += 1
        msg = {"id": self._id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        os.write(self._w, json.dumps(msg).encode() + b"\0")
        return self._id

    def _read(self, deadline: float) -> dict:
        while b"\0" not in self._buf:
            if time.monotonic() > deadline:
                raise TimeoutError("chromium did not answer")
            chunk = os.read(self._r, 1 << 20)
            if not chunk:
                raise RuntimeError("chromium closed the pipe")
            self._buf += chunk
        raw, self._buf = self._buf.split(b"\0", 1)
        return json.loads(raw)

    def call(self, method: str, params: dict | None = None, session: str | None = None,
             timeout: float = 60) -> dict:
        want = self._send(method, params, session)
        deadline = time.monotonic() + timeout
        while True:
            msg = self._read(deadline)
            if msg.get("id") == want:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})
            self.events.append(msg)

    def wait_event(self, method: str, timeout: float = 60) -> dict:
        for i, ev in enumerate(self.events):
            if ev.get("method") == method:
                return self.events.pop(i)
        deadline = time.monotonic() + timeout
        while True:
            msg = self._read(deadline)
            if msg.get("method") == method:
                return msg
            self.events.append(msg)

    def load(self, page: Path, width: int, height: int, screenshot: Path | None = None,
             mobile: bool = False) -> PageResult:
        target = self.call("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        for domain in ("Page", "Runtime", "Log", "Network"):
            self.call(f"{domain}.enable", session=session)
        self.call("Emulation.setDeviceMetricsOverride", {"width": width, "height": height,
                                                         "deviceScaleFactor": 1, "mobile": mobile},
                  session=session)
        self.events.clear()
        self.call("Page.navigate", {"url": page.resolve().as_uri()}, session=session)
        self.wait_event("Page.loadEventFired")
        info = json.loads(self.call("Runtime.evaluate", {"expression": IMAGES_JS, "returnByValue": True},
                                    session=session)["result"]["value"])
        if screenshot is not None:
            self.call("Emulation.setDeviceMetricsOverride", {"width": width, "height": int(info["height"]),
                                                             "deviceScaleFactor": 1, "mobile": mobile},
                      session=session)
            shot = self.call("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True},
                             session=session)
            screenshot.write_bytes(base64.b64decode(shot["data"]))
        result = PageResult(images=info["images"], scroll_width=info["scrollWidth"],
                            inner_width=info["innerWidth"], text=info["text"])
        for ev in self.events:
            m, p = ev.get("method"), ev.get("params", {})
            if m == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert", "warning"):
                result.console_errors.append(" ".join(str(a.get("value", a.get("description")))
                                                      for a in p.get("args", [])))
            elif m == "Runtime.exceptionThrown":
                result.console_errors.append(p["exceptionDetails"].get("text", "exception"))
            elif m == "Log.entryAdded" and p["entry"].get("level") in ("error", "warning"):
                result.console_errors.append(p["entry"].get("text", ""))
            elif m == "Network.requestWillBeSent":
                result.requests.append(p["request"]["url"])
        self.call("Target.closeTarget", {"targetId": target})
        return result

    def close(self) -> None:
        try:
            self._send("Browser.close")
            self.proc.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
        finally:
            os.close(self._w)
            os.close(self._r)
            shutil.rmtree(self.profile, ignore_errors=True)
