"""pytest runs in importlib mode (no test folder on sys.path): make the repository root importable so the tests
can import the ``loadtests`` package however pytest is invoked."""

import sys
from pathlib import Path

_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)
