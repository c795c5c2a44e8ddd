"""Ready worker classes: small but real parallel models for :class:`DistributedRunner`.

* :mod:`workers.tensor_parallel` -- ``TensorParallelWorker``, a Megatron-style
  tensor-parallel transformer block (heads and MLP units split across ranks).
* :mod:`workers.video` -- ``VideoWorker``, a sequence-parallel video generator (frames
  split across ranks, cross-rank temporal attention, frames gathered onto rank 0).

Each module imports torch; this package file does not, so importing one worker does
not pay for the other.
"""
