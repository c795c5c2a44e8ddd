"""What runs: ours (``pools.OurPool``, ``pools.EchoRunner`` and the workers in
``bench_workers``), the baselines a user would otherwise write (``baselines``), this
machine's floors (``raw_floor`` for a call, ``floors`` for copies and start-up), the
stand-in model they all run (``workload``) and process hygiene (``procs``)."""
