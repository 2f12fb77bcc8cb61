"""The HTML report renders in a real browser (headless Chromium) to a non-trivial page, plots included.

`.ci/run` installs Debian's chromium; without it these tests are skipped.
"""

from __future__ import annotations

import base64
import os
import re
import shutil
import subprocess

import pytest

from check_helpers import fixture_root
from gdskit.accept import items
from gdskit.accept.context import AcceptContext, AcceptOptions
from gdskit.accept.report import write_report
from gdskit.accept.result import AcceptReport
from gdskit.accept.run import run_accept

from test_accept_fake_gpu import TINY

CHROMIUM = shutil.which("chromium") or ("/usr/bin/chromium" if os.path.exists("/usr/bin/chromium") else None)
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (.ci/run installs it)")


def screenshot(html_path: str, tmp_path) -> str:
    png = str(tmp_path / "shot.png")
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           f"--user-data-dir={tmp_path / 'chromium-profile'}", f"--screenshot={png}", "--window-size=1200,2000",
           "file://" + os.path.abspath(html_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert os.path.getsize(png) > 0
    return png


def assert_non_trivial(png: str) -> None:
    """The page is drawn: the right size, many colours, and far from one flat colour."""
    mpimg = pytest.importorskip("matplotlib.image")
    np = pytest.importorskip("numpy")
    img = mpimg.imread(png)
    assert img.shape[:2] == (2000, 1200)
    rgb = (img[..., :3] * 255).astype(np.uint8).reshape(-1, 3)
    colours, counts = np.unique(rgb, axis=0, return_counts=True)
    assert len(colours) > 50
    assert counts.max() / counts.sum() < 0.97     # not (almost) a single colour
    # the status badges are drawn: their green, red or grey is somewhere on the page
    badge = {(0x1e, 0x7d, 0x32), (0xc6, 0x28, 0x28), (0x6b, 0x6b, 0x6b)}
    assert badge & {tuple(int(v) for v in c) for c in colours}


@needs_chromium
def test_live_report_renders(tmp_path):
    opts = AcceptOptions(targets=[str(tmp_path)], report_dir=str(tmp_path / "rep"), quick=True, items=(1, 2, 6))
    run_accept(opts)
    assert_non_trivial(screenshot(str(tmp_path / "rep" / "report.html"), tmp_path))


@needs_chromium
def test_report_with_embedded_plots_renders(tmp_path, request):
    """A report with a failing captured tree (items 1-2) and the benchmark items on the stand-ins,
    whose plots are embedded as base64 PNG."""
    pytest.importorskip("matplotlib")
    from gdskit.engine import cuda
    if cuda.device_count() > 0:
        pytest.skip("a real GPU is present: the stand-ins would hide it")
    request.getfixturevalue("compat_cufile")

    (tmp_path / "t").mkdir()
    rep_dir = tmp_path / "rep"
    rep_dir.mkdir()
    captured = AcceptContext(AcceptOptions(targets=[], report_dir=str(rep_dir), root=fixture_root("vm-firecracker")))
    live = AcceptContext(AcceptOptions(targets=[str(tmp_path / "t")], report_dir=str(rep_dir), quick=True))
    live.sizes = TINY
    results = [items.item_platform(captured), items.item_mounts(captured), items.item_ab(live),
               items.item_sweep(live)] + [items.not_applicable(i, "not selected") for i in (5, 6, 7)]
    report = AcceptReport(created="2026-01-01T00:00:00Z", machine={"hostname": "test"},
                          options={"targets": ["/"]}, items=results)
    paths = write_report(report, str(rep_dir))
    html = open(paths["html"], encoding="utf-8").read()
    images = re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', html)
    assert len(images) == 2
    for data in images:
        assert base64.b64decode(data)[:8] == b"\x89PNG\r\n\x1a\n"
    assert "ab.png" in open(paths["markdown"], encoding="utf-8").read()
    assert_non_trivial(screenshot(paths["html"], tmp_path))

