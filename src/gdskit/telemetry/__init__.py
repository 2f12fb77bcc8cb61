"""Live gdskit figures: publication (``GDSKIT_STATS``), reading, Prometheus, ``gdskit run``.

>>> from gdskit.telemetry import run_workload
>>> report = run_workload(["python", "train.py"])      # doctest: +SKIP
>>> report.verdict                                      # doctest: +SKIP
'direct grew, posix flat'

docs/stats.md describes the files, the JSON schema and the metric names.
"""

from gdskit.telemetry.location import stats_dir
from gdskit.telemetry.prometheus import render as to_prometheus
from gdskit.telemetry.prometheus import start_exporter
from gdskit.telemetry.publish import publish_now, start_publishing
from gdskit.telemetry.read import clean_stale, list_snapshots, read_snapshot
from gdskit.telemetry.snapshot import SCHEMA, Snapshot
from gdskit.telemetry.verdict import verdict
from gdskit.telemetry.workload import WorkloadReport, run_workload

__all__ = [
    "SCHEMA", "Snapshot", "WorkloadReport", "clean_stale", "list_snapshots", "publish_now", "read_snapshot",
    "run_workload", "start_exporter", "start_publishing", "stats_dir", "to_prometheus", "verdict",
]
