"""The A/B chart of item 3 (matplotlib, optional); the sweep reuses ``gdskit.bench.report.plot``."""

from __future__ import annotations

from typing import Any

from gdskit.durable import write_whole

PATH_COLOURS = {"cufile": "#2b7bba", "bounce": "#e8871e", "host": "#7f7f7f"}


def ab_chart(report: Any, filename: str) -> bool:
    """Throughput, latency and CPU cost of each path side by side, to ``filename`` (PNG).

    Returns False (and writes nothing) when matplotlib is not installed.
    """
    try:
        import matplotlib  # noqa: PLC0415 - optional dependency (matplotlib)
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415 - optional dependency (matplotlib)
    except ImportError:
        return False

    sums = report.summaries
    names = [s.path + (" (fell back)" if s.fell_back else "") for s in sums]
    colours = [PATH_COLOURS.get(s.path, "#555555") for s in sums]
    xs = range(len(sums))
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(12, 4.2))

    med = [s.gib_per_s_median for s in sums]
    err = [[m - s.gib_per_s_min for m, s in zip(med, sums)], [s.gib_per_s_max - m for m, s in zip(med, sums)]]
    ax1.bar(xs, med, yerr=err, capsize=4, color=colours)
    ax1.set_title("Throughput (GiB/s, median; bars: min-max)")

    width = 0.38
    p50 = [s.latency_p50_us or 0.0 for s in sums]
    p99 = [s.latency_p99_us or 0.0 for s in sums]
    ax2.bar([x - width / 2 for x in xs], p50, width, color=colours, label="p50")
    ax2.bar([x + width / 2 for x in xs], p99, width, color=colours, alpha=0.5, hatch="//", label="p99")
    ax2.set_title("Latency per I/O (µs)")
    ax2.legend()

    ax3.bar(xs, [s.cpu_s_per_gib or 0.0 for s in sums], color=colours)
    ax3.set_title("CPU cost (CPU-s per GiB, lower is better)")

    for ax in (ax1, ax2, ax3):
        ax.set_xticks(list(xs))
        ax.set_xticklabels(names)
        ax.grid(True, axis="y", alpha=0.3)
        ax.set_ylim(bottom=0)
    p, m = report.params, report.machine
    io = sums[0].io_size >> 10 if sums else 0
    fig.suptitle(f"A/B: {p.get('op')}, {io} KiB I/O, {p.get('workers')} workers, cache {p.get('cache')}, "
                 f"{m.get('filesystem') or '?'} on {m.get('mount_source') or '?'}")
    fig.tight_layout()
    try:
        write_whole(filename, lambda tmp: fig.savefig(tmp, dpi=100, format="png"))
    finally:
        plt.close(fig)
    return True
