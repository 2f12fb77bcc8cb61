"""Write an :class:`~gdskit.accept.result.AcceptReport` as Markdown, a self-contained HTML page and JSON.

The HTML page needs nothing beside it: its style is inline and its plots are
embedded as base64 PNG, so it can be mailed or archived as one file. The
Markdown refers to the plots and other artifacts by relative path.
"""

from __future__ import annotations

import base64
import html
import os

from gdskit.accept.result import FAIL, NA, PASS, AcceptReport, ItemResult, write_json
from gdskit.durable import write_text_whole

MARKDOWN = "report.md"
HTML = "report.html"
JSON = "report.json"

_LABEL = {PASS: "PASS", FAIL: "FAIL", NA: "N/A"}
_COLOUR = {PASS: "#1e7d32", FAIL: "#c62828", NA: "#6b6b6b"}
#: The headline's colour: green only when every item passed; amber when none failed but some did not run.
VERDICT_COLOUR = {"accepted": _COLOUR[PASS], "not accepted": _COLOUR[FAIL], "incomplete": "#a15c00"}


def headline(report: AcceptReport) -> str:
    return (f"{report.verdict.upper()}: {report.count(PASS)} passed, {report.count(FAIL)} failed, "
            f"{report.count(NA)} not applicable")


def _machine_lines(report: AcceptReport) -> list[tuple[str, str]]:
    m = report.machine
    rows = [("created", report.created), ("host", f"{m.get('hostname')} (kernel {m.get('kernel')}"
                                            + (f", {m['virtualization']} guest" if m.get("virtualization") else "") + ")"),
            ("GPUs", ", ".join(m.get("gpus") or []) or "none"),
            ("driver", m.get("driver") or "-"), ("libcufile", m.get("cufile") or "not found"),
            ("targets", ", ".join(report.options.get("targets") or []) or "(every mount of the captured tree)")]
    if report.options.get("root"):
        rows.append(("captured tree", report.options["root"]))
    rows.append(("gdskit", m.get("gdskit_version", "")))
    return rows


