"""A real OCI registry for tests: Debian's ``docker-registry`` (distribution 2.8) on a free port.

Storage is the filesystem driver under a temporary folder. Modes:
``open`` (anonymous push and pull), ``basic`` (htpasswd: user ``pusher``, password
``secret``), ``token`` (the registry's token auth: Bearer JWTs from a small token
service beside it, signed with a throwaway key whose certificate is the registry's
``rootcertbundle``; the token service takes the same user and password), ``readonly``
(maintenance read-only mode: every push is refused).
Install it with ``apt-get install -y docker-registry``.
"""

from __future__ import annotations

import asyncio
import base64
import datetime
import json
import os
import shutil
import subprocess
import time
import uuid
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa
from cryptography.x509.oid import NameOID
from tornado import web
from tornado.httpclient import AsyncHTTPClient
from tornado.httpserver import HTTPServer

from .ports import free_port

REGISTRY_BIN = "/usr/bin/docker-registry"
USER = "pusher"
PASSWORD = "secret"
# bcrypt of PASSWORD (distribution's htpasswd accepts bcrypt only)
PASSWORD_BCRYPT = "$2b$05$abcdefghijklmnopqrstuuOQiyCxlgf/oeuTqixKmWdcYUh4Hjl0a"


def docker_config(path: Path, host: str, user: str = USER, password: str = PASSWORD) -> Path:
    """Write a docker config JSON (the shape of a dockerconfigjson Secret) for ``host``."""
    auth = base64.b64encode(f"{user}:{password}".encode()).decode()
    path.write_text(json.dumps({"auths": {host: {"auth": auth}}}))
    return path


def _b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


class TokenService:
    """The registry token protocol's issuer: ``GET /token?service=&scope=`` with Basic auth → JWT."""

    service = "gpusnap-test-registry"
    issuer = "gpusnap-test-issuer"

    def __init__(self, root: Path):
        self.root = Path(root)
        self.port = free_port()
        self.key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "gpusnap test token issuer")])
        now = datetime.datetime.now(datetime.timezone.utc)
        self.cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(self.key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(self.key, hashes.SHA256())
        )
        self.cert_path = self.root / "token-issuer.pem"
        self.issued: list[str] = []  # scopes granted, for tests to look at
        self.server: HTTPServer | None = None

    @property
    def realm(self) -> str:
        return f"http://127.0.0.1:{self.port}/token"

    def token(self, subject: str, scope: str) -> str:
        access = []
        for item in filter(None, scope.split(" ")):
            kind, _, rest = item.partition(":")
            name, _, actions = rest.rpartition(":")
            access.append({"type": kind, "name": name, "actions": actions.split(",")})
        now = int(time.time())
        der = self.cert.public_bytes(serialization.Encoding.DER)
        header = {"typ": "JWT", "alg": "RS256", "x5c": [base64.b64encode(der).decode()]}
        claims = {
            "iss": self.issuer,
            "sub": subject,
            "aud": self.service,
            "exp": now + 300,
            "nbf": now - 10,
            "iat": now,
            "jti": uuid.uuid4().hex,
            "access": access,
        }
        signing_input = (
            f"{_b64url(json.dumps(header).encode())}.{_b64url(json.dumps(claims).encode())}"
        )
        signature = self.key.sign(signing_input.encode(), padding.PKCS1v15(), hashes.SHA256())
        return f"{signing_input}.{_b64url(signature)}"

    async def start(self) -> TokenService:
        self.root.mkdir(parents=True, exist_ok=True)
        self.cert_path.write_bytes(self.cert.public_bytes(serialization.Encoding.PEM))
        service = self

        class TokenHandler(web.RequestHandler):
            def get(self) -> None:
                scheme, _, value = self.request.headers.get("Authorization", "").partition(" ")
                user, _, password = (
                    base64.b64decode(value).decode().partition(":")
                    if scheme == "Basic"
                    else ("", "", "")
                )
                if (user, password) != (USER, PASSWORD):
                    self.set_status(401)
                    self.finish({"details": "incorrect username or password"})
                    return
                scope = self.get_argument("scope", "")
                service.issued.append(scope)
                token = service.token(user, scope)
                self.finish({"token": token, "access_token": token, "expires_in": 300})

        self.server = HTTPServer(web.Application([(r"/token", TokenHandler)]))
        self.server.listen(self.port, "127.0.0.1")
        return self

    def stop(self) -> None:
        if self.server:
            self.server.stop()


class Registry:
    """One ``docker-registry serve CONFIG`` process."""

    def __init__(self, root: Path, mode: str = "open"):
        self.root = Path(root)
        self.mode = mode
        self.port = free_port()
        self.host = f"127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.tokens = TokenService(self.root / "token") if mode == "token" else None

    def config_text(self) -> str:
        storage = self.root / "storage"
        storage.mkdir(parents=True, exist_ok=True)
        lines = [
            "version: 0.1",
            "log:",
            "  level: warn",
            "storage:",
            "  filesystem:",
            f"    rootdirectory: {storage}",
            "  delete:",
            "    enabled: true",
        ]
        if self.mode == "readonly":
            lines += ["  maintenance:", "    readonly:", "      enabled: true"]
        lines += ["http:", f"  addr: 127.0.0.1:{self.port}"]
        if self.mode == "basic":
            htpasswd = self.root / "htpasswd"
            htpasswd.write_text(f"{USER}:{PASSWORD_BCRYPT}\n")
            lines += ["auth:", "  htpasswd:", "    realm: gpusnap-test", f"    path: {htpasswd}"]
        if self.mode == "token":
            t = self.tokens
            lines += [
                "auth:",
                "  token:",
                f"    realm: {t.realm}",
                f"    service: {t.service}",
                f"    issuer: {t.issuer}",
                f"    rootcertbundle: {t.cert_path}",
            ]
        return "\n".join(lines) + "\n"

    async def start(self) -> Registry:
        if not os.path.exists(REGISTRY_BIN):
            raise RuntimeError(f"{REGISTRY_BIN} is missing: apt-get install -y docker-registry")
        self.root.mkdir(parents=True, exist_ok=True)
        if self.tokens:
            await self.tokens.start()
        config = self.root / "config.yml"
        config.write_text(self.config_text())
        self.log = open(self.root / "registry.log", "wb")
        self.proc = subprocess.Popen(
            [REGISTRY_BIN, "serve", str(config)], stdout=self.log, stderr=subprocess.STDOUT
        )
        client = AsyncHTTPClient()
        for _ in range(200):
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"docker-registry exited: {(self.root / 'registry.log').read_text()}"
                )
            try:
                r = await client.fetch(f"http://{self.host}/v2/", raise_error=False)
                if r.code in (200, 401):
                    return self
            except OSError:
                pass
            await asyncio.sleep(0.05)
        raise RuntimeError("docker-registry did not answer within 10 s")

    def stop(self) -> None:
        if self.tokens:
            self.tokens.stop()
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()

    def blob_files(self) -> list[Path]:
        return list((self.root / "storage").rglob("data"))

    def wipe(self) -> None:
        shutil.rmtree(self.root / "storage", ignore_errors=True)
