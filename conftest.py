"""Collection rules of the whole repository (pytest loads this file for every test folder below it).

``--doctest-modules`` (pyproject.toml) runs the examples in every module's docstrings, so they cannot go stale.
What must not be collected that way is listed here, each with its reason. (``__main__.py`` modules are never
collected by pytest's doctest plugin, and nothing in the source folders does work at import time.) An example that
needs a running server, the platform or ``await`` is written as a plain ``Example::`` block instead of ``>>>``.
"""

collect_ignore: list[str] = []