# --------------------------------------------------------------------------- Markdown
def _md_escape(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def to_markdown(report: AcceptReport) -> str:
    out = [f"# gdskit accept: {headline(report)}", ""]
    out += [f"- **{k}**: {v}" for k, v in _machine_lines(report)]
    out += ["", "| # | item | status | summary |", "|---|---|---|---|"]
    for it in report.items:
        out.append(f"| {it.id} | {_md_escape(it.title)} | **{_LABEL[it.status]}** | {_md_escape(it.summary)} |")
    for it in report.items:
        out += ["", f"## {it.id}. {it.title}: {_LABEL[it.status]}", "", it.summary, ""]
        if it.evidence:
            out += ["Evidence:", "", "```text", *it.evidence, "```", ""]
        if it.fix:
            out += ["**Fix:**", "", *[f"- {line}" for line in it.fix.splitlines()], ""]
        for a in it.artifacts:
            out.append(f"![{a.title}]({a.path})" if a.kind == "plot" else f"- [{a.title}]({a.path})")
    if report.notes:
        out += ["", "## Notes", "", *[f"- {n}" for n in report.notes]]
    out += ["", f"Exit status: {report.exit_code} (non-zero when an item fails).", ""]
    return "\n".join(out)


# --------------------------------------------------------------------------- HTML
_STYLE = """
body{font-family:system-ui,-apple-system,'Segoe UI',Roboto,sans-serif;margin:24px auto;max-width:1180px;
color:#1d1d1f;background:#fafafa;padding:0 16px}
h1{font-size:26px;margin:0 0 6px} h2{font-size:19px;margin:0}
.verdict{display:inline-block;padding:6px 14px;border-radius:6px;color:#fff;font-weight:600;margin:8px 0 14px}
table{border-collapse:collapse;width:100%;margin:10px 0 22px;background:#fff}
td,th{border:1px solid #ddd;padding:6px 9px;text-align:left;vertical-align:top;font-size:14px}
th{background:#f0f0f0}
.badge{display:inline-block;min-width:44px;text-align:center;padding:2px 8px;border-radius:4px;color:#fff;
font-weight:600;font-size:13px}
.item{background:#fff;border:1px solid #ddd;border-left:6px solid #999;border-radius:6px;padding:14px 18px;margin:16px 0}
.item header{display:flex;gap:12px;align-items:center;margin-bottom:8px}
pre{background:#f5f5f5;padding:10px;border-radius:4px;overflow-x:auto;font-size:12.5px;white-space:pre-wrap}
.fix{background:#fff4f4;border:1px solid #f3c4c4;border-radius:4px;padding:8px 12px;margin-top:8px}
img{max-width:100%;border:1px solid #eee;margin-top:10px}
.meta td:first-child{font-weight:600;width:140px}
"""


def _badge(status: str) -> str:
    return f'<span class="badge" style="background:{_COLOUR[status]}">{_LABEL[status]}</span>'


def _embedded_png(report_dir: str, rel: str) -> str | None:
    try:
        with open(os.path.join(report_dir, rel), "rb") as fh:
            return base64.b64encode(fh.read()).decode("ascii")
    except OSError:
        return None


def _html_item(it: ItemResult, report_dir: str) -> str:
    e = html.escape
    parts = [f'<section class="item" id="item-{it.id}" style="border-left-color:{_COLOUR[it.status]}">',
             f"<header>{_badge(it.status)}<h2>{it.id}. {e(it.title)}</h2></header>", f"<p>{e(it.summary)}</p>"]
    if it.evidence:
        parts.append("<pre>" + e("\n".join(it.evidence)) + "</pre>")
    if it.fix:
        parts.append('<div class="fix"><b>Fix:</b><br>' + "<br>".join(e(x) for x in it.fix.splitlines()) + "</div>")
    files = []
    for a in it.artifacts:
        if a.kind == "plot":
            data = _embedded_png(report_dir, a.path)
            if data is not None:
                parts.append(f'<img alt="{e(a.title)}" title="{e(a.title)}" src="data:image/png;base64,{data}">')
        else:
            files.append(f'<a href="{e(a.path)}">{e(a.title)}</a>')
    if files:
        parts.append("<p>Archived: " + " · ".join(files) + "</p>")
    parts.append("</section>")
    return "\n".join(parts)


def to_html(report: AcceptReport, report_dir: str) -> str:
    e = html.escape
    colour = VERDICT_COLOUR[report.verdict]
    meta = "".join(f"<tr><td>{e(k)}</td><td>{e(str(v))}</td></tr>" for k, v in _machine_lines(report))
    rows = "".join(f'<tr><td>{it.id}</td><td><a href="#item-{it.id}">{e(it.title)}</a></td>'
                   f"<td>{_badge(it.status)}</td><td>{e(it.summary)}</td></tr>" for it in report.items)
    notes = "".join(f"<li>{e(n)}</li>" for n in report.notes)
    return "\n".join([
        "<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
        f"<title>gdskit accept: {e(report.verdict)}</title>", f"<style>{_STYLE}</style></head><body>",
        "<h1>gdskit accept: production acceptance checklist</h1>",
        f'<div class="verdict" style="background:{colour}">{e(headline(report))}</div>',
        f'<table class="meta">{meta}</table>',
        f"<table><tr><th>#</th><th>item</th><th>status</th><th>summary</th></tr>{rows}</table>",
        *[_html_item(it, report_dir) for it in report.items],
        f"<h2>Notes</h2><ul>{notes}</ul>" if notes else "",
        f"<p>Exit status {report.exit_code} (non-zero when an item fails). Machine-readable: "
        f'<a href="{JSON}">{JSON}</a>.</p>',
        "</body></html>", ""])


# --------------------------------------------------------------------------- files
def write_report(report: AcceptReport, report_dir: str) -> dict[str, str]:
    """Write report.md, report.html and report.json into ``report_dir``; returns their paths."""
    os.makedirs(report_dir, exist_ok=True)
    paths = {"markdown": os.path.join(report_dir, MARKDOWN), "html": os.path.join(report_dir, HTML),
             "json": os.path.join(report_dir, JSON)}
    write_json(paths["json"], report.to_dict())
    write_text_whole(paths["markdown"], to_markdown(report))
    write_text_whole(paths["html"], to_html(report, report_dir))
    return paths
