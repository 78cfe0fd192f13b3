"""Goodput's response cache: L1 exact (Redis) and L2 semantic (per-partition vector index), fail-open."""
