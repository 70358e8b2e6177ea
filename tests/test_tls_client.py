"""
TLS settings of the original agent (issue 20 #5): TLS_CA_BUNDLE (CA_BUNDLE its alias),
TLS_CLIENT_CERT and TLS_CLIENT_KEY, against a real loopback stand-in backend that requires
client certificates: enrollment, the stream, rotation and node-file downloads present the
certificate; a refused handshake says which certificate was refused.
"""

from __future__ import annotations

import datetime
import json
import os
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from twisted.internet import reactor
from twisted.trial.unittest import SynchronousTestCase

from llmport_agent.core.config import ConfigError, load_config
from llmport_agent.devbackend import DevBackend
from llmport_agent.devbackend.tls import make_test_tls
from llmport_agent.session.tls import ClientCertError, load_client_certificate
from tests.agentharness import AgentTestCase
from tests.test_operator_texts import Captured

P = "LLM_PORT_NODE_AGENT_"


def _write(path: str, data: bytes, mode: int = 0o644) -> str:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    return path


def make_client_pki(directory: str, name: str = "client") -> dict[str, str]:
    """A CA and a client certificate it issued (clientAuth), as PEM files in C{directory}."""
    directory = os.path.abspath(directory)
    os.makedirs(directory, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"{name} client CA")])
    ca = (
        x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
        .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"{name} node")]))
        .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    key_pem = key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    enc_pem = key.private_bytes(pem, serialization.PrivateFormat.PKCS8,
                                serialization.BestAvailableEncryption(b"pass"))
    j = os.path.join
    return {
        "ca": _write(j(directory, "client-ca.pem"), ca.public_bytes(pem)),
        "cert": _write(j(directory, "client.pem"), cert.public_bytes(pem)),
        "key": _write(j(directory, "client-key.pem"), key_pem, 0o600),
        "both": _write(j(directory, "client-both.pem"), cert.public_bytes(pem) + key_pem, 0o600),
        "encrypted": _write(j(directory, "client-enc.pem"), enc_pem, 0o600),
    }


class SettingsTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.server = make_test_tls(self.mktemp())
        self.pki = make_client_pki(self.mktemp())
        self.other = make_client_pki(self.mktemp(), "other")

    def test_tls_ca_bundle_and_its_alias(self) -> None:
        self.assertEqual(load_config({P + "TLS_CA_BUNDLE": self.server.ca_pem}).ca_bundle, self.server.ca_pem)
        self.assertEqual(load_config({P + "CA_BUNDLE": self.server.ca_pem}).ca_bundle, self.server.ca_pem)
        same = load_config({P + "CA_BUNDLE": self.server.ca_pem, P + "TLS_CA_BUNDLE": self.server.ca_pem})
        self.assertEqual(same.ca_bundle, self.server.ca_pem)

    def test_both_set_and_different_is_one_error(self) -> None:
        e = self.assertRaises(ConfigError, load_config,
                              {P + "CA_BUNDLE": self.server.ca_pem, P + "TLS_CA_BUNDLE": self.pki["ca"]})
        self.assertIn("TLS_CA_BUNDLE", str(e))
        self.assertIn("CA_BUNDLE", str(e))
        self.assertIn("different", str(e))
        self.assertNotIn("\n", str(e))

    def test_client_certificate_and_key(self) -> None:
        c = load_config({P + "TLS_CLIENT_CERT": self.pki["cert"], P + "TLS_CLIENT_KEY": self.pki["key"]})
        self.assertEqual((c.tls_client_cert, c.tls_client_key), (self.pki["cert"], self.pki["key"]))
        # A certificate file that holds its key too.
        self.assertEqual(load_config({P + "TLS_CLIENT_CERT": self.pki["both"]}).tls_client_key, None)

    def test_bad_client_settings_are_one_line_each(self) -> None:
        cases = [
            ({P + "TLS_CLIENT_KEY": self.pki["key"]}, "TLS_CLIENT_CERT is not"),
            ({P + "TLS_CLIENT_CERT": self.pki["cert"]}, "holds no PEM private key"),
            ({P + "TLS_CLIENT_CERT": self.pki["cert"], P + "TLS_CLIENT_KEY": self.other["key"]},
             "does not belong to the certificate"),
            ({P + "TLS_CLIENT_CERT": self.pki["cert"], P + "TLS_CLIENT_KEY": self.pki["encrypted"]},
             "encrypted"),
            ({P + "TLS_CLIENT_CERT": self.pki["key"], P + "TLS_CLIENT_KEY": self.pki["key"]},
             "holds no PEM certificate"),
            ({P + "TLS_CLIENT_CERT": "/nonexistent.pem"}, "no such file"),
        ]
        for env, text in cases:
            e = self.assertRaises(ConfigError, load_config, env)
            self.assertIn(text, str(e), env)
            self.assertNotIn("\n", str(e))

    def test_loader_checks_the_pair(self) -> None:
        self.assertRaises(ClientCertError, load_client_certificate, self.pki["cert"], self.other["key"])
        load_client_certificate(self.pki["cert"], self.pki["key"])

    def test_loki_gets_the_ca_only(self) -> None:
        """Loki is another server: it gets the CA bundle, never the backend's client certificate."""
        import llmport_agent.logs.wiring as wiring

        calls: list[tuple[Any, ...]] = []
        real = __import__("llmport_agent.session.tls", fromlist=["https_policy"]).https_policy

        def spy(*args: Any) -> Any:
            calls.append(args)
            return real(*args)

        import llmport_agent.session.tls as tls_module

        self.patch(tls_module, "https_policy", spy)
        c = load_config({P + "TLS_CA_BUNDLE": self.server.ca_pem, P + "TLS_CLIENT_CERT": self.pki["cert"],
                         P + "TLS_CLIENT_KEY": self.pki["key"], P + "LOKI_URL": "https://127.0.0.1:1",
                         P + "LOKI_SPOOL_MAX_MB": "0"})
        from twisted.internet.task import Clock

        wiring.build_log_shipping(Clock(), c, state_dir=self.mktemp(), host=lambda: "h", secrets=lambda: [])
        self.assertEqual(calls, [(c.verify_tls, self.server.ca_pem)])


