"""gdskit.vllm where vLLM is absent: a stand-in of the three names it imports from vLLM,
as strict as vLLM's own, and the ``gdskit_vllm`` fixture that imports gdskit.vllm over vLLM
where it is installed, else over the stand-in.

Test modules import the fixture: ``from vllm_stand_in import gdskit_vllm  # noqa: F401``.
"""

from __future__ import annotations

import abc
import importlib
import importlib.util
import sys
import types
from types import SimpleNamespace

import pytest

HAS_VLLM = importlib.util.find_spec("vllm") is not None


def vllm_stand_in() -> dict[str, types.ModuleType]:
    """The modules that hold what gdskit.vllm imports from vLLM, as strict as vLLM's own:
    ``BaseModelLoader`` is an abstract class that keeps its ``load_config`` and whose two loading
    methods a subclass must define; ``register_model_loader`` takes only its subclasses."""
    class BaseModelLoader(abc.ABC):
        def __init__(self, load_config) -> None:
            self.load_config = load_config

        @abc.abstractmethod
        def download_model(self, model_config) -> None: ...

        @abc.abstractmethod
        def load_weights(self, model, model_config) -> None: ...

    def register_model_loader(load_format: str):
        def register(cls):
            if not issubclass(cls, BaseModelLoader):
                raise TypeError(f"{cls} is not a BaseModelLoader")
            return cls
        return register

    names = ("vllm", "vllm.model_executor", "vllm.model_executor.model_loader",
             "vllm.model_executor.model_loader.base_loader")
    modules = {name: types.ModuleType(name) for name in names}
    modules["vllm.model_executor.model_loader"].register_model_loader = register_model_loader
    modules["vllm.model_executor.model_loader.base_loader"].BaseModelLoader = BaseModelLoader
    return modules


@pytest.fixture
def gdskit_vllm(monkeypatch):
    """gdskit.vllm over vLLM where it is installed, else over :func:`vllm_stand_in`
    (imported afresh, and forgotten afterwards: without vLLM the module is not importable)."""
    pytest.importorskip("torch")
    if HAS_VLLM:
        import gdskit.vllm as gv
        yield gv
        return
    for name, module in vllm_stand_in().items():
        monkeypatch.setitem(sys.modules, name, module)
    import gdskit
    try:
        yield importlib.import_module("gdskit.vllm")
    finally:
        sys.modules.pop("gdskit.vllm", None)
        gdskit.__dict__.pop("vllm", None)


def load_config(extra):
    """vLLM's LoadConfig holding ``extra`` where vLLM is installed; else an object with the same
    two fields (LoadConfig lets any value of model_loader_extra_config through: its type is
    ``dict | TensorizerConfig``, and TensorizerConfig is ``Any`` at run time)."""
    if HAS_VLLM:
        from vllm.config.load import LoadConfig
        return LoadConfig(load_format="gdskit", model_loader_extra_config=extra)
    return SimpleNamespace(load_format="gdskit", model_loader_extra_config=extra)
