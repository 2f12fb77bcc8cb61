"""`gdskit accept` on a real GPU machine: the report must be honest about that machine.

Items 3, 4, 6 and 7 measure and must pass on any working GPU machine; items 1, 2 and 5
must agree with what `gdskit check` and the workload's own counters say.
"""

from __future__ import annotations

import pytest

from gdskit.accept.context import AcceptOptions
from gdskit.accept.run import run_accept

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    target = tmp_path_factory.mktemp("accept-target", numbered=True)
    opts = AcceptOptions(targets=[str(target)], report_dir=str(tmp_path_factory.mktemp("accept-report")),
                         quick=True)
    return run_accept(opts), target


def test_measuring_items_pass(report):
    rep, _ = report
    by_id = {i.id: i for i in rep.items}
    for item in (3, 4, 7):
        assert by_id[item].status == "pass", (by_id[item].summary, by_id[item].evidence)
    assert by_id[6].status in ("pass", "n/a")  # n/a only without torch
    assert any(a.kind == "plot" for a in by_id[4].artifacts)


def test_verdict_items_agree_with_check(report):
    from gdskit.probe import run_check

    rep, target = report
    by_id = {i.id: i for i in rep.items}
    check = run_check([str(target)])
    all_direct = all(m.verdict == "direct" for m in check.mounts)
    assert (by_id[2].status == "pass") is all_direct
    nvfs_or_p2p = check.gds.nvidia_fs.loaded or check.gds.p2pdma.available
    if not nvfs_or_p2p:
        assert by_id[1].status == "fail" and by_id[1].fix
    if not all_direct:
        assert by_id[5].status == "fail", by_id[5].evidence  # no direct route: direct bytes cannot grow
    for it in rep.items:
        if it.status == "fail":
            assert it.fix
    assert rep.exit_code == (1 if rep.failed else 0)
