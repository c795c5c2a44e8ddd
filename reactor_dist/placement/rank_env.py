"""Environment variables every rank starts with unless the caller's environment (or the
runner's ``env=``) sets them: settings measured to pay in a rank (docs/performance.md,
"A fresh CPU buffer per call").

``THP_MEM_ALLOC_ENABLE=1``: torch's CPU allocator asks for transparent huge pages
(``madvise``) for blocks of 2 MB and more.  ``tensor.cpu()`` of a CUDA tensor allocates
such a block afresh on every call; 97 MB of it first-touched in 4 KiB pages is ~24,000
page faults, in 2 MB pages a few hundred (``python -m benchmarks.cpu_copy_settings``).
Freed blocks still go back to the system: memory stays bounded as without it.  Set it to
``0`` to opt out.

``TORCH_NCCL_ASYNC_ERROR_HANDLING=0``: NCCL's watchdog leaves an error or a timeout of a
collective to us.  torch's default (3, ProcessGroupNCCL's "skip clean-up") tears the
whole process down, so every survivor of a peer's death or hang would die with it and a
restart could keep none; ``_abort_process_group``, which a restart uses to get the
survivors out of the failed step (reactor_dist.rank.group), says in its docstring (torch
2.13) that it is to be used with 0.  With 0 a hung
collective waits until the call's timeout and the restart's abort.  An application that
sets it keeps its value and gives that up (docs/errors-and-recovery.md).
"""

from __future__ import annotations

RANK_ENV_DEFAULTS: dict[str, str] = {"THP_MEM_ALLOC_ENABLE": "1",
                                     "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"}
