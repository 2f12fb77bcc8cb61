"""Where the loaders put tensors: one check of a device argument for every format.

torch itself fails late and obscurely on a CUDA device it cannot use (a bare
``AssertionError`` "Torch not compiled with CUDA enabled" at the first allocation, or
"invalid device ordinal" after the headers have been read); the loaders ask here first.
"""

from __future__ import annotations

from typing import Any

from gdskit.errors import DeviceUnavailableError, InvalidArgumentError


def torch_device(torch: Any, device: Any, *, argument: str = "device") -> Any:
    """``device`` (a str, a CUDA index or a ``torch.device``) as a ``torch.device``; a CUDA
    device gets its index (the current device where none is given).

    Raises
    ------
    DeviceUnavailableError
        ``device`` names no device torch knows, or a CUDA device this process cannot use
        (no CUDA, or no GPU of that index). The message suggests ``{argument}='cpu'``.
    InvalidArgumentError
        ``device`` is a bool (``True`` is not GPU 1).
    """
    if isinstance(device, bool):
        raise InvalidArgumentError(f"{argument} must be a device, not a boolean")
    try:
        dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    except (RuntimeError, TypeError, ValueError) as exc:
        raise DeviceUnavailableError(f"{argument}={device!r} is not a device: {exc}") from None
    if dev.type != "cuda":
        return dev
    if not torch.cuda.is_available():
        raise DeviceUnavailableError(f"tensors were asked for on {dev}, but CUDA is not available "
                                     f"(pass {argument}='cpu')")
    if dev.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    count = torch.cuda.device_count()
    if dev.index >= count:
        raise DeviceUnavailableError(f"tensors were asked for on {dev}, but this process sees "
                                     f"{count} GPU{'s' if count != 1 else ''} (pass {argument}='cpu' or a GPU index below {count})")
    return dev
