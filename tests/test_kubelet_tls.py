"""The agent verifies the kubelet's TLS certificate by default, with a clear error when it fails.

The fake kubelet serves real TLS with a certificate signed by a CA generated here
(``cryptography``); the agent's KubeletClient checkpoints through it with the right CA,
and is refused, naming the setting to change, with another CA or none.
"""

from __future__ import annotations

import datetime
import ipaddress
import ssl
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from jupyterhub_gpusnap.agent.kubelet import KubeletClient
from jupyterhub_gpusnap.kube import AgentError
from jupyterhub_gpusnap.kube.api import SA_DIR, KubeAPI
from tests.helpers.fake_kube import NODE, FakeKube, Workload

pytestmark = [pytest.mark.k8s]


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def make_ca(folder: Path, cn: str) -> tuple[Path, ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(cn))
        .issuer_name(_name(cn))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), False)
        .sign(key, hashes.SHA256())
    )
    path = folder / f"{cn}.crt"
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return path, key, cert


def kubelet_tls(folder: Path, ca_key, ca_cert) -> ssl.SSLContext:
    """A kubelet serving certificate for 127.0.0.1 (as serverTLSBootstrap issues), signed by the CA."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(
            x509.Name(
                [
                    x509.NameAttribute(NameOID.ORGANIZATION_NAME, "system:nodes"),
                    x509.NameAttribute(NameOID.COMMON_NAME, f"system:node:{NODE}"),
                ]
            )
        )
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName(NODE), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
        .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), False
        )
        .sign(ca_key, hashes.SHA256())
    )
    crt, pem = folder / "kubelet.crt", folder / "kubelet.key"
    crt.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    pem.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(crt, pem)
    return ctx


@pytest.fixture
async def tls_kube(tmp_path):
    """A fake cluster whose kubelet serves https with a certificate of ``cluster-ca``."""
    ca_path, ca_key, ca_cert = make_ca(tmp_path, "cluster-ca")
    kube = FakeKube(tmp_path / "kube", kubelet_ssl=kubelet_tls(tmp_path, ca_key, ca_cert))
    await kube.start()
    kube.add_node(NODE)
    token = tmp_path / "token"
    token.write_text(kube.add_token("system:serviceaccount:gpusnap:agent"))
    kube.ca_path = ca_path
    kube.token_path = token
    yield kube
    await kube.stop()


def client(kube: FakeKube, **traits) -> KubeletClient:
    api = KubeAPI(api_url=kube.api_url, token_file=str(kube.token_path))
    return KubeletClient(api, **traits)


def test_verification_is_on_by_default_with_the_cluster_ca():
    c = KubeletClient(KubeAPI(api_url="https://127.0.0.1:1"))
    assert c.verify_kubelet_tls is True
    assert c.kubelet_ca_file == f"{SA_DIR}/ca.crt"
    assert c.kubelet_scheme == "https"


async def test_checkpoint_over_verified_tls_with_the_right_ca(tls_kube, tmp_path):
    work = Workload(tmp_path).start()
    try:
        await work.wait_lines(2)
        tls_kube.add_pod("jhub", "jupyter-alice", NODE, workload=work)
        path = await client(tls_kube, kubelet_ca_file=str(tls_kube.ca_path)).checkpoint(
            NODE, "jhub", "jupyter-alice", "notebook", 30
        )
        assert path.startswith("/var/lib/kubelet/checkpoints/checkpoint-jupyter-alice_jhub-")
        assert tls_kube.checkpointed == ["jhub/jupyter-alice/notebook"]
        assert work.alive()  # the kubelet's checkpoint leaves the container running
    finally:
        work.stop()


async def test_wrong_ca_is_refused_naming_the_setting(tls_kube, tmp_path):
    other, _, _ = make_ca(tmp_path, "some-other-ca")
    tls_kube.add_pod("jhub", "jupyter-alice", NODE)
    with pytest.raises(AgentError) as err:
        await client(tls_kube, kubelet_ca_file=str(other)).checkpoint(
            NODE, "jhub", "jupyter-alice", "notebook", 30
        )
    e = err.value
    assert e.code == 502
    assert "failed verification against KubeletClient.kubelet_ca_file" in e.message
    assert str(other) in e.message and "certificate" in e.message
    assert "KubeletClient.kubelet_ca_file" in e.fix and "verify_kubelet_tls = False" in e.fix
    # the request never reached the kubelet: no token was handed to an unverified peer
    assert not any(path.startswith("/checkpoint/") for _, path, _ in tls_kube.requests)
    assert tls_kube.checkpointed == []


async def test_missing_ca_file_names_the_setting(tls_kube, tmp_path):
    tls_kube.add_pod("jhub", "jupyter-alice", NODE)
    missing = tmp_path / "no-such-ca.crt"
    with pytest.raises(AgentError) as err:
        await client(tls_kube, kubelet_ca_file=str(missing)).checkpoint(
            NODE, "jhub", "jupyter-alice", "notebook", 30
        )
    assert f"KubeletClient.kubelet_ca_file {missing} does not exist" in err.value.message
    assert "mount it into the agent pod" in err.value.fix


async def test_turning_verification_off_accepts_an_unknown_certificate(tls_kube, tmp_path):
    """The documented opt-out: a self-signed kubelet certificate on a trusted network."""
    tls_kube.kubelet_mode = "gate-off"  # any HTTP answer proves the TLS handshake passed
    tls_kube.add_pod("jhub", "jupyter-alice", NODE)
    with pytest.raises(AgentError, match="404 from the kubelet"):
        await client(
            tls_kube, verify_kubelet_tls=False, kubelet_ca_file=str(tmp_path / "none")
        ).checkpoint(NODE, "jhub", "jupyter-alice", "notebook", 30)
    assert ("POST", "/checkpoint/jhub/jupyter-alice/notebook?timeout=30", None) in tls_kube.requests
