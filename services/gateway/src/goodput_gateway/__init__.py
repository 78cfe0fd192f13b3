"""Goodput gateway service."""
