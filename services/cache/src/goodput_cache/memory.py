"""What the L2 index charges against its memory budget (``GOODPUT_CACHE_MAX_L2_BYTES``), and how a partition's rows
grow and shrink.

The charges are estimates of what numpy, faiss and CPython allocate for a partition and its entries, from the sizes
that matter: the rows (vector and expiry, allocated capacity, not only the rows in use), the HNSW graph, each entry's
key and question strings, and a fixed cost per entry (its slots in the dicts and lists that find it) and per
partition (its objects). ``tests/test_memory_budget.py`` holds them against ``tracemalloc`` for 100k small
partitions.

A partition grows by :func:`grow_step` rows when full: half its size while small (1, 2, 3, 4, 6, 9, ...), 64 rows
from 128 to 512, then an eighth. So a partition with a few entries holds a few rows, never a fixed preallocation,
and a large one at most an eighth of spare rows.

    >>> [grow_step(n) for n in (0, 1, 4, 100, 300, 4096)]
    [1, 1, 2, 50, 64, 512]
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from collections.abc import Callable

__all__ = ["ENTRY_BYTES", "PARTITION_BYTES", "graph_row_bytes", "grow_step", "str_bytes", "trimmer"]

# An entry's slots beyond its row and its strings: its key in the partition's row map and in the index's LRU order
# (an OrderedDict: a dict slot and a link), and its places in the partition's key and question lists.
ENTRY_BYTES = 240
# A partition's own objects: the partition, its two or three arrays, two lists, a dict, its name (32 hex digits)
# and its slot in the index's partition map.
PARTITION_BYTES = 672
_CHUNK = 64


def grow_step(n: int) -> int:
    """Rows a full partition of ``n`` rows grows by: n/2 (at least 1) up to 64, then 64, then n/8 beyond 512."""
    return min(max(1, n // 2), max(_CHUNK, n // 8))


def str_bytes(s: str) -> int:
    """What a str object costs (header and characters)."""
    return sys.getsizeof(s)


def graph_row_bytes(dim: int, m: int) -> int:
    """One node of a faiss ``IndexHNSWFlat``: its vector, 2M links on level 0 and about M/(M-1) above, its offset
    and level."""
    return 4 * dim + 4 * (2 * m + 1) + 12


def trimmer() -> Callable[[], None]:
    """A call that hands the C heap's free pages back to the OS (glibc's ``malloc_trim``; a no-op elsewhere). After a
    graph rebuild frees a partition's old rows and graph, glibc keeps them in the build thread's arena: measured on
    a 20k-entry partition, the process's RSS stayed ~60 MiB above what the index held until trimmed."""
    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        trim = None
    if trim is None:
        return lambda: None
    return lambda: None if trim(0) else None
