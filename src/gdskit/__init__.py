"""gdskit: files to GPU (or host) memory by the fastest path, with a ledger of the path every byte took."""
from gdskit.settings import settings
from gdskit.vocabulary import Mode, ODirectPolicy, Path, Reason

__version__ = "0.1.0"
__all__ = ["settings", "Mode", "ODirectPolicy", "Path", "Reason", "__version__"]
