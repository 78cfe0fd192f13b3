"""Mutual TLS between Goodput services: a development CA with one certificate per identity, and the gRPC
credentials every server and internal client builds from a service's settings.

An identity is a topology key (``scheduler``, ``jobsWorker``…) or ``operator`` (the CLI and the local supervisor).
It is written into the certificate as the URI SAN ``spiffe://<trust domain>/<release>/<identity>`` (what cert-manager's
``uris`` or a SPIFFE issuer would put there); :mod:`goodput_core.authz` reads it back from the TLS auth context and
takes no other name: a certificate of the same issuer made for another release or trust domain names nobody here,
nor does a common name. Development certificates name ``127.0.0.1`` and ``localhost``, so every local address
verifies.

Settings (every service, with its own prefix): ``TLS_CERT_FILE``, ``TLS_KEY_FILE`` and ``TLS_CA_FILE`` (PEM files,
the service's certificate and key and the CA its peers' certificates must chain to), or ``INSECURE_INTERNAL=true``
for plaintext (also read from the common ``GOODPUT_INSECURE_INTERNAL``), which logs a warning at every start;
``TLS_TRUST_DOMAIN`` and ``TLS_RELEASE`` (also the common ``GOODPUT_TLS_TRUST_DOMAIN``/``GOODPUT_TLS_RELEASE``)
make the identity prefix.

Example:
    >>> import tempfile
    >>> folder = Path(tempfile.mkdtemp())
    >>> files = ensure_dev_pki(folder, ["scheduler", "operator"])
    >>> sorted(files)
    ['operator', 'scheduler']
    >>> identity_of(files["scheduler"].cert.read_bytes())
    'scheduler'
    >>> ensure_dev_pki(folder, ["scheduler"])["scheduler"] == files["scheduler"]   # reused while valid
    True
"""

from __future__ import annotations

import contextlib
import datetime as dt
import functools
import ipaddress
import logging
import os
import tempfile
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import grpc
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

__all__ = ["DEFAULT_PREFIX", "CertificateFiles", "ClientCertificates", "ServerCertificates", "TlsConfigError",
           "TlsFiles", "TlsSettings", "channel_credentials", "common_identity", "configured_files", "ensure_dev_pki",
           "identity_of", "identity_prefix", "platform_prefix", "server_certificates", "spiffe_id", "spiffe_prefix",
           "tls_files", "write_private"]

log = logging.getLogger("goodput.tls")

# The identity prefix's parts (goodput_core.settings.ServiceSettings.tls_trust_domain, tls_release): a trust domain
# as SPIFFE spells one, a release as one or more path segments (the chart: <namespace>/<release>).
DEFAULT_TRUST_DOMAIN = "goodput"
DEFAULT_RELEASE = "default"
TRUST_DOMAIN_PATTERN = r"^[a-z0-9._-]{1,255}$"
RELEASE_PATTERN = r"^[A-Za-z0-9_-][A-Za-z0-9._-]{0,252}(/[A-Za-z0-9_-][A-Za-z0-9._-]{0,252}){0,3}$"  # no "." or ".."
CA_NAME = "ca"
# A development CA lives a year, its leaves 90 days; a leaf within RENEW_BEFORE of its end is issued again.
CA_DAYS = 365
LEAF_DAYS = 90
RENEW_BEFORE = dt.timedelta(days=7)
# The DNS name every platform certificate carries and every internal client checks (gRPC's target name override):
# peers are dialled by address (a worker by its pod IP, which no certificate can name), so the client verifies that
# the server holds a certificate of this platform's CA under this name; which service it is, the server proves
# no further (the server side authorizes the caller by its identity).
PLATFORM_NAME = "goodput.internal"
DEV_HOSTS = ("localhost", PLATFORM_NAME)
DEV_IPS = ("127.0.0.1", "::1")
# How often a process's outgoing channels look at their certificate's files (a few stat calls, on a call's path).
CLIENT_CHECK_S = 5.0


class TlsConfigError(ValueError):
    """Mutual TLS is on (the default) but the settings do not name the service's certificate, key and CA."""


class TlsSettings(Protocol):
    """What a service's settings say about its TLS (fields of :class:`goodput_core.settings.ServiceSettings`)."""

    @property
    def tls_cert_file(self) -> str: ...
    @property
    def tls_key_file(self) -> str: ...
    @property
    def tls_ca_file(self) -> str: ...
    @property
    def insecure_internal(self) -> bool: ...
    @property
    def tls_trust_domain(self) -> str: ...
    @property
    def tls_release(self) -> str: ...


