"""The chaos suite: steady mixed traffic through the whole local platform while one component at a time is killed,
restarted, frozen or cut off, and what became of every request (``python -m chaos``; see :mod:`chaos.run`)."""
