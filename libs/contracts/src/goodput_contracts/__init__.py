"""Facts every Goodput part relies on, defined once: the services' topology and the knowledge-base version
contract. No dependencies, so services, the CLI and tests can all import it.

Example:
    >>> from goodput_contracts import SERVICES, version_key
    >>> SERVICES["cache"].grpc_port, version_key("acme", "handbook")
    (50055, 'goodput:kb:acme:handbook:version')
"""

from goodput_contracts.kb_version import DEFAULT_CHANNEL, DEFAULT_KEY_PREFIX, VersionChange, kb_key, version_key
from goodput_contracts.topology import SERVICES, Peer, Service, callers

__all__ = ["DEFAULT_CHANNEL", "DEFAULT_KEY_PREFIX", "SERVICES", "Peer", "Service", "VersionChange", "callers",
           "kb_key", "version_key"]