@dataclass(frozen=True)
class TlsFiles:
    """One identity's PEM files and the CA that signed them."""

    cert: Path
    key: Path
    ca: Path

    def read(self) -> tuple[bytes, bytes, bytes]:
        return self.cert.read_bytes(), self.key.read_bytes(), self.ca.read_bytes()

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """Presents this certificate to the peers it dials and verifies theirs against the CA."""
        cert, key, ca = self.read()
        return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)


def spiffe_prefix(trust_domain: str = DEFAULT_TRUST_DOMAIN, release: str = DEFAULT_RELEASE) -> str:
    """What every identity's URI SAN starts with in one release of one trust domain.

    >>> spiffe_prefix("example.org", "prod/goodput")
    'spiffe://example.org/prod/goodput/'
    """
    return f"spiffe://{trust_domain}/{release}/"


DEFAULT_PREFIX = spiffe_prefix()


def identity_prefix(settings: TlsSettings) -> str:
    """The identity prefix a service's settings name."""
    return spiffe_prefix(settings.tls_trust_domain, settings.tls_release)


def common_identity(env: Mapping[str, str]) -> tuple[str, str]:
    """The trust domain and release the common variables in ``env`` name (``GOODPUT_TLS_TRUST_DOMAIN``,
    ``GOODPUT_TLS_RELEASE``): what a service takes without settings of its own."""
    return (env.get("GOODPUT_TLS_TRUST_DOMAIN", "").strip() or DEFAULT_TRUST_DOMAIN,
            env.get("GOODPUT_TLS_RELEASE", "").strip() or DEFAULT_RELEASE)


def platform_prefix(env: Mapping[str, str]) -> str:
    """The identity prefix a platform's processes take from the common variables in ``env`` (what a launcher that
    issues their certificates must use)."""
    return spiffe_prefix(*common_identity(env))


def spiffe_id(identity: str, prefix: str = DEFAULT_PREFIX) -> str:
    """The URI SAN naming ``identity``.

    >>> spiffe_id("gateway")
    'spiffe://goodput/default/gateway'
    """
    return prefix + identity


def identity_in(uris: Iterable[str], prefix: str = DEFAULT_PREFIX) -> str | None:
    """The identity the first of ``uris`` under ``prefix`` names (one path segment after it), else None.

    >>> identity_in(["spiffe://goodput/other/gateway", "spiffe://goodput/default/gateway"])
    'gateway'
    >>> identity_in(["spiffe://goodput/default/a/gateway"]) is None
    True
    """
    for uri in uris:
        rest = uri[len(prefix):] if uri.startswith(prefix) else ""
        if rest and "/" not in rest:
            return rest
    return None


def identity_of(cert_pem: bytes, prefix: str = DEFAULT_PREFIX) -> str | None:
    """The Goodput identity a certificate names: its URI SAN under ``prefix``; a common name does not count."""
    cert = x509.load_pem_x509_certificate(cert_pem)
    try:
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return None
    return identity_in(sans.get_values_for_type(x509.UniformResourceIdentifier), prefix)


# --- the development CA (``goodput up``, tests) -----------------------------------------------------------------

def write_private(path: Path, data: bytes) -> None:
    """Replaces ``path`` with ``data`` at once, readable by its owner only: a temporary file beside it, mode 0600 from
    the first byte, fsynced, then renamed. A symlink is followed: its target is replaced, the link stays."""
    path = Path(os.path.realpath(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")  # mkstemp: mode 0600
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    with contextlib.suppress(OSError):  # the rename itself survives a crash once the folder is synced
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


def _load(path: Path) -> x509.Certificate | None:
    try:
        return x509.load_pem_x509_certificate(path.read_bytes())
    except (OSError, ValueError):
        return None


def _fresh(cert: x509.Certificate, margin: dt.timedelta) -> bool:
    now = _now()
    return cert.not_valid_before_utc <= now and cert.not_valid_after_utc - margin > now


def _signed_by(cert: x509.Certificate, ca: x509.Certificate) -> bool:
    try:
        cert.verify_directly_issued_by(ca)
        return True
    except (ValueError, TypeError, InvalidSignature):
        return False


def _ensure_ca(folder: Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey, bool]:
    cert_path, key_path = folder / f"{CA_NAME}.pem", folder / f"{CA_NAME}-key.pem"
    cert = _load(cert_path)
    if cert is not None and _fresh(cert, RENEW_BEFORE) and key_path.exists():
        key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
        if isinstance(key, ec.EllipticCurvePrivateKey) and key.public_key() == cert.public_key():
            return cert, key, False
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "Goodput"),
                      x509.NameAttribute(NameOID.COMMON_NAME, "Goodput development CA")])
    now = _now()
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=CA_DAYS))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                         crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256()))
    write_private(key_path, _key_pem(key))
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    log.info("created a development CA", extra={"path": str(cert_path)})
    return cert, key, True


