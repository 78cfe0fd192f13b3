"""Goodput load generators and benchmarks. Each benchmark is a module run with ``python -m loadtests.<name>``.

- ``loadtests.overhead``: TTFT and inter-token latency through the gateway versus directly at the worker.

Shared helpers (percentiles, report writing, machine info) live in ``loadtests.common``.
"""
