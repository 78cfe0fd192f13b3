"""The `goodput` command line and the local process supervisor.

Example::

    from goodput_cli import Platform
    with Platform(workdir=Path(".goodput"), workers=2) as platform:
        print(platform.gateway_http, platform.dev_key)
"""

from goodput_cli.keys import DEV_KEY_FILE, KEYS_FILE, hash_key, read_dev_key, write_dev_keys
from goodput_cli.supervisor import Platform, PlatformError, ServiceSpec, cpu_bindings

__all__ = [
    "DEV_KEY_FILE",
    "KEYS_FILE",
    "Platform",
    "PlatformError",
    "ServiceSpec",
    "cpu_bindings",
    "hash_key",
    "read_dev_key",
    "write_dev_keys",
]
