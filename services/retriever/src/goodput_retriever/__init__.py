"""Goodput retriever service."""
