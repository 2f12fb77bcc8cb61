"""What the user-facing modules show: their API and its errors, every listed name present."""

from __future__ import annotations

import importlib

import pytest

pytest.importorskip("torch")

MODULES = ["gdskit", "gdskit.safetensors", "gdskit.torch", "gdskit.data", "gdskit.dcp", "gdskit.engine"]


@pytest.mark.parametrize("name", MODULES)
def test_every_listed_name_is_there(name):
    module = importlib.import_module(name)
    for attr in module.__all__:
        assert getattr(module, attr) is not None, f"{name}.{attr}"


@pytest.mark.parametrize("name", ["gdskit.safetensors", "gdskit.torch"])
def test_a_loader_module_shows_only_its_api(name):
    module = importlib.import_module(name)
    assert dir(module) == sorted(module.__all__)
    assert not {"os", "functools", "dataclasses", "executor", "fmt", "read_plan", "OwnedTemp"} & set(dir(module))


def test_the_package_does_not_offer_the_driver_layer():
    import gdskit

    assert "cuda" not in gdskit.__all__
    assert "File" in gdskit.__all__ and "open" in gdskit.__all__
