"""``gdskit bench``: the direct path against the CPU paths, same parameters, CPU cost included.

Modules: :mod:`~gdskit.bench.params` (arguments), :mod:`~gdskit.bench.runner`
(the interleaved A/B runs), :mod:`~gdskit.bench.cpu` (CPU accounting),
:mod:`~gdskit.bench.knee` (where the direct path starts to pay),
:mod:`~gdskit.bench.profile` (per-mount cut-offs for ``auto`` mode),
:mod:`~gdskit.bench.report` (JSON, CSV, table, plot),
:mod:`~gdskit.bench.machine` (machine facts).
"""
