"""The page `torchsprint serve` shows at /, used as a person would: a real headless Chromium loads it from a real
server, image files are dropped on it (Chrome DevTools Protocol's Input.dispatchDragEvent, over
--remote-debugging-pipe: no extra package), and the labels it shows must be predict's for those files."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time

import pytest

from serve_helpers import TOL, ThreadServer, digit_images, encode
from torchsprint.commands.predict import Predictor

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


class DevTools:
    """Chromium driven over --remote-debugging-pipe: commands go to its fd 3, answers and events come from its
    fd 4, each a JSON message ending in a NUL byte (as Puppeteer's pipe transport)."""

    def __init__(self, profile):
        to_browser, self._write = os.pipe()
        self._read, from_browser = os.pipe()

        def pipes():  # in the child: the browser reads fd 3, writes fd 4
            os.dup2(to_browser, 3)
            os.dup2(from_browser, 4)

        self.proc = subprocess.Popen(
            [CHROMIUM, *FLAGS, "--remote-debugging-pipe", f"--user-data-dir={profile}", "about:blank"],
            preexec_fn=pipes,
            close_fds=False,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        os.close(to_browser)
        os.close(from_browser)
        self._buf, self._id, self.events = b"", 0, []

    def _message(self, deadline: float) -> dict:
        while b"\0" not in self._buf:
            assert time.monotonic() < deadline, "Chromium did not answer"
            chunk = os.read(self._read, 1 << 16)
            assert chunk, "Chromium closed its pipe"
            self._buf += chunk
        raw, self._buf = self._buf.split(b"\0", 1)
        return json.loads(raw)

    def send(self, method: str, session: str | None = None, timeout: float = 60, **params) -> dict:
        self._id += 1
        msg = {"id": self._id, "method": method, "params": params, **({"sessionId": session} if session else {})}
        os.write(self._write, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            m = self._message(deadline)
            if m.get("id") == self._id:
                assert "error" not in m, (method, m["error"])
                return m.get("result", {})
            self.events.append(m)

    def wait_event(self, method: str, timeout: float = 60) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            for i, e in enumerate(self.events):
                if e.get("method") == method:
                    return self.events.pop(i)
            self.events.append(self._message(deadline))

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()
        os.close(self._read)
        os.close(self._write)


@pytest.mark.skipif(CHROMIUM is None, reason="needs Chromium (Debian: apt-get install chromium); .ci/run installs it")
def test_dropping_images_on_the_page_shows_predicts_labels(serve_run, tmp_path):
    """Three digit PNGs dropped at once on the page's drop zone: for each, the page shows the classes and
    probabilities predict gives for that file, in predict's order. Bugs caught: a page that cannot post a dropped
    file (wrong body, content type, URL), results shown under the wrong image, labels that are not predict's."""
    run = serve_run
    paths = []
    for i, arr in enumerate(digit_images(3)):
        paths.append(tmp_path / f"digit{i}.png")
        paths[-1].write_bytes(encode(arr, "PNG"))
    expected = {
        p.name: r["top"] for p, r in zip(paths, Predictor.from_run(run).predict([str(p) for p in paths], topk=5))
    }
    server = ThreadServer(run, topk=5)
    browser = DevTools(tmp_path / "profile")
    try:
        target = browser.send("Target.createTarget", url="about:blank")["targetId"]
        session = browser.send("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        browser.send("Page.enable", session)
        browser.send("Page.navigate", session, url=server.url + "/")
        browser.wait_event("Page.loadEventFired")

        def evaluate(expression: str):
            return browser.send("Runtime.evaluate", session, expression=expression, returnByValue=True)["result"].get(
                "value"
            )

        box = json.loads(evaluate("JSON.stringify(document.getElementById('drop').getBoundingClientRect())"))
        x, y = box["x"] + box["width"] / 2, box["y"] + box["height"] / 2
        data = {"items": [], "files": [str(p) for p in paths], "dragOperationsMask": 1}
        for kind in ("dragEnter", "dragOver", "drop"):
            browser.send("Input.dispatchDragEvent", session, type=kind, x=x, y=y, data=data)
        deadline = time.monotonic() + 60
        while evaluate("document.body.dataset.state") != "done":
            assert time.monotonic() < deadline, evaluate("document.body.innerText")
            time.sleep(0.05)
        shown = json.loads(
            evaluate(
                "JSON.stringify([...document.querySelectorAll('section.result')].map(s => "
                "[s.dataset.file, s.dataset.state, [...s.querySelectorAll('tr.pred')].map(r => "
                "[r.dataset.class, Number(r.dataset.prob), r.querySelector('.label').textContent])]))"
            )
        )
        assert sorted(name for name, _, _ in shown) == sorted(expected)
        for name, state, rows in shown:
            assert state == "done", (name, rows)
            assert [c for c, _, _ in rows] == [t["class"] for t in expected[name]], name  # predict's labels, in order
            assert [label for _, _, label in rows] == [c for c, _, _ in rows]  # what the page shows as text
            assert max(abs(p - t["prob"]) for (_, p, _), t in zip(rows, expected[name])) <= TOL, name
    finally:
        browser.close()
        server.close()
