"""Goodput scheduler service."""
