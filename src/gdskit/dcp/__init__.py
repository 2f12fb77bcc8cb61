"""torch.distributed.checkpoint (DCP) storage on the gdskit engine.

>>> import torch.distributed.checkpoint as dcp, gdskit.dcp
>>> dcp.save(state_dict, storage_writer=gdskit.dcp.StorageWriter("ckpt/step_100"))
>>> dcp.load(state_dict, storage_reader=gdskit.dcp.StorageReader("ckpt/step_100"))

Every rank moves its own shards straight between its device memory and the
filesystem, in parallel, and the ledger records the path. The on-disk layout is
DCP's stock one, so torch's ``FileSystemReader`` and ``FileSystemWriter``
interoperate both ways. Needs torch (``pip install 'gdskit[torch]'``).
"""

from __future__ import annotations

from gdskit.errors import MissingDependencyError

try:
    import torch.distributed.checkpoint  # noqa: F401
except ImportError:  # pragma: no cover - depends on the environment
    raise MissingDependencyError("gdskit.dcp needs torch with torch.distributed: "
                                 "pip install 'gdskit[torch]'") from None

from gdskit.dcp._common import CheckpointExistsError, IncompleteCheckpointError, UnsupportedItemError
from gdskit.dcp._reader import StorageReader
from gdskit.dcp._writer import StorageWriter

__all__ = ["StorageWriter", "StorageReader", "IncompleteCheckpointError", "CheckpointExistsError",
           "UnsupportedItemError"]
