from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest
from hypothesis import given, strategies as st

import gdskit
from gdskit.errors import ConfigError
from gdskit.settings import KiB, MiB, Settings, parse_size


def test_set_as_context_manager_restores():
    before = gdskit.settings.as_dict()
    with gdskit.settings.set(mode="bounce", threads=3, chunk_size="128KiB") as s:
        assert s.mode is gdskit.Mode.BOUNCE and s.threads == 3 and s.chunk_size == 128 * KiB
        assert gdskit.settings.snapshot().threads == 3
    assert gdskit.settings.as_dict() == before
    assert gdskit.settings.snapshot().threads == before["threads"]


def test_set_without_with_persists():
    old = gdskit.settings.threads
    gdskit.settings.set(threads=old + 1)
    try:
        assert gdskit.settings.threads == old + 1
    finally:
        gdskit.settings.set(threads=old)


@pytest.mark.parametrize("changes", [
    {"mode": "fast"}, {"threads": 0}, {"threads": "many"}, {"chunk_size": "3KiB"}, {"chunk_size": 1000},
    {"pinned_budget": "12"}, {"alignment": 3000}, {"odirect": "sometimes"}, {"cufile_stats": "maybe"},
    {"pinned_alloc": "mlock"}, {"no_such_setting": 1},
])
def test_invalid_values(changes):
    before = gdskit.settings.as_dict()
    with pytest.raises(ConfigError):
        gdskit.settings.set(**changes)
    assert gdskit.settings.as_dict() == before


def test_env_overrides_in_a_fresh_process():
    code = "import gdskit; print(gdskit.settings.as_dict())"
    env = {"GDSKIT_MODE": "bounce", "GDSKIT_CHUNK_SIZE": "16MiB", "GDSKIT_THREADS": "5",
           "GDSKIT_ODIRECT": "never", "GDSKIT_CUFILE_STATS": "off", "PATH": "/usr/bin:/bin"}
    import os

    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    d = eval(out)  # noqa: S307 - our own repr of a dict of plain values
    assert d["mode"] == "bounce" and d["chunk_size"] == 16 * MiB and d["threads"] == 5
    assert d["odirect"] == "never" and d["cufile_stats"] is False


def test_bad_env_value_is_a_config_error():
    with pytest.raises(ConfigError):
        Settings()._apply_env({"GDSKIT_THREADS": "-2"})


@given(n=st.integers(0, 10**6), unit=st.sampled_from(["", "k", "KiB", "M", "MiB", "g", "GiB"]))
def test_parse_size(n, unit):
    mult = {"": 1, "k": KiB, "KiB": KiB, "M": MiB, "MiB": MiB, "g": 1 << 30, "GiB": 1 << 30}[unit]
    assert parse_size(f"{n}{unit}") == n * mult


@pytest.mark.parametrize("text", ["", "abc", "1.5M", "-3", "4 XB"])
def test_parse_size_rejects(text):
    with pytest.raises(ConfigError):
        parse_size(text)



def test_subscribers_hear_every_change_of_their_settings(monkeypatch):
    s = Settings()
    heard: list[tuple[frozenset[str], int]] = []
    s.subscribe(lambda names: heard.append((names, s.threads)))
    with s.set(threads=3, mode="bounce"):
        assert heard == [(frozenset({"threads", "mode"}), 3)]
    assert heard[-1] == (frozenset({"threads", "mode"}), Settings().threads)  # told after the restore
    with pytest.raises(ConfigError):
        s.set(threads=0)
    assert len(heard) == 2  # a refused change changes nothing and tells no one
    monkeypatch.delenv("GDSKIT_THREADS", raising=False)
    s.reset()
    assert heard[-1][0] == frozenset(f.name for f in dataclasses.fields(Settings))
    assert s.snapshot()._subscribers == []  # a request's copy tells no one


def test_stats_publication_follows_the_setting_from_the_package(tmp_path):
    # The engine's settings never import telemetry: the package subscribes it to them.
    code = ("import sys, gdskit\n"
            "print('gdskit.telemetry.publish' in sys.modules)\n"
            "gdskit.settings.set(stats_level=1)\n"
            "print('gdskit.telemetry.publish' in sys.modules)\n")
    env = {**os.environ, "GDSKIT_STATS": "0", "GDSKIT_STATS_DIR": str(tmp_path / "stats")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    assert out.stdout.split() == ["False", "True"]
