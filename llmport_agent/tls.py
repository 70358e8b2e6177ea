"""
TLS client settings for talking to the backend (HTTPS and WSS).

Verification is on by default with service-identity host name checks; C{CA_BUNDLE} replaces the
system trust store; C{VERIFY_TLS=false} turns verification off (and the session warns before the
first request and at every reconnect). L{describe_connection_error} turns a TLS failure into one
line that says what to set.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from OpenSSL import SSL
from twisted.internet import ssl
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


def client_tls_options(
    hostname: str, verify: bool, ca_bundle: str | None
) -> IOpenSSLClientConnectionCreator:
    """Connection creator for one backend host name."""
    if not verify:
        return _Unverified()
    return ssl.optionsForClientTLS(hostname, trustRoot=load_trust_root(ca_bundle))


@implementer(IOpenSSLClientConnectionCreator)
class _Unverified:
    """TLS without certificate verification (VERIFY_TLS=false)."""

    def __init__(self) -> None:
        self._options = ssl.CertificateOptions(verify=False, raiseMinimumTo=ssl.TLSVersion.TLSv1_2)

    def clientConnectionForTLS(self, tlsProtocol: Any) -> SSL.Connection:
        context = self._options.getContext()
        connection = SSL.Connection(context, None)
        connection.set_app_data(tlsProtocol)
        return connection


@implementer(IPolicyForHTTPS)
class _UnverifiedPolicy:
    def creatorForNetloc(self, hostname: bytes, port: int) -> Any:
        return _Unverified()


def https_policy(verify: bool, ca_bundle: str | None) -> Any:
    """The treq/Agent HTTPS policy for the backend."""
    if not verify:
        return _UnverifiedPolicy()
    return BrowserLikePolicyForHTTPS(trustRoot=load_trust_root(ca_bundle))


CA_HINT = (
    "if the backend's certificate comes from a private or self-signed CA, set "
    "LLM_PORT_NODE_AGENT_CA_BUNDLE to that CA's PEM file (LLM_PORT_NODE_AGENT_VERIFY_TLS=false "
    "turns the check off, for testing only)"
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


def describe_connection_error(obj: Any) -> str | None:
    """
    One line for a TLS failure inside C{obj} (a Failure or an exception, possibly wrapped by
    treq or Twisted's web client), saying what happened and what to set; C{None} when it is
    not a TLS failure.
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
            if "verify failed" in reason or "unknown ca" in reason or "self-signed" in reason:
                return f"TLS verification of the backend's certificate failed ({reason}); {CA_HINT}"
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
