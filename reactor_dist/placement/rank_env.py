"""Environment variables every rank starts with unless the caller's environment (or the
runner's ``env=``) sets them: settings measured to pay in a rank (docs/performance.md,
"A fresh CPU buffer per call").

``THP_MEM_ALLOC_ENABLE=1``: torch's CPU allocator asks for transparent huge pages
(``madvise``) for blocks of 2 MB and more.  ``tensor.cpu()`` of a CUDA tensor allocates
such a block afresh on every call; 97 MB of it first-touched in 4 KiB pages is ~24,000
page faults, in 2 MB pages a few hundred (``python -m benchmarks.cpu_copy_settings``).
Freed blocks still go back to the system: memory stays bounded as without it.  Set it to
``0`` to opt out.
"""

from __future__ import annotations

RANK_ENV_DEFAULTS: dict[str, str] = {"THP_MEM_ALLOC_ENABLE": "1"}
