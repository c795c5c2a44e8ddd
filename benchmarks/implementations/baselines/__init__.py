"""What people write without this library, kept small and honest so the comparison is fair:

- ``json_subprocess``: a subprocess per rank, a JSON request/reply loop over
  stdin/stdout and frames through temporary ``.npy`` files (the adapter the product
  document says this library replaces);
- ``mp_queue``: a ``multiprocessing`` spawn pool with one ``Queue`` per rank each way and
  pickled payloads.

Both run ``benchmarks.implementations.workload.BenchModel`` on every rank, as our workers do.
"""

from benchmarks.implementations.baselines.json_subprocess import JsonSubprocessPool
from benchmarks.implementations.baselines.mp_queue import MpQueuePool

__all__ = ["JsonSubprocessPool", "MpQueuePool"]
