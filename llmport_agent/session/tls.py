"""
TLS client settings for talking to the backend (HTTPS and WSS).

Verification is on by default with service-identity host name checks; C{TLS_CA_BUNDLE} (alias
C{CA_BUNDLE}) replaces the system trust store; C{VERIFY_TLS=false} turns verification off (and the
session warns before the first request and at every reconnect). C{TLS_CLIENT_CERT} and
C{TLS_CLIENT_KEY} give the node a client certificate for backends that require one (mTLS).
L{describe_connection_error} turns a TLS failure into one line that says which certificate was
refused, and what to set.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from OpenSSL import SSL
from twisted.internet import ssl
from twisted.internet._sslverify import VerifyError
from twisted.internet.interfaces import IOpenSSLClientConnectionCreator
from twisted.python.failure import Failure
from twisted.web.client import BrowserLikePolicyForHTTPS
from twisted.web.iweb import IPolicyForHTTPS
from zope.interface import implementer


def load_trust_root(ca_bundle: str | None) -> Any:
    """The trust root for C{ca_bundle} (a PEM file of one or more CAs), or the platform's."""
    if not ca_bundle:
        return ssl.platformTrust()
    with open(ca_bundle, "rb") as f:
        data = f.read()
    certs = []
    marker = b"-----END CERTIFICATE-----"
    for chunk in data.split(marker):
        if b"-----BEGIN CERTIFICATE-----" in chunk:
            certs.append(ssl.Certificate.loadPEM(chunk + marker))
    return ssl.trustRootFromCertificates(certs)


class ClientCertError(ValueError):
    """The client certificate or key cannot be used. C{str()} is the one line to show."""


def load_client_certificate(cert_path: str, key_path: str | None) -> ssl.PrivateCertificate:
    """
    The client certificate with its key (C{key_path}, or the key inside C{cert_path}), checked
    to match. Blocking (two small file reads).

    @raise ClientCertError: unreadable, not PEM, encrypted, or a key of another certificate.
    """
    names = "LLM_PORT_NODE_AGENT_TLS_CLIENT_CERT" + (" and _TLS_CLIENT_KEY" if key_path else "")
    try:
        with open(cert_path, "rb") as f:
            cert_pem = f.read(1 << 20)
        key_pem = cert_pem
        if key_path:
            with open(key_path, "rb") as f:
                key_pem = f.read(1 << 20)
    except OSError as e:
        raise ClientCertError(f"{names}: cannot read {e.filename} ({e.strerror})") from None
    if b"-----BEGIN CERTIFICATE-----" not in cert_pem:
        raise ClientCertError(f"LLM_PORT_NODE_AGENT_TLS_CLIENT_CERT={cert_path!r} holds no PEM certificate")
    if b"PRIVATE KEY-----" not in key_pem:
        where = f"LLM_PORT_NODE_AGENT_TLS_CLIENT_KEY={key_path!r}" if key_path else (
            f"LLM_PORT_NODE_AGENT_TLS_CLIENT_CERT={cert_path!r} (no TLS_CLIENT_KEY is set)")
        raise ClientCertError(f"{where} holds no PEM private key")
    if b"ENCRYPTED" in key_pem:
        raise ClientCertError(f"{names}: the private key is encrypted; expected an unencrypted PEM key "
                              "(openssl pkey -in key.pem -out plain.pem), readable by the agent only")
    try:
        private = ssl.PrivateCertificate.loadPEM(cert_pem + b"\n" + key_pem)
        check = SSL.Context(SSL.TLS_METHOD)
        check.use_certificate(private.original)
        check.use_privatekey(private.privateKey.original)
        check.check_privatekey()  # SSL.Error when the key is not the certificate's
    except (SSL.Error, VerifyError):
        raise ClientCertError(f"{names}: the private key does not belong to the certificate") from None
    except Exception as e:  # noqa: BLE001 - any parse error: one line, no traceback
        raise ClientCertError(f"{names}: cannot be loaded ({type(e).__name__}); expected PEM files") from None
    return private


def client_tls_options(
    hostname: str,
    verify: bool,
    ca_bundle: str | None,
    client_cert: str | None = None,
    client_key: str | None = None,
) -> IOpenSSLClientConnectionCreator:
    """Connection creator for one backend host name (with the client certificate, if any)."""
    client = load_client_certificate(client_cert, client_key) if client_cert else None
    if not verify:
        return _Unverified(client)
    return ssl.optionsForClientTLS(hostname, trustRoot=load_trust_root(ca_bundle), clientCertificate=client)


@implementer(IOpenSSLClientConnectionCreator)
class _Unverified:
    """TLS without certificate verification (VERIFY_TLS=false)."""

    def __init__(self, client: ssl.PrivateCertificate | None = None) -> None:
        extra: dict[str, Any] = {}
        if client is not None:
            extra = {"privateKey": client.privateKey.original, "certificate": client.original}
        self._options = ssl.CertificateOptions(verify=False, raiseMinimumTo=ssl.TLSVersion.TLSv1_2, **extra)

    def clientConnectionForTLS(self, tlsProtocol: Any) -> SSL.Connection:
        context = self._options.getContext()
        connection = SSL.Connection(context, None)
        connection.set_app_data(tlsProtocol)
        return connection


@implementer(IPolicyForHTTPS)
class _UnverifiedPolicy:
    def __init__(self, client: ssl.PrivateCertificate | None = None) -> None:
        self._client = client

    def creatorForNetloc(self, hostname: bytes, port: int) -> Any:
        return _Unverified(self._client)