class MutualTLSTests(AgentTestCase):
    """A real loopback stand-in backend that requires a client certificate from its client CA."""

    timeout = 60

    async def mtls_backend(self) -> tuple[DevBackend, dict[str, str], Any]:
        server = make_test_tls(self.mktemp())
        pki = make_client_pki(self.mktemp())
        backend = DevBackend(reactor)
        self.watch_backend(backend)
        await backend.listen(0, "127.0.0.1", tls=server, client_ca=pki["ca"])
        self.addCleanup(backend.stop)
        return backend, pki, server

    async def test_enroll_stream_rotate_and_files_over_mtls(self) -> None:
        backend, pki, server = await self.mtls_backend()
        agent = self.start_agent(backend, TLS_CA_BUNDLE=server.ca_pem,
                                 TLS_CLIENT_CERT=pki["cert"], TLS_CLIENT_KEY=pki["key"])
        node_id = await self.wait_connected(backend, agent)
        self.assertTrue(backend.url.startswith("https://"))
        old = agent.state.credential
        self.assertTrue(await agent.session.rotate())
        self.assertNotEqual(agent.state.credential, old)
        # Model blobs and image transfers go through this same client (and its TLS policy).
        self.assertIs(agent.models._http, agent.http)
        response = await agent.http.get(
            backend.url + "/api/node-files/whoami",
            headers={"Authorization": f"Bearer {agent.state.credential}"},
        )
        self.assertEqual(response.code, 200)
        self.assertEqual(json.loads(await response.content())["node_id"], node_id)

    async def enroll_fails_with(self, **extra: str) -> str:
        captured = Captured(self)
        backend, pki, server = await self.mtls_backend()
        extra.setdefault("TLS_CA_BUNDLE", server.ca_pem)
        self.start_agent(backend, **extra)
        await backend.wait_for(lambda: any("Enrollment failed" in t for t in captured.lines()), 15)
        line = next(t for t in captured.lines() if "Enrollment failed" in t)
        self.assertNotIn("<twisted.python.failure.Failure", line)
        self.assertEqual(backend.state.nodes, {})
        return line

    async def test_no_client_certificate(self) -> None:
        line = await self.enroll_fails_with()
        self.assertIn("requires a TLS client certificate", line)
        self.assertIn("LLM_PORT_NODE_AGENT_TLS_CLIENT_CERT", line)

    async def test_client_certificate_of_another_ca_refused_by_the_server(self) -> None:
        other = make_client_pki(self.mktemp(), "other")
        line = await self.enroll_fails_with(TLS_CLIENT_CERT=other["cert"], TLS_CLIENT_KEY=other["key"])
        self.assertIn("refused this node's TLS client certificate", line)
        self.assertIn(other["cert"], line)
        self.assertNotIn("server certificate", line)

    async def test_server_certificate_not_trusted_here(self) -> None:
        pki_dir = self.mktemp()
        other = make_client_pki(pki_dir, "x")
        # A valid client certificate is beside the point: the backend's certificate is not trusted.
        line = await self.enroll_fails_with(TLS_CA_BUNDLE=other["ca"], TLS_CLIENT_CERT=other["cert"],
                                            TLS_CLIENT_KEY=other["key"])
        self.assertIn("server certificate is not trusted here", line)
        self.assertIn("LLM_PORT_NODE_AGENT_TLS_CA_BUNDLE", line)

    async def test_stream_says_which_certificate(self) -> None:
        """With a stored credential (no enrollment): the stream's refusal line names the client certificate."""
        captured = Captured(self)
        backend, pki, server = await self.mtls_backend()
        reply = backend.enroll_node("mtls-node")
        state_dir = self.mktemp()
        os.makedirs(state_dir)
        with open(os.path.join(state_dir, "state.json"), "w") as f:
            json.dump({"credential": reply["credential"], "node_id": reply["node_id"]}, f)
        self.start_agent(backend, state_dir=state_dir, token=False, AGENT_ID="mtls-node",
                         TLS_CA_BUNDLE=server.ca_pem)
        await backend.wait_for(lambda: any("Could not open the backend stream" in t for t in captured.lines()), 15)
        line = next(t for t in captured.lines() if "Could not open the backend stream" in t)
        self.assertIn("requires a TLS client certificate", line)



