"""Facts about this machine that the engine and ``gdskit check`` read: GPUs, PCIe topology and
distances, NUMA nodes, mounts and block devices, the GPUDirect Storage stack and cuFile's
configuration. Every reader goes through :class:`gdskit.machine.root.SystemRoot` (the test seam:
a captured tree in place of ``/``); nothing here decides or changes anything."""
