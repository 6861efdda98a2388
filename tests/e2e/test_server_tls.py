"""TLS and mutual TLS end to end: a real server with certificates, the SDK client on the other side;
and mutual TLS on the internal streams between the coordinator and the Ray worker actors.

Certificates are made here (a throwaway CA, a server certificate for localhost/127.0.0.1, a client
certificate), so the test needs no files and no network.
"""

from __future__ import annotations

import datetime
import ipaddress

import pytest

from duospec.coordinator.config import ServerSettings, TlsSettings
from duospec.sdk.aio import AsyncClient
from duospec.sdk.errors import Unavailable
from server_support import running_server, server_coordinator

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
    worker_key = _key()  # the internal data plane: one certificate for workers and coordinator alike
    write("worker", _cert("duospec worker", worker_key, ca.subject, ca_key, sans=(x509.DNSName("duospec-worker"),)),
          worker_key)
    return files


def _settings(pki, mutual: bool) -> ServerSettings:
    tls = TlsSettings(cert_file=str(pki["server"][0]), key_file=str(pki["server"][1]),
                      client_ca_file=str(pki["ca"][0]) if mutual else None)
    return ServerSettings(host="127.0.0.1", port=0, metrics_port=0, http_port=0, tls=tls)


async def test_tls_server_serves_a_client_that_trusts_its_ca(tiny_pair, pki):
    async with running_server(server_coordinator(tiny_pair), _settings(pki, mutual=False)) as harness:
        address = f"localhost:{harness.server.port}"
        async with AsyncClient(address, tls=str(pki["ca"][0]), timeout=60, max_retries=0) as client:
            result = await client.generate("def add(a, b):", max_new_tokens=6, ignore_eos=True)
            assert len(result.token_ids) == 6
        async with AsyncClient(address, timeout=10, max_retries=0) as plaintext:  # no TLS: no handshake
            with pytest.raises(Unavailable):
                await plaintext.generate("x", max_new_tokens=2)


async def test_mutual_tls_needs_a_client_certificate_from_the_ca(tiny_pair, pki):
    async with running_server(server_coordinator(tiny_pair), _settings(pki, mutual=True)) as harness:
        address = f"localhost:{harness.server.port}"
        async with AsyncClient(address, tls=str(pki["ca"][0]), client_cert_chain=str(pki["client"][0]),
                               client_private_key=str(pki["client"][1]), timeout=60, max_retries=0) as client:
            assert [card.name for card in await client.models()] == ["tiny"]
        async with AsyncClient(address, tls=str(pki["ca"][0]), timeout=10, max_retries=0) as anonymous:
            with pytest.raises(Unavailable):
                await anonymous.models()


@pytest.mark.ray
async def test_internal_streams_use_mutual_tls_and_refuse_plaintext_or_certless_peers(ray_runtime, pki, tmp_path):
    import grpc

    from duospec.cluster.secret import InternalTls, call_metadata
    from duospec.coordinator.api import FinishEvent, GenerationRequest, TokensEvent
    from duospec.coordinator.pipeline import start_pipeline
    from duospec.internal.v1 import pearl_pb2 as ipb
    from duospec.internal.v1 import pearl_pb2_grpc as ipb_grpc
    from exactness import hf_greedy, reference_model
    from pipeline_support import model_config
    from tiny_models import make_tiny_checkpoint

    target = make_tiny_checkpoint(tmp_path / "target", "llama", seed=41)
    draft = make_tiny_checkpoint(tmp_path / "draft", "llama", seed=42, hidden_size=32, num_layers=1)
    tls = InternalTls.from_files(str(pki["worker"][0]), str(pki["worker"][1]), str(pki["ca"][0]))
    assert "PRIVATE" not in repr(tls)
    coordinator = start_pipeline([model_config("mtls", target, draft)], internal_tls=tls)
    try:
        prompt = [5, 6, 7, 8]
        tokens = []
        async for event in coordinator.generate(GenerationRequest("r1", tuple(prompt), 16, model="mtls",
                                                                  ignore_eos=True)):
            if isinstance(event, TokensEvent):
                tokens.extend(event.token_ids)
            assert not isinstance(event, FinishEvent) or event.completion_tokens == 16

        assert tokens == hf_greedy(reference_model(str(target)), prompt, 16)
        pair = coordinator.pairs["mtls"]
        secret = pair.deployment_secret
        for info in (pair.target_info, pair.draft_info):
            endpoint = info["endpoint"]
            stranger_key = _key()  # a certificate the deployment's CA did not sign
            stranger = _cert("stranger", stranger_key, sans=(x509.DNSName("duospec-worker"),))
            from cryptography.hazmat.primitives import serialization

            untrusted = InternalTls(stranger.public_bytes(serialization.Encoding.PEM), _pem_key(stranger_key),
                                    tls.ca_pem)
            for channel in (grpc.aio.insecure_channel(endpoint),
                            grpc.aio.secure_channel(endpoint, grpc.ssl_channel_credentials(tls.ca_pem),
                                                    options=tls.channel_options()),  # no client certificate
                            grpc.aio.secure_channel(endpoint, untrusted.channel_credentials(),
                                                    options=tls.channel_options())):
                async with channel:
                    stub = ipb_grpc.TargetServiceStub(channel)
                    call = stub.Verify(iter([ipb.VerifyBatch(batch_id=1)]), metadata=call_metadata(secret),
                                       timeout=5)
                    with pytest.raises(grpc.aio.AioRpcError) as refused:
                        async for _ in call:
                            pass
                    assert refused.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
    finally:
        await coordinator.close()
