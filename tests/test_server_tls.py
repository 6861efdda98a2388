"""TLS and mutual TLS end to end: a real server with certificates, the SDK client on the other side.

Certificates are made here (a throwaway CA, a server certificate for localhost/127.0.0.1, a client
certificate), so the test needs no files and no network.
"""

from __future__ import annotations

import datetime
import ipaddress

import pytest

from coordinator.config import ServerSettings, TlsSettings
from duospec.sdk.aio import AsyncClient
from duospec.sdk.errors import Unavailable
from test_server_support import running_server, server_coordinator
from test_server_support import tiny_pair  # noqa: F401  (fixture)

x509 = pytest.importorskip("cryptography.x509", reason="the dev extra's `cryptography` makes the test certificates")


def _key():
    from cryptography.hazmat.primitives.asymmetric import ec

    return ec.generate_private_key(ec.SECP256R1())


def _pem_key(key) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _cert(subject: str, key, issuer_name=None, issuer_key=None, *, ca=False, sans=()):
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import NameOID

    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(name).issuer_name(issuer_name or name)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(list(sans)), critical=False)
    return builder.sign(issuer_key or key, hashes.SHA256())


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    from cryptography.hazmat.primitives import serialization

    root = tmp_path_factory.mktemp("pki")
    ca_key = _key()
    ca = _cert("duospec test CA", ca_key, ca=True)
    files = {}

    def write(name: str, cert, key) -> None:
        files[name] = (root / f"{name}.pem", root / f"{name}.key")
        files[name][0].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        files[name][1].write_bytes(_pem_key(key))

    write("ca", ca, ca_key)
    server_key, client_key = _key(), _key()
    write("server", _cert("localhost", server_key, ca.subject, ca_key,
                          sans=(x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1")))),
          server_key)
    write("client", _cert("duospec test client", client_key, ca.subject, ca_key), client_key)
    return files


def _settings(pki, mutual: bool) -> ServerSettings:
    tls = TlsSettings(cert_file=str(pki["server"][0]), key_file=str(pki["server"][1]),
                      client_ca_file=str(pki["ca"][0]) if mutual else None)
    return ServerSettings(host="127.0.0.1", port=0, metrics_port=0, http_port=0, tls=tls)


async def test_tls_server_serves_a_client_that_trusts_its_ca(tiny_pair, pki):  # noqa: F811
    async with running_server(server_coordinator(tiny_pair), _settings(pki, mutual=False)) as harness:
        address = f"localhost:{harness.server.port}"
        async with AsyncClient(address, tls=str(pki["ca"][0]), timeout=60, max_retries=0) as client:
            result = await client.generate("def add(a, b):", max_new_tokens=6, ignore_eos=True)
            assert len(result.token_ids) == 6
        async with AsyncClient(address, timeout=10, max_retries=0) as plaintext:  # no TLS: no handshake
            with pytest.raises(Unavailable):
                await plaintext.generate("x", max_new_tokens=2)


async def test_mutual_tls_needs_a_client_certificate_from_the_ca(tiny_pair, pki):  # noqa: F811
    async with running_server(server_coordinator(tiny_pair), _settings(pki, mutual=True)) as harness:
        address = f"localhost:{harness.server.port}"
        async with AsyncClient(address, tls=str(pki["ca"][0]), client_cert_chain=str(pki["client"][0]),
                               client_private_key=str(pki["client"][1]), timeout=60, max_retries=0) as client:
            assert [card.name for card in await client.models()] == ["tiny"]
        async with AsyncClient(address, tls=str(pki["ca"][0]), timeout=10, max_retries=0) as anonymous:
            with pytest.raises(Unavailable):
                await anonymous.models()