@implementer(IPolicyForHTTPS)
class _ClientCertPolicy:
    """Browser-like verification, presenting the node's client certificate (mTLS)."""

    def __init__(self, trust_root: Any, client: ssl.PrivateCertificate) -> None:
        self._trust_root = trust_root
        self._client = client

    def creatorForNetloc(self, hostname: bytes, port: int) -> Any:
        return ssl.optionsForClientTLS(
            hostname.decode("ascii"), trustRoot=self._trust_root, clientCertificate=self._client
        )


def https_policy(
    verify: bool, ca_bundle: str | None, client_cert: str | None = None, client_key: str | None = None
) -> Any:
    """
    The treq/Agent HTTPS policy for the backend (with the node's client certificate when
    C{client_cert} is set; Loki gets the CA only).
    """
    client = load_client_certificate(client_cert, client_key) if client_cert else None
    if not verify:
        return _UnverifiedPolicy(client)
    trust_root = load_trust_root(ca_bundle)
    if client is not None:
        return _ClientCertPolicy(trust_root, client)
    return BrowserLikePolicyForHTTPS(trustRoot=trust_root)


CA_HINT = (
    "if the backend's certificate comes from a private or self-signed CA, set "
    "LLM_PORT_NODE_AGENT_TLS_CA_BUNDLE (alias LLM_PORT_NODE_AGENT_CA_BUNDLE) to that CA's PEM "
    "file (LLM_PORT_NODE_AGENT_VERIFY_TLS=false turns the check off, for testing only)"
)

#: TLS alerts a server sends when it refuses the client's certificate (or its absence).
_CLIENT_CERT_ALERTS = (
    "alert certificate required",
    "alert bad certificate",
    "alert unknown ca",
    "alert certificate expired",
    "alert certificate revoked",
    "alert certificate unknown",
    "alert unsupported certificate",
    "alert access denied",
    "peer did not return a certificate",
)


def _causes(obj: Any, depth: int = 0) -> Iterator[BaseException]:
    """Every exception inside C{obj}: Failures, treq/web C{reasons} lists, causes."""
    if obj is None or depth > 8:
        return
    value = obj.value if isinstance(obj, Failure) else obj
    if not isinstance(value, BaseException) or isinstance(value, Failure):
        return
    yield value
    for reason in getattr(value, "reasons", None) or ():
        yield from _causes(reason, depth + 1)
    for nested in (value.__cause__, value.__context__):
        if nested is not None and nested is not value:
            yield from _causes(nested, depth + 1)


def _ssl_reason(exc: BaseException) -> str:
    """C{certificate verify failed} from C{[('SSL routines', '', 'certificate verify failed')]}."""
    parts: list[str] = []
    for arg in exc.args:
        items = arg if isinstance(arg, list) else [arg]
        for item in items:
            if isinstance(item, tuple) and item:
                parts.append(str(item[-1]))
            elif item:
                parts.append(str(item))
    return "; ".join(p for p in parts if p) or type(exc).__name__


def describe_connection_error(obj: Any, client_cert: str | None = None) -> str | None:
    """
    One line for a TLS failure inside C{obj} (a Failure or an exception, possibly wrapped by
    treq or Twisted's web client), saying which certificate was refused (the backend's, not
    trusted here; or this node's client certificate, refused by the backend) and what to set;
    C{None} when it is not a TLS failure.

    @param client_cert: the configured C{TLS_CLIENT_CERT} (named in the line), if any.
    """
    for exc in _causes(obj):
        name = type(exc).__name__
        module = type(exc).__module__
        if module.startswith("service_identity") or name in ("VerificationError", "CertificateError"):
            return (
                "the backend's TLS certificate is not valid for the host name in "
                f"LLM_PORT_NODE_AGENT_BACKEND_URL ({' '.join(str(exc).split())[:200] or name}); use the "
                f"name the certificate was issued for; {CA_HINT}"
            )
        if isinstance(exc, SSL.Error):
            reason = _ssl_reason(exc)
            if any(alert in reason for alert in _CLIENT_CERT_ALERTS):
                # The server's alert: it is the node's certificate that was refused.
                if client_cert:
                    return (
                        f"the backend refused this node's TLS client certificate ({reason}): "
                        f"LLM_PORT_NODE_AGENT_TLS_CLIENT_CERT={client_cert} is not issued by a CA the "
                        "backend trusts, or has expired or been revoked; set it (and TLS_CLIENT_KEY) "
                        "to a certificate the backend accepts"
                    )
                return (
                    f"the backend requires a TLS client certificate (mTLS) and this node presents "
                    f"none ({reason}); set LLM_PORT_NODE_AGENT_TLS_CLIENT_CERT and "
                    "LLM_PORT_NODE_AGENT_TLS_CLIENT_KEY to the node's certificate and key"
                )
            if "verify failed" in reason or "self-signed" in reason or "unknown ca" in reason:
                return (
                    f"TLS verification of the backend's certificate failed: the backend's server "
                    f"certificate is not trusted here ({reason}); {CA_HINT}"
                )
            return (
                f"the TLS handshake with the backend failed ({reason}); check that "
                "LLM_PORT_NODE_AGENT_BACKEND_URL says https only for a TLS endpoint (and http "
                "for a plain one)"
            )
    return None


def innermost_error(obj: Any) -> BaseException | None:
    """The deepest exception inside C{obj} (what actually failed), or C{None}."""
    last: BaseException | None = None
    for exc in _causes(obj):
        last = exc
    return last
