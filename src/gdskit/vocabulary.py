"""The words gdskit uses in code, output and docs for paths and reasons.

A *path* is how bytes actually moved. A *reason* says why a request did not
take the direct path (or why it took the one it did). Both are ``str`` enums so
they print, compare and serialise as their plain names.
"""

from __future__ import annotations

import enum


class Path(str, enum.Enum):
    """How bytes moved between a file and memory."""

    CUFILE_NVFS = "cufile-nvfs"        # GDS through nvidia-fs: storage DMA straight into GPU memory
    CUFILE_P2PDMA = "cufile-p2pdma"    # GDS through upstream PCI P2PDMA
    CUFILE_COMPAT = "cufile-compat"    # cuFile ran, but through its own POSIX fallback
    BOUNCE_CACHED = "bounce-cached"    # through the page cache (a read hit, a buffered write) and the pinned ring
    BOUNCE_DIRECT = "bounce-direct"    # O_DIRECT read/write through gdskit's pinned ring
    HOST = "host"                      # the memory was host memory: no GPU involved
    PEER = "peer"                      # arrived from another rank of a process group, not from storage
    OBJECT = "object"                  # ranged GETs (or multipart PUTs) of an object store (s3://)

    def __str__(self) -> str:
        return self.value

    @property
    def is_direct(self) -> bool:
        return self in (Path.CUFILE_NVFS, Path.CUFILE_P2PDMA)


_DIRECT_NAMES = frozenset(p.value for p in Path if p.is_direct)


def is_direct_path(name: str) -> bool:
    """Whether a path name (a ``Path`` or its string, e.g. from a snapshot) is a direct path.
    A name this gdskit does not know (from a newer one) is not."""
    return str(name) in _DIRECT_NAMES


def is_peer_path(name: str) -> bool:
    """Whether a path name is ``peer``: bytes another rank sent, which moved no storage I/O here."""
    return str(name) == Path.PEER.value


class Reason(str, enum.Enum):
    """Why a request took the path it took (for non-direct paths: why not direct)."""

    DIRECT = "direct"                          # it did take the direct path
    NO_GPU = "no_gpu"
    CUFILE_MISSING = "cufile_missing"
    NVIDIA_FS_MISSING = "nvidia_fs_missing"
    P2PDMA_UNAVAILABLE = "p2pdma_unavailable"
    UDEV_MISSING = "udev_missing"
    HANDLE_REGISTER_FAILED = "handle_register_failed"
    FS_UNSUPPORTED = "fs_unsupported"
    UNALIGNED = "unaligned"
    BELOW_THRESHOLD = "below_threshold"
    MANAGED_MEMORY = "managed_memory"
    HOST_MEMORY = "host_memory"
    FORCED_BY_SETTING = "forced_by_setting"
    RAID_OR_MULTIPATH = "raid_or_multipath"
    CUFILE_COMPAT_OBSERVED = "cufile_compat_observed"  # cuFile's own counters showed POSIX I/O
    FAN_OUT = "fan_out"                        # path peer: another rank of the group read these bytes
    OBJECT_STORE = "object_store"              # path object into GPU memory: an object store's bytes cross host memory

    def __str__(self) -> str:
        return self.value


class Mode(str, enum.Enum):
    """Which backend the engine may use (``settings.mode``)."""

    AUTO = "auto"      # decide per request; record the reason
    CUFILE = "cufile"  # always cuFile for device memory; error if it cannot be used
    BOUNCE = "bounce"  # always gdskit's pinned-bounce path for device memory
    HOST = "host"      # host memory only; device buffers are refused

    def __str__(self) -> str:
        return self.value


class ODirectPolicy(str, enum.Enum):
    """When the CPU paths use O_DIRECT (``settings.odirect``)."""

    AUTO = "auto"      # reads: page-cache hits buffered, misses O_DIRECT; writes: aligned body O_DIRECT
    ALWAYS = "always"  # aligned parts of reads and writes always O_DIRECT
    NEVER = "never"    # always through the page cache

    def __str__(self) -> str:
        return self.value


class PinnedAlloc(str, enum.Enum):
    """How the bounce ring gets its pinned memory (``settings.pinned_alloc``)."""

    REGISTER = "register"    # anonymous memory on huge pages, touched by its worker, then cudaHostRegister
    HOSTALLOC = "hostalloc"  # cudaHostAlloc

    def __str__(self) -> str:
        return self.value


class Routing(str, enum.Enum):
    """Whether reads go through the GPU nearest the storage (``settings.routing``)."""

    AUTO = "auto"    # when a GPU strictly nearer the file's storage reaches the target peer to peer
    OFF = "off"      # never
    FORCE = "force"  # through the nearest other GPU whenever there are two, even on ties (for testing)

    def __str__(self) -> str:
        return self.value


class CufileBatch(str, enum.Enum):
    """Whether many small cuFile reads are submitted through cuFile's batch API (``settings.cufile_batch``)."""

    AUTO = "auto"      # at the entry sizes where batches measured faster (gdskit.engine.backends.cufile_batch.BATCH_WINS)
    ALWAYS = "always"  # every cuFile read job whose entries a batch can take
    NEVER = "never"    # one cuFileRead per piece, as before batches existed

    def __str__(self) -> str:
        return self.value


class Resident(str, enum.Enum):
    """Whether GPU loads go through this user's resident loader (``settings.resident``)."""

    AUTO = "auto"        # where ``gdskit serve`` is listening for the load's GPU; otherwise in this process
    OFF = "off"          # always in this process
    REQUIRE = "require"  # through it, or a ResidentLoaderError saying why not

    def __str__(self) -> str:
        return self.value


class IoUring(str, enum.Enum):
    """Whether batches of small host reads go through io_uring (``settings.io_uring``)."""

    AUTO = "auto"    # where the kernel offers it (gdskit.engine.backends.uring.availability()) and a batch is big enough
    NEVER = "never"  # one preadv system call per read

    def __str__(self) -> str:
        return self.value
