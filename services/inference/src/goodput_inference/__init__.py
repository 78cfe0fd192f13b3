"""Goodput inference service."""
