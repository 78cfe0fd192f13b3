"""Collection rules of the whole repository (pytest loads this file for every test folder below it).

``--doctest-modules`` (pyproject.toml) runs the examples in every module's docstrings, so they cannot go stale.
What must not be collected that way is listed here, each with its reason. (``__main__.py`` modules are never
collected by pytest's doctest plugin, and nothing in the source folders does work at import time.) An example that
needs a running server, the platform or ``await`` is written as a plain ``Example::`` block instead of ``>>>``.
"""

import os

collect_ignore: list[str] = [
    # Triton's model repository: model.py files run inside tritonserver's Python backend (they import its
    # triton_python_backend_utils, which exists only there); tests/integration/test_triton_engine.py serves them.
    "services/inference/triton",
]

# In-process unit tests run their gRPC servers and clients in plaintext: a service's settings default to mutual TLS
# and would refuse to start without certificates. Mutual TLS and authorization are tested where they are built
# (libs/core/tests) and end to end (tests/security, tests/integration: the local platform runs mTLS whatever this
# process says, since the supervisor sets the switch for every child).
os.environ.setdefault("GOODPUT_INSECURE_INTERNAL", "true")

# In-process gateways serve no /metrics (0): its fixed port (8090) would be contended by every gateway a test starts
# and by a local platform. A test that scrapes gives it a free port; the platform's gateways (their own processes) get
# theirs from the supervisor.
os.environ.setdefault("GOODPUT_GATEWAY_METRICS_PORT", "0")

# In-process gateways and jobs workers seal job records with this key (a platform's get one of their own from the
# supervisor, kept in its state folder).
os.environ.setdefault("GOODPUT_GATEWAY_JOBS__MAC_KEY", "test-jobs-mac-key")
