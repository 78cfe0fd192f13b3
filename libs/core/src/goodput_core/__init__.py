"""Shared foundation of Goodput services."""
