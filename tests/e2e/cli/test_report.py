"""`torchsprint report RUN`: one self-contained page with the run's curves, confusion matrix, per-class
scores and worst mistakes, rendered by a real headless Chromium."""

from __future__ import annotations

import csv
import re
import shutil
import subprocess

import pytest

from torchsprint import cli

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


@pytest.fixture(scope="module")
def reported(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("report")
    run = tmp / "run"
    assert (
        cli.main(
            [
                "train",
                "run.epochs=2",
                f"run.dir={run}",
                "log.every_steps=5",
                "log.tensorboard=false",
                "model.args={width: 4}",
            ]
        )
        == 0
    )
    assert cli.main(["report", str(run)]) == 0
    return run, run / "report" / "report.html"


def test_report_files_and_what_the_page_holds(reported):
    run, page = reported
    for png in ("curves.png", "confusion_matrix.png", "wrong.png"):
        assert (page.parent / png).stat().st_size > 10_000, png
    text = page.read_text()
    assert "<h2>Curves</h2>" in text and "<h2>Confusion matrix</h2>" in text and "<h2>Per class</h2>" in text
    assert "http" not in re.sub(r"data:image/png;base64,[A-Za-z0-9+/=]+", "", text)  # self-contained: nothing to fetch
    # The per-class table comes from a fresh validation pass: it must agree with the run's own evaluation of
    # the same (best) weights, written by the training run as per_class.csv.
    with open(run / "per_class.csv") as f:
        saved = {r["class"]: r for r in csv.DictReader(f)}
    rows = re.findall(
        r"<tr><td>([^<]+)</td><td>([0-9.]+)</td><td>([0-9.]+)</td><td>([0-9.]+)</td><td>(\d+)</td></tr>", text
    )
    assert len(rows) == 10
    for name, prec, rec, f1, support in rows:
        for key, value in (("precision", prec), ("recall", rec), ("f1", f1)):
            assert float(value) == pytest.approx(float(saved[name][key]), abs=1e-4), (name, key)
        assert int(support) == int(saved[name]["support"]), name


@pytest.mark.skipif(CHROMIUM is None, reason="needs Chromium (Debian: apt-get install chromium); .ci/run installs it")
def test_report_renders_in_a_real_headless_browser(reported, tmp_path):
    _, page = reported
    dom = subprocess.run(
        [
            CHROMIUM,
            *FLAGS,
            f"--user-data-dir={tmp_path / 'profile'}",
            "--virtual-time-budget=5000",
            "--dump-dom",
            page.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    m = re.search(r'data-images-decoded="(\d+)/(\d+)"', dom.stdout)
    assert m, dom.stdout[:500] + dom.stderr[-500:]
    assert m.group(1) == m.group(2) == "3"  # curves, confusion matrix and wrong images all decoded
    shot = tmp_path / "shot.png"
    subprocess.run(
        [
            CHROMIUM,
            *FLAGS,
            f"--user-data-dir={tmp_path / 'profile2'}",
            "--window-size=1200,2400",
            f"--screenshot={shot}",
            page.as_uri(),
        ],
        capture_output=True,
        timeout=120,
    )
    from PIL import Image

    pixels = Image.open(shot).convert("L")
    assert pixels.size == (1200, 2400)
    lo, hi = pixels.getextrema()
    assert hi - lo > 200  # text and figures on a white page, not a blank or error page
