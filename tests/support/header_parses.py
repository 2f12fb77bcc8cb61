"""Counting the safetensors header parses a test causes (the parser's own work, not a lookup)."""

from __future__ import annotations

from gdskit.formats import safetensors_format as fmt


def count_parses(monkeypatch) -> list[int]:
    """A list that gets each parsed header's length, for as long as ``monkeypatch`` holds."""
    calls: list[int] = []
    real = fmt._parse_header_json

    def parse(raw, data_start, file_size):
        calls.append(len(raw))
        return real(raw, data_start, file_size)

    monkeypatch.setattr(fmt, "_parse_header_json", parse)
    return calls
