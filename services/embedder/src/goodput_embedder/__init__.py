"""Goodput embedder service."""
