"""Level-3 figures (per GPU, cuFile's own counters on a stand-in libcufile) and the Prometheus text and exporter."""

from __future__ import annotations

import re
import urllib.request

import pytest
from fake_cufile import FakeCufile

from gdskit.engine.backends import cufile as cufile_backend
from gdskit.engine.ledger import Ledger
from gdskit.telemetry import cufile_counters, to_prometheus
from gdskit.telemetry.snapshot import ledger_dict, restrict
from gdskit.vocabulary import Path, Reason


def _doc(session: str = "s1") -> dict:
    led = Ledger()
    led.record(Path.CUFILE_NVFS, Reason.DIRECT, "read", 1 << 20, 1, 0.01, device=0)
    led.record(Path.CUFILE_NVFS, Reason.DIRECT, "read", 3 << 20, 1, 0.02, device=0)
    led.record(Path.BOUNCE_DIRECT, Reason.UNALIGNED, "read", 4096, 1, 0.001, device=1)
    gpus = led.device_snapshot()
    return {
        "schema": "gdskit.stats/1", "pid": 42, "level": 3, "session": session, "updated_at": 1.5,
        "ledger": ledger_dict(led.snapshot(), 3),
        "gpus": {str(g): {p: ps.to_dict() for p, ps in per.items()} for g, per in gpus.items()},
        "cufile": {"per_gpu": {"0": {"n_nvfs_reads": 2, "n_posix_reads": 1, "n_unaligned_reads": 1,
                                     "n_reads_err": 0, "read_bytes": 4 << 20}},
                   "totals": {"n_nvfs_reads": 2}},
    }


def parse_prometheus(text: str) -> dict[tuple[str, frozenset], float]:
    """Samples by (name, labels): through prometheus_client's parser where it is installed, else a strict
    reading of the text format's lines."""
    try:
        from prometheus_client.parser import text_string_to_metric_families
    except ImportError:
        out = {}
        for line in text.splitlines():
            if line.startswith("#"):
                assert re.fullmatch(r"# (HELP|TYPE) [a-zA-Z_:][a-zA-Z0-9_:]* .+", line), line
                continue
            m = re.fullmatch(r'([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)', line)
            assert m, line
            pairs = re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"', m.group(2) or "")
            labels = {k: re.sub(r"\\(.)", lambda c: "\n" if c.group(1) == "n" else c.group(1), v) for k, v in pairs}
            out[(m.group(1), frozenset(labels.items()))] = float(m.group(3))
        return out
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}



def test_level_3_text_has_ledger_histograms_gpus_and_cufile_counters():
    s = parse_prometheus(to_prometheus([_doc()]))
    nvfs = frozenset({"pid": "42", "path": "cufile-nvfs", "reason": "direct", "op": "read"}.items())
    assert s[("gdskit_bytes_total", nvfs)] == 4 << 20
    assert s[("gdskit_requests_total", nvfs)] == 2
    le = {"pid": "42", "path": "cufile-nvfs", "op": "read"}
    assert s[("gdskit_request_size_bytes_bucket", frozenset({**le, "le": str(1 << 20)}.items()))] == 1
    assert s[("gdskit_request_size_bytes_bucket", frozenset({**le, "le": str(4 << 20)}.items()))] == 2  # cumulative
    assert s[("gdskit_request_size_bytes_count", frozenset(le.items()))] == 2
    assert s[("gdskit_request_size_bytes_sum", frozenset(le.items()))] == 4 << 20
    gpu1 = frozenset({"pid": "42", "gpu": "1", "path": "bounce-direct", "op": "read"}.items())
    assert s[("gdskit_gpu_bytes_total", gpu1)] == 4096
    posix = frozenset({"pid": "42", "gpu": "0", "op": "read", "route": "posix"}.items())
    assert s[("gdskit_cufile_ops_total", posix)] == 1
    assert s[("gdskit_cufile_unaligned_ops_total", frozenset({"pid": "42", "gpu": "0", "op": "read"}.items()))] == 1
    assert s[("gdskit_process_info", frozenset({"pid": "42", "level": "3", "session": "s1"}.items()))] == 1


def test_lower_levels_leave_out_what_they_do_not_publish():
    text = to_prometheus([restrict(_doc(), 1)])
    assert "gdskit_bytes_total" in text
    assert "gdskit_request_size_bytes" not in text and "gdskit_cufile" not in text and "gdskit_gpu_" not in text
    text = to_prometheus([_doc()], level=2)
    assert "gdskit_request_size_bytes_bucket" in text and "gdskit_cufile" not in text


def test_label_values_are_escaped():
    text = to_prometheus([_doc(session='a"b\\c\nd')], pid_label=False)
    assert 'session="a\\"b\\\\c\\nd"' in text and 'pid="' not in text
    s = parse_prometheus(text)
    assert ("gdskit_process_info", frozenset({"level": "3", "session": 'a"b\\c\nd'}.items())) in s


def test_cufile_counters_are_read_only_where_cufile_is_open(monkeypatch):
    fake = FakeCufile(route="posix")
    lib = cufile_backend.CufileLibrary(loader=lambda: fake)
    monkeypatch.setattr(cufile_backend, "cufile_library", lambda: lib)
    assert cufile_counters.read_per_gpu() is None  # not opened by any I/O: publishing must not open it
    assert lib.available() and lib.stats_enabled
    fake.counters["n_posix_reads"] = 3
    fake.counters["n_nvfs_writes"] = 1
    per_gpu = cufile_counters.read_per_gpu()
    assert per_gpu == {0: {"n_nvfs_reads": 0, "n_p2p_reads": 0, "n_posix_reads": 3, "n_nvfs_writes": 1,
                           "n_p2p_writes": 0, "n_posix_writes": 0}}  # GPU 1 counted nothing: left out
    assert cufile_counters.totals(per_gpu)["n_posix_reads"] == 3
    assert cufile_counters.subtract(per_gpu, {0: {"n_posix_reads": 3, "n_nvfs_writes": 1}}) == {}
    lib.close()


def test_exporter_serves_this_process(monkeypatch):
    pytest.importorskip("prometheus_client")
    from gdskit.telemetry import start_exporter

    served = start_exporter(0, source=lambda: [_doc()])
    if not isinstance(served, tuple):
        pytest.skip("this prometheus_client does not say which port it took")
    server, _thread = served
    try:
        body = urllib.request.urlopen(f"http://127.0.0.1:{server.server_port}/metrics", timeout=10).read().decode()
        s = parse_prometheus(body)
        nvfs = frozenset({"pid": "42", "path": "cufile-nvfs", "reason": "direct", "op": "read"}.items())
        assert s[("gdskit_bytes_total", nvfs)] == 4 << 20
    finally:
        server.shutdown()
        server.server_close()
    # By default: this process's own ledger, without a pid label.
    server, _ = start_exporter(0)
    try:
        body = urllib.request.urlopen(f"http://127.0.0.1:{server.server_port}/metrics", timeout=10).read().decode()
        assert 'gdskit_process_info{level="1",session=""} 1.0' in body
    finally:
        server.shutdown()
        server.server_close()