def _leaf_ok(files: TlsFiles, ca: x509.Certificate, identity: str, prefix: str) -> bool:
    cert = _load(files.cert)
    if cert is None or not files.key.exists() or not _fresh(cert, RENEW_BEFORE) or not _signed_by(cert, ca):
        return False
    try:
        key = serialization.load_pem_private_key(files.key.read_bytes(), password=None)
    except (OSError, ValueError):
        return False
    try:
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return False
    return (key.public_key() == cert.public_key() and identity_of(files.cert.read_bytes(), prefix) == identity
            and PLATFORM_NAME in names.get_values_for_type(x509.DNSName))


def _issue(files: TlsFiles, ca: x509.Certificate, ca_key: ec.EllipticCurvePrivateKey, identity: str,
           prefix: str) -> None:
    key = ec.generate_private_key(ec.SECP256R1())
    now = _now()
    sans: list[x509.GeneralName] = [x509.UniformResourceIdentifier(spiffe_id(identity, prefix))]
    sans += [x509.DNSName(h) for h in DEV_HOSTS]
    sans += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in DEV_IPS]
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "Goodput"),
                                     x509.NameAttribute(NameOID.COMMON_NAME, identity)]))
            .issuer_name(ca.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=LEAF_DAYS))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            # Every service is both a server (its own API) and a client (its peers').
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    write_private(files.key, _key_pem(key))
    files.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def tls_files(folder: Path, identity: str) -> TlsFiles:
    """Where :func:`ensure_dev_pki` keeps ``identity``'s files in ``folder``."""
    return TlsFiles(cert=folder / f"{identity}.pem", key=folder / f"{identity}-key.pem", ca=folder / f"{CA_NAME}.pem")


def ensure_dev_pki(folder: Path, identities: Iterable[str], *, prefix: str = DEFAULT_PREFIX) -> dict[str, TlsFiles]:
    """A development CA in ``folder`` and a certificate per identity (its URI SAN under ``prefix``), reusing the
    files already there while they are valid (not expiring within a week, signed by the CA, naming the identity
    under ``prefix``, matching their key); a new CA issues every certificate again. Keys are written 0600, the
    folder 0700."""
    folder.mkdir(parents=True, exist_ok=True)
    folder.chmod(0o700)
    ca, ca_key, new_ca = _ensure_ca(folder)
    out: dict[str, TlsFiles] = {}
    for identity in identities:
        files = tls_files(folder, identity)
        if new_ca or not _leaf_ok(files, ca, identity, prefix):
            _issue(files, ca, ca_key, identity, prefix)
        out[identity] = files
    return out


# --- credentials from settings -------------------------------------------------------------------------------------

def configured_files(settings: TlsSettings, *, warn: bool = True) -> TlsFiles | None:
    """The settings' files, None when plaintext is asked for (with a warning, at every start); fails fast naming the
    missing settings (with the settings class's env prefix)."""
    prefix = str(getattr(type(settings), "model_config", {}).get("env_prefix", ""))
    if settings.insecure_internal:
        if warn:
            log.warning("internal gRPC is PLAINTEXT (%sINSECURE_INTERNAL=true): peers are not authenticated and calls "
                        "are not authorized by identity; never run it so in production", prefix)
        return None
    missing = [name for name, value in (("TLS_CERT_FILE", settings.tls_cert_file),
                                        ("TLS_KEY_FILE", settings.tls_key_file),
                                        ("TLS_CA_FILE", settings.tls_ca_file)) if not value]
    if missing:
        raise TlsConfigError(f"internal gRPC is mutual TLS: set {', '.join(prefix + m for m in missing)} "
                         f"(or {prefix}INSECURE_INTERNAL=true for plaintext, never in production)")
    return TlsFiles(Path(settings.tls_cert_file), Path(settings.tls_key_file), Path(settings.tls_ca_file))


