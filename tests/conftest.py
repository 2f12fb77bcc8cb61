from __future__ import annotations

import pytest


def _gpu_present() -> bool:
    try:
        from gdskit import cuda
        return cuda.device_count() > 0
    except Exception:
        return False


def _torch_present() -> bool:
    try:
        import torch  # noqa: F401
        return True
    except Exception:
        return False


HAS_GPU = _gpu_present()
HAS_TORCH = _torch_present()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    skip_torch = pytest.mark.skip(reason="needs torch")
    for item in items:
        if "gpu" in item.keywords and not HAS_GPU:
            item.add_marker(skip_gpu)
        if "torch" in item.keywords and not HAS_TORCH:
            item.add_marker(skip_torch)
