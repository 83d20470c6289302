"""A headless Chromium driven over the DevTools protocol: just enough to check pages of the Prefect UI.

No Selenium or Playwright download: Debian's ``chromium`` plus ``websocket-client`` (already installed
with the kubernetes client) are all it needs.
"""

from __future__ import annotations

import base64
import itertools
import json
import shutil
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import websocket

from tasks.processes import stop_process

CANDIDATES = ("chromium", "chromium-browser", "google-chrome")


def find_chromium() -> str | None:
    return next((path for name in CANDIDATES if (path := shutil.which(name))), None)


class Browser:
    """One headless Chromium with one page; ``with Browser() as b: b.open(url); b.wait_for_text(...)``."""

    def __init__(self, width: int = 1400, height: int = 1000) -> None:
        binary = find_chromium()
        if binary is None:
            raise RuntimeError("no Chromium found: install Debian's `chromium` (scripts/bootstrap.sh does as root)")
        self.profile = Path(tempfile.mkdtemp(prefix="laneflow-chromium-"))
        self.process = subprocess.Popen(
            [binary, "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
             "--remote-debugging-port=0", f"--user-data-dir={self.profile}", f"--window-size={width},{height}",
             "--no-first-run", "--disable-background-networking", "--disable-component-update", "--disable-sync",
             "about:blank"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True)  # its zygote, renderers and GPU process share its group: all stopped together
        port_file = self.profile / "DevToolsActivePort"
        deadline = time.monotonic() + 60
        while not port_file.is_file() or not port_file.read_text().strip():
            if time.monotonic() > deadline or self.process.poll() is not None:
                self.close()
                raise RuntimeError("Chromium did not open its DevTools port")
            time.sleep(0.2)
        port = int(port_file.read_text().split()[0])
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as response:
            pages = [t for t in json.load(response) if t["type"] == "page"]
        self.socket = websocket.create_connection(pages[0]["webSocketDebuggerUrl"], timeout=60,
                                                  suppress_origin=True)
        self.ids = itertools.count(1)
        #: What went wrong in the page so far (uncaught exceptions, console errors, failed loads, a crash), for
        #: the message of a wait that times out: a blank page says nothing about why.
        self.troubles: list[str] = []
        for domain in ("Runtime", "Network", "Inspector", "Page"):
            self.call(f"{domain}.enable")

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        message_id = next(self.ids)
        self.socket.send(json.dumps({"id": message_id, "method": method, "params": params}))
        while True:
            reply = json.loads(self.socket.recv())
            self._note_trouble(reply)
            if reply.get("id") == message_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply["result"]

    def _note_trouble(self, event: dict[str, Any]) -> None:
        method, params = event.get("method"), event.get("params", {})
        if method == "Runtime.exceptionThrown":
            details = params.get("exceptionDetails", {})
            note = details.get("exception", {}).get("description") or details.get("text", "")
        elif method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
            note = "console: " + " ".join(str(a.get("value", a.get("description", ""))) for a in params.get("args", []))
        elif method == "Network.loadingFailed":
            note = f"load failed: {params.get('errorText')} ({params.get('type')})"
        elif method == "Inspector.targetCrashed":
            note = "the page's renderer crashed"
        else:
            return
        self.troubles = [*self.troubles[-19:], note[:300]]

    def evaluate(self, expression: str) -> Any:
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        return result["result"].get("value")

    def open(self, url: str) -> None:
        self.call("Page.navigate", url=url)

    def reload(self) -> None:
        self.call("Page.reload", ignoreCache=True)

    def wait_for_text(self, *texts: str, timeout_s: float = 60.0, reload_blank_after_s: float | None = None) -> str:
        """The page's visible text once it contains every one of ``texts`` (parts of a page render at different
        times: wait for what you assert); TimeoutError naming what is missing and what the page showed.

        ``reload_blank_after_s``: reload once, as a user would, a page whose app has shown no text at all by then
        (CI saw the Prefect UI stay blank for 120 s once on a loaded machine); the reload is in the troubles."""
        deadline = time.monotonic() + timeout_s
        reload_at = None if reload_blank_after_s is None else time.monotonic() + reload_blank_after_s
        body = ""
        while time.monotonic() < deadline:
            body = self.evaluate("document.body ? document.body.innerText : ''") or ""
            if all(text in body for text in texts):
                return body
            if reload_at is not None and time.monotonic() > reload_at and not body.strip():
                self.troubles.append(f"blank after {reload_blank_after_s:.0f} s: reloaded")
                self.reload()
                reload_at = None
            time.sleep(0.5)
        missing = [text for text in texts if text not in body]
        where = self.evaluate("location.href + ' (' + document.readyState + ')'")
        troubles = "\n".join(self.troubles) or "nothing went wrong that the page reported"
        raise TimeoutError(f"{missing} did not appear within {timeout_s:.0f} s at {where}; the page showed:\n"
                           f"{body[:2000]}\n--- what the page reported:\n{troubles}")

    def click_text(self, text: str, timeout_s: float = 30.0) -> None:
        """Click the innermost element whose text is exactly ``text``."""
        script = f"""(() => {{
            const want = {json.dumps(text)};
            const all = [...document.querySelectorAll('button, a, [role=tab], li, span, div')];
            const hits = all.filter(e => e.textContent.trim() === want);
            const hit = hits[hits.length - 1];  // descendants come after ancestors: the innermost match
            if (!hit) return false;
            hit.click();
            return true;
        }})()"""
        deadline = time.monotonic() + timeout_s
        while not self.evaluate(script):
            if time.monotonic() > deadline:
                raise TimeoutError(f"no element with text '{text}' to click")
            time.sleep(0.5)

    def screenshot(self, path: Path) -> Path:
        data = self.call("Page.captureScreenshot", format="png")["data"]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(data))
        return path

    def close(self) -> None:
        if getattr(self, "socket", None) is not None:
            self.socket.close()
        stop_process(self.process, grace_s=10)
        shutil.rmtree(self.profile, ignore_errors=True)

    def __enter__(self) -> Browser:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