class CertificateFiles:
    """One identity's certificate, key and CA, read again when their files change on disk (cert-manager renews the
    Secret and the kubelet swaps the mounted files): :meth:`poll` (a few ``stat`` calls) gives the new contents once
    the certificate and key on disk belong together. ``not_after`` is the end of the certificate last taken (the
    expiry gauge's value)."""

    def __init__(self, files: TlsFiles) -> None:
        self.files = files
        self.not_after = 0.0
        self._stamp: tuple[tuple[int, int, int], ...] | None = None
        self._lock = threading.Lock()

    def _stamp_now(self) -> tuple[tuple[int, int, int], ...]:
        return tuple((st.st_mtime_ns, st.st_size, st.st_ino) for st in map(os.stat, (self.files.cert, self.files.key,
                                                                                   self.files.ca)))

    def poll(self) -> tuple[bytes, bytes, bytes] | None:
        """The files' (certificate, key, CA) when they changed and make a valid pair, else None: keep the current
        ones. The first read's failure raises :class:`TlsConfigError`; a later one is logged and keeps them."""
        with self._lock:
            try:
                stamp = self._stamp_now()
                if stamp == self._stamp:
                    return None
                cert, key, ca = self.files.read()
                leaf = x509.load_pem_x509_certificate(cert)
                private = serialization.load_pem_private_key(key, password=None)
                if leaf.public_key().public_numbers() != private.public_key().public_numbers():  # type: ignore[union-attr]
                    return None  # caught between the certificate's write and the key's: the next poll looks again
            except (OSError, ValueError, TypeError, AttributeError) as err:
                if self._stamp is None:
                    raise TlsConfigError(f"cannot read the TLS files {self.files}: {err}") from err
                log.warning("TLS files unreadable; keeping the certificate already loaded", extra={"error": repr(err)})
                return None
            first, self._stamp = self._stamp is None, stamp
            self.not_after = leaf.not_valid_after_utc.timestamp()
            if not first:
                log.warning("TLS certificate reloaded", extra={"use": type(self).__name__, "serial":
                                                               f"{leaf.serial_number:x}",
                                                               "not_after": leaf.not_valid_after_utc.isoformat()})
            return cert, key, ca


class ServerCertificates(CertificateFiles):
    """A server's certificate: every new connection's handshake polls the files and gets the renewed pair without
    a restart; connections already open keep theirs."""

    def fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """The new configuration when the files changed (and make a valid pair), else None: keep the current one."""
        read = self.poll()
        return None if read is None else grpc.ssl_server_certificate_configuration([(read[1], read[0])],
                                                                                   root_certificates=read[2])

    def credentials(self) -> grpc.ServerCredentials:
        """Mutual TLS (a client certificate from the CA required) whose pair follows the files."""
        initial = self.fetch()
        assert initial is not None
        return grpc.dynamic_ssl_server_credentials(initial, self.fetch, require_client_authentication=True)


class ClientCertificates(CertificateFiles):
    """The certificate a process dials its peers with: :meth:`current` polls the files at most every
    ``CLIENT_CHECK_S`` and gives new credentials (and a new generation number) once they were renewed; the channels
    of :func:`goodput_core.clients.make_channel` then open new connections with them (gRPC's channel credentials
    are fixed, so the channel is replaced, not reconfigured)."""

    def __init__(self, files: TlsFiles) -> None:
        super().__init__(files)
        self.generation = 0
        self._next_check = 0.0
        read = self.poll()
        assert read is not None
        self._credentials = self._build(read)

    @staticmethod
    def _build(read: tuple[bytes, bytes, bytes]) -> grpc.ChannelCredentials:
        cert, key, ca = read
        return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)

    def current(self) -> tuple[int, grpc.ChannelCredentials]:
        now = time.monotonic()
        if now >= self._next_check:
            self._next_check = now + CLIENT_CHECK_S
            read = self.poll()
            if read is not None:
                self._credentials, self.generation = self._build(read), self.generation + 1
        return self.generation, self._credentials

    def expiry(self) -> float:
        """When the certificate the channels dial with (once they take the files as they are now) ends."""
        self.current()
        return self.not_after


def server_certificates(settings: TlsSettings) -> ServerCertificates | None:
    """The server's reloading certificates; None when ``insecure_internal`` is set."""
    files = configured_files(settings)
    return None if files is None else ServerCertificates(files)


def channel_credentials(settings: TlsSettings) -> ClientCertificates | None:
    """The service's own certificate for dialling its peers (theirs verified against the CA), followed when its
    files are renewed; one per set of files in a process (every channel, and the expiry gauge, read the same);
    None when insecure."""
    files = configured_files(settings)
    return None if files is None else _client_certificates(files)


@functools.cache
def _client_certificates(files: TlsFiles) -> ClientCertificates:
    return ClientCertificates(files)
