"""Collection rules of the whole repository (pytest loads this file for every test folder below it).

``--doctest-modules`` (pyproject.toml) runs the examples in every module's docstrings, so they cannot go stale.
What must not be collected that way is listed here, each with its reason. (``__main__.py`` modules are never
collected by pytest's doctest plugin, and nothing in the source folders does work at import time.)
"""

collect_ignore = [
    # Its examples need a running scheduler and cache or ``await`` (goodput_gateway.caching, jobs.parking, jobs.routes,
    # jobs.store, jobs.worker, knowledge, metrics, pipeline, rag, service): to be rewritten as plain ``Example::``
    # blocks or runnable doctests, then this line goes.
    "services/gateway/src",
]
