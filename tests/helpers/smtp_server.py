"""A real SMTP server for tests: aiosmtpd on a free port, STARTTLS or implicit TLS, AUTH required.

The certificate is self-signed and generated at test time (``cryptography``) for
``localhost`` / ``127.0.0.1``; clients verify it by passing :attr:`SmtpServer.ca_file`.
Every accepted message is parsed and kept in :attr:`SmtpServer.messages`, so a test
reads exactly what a mail client would receive.
"""

from __future__ import annotations

import datetime
import email
import email.policy
import ipaddress
import ssl
import threading
from dataclasses import dataclass, field
from email.message import EmailMessage
from pathlib import Path

from aiosmtpd.controller import Controller
from aiosmtpd.smtp import AuthResult, LoginPassword
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from .ports import free_port


def make_self_signed(directory: Path) -> tuple[Path, Path]:
    """Write a self-signed certificate and key for localhost into ``directory``."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_file = directory / "smtp-cert.pem"
    key_file = directory / "smtp-key.pem"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_file, key_file


@dataclass
class Received:
    """One delivered message: the SMTP envelope, the parsed message and who logged in."""

    mail_from: str
    rcpt_tos: list[str]
    message: EmailMessage
    login: str | None

    @property
    def subject(self) -> str:
        # A folded header unfolds to a leading space; mail clients drop it, so do we.
        return str(self.message["Subject"]).strip()

    def part(self, subtype: str) -> str:
        """The decoded ``text/<subtype>`` body ("plain" or "html")."""
        body = self.message.get_body(preferencelist=(subtype,))
        assert body is not None and body.get_content_subtype() == subtype, f"no text/{subtype}"
        return body.get_content()


@dataclass
class _Handler:
    server: SmtpServer
    messages: list[Received] = field(default_factory=list)

    async def handle_DATA(self, smtp, session, envelope) -> str:
        parsed = email.message_from_bytes(envelope.original_content, policy=email.policy.default)
        login = session.auth_data.login.decode() if session.auth_data else None
        with self.server.lock:
            self.messages.append(
                Received(envelope.mail_from, list(envelope.rcpt_tos), parsed, login)
            )
        return "250 OK"


class SmtpServer:
    """aiosmtpd in its own thread; ``tls="starttls"`` (default), ``"implicit"`` or ``"none"``.

    With TLS, AUTH LOGIN/PLAIN is required with ``username``/``password``, and offered only
    once TLS is up, so a client must get both right to deliver anything. ``"none"`` is a
    plain relay that takes mail from anyone (like a local postfix).
    """

    def __init__(
        self,
        directory: Path,
        tls: str = "starttls",
        username: str = "mailer",
        password: str = "s3cret-pw",
    ) -> None:
        self.host = "127.0.0.1"
        self.port = free_port()
        self.tls = tls
        self.username = username
        self.password = password
        self.lock = threading.Lock()
        self.ca_file, key_file = make_self_signed(directory)
        self.ssl_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self.ssl_context.load_cert_chain(self.ca_file, key_file)
        self.auth_failures = 0
        self.handler = _Handler(self)
        smtp_kwargs = dict(
            authenticator=self._authenticate,
            auth_required=True,
            # aiosmtpd only knows about TLS it started itself (STARTTLS); on the implicit-TLS
            # listener every connection is TLS, so its own check must be off there.
            auth_require_tls=tls == "starttls",
        )
        if tls == "starttls":
            self.controller = Controller(
                self.handler,
                hostname=self.host,
                port=self.port,
                tls_context=self.ssl_context,
                require_starttls=True,
                **smtp_kwargs,
            )
        elif tls == "none":  # a relay on localhost: no TLS, no login
            self.controller = Controller(self.handler, hostname=self.host, port=self.port)
        elif tls == "implicit":
            self.controller = Controller(
                self.handler,
                hostname=self.host,
                port=self.port,
                ssl_context=self.ssl_context,
                **smtp_kwargs,
            )
        else:
            raise ValueError(f"tls must be 'starttls', 'implicit' or 'none', not {tls!r}")

    def _authenticate(self, server, session, envelope, mechanism, auth_data) -> AuthResult:
        ok = (
            mechanism in ("LOGIN", "PLAIN")
            and isinstance(auth_data, LoginPassword)
            and auth_data.login == self.username.encode()
            and auth_data.password == self.password.encode()
        )
        if not ok:
            self.auth_failures += 1
        # handled=False: aiosmtpd answers "535 authentication failed" itself
        return AuthResult(success=ok, handled=ok, auth_data=auth_data if ok else None)

    @property
    def messages(self) -> list[Received]:
        with self.lock:
            return list(self.handler.messages)

    def start(self) -> SmtpServer:
        self.controller.start()
        return self

    def stop(self) -> None:
        self.controller.stop()
