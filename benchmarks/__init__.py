"""`make bench`: what a step costs on top of the model, measured next to this machine's floors.

Every figure is a median over repeated trials with its spread; nothing here asserts a
timing (machines are noisy), the report only says whether each target was met.
Entry point: ``python -m benchmarks.run [--quick] [--out DIR]``.
"""
