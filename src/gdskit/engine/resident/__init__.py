"""The resident loader: a process that keeps the engine warm (modules imported, pinned lanes
registered, worker threads started) and reads checkpoints into other processes' GPU memory, so
that a fresh program's first load runs at a warm one's rate (docs/resident.md).

- :mod:`~gdskit.engine.resident.wire`: where the socket lives, who may talk to it, the messages;
- :mod:`~gdskit.engine.resident.ipc`: the few driver calls a client needs to share its memory;
- :mod:`~gdskit.engine.resident.client`: a load's side (light: no engine, no bindings);
- :mod:`~gdskit.engine.resident.server`: ``gdskit serve``'s side.
"""
