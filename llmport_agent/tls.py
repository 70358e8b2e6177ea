"""
TLS client settings for talking to the backend (HTTPS and WSS).

Verification is on by default with service-identity host name checks; C{CA_BUNDLE} replaces the
system trust store; C{VERIFY_TLS=false} turns verification off (and the session warns at every
connect).
"""

from __future__ import annotations

from typing import Any

from OpenSSL import SSL
from twisted.internet import ssl
from twisted.internet.interfaces import IOpenSSLClientConnectionCreator
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
