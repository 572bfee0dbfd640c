"""OCI checkpoint images: pure building of config and manifest, and a distribution-API client.

A Kubernetes checkpoint archive (the kubelet's uncompressed tar of ``config.dump``,
``spec.dump``, ``checkpoint/``, ``rootfs-diff.tar``, ``dump.log``, ``stats-dump``) becomes
an image with exactly one layer: the archive itself, unchanged. It already is a tar of
the archive's contents, so its sha256 is both the layer digest and the config's
``diff_id`` and it is read once, streamed, never rewritten. CRI-O restores such an image
through the ``io.kubernetes.cri-o.annotations.checkpoint.name`` annotation, containerd
2.1–2.3 through ``org.criu.checkpoint.container.name``; our own annotations name the
server and its GPU footprint.

The client speaks the OCI distribution API over tornado: blob uploads (monolithic for
small blobs, chunked ``PATCH`` for large ones, hashing while reading), ``HEAD`` of
blobs, manifests by tag or digest, and Basic or Bearer (token service) auth with
credentials from a docker config JSON (a ``kubernetes.io/dockerconfigjson`` Secret).

Requests that fail for a moment (no answer, 500, 502, 503, 504) are tried again with
backoff (:class:`~jupyterhub_gpusnap.retry.Backoff`); a 4xx never is. A chunked upload
resumes instead of starting over: after a failed ``PATCH`` it asks the registry how far
the upload got (``GET`` on the upload URL, whose ``Range: 0-<last byte>`` says it) and
sends only the rest. A registry that dropped the upload meanwhile (distribution cancels
one whose state no longer matches what it holds) answers 404 or 400, and the upload starts
again from its first byte.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlencode, urljoin, urlparse

from tornado.httpclient import AsyncHTTPClient, HTTPClientError, HTTPRequest, HTTPResponse
from traitlets import Float, Instance, Integer, Unicode, default
from traitlets.config import LoggingConfigurable

from ..retry import Backoff

MANIFEST_TYPE = "application/vnd.oci.image.manifest.v1+json"
CONFIG_TYPE = "application/vnd.oci.image.config.v1+json"
LAYER_TYPE = "application/vnd.oci.image.layer.v1.tar"

ANNOTATION_CRIO = "io.kubernetes.cri-o.annotations.checkpoint.name"
ANNOTATION_CRIU = "org.criu.checkpoint.container.name"
ANNOTATION_SERVER = "org.jupyterhub.gpusnap.server"
ANNOTATION_GPU_BYTES = "org.jupyterhub.gpusnap.gpu-bytes"
ANNOTATION_CREATED = "org.jupyterhub.gpusnap.created"

READ_BLOCK = 1 << 20
#: Answers that say "not now" rather than "no" (599: no answer at all): tried again.
TRANSIENT = (500, 502, 503, 504, 599)


class RegistryError(Exception):
    """The registry refused or failed a request; the message names the fix."""

    def __init__(self, message: str, code: int = 0):
        super().__init__(message)
        self.code = code


@dataclass
class Descriptor:
    """An OCI content descriptor: what a manifest says about one blob."""

    media_type: str
    digest: str
    size: int
    annotations: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        d = {"mediaType": self.media_type, "digest": self.digest, "size": self.size}
        if self.annotations:
            d["annotations"] = dict(self.annotations)
        return d


@dataclass
class ImageRef:
    """``registry/name[:tag][@digest]`` split into its parts."""

    registry: str
    name: str
    tag: str = ""
    digest: str = ""

    @classmethod
    def parse(cls, ref: str) -> ImageRef:
        """Parse a reference; the first path part is the registry host (``host:port`` allowed)."""
        rest, _, digest = ref.partition("@")
        registry, slash, path = rest.partition("/")
        if not slash or not path:
            raise ValueError(
                f"image reference {ref!r} has no registry host: write it as host[:port]/name[:tag]"
            )
        tag = ""
        last = path.rsplit("/", 1)[-1]
        if ":" in last:
            path, _, tag = path.rpartition(":")
        return cls(registry=registry, name=path, tag=tag, digest=digest)

    @property
    def repository(self) -> str:
        return f"{self.registry}/{self.name}"

    def with_digest(self, digest: str) -> str:
        return f"{self.repository}@{digest}"

    def __str__(self) -> str:
        s = self.repository
        if self.tag:
            s += f":{self.tag}"
        if self.digest:
            s += f"@{self.digest}"
        return s


def sha256_file(path: str | os.PathLike) -> tuple[str, int]:
    """Return (``sha256:…`` digest, size) of a file, reading it in blocks."""
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while block := f.read(READ_BLOCK):
            h.update(block)
            size += len(block)
    return "sha256:" + h.hexdigest(), size


def digest_bytes(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def tag_for(text: str, created: float) -> str:
    """A valid tag (``[A-Za-z0-9_][A-Za-z0-9._-]{0,127}``) naming a server and a time."""
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "-", text).strip(".-") or "server"
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(created))
    return f"{safe[:100]}-{stamp}"


def image_config(
    diff_id: str, created: float, architecture: str = "amd64", os_name: str = "linux"
) -> bytes:
    """The image config JSON (OCI image spec): platform, creation time, the one layer's diff_id."""
    config = {
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(created)),
        "architecture": architecture,
        "os": os_name,
        "config": {},
        "rootfs": {"type": "layers", "diff_ids": [diff_id]},
        "history": [
            {"created_by": "jupyterhub-gpusnap checkpoint", "comment": "checkpoint archive"}
        ],
    }
    return json.dumps(config, sort_keys=True, separators=(",", ":")).encode()


def checkpoint_annotations(
    container: str, server: str, gpu_bytes: int, created: float, extra: dict | None = None
) -> dict:
    """Manifest annotations: the runtimes' checkpoint markers plus ours."""
    ann = {
        ANNOTATION_CRIO: container,
        ANNOTATION_CRIU: container,
        ANNOTATION_SERVER: server,
        ANNOTATION_GPU_BYTES: str(int(gpu_bytes)),
        ANNOTATION_CREATED: time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(created)),
    }
    ann.update(extra or {})
    return ann


def image_manifest(config: Descriptor, layers: list[Descriptor], annotations: dict) -> bytes:
    """The image manifest JSON (``application/vnd.oci.image.manifest.v1+json``)."""
    manifest = {
        "schemaVersion": 2,
        "mediaType": MANIFEST_TYPE,
        "config": config.as_dict(),
        "layers": [layer.as_dict() for layer in layers],
        "annotations": dict(annotations),
    }
    return json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()


def load_docker_config(path: str | os.PathLike) -> dict[str, tuple[str, str]]:
    """Read ``{"auths": {host: {"auth": b64(user:pass)} | {"username", "password"}}}``.

    Accepts both a ``~/.docker/config.json`` and the ``.dockerconfigjson`` key of a
    ``kubernetes.io/dockerconfigjson`` Secret mounted as a file. Returns host → (user, password).
    """
    data = json.loads(Path(path).read_text())
    creds: dict[str, tuple[str, str]] = {}
    for host, entry in (data.get("auths") or {}).items():
        user, password = entry.get("username", ""), entry.get("password", "")
        if entry.get("auth"):
            user, _, password = base64.b64decode(entry["auth"]).decode().partition(":")
        key = urlparse(host).netloc if "://" in host else host.rstrip("/")
        creds[key] = (user, password)
    return creds


def transient(e: BaseException) -> bool:
    """A registry failure worth another try: no answer, or a 5xx that says "not now"."""
    return isinstance(e, RegistryError) and e.code in TRANSIENT


def _range_end(header: str) -> int | None:
    """The last byte of ``Range: 0-<last>`` (the registry's upload progress), or None."""
    match = re.fullmatch(r"\s*(?:bytes=)?0-(\d+)\s*", header or "")
    return int(match.group(1)) if match else None


class _ChunkHasher:
    """sha256 of a file uploaded in chunks, some sent more than once after a failure:
    every byte is hashed once, in order, however often its chunk is read."""

    def __init__(self):
        self._h = hashlib.sha256()
        self._done = 0

    def update_at(self, offset: int, chunk: bytes) -> None:
        if offset > self._done:
            raise ValueError(f"chunk at {offset} skips bytes {self._done}-{offset - 1}")
        if offset + len(chunk) > self._done:
            self._h.update(chunk[self._done - offset :])
            self._done = offset + len(chunk)

    def hexdigest(self, size: int) -> str:
        if self._done != size:
            raise ValueError(f"hashed {self._done} of {size} bytes")
        return "sha256:" + self._h.hexdigest()


def _parse_challenge(header: str) -> tuple[str, dict[str, str]]:
    scheme, _, rest = header.strip().partition(" ")
    params = dict(re.findall(r'(\w+)="([^"]*)"', rest))
    return scheme.lower(), params


class RegistryClient(LoggingConfigurable):
    """A small OCI distribution API client for one registry host.

    Every request goes through :meth:`request`, which answers a 401 challenge once
    (Basic with the configured credentials, or a Bearer token fetched from the
    challenge's realm) and turns failures into :class:`RegistryError` naming the fix.
    """

    scheme = Unicode(
        "https",
        help="'https' for real registries; 'http' only for a registry on a trusted network "
        "(a local test registry, a node-local mirror).",
    ).tag(config=True)

    docker_config_path = Unicode(
        "",
        help="Path of a docker config JSON with push credentials for the registry, e.g. the "
        "'.dockerconfigjson' key of a kubernetes.io/dockerconfigjson Secret mounted into the agent "
        "pod (/etc/gpusnap/registry/.dockerconfigjson). Empty: anonymous.",
    ).tag(config=True)

    ca_file = Unicode(
        "",
        help="CA bundle that signs the registry's TLS certificate, when it is not in the system store.",
    ).tag(config=True)

    chunk_size = Integer(
        64 << 20,
        help="Bytes per PATCH of a chunked blob upload. Each chunk is held in memory once; "
        "blobs larger than this are always uploaded in chunks.",
    ).tag(config=True)

    request_timeout = Float(
        600.0,
        help="Seconds one registry request (one chunk, one manifest) may take.",
    ).tag(config=True)

    backoff = Instance(Backoff)

    @default("backoff")
    def _default_backoff(self) -> Backoff:
        return Backoff(parent=self)

    def __init__(self, host: str, **kwargs):
        super().__init__(**kwargs)
        self.host = host
        self._auth_header: str | None = None
        #: bytes sent in PATCH bodies by the last push_blob_file (resent chunks counted again)
        self.uploaded_bytes = 0
        # its own client: the shared one refuses bodies over 100 MB, layers are GiBs
        self._http = AsyncHTTPClient(force_instance=True, max_body_size=1 << 44)

    @property
    def base(self) -> str:
        return f"{self.scheme}://{self.host}"

    def close(self) -> None:
        self._http.close()

    def _credentials(self) -> tuple[str, str] | None:
        if not self.docker_config_path:
            return None
        try:
            creds = load_docker_config(self.docker_config_path)
        except (OSError, ValueError) as e:
            raise RegistryError(
                f"cannot read registry credentials {self.docker_config_path}: {e}; "
                "mount a kubernetes.io/dockerconfigjson Secret there or clear docker_config_path"
            ) from e
        return creds.get(self.host)

    async def _answer_challenge(self, response: HTTPResponse, scope: str) -> bool:
        challenge = response.headers.get("WWW-Authenticate", "")
        scheme, params = _parse_challenge(challenge)
        creds = self._credentials()
        if scheme == "basic":
            if not creds:
                return False
            token = base64.b64encode(f"{creds[0]}:{creds[1]}".encode()).decode()
            self._auth_header = f"Basic {token}"
            return True
        if scheme == "bearer" and params.get("realm"):
            query = {"service": params.get("service", "")}
            query["scope"] = params.get("scope") or scope
            headers = {}
            if creds:
                b = base64.b64encode(f"{creds[0]}:{creds[1]}".encode()).decode()
                headers["Authorization"] = f"Basic {b}"
            url = params["realm"] + ("&" if "?" in params["realm"] else "?") + urlencode(query)
            try:
                resp = await self._http.fetch(
                    url,
                    headers=headers,
                    request_timeout=self.request_timeout,
                    ca_certs=self.ca_file or None,
                )
            except HTTPClientError as e:
                raise RegistryError(
                    f"the registry's token service {params['realm']} refused us ({e.code}): "
                    "check the credentials in docker_config_path",
                    e.code,
                ) from e
            body = json.loads(resp.body)
            self._auth_header = "Bearer " + (body.get("token") or body.get("access_token", ""))
            return True
        return False

    async def request(
        self,
        method: str,
        path_or_url: str,
        body: bytes | None = None,
        headers: dict | None = None,
        scope: str = "",
        ok: tuple[int, ...] = (200, 201, 202, 204),
        streaming_callback=None,
        retry: bool = True,
    ) -> HTTPResponse:
        """Send a request, answering one auth challenge; raise RegistryError if not ``ok``.

        With ``retry`` (for requests that may be repeated as they are) a transient failure
        is tried again with :attr:`backoff`; the chunked upload passes ``retry=False`` and
        recovers by itself.
        """
        if not retry:
            return await self._request_once(
                method, path_or_url, body, headers, scope, ok, streaming_callback
            )
        url = path_or_url if "://" in path_or_url else urljoin(self.base, path_or_url)
        return await self.backoff.run(
            lambda: self._request_once(
                method, path_or_url, body, headers, scope, ok, streaming_callback
            ),
            transient,
            f"registry {self.host}: {method} {urlparse(url).path}",
        )

    async def _request_once(
        self,
        method: str,
        path_or_url: str,
        body: bytes | None,
        headers: dict | None,
        scope: str,
        ok: tuple[int, ...],
        streaming_callback,
    ) -> HTTPResponse:
        url = path_or_url if "://" in path_or_url else urljoin(self.base, path_or_url)
        for attempt in (0, 1):
            h = dict(headers or {})
            if self._auth_header:
                h["Authorization"] = self._auth_header
            req = HTTPRequest(
                url,
                method=method,
                headers=h,
                body=body
                if body is not None
                else (b"" if method in ("POST", "PUT", "PATCH") else None),
                request_timeout=self.request_timeout,
                follow_redirects=method in ("GET", "HEAD"),
                streaming_callback=streaming_callback,
                ca_certs=self.ca_file or None,
                allow_nonstandard_methods=True,
            )
            try:
                response = await self._http.fetch(req, raise_error=False)
            except HTTPClientError as e:  # timeouts raise even with raise_error=False
                raise RegistryError(
                    f"registry {self.host} did not answer {method} {urlparse(url).path} within "
                    f"{self.request_timeout:g}s: {e}; check the registry's load and network, or raise request_timeout",
                    599,
                ) from e
            except OSError as e:
                raise RegistryError(
                    f"cannot reach registry {self.host}: {e}; check that the registry is reachable "
                    "from the node (address, port, TLS, network policy)",
                    599,
                ) from e
            if (
                response.code == 401
                and attempt == 0
                and await self._answer_challenge(response, scope)
            ):
                continue
            break
        if response.code in ok:
            return response
        raise self._error(method, url, response)

    def _error(self, method: str, url: str, response: HTTPResponse) -> RegistryError:
        code = response.code
        detail = ""
        if response.body and not response.request.streaming_callback:
            try:
                errors = json.loads(response.body).get("errors") or []
                detail = "; ".join(f"{e.get('code')}: {e.get('message')}" for e in errors)
            except (ValueError, AttributeError):
                detail = response.body[:200].decode(errors="replace").strip()
        if code == 599:
            detail = str(response.error)
        fixes = {
            401: "give the agent push credentials: a docker config JSON in docker_config_path "
            "(a kubernetes.io/dockerconfigjson Secret)",
            403: "grant the credentials in docker_config_path push (and pull) rights on this repository",
            404: "check the repository name and that the registry serves the OCI distribution API at /v2/",
            405: "the registry does not accept pushes (read-only or a pull-through mirror): "
            "point the target repository at a writable registry",
            503: "the registry is unavailable or read-only: check its storage and maintenance mode",
            599: "check that the registry is reachable from the node (address, port, TLS, network policy)",
        }
        fix = fixes.get(code, "check the registry's log")
        return RegistryError(
            f"registry {self.host} answered {code} to {method} {urlparse(url).path}"
            f"{': ' + detail if detail else ''}; {fix}",
            code,
        )

    # -- blobs --------------------------------------------------------------------------

    async def blob_size(self, name: str, digest: str) -> int | None:
        """HEAD a blob: its size, or None when the registry does not have it."""
        r = await self.request(
            "HEAD", f"/v2/{name}/blobs/{digest}", scope=f"repository:{name}:pull", ok=(200, 404)
        )
        if r.code == 404:
            return None
        return int(r.headers.get("Content-Length", "-1"))

    async def push_blob_bytes(self, name: str, data: bytes) -> Descriptor:
        """Upload a small blob monolithically (POST to open, PUT with the body and digest);
        a failed try starts a new upload (one already there is not sent again)."""
        digest = digest_bytes(data)

        async def once() -> None:
            if await self.blob_size(name, digest) == len(data):
                return
            location = await self._start_upload(name)
            await self.request(
                "PUT",
                self._with_query(location, digest=digest),
                body=data,
                headers={"Content-Type": "application/octet-stream"},
                scope=f"repository:{name}:pull,push",
                ok=(201,),
                retry=False,
            )

        await self.backoff.run(once, transient, f"registry {self.host}: upload of {digest}")
        return Descriptor("", digest, len(data))

    async def push_blob_file(self, name: str, path: str | os.PathLike) -> Descriptor:
        """Upload a file in chunks of ``chunk_size``, hashing while reading; returns its descriptor.

        Memory use stays at one chunk whatever the file's size. A chunk that fails for a
        moment is not simply sent again: the registry is asked how much of the upload it
        holds (:meth:`upload_offset`) and the upload goes on from there; one that dropped the
        upload gets a new one from the first byte. ``1 + backoff.retries`` failures in a
        row without progress give up, naming the last error.
        """
        size = os.path.getsize(path)
        digest = _ChunkHasher()
        loop = asyncio.get_running_loop()
        location = await self._start_upload(name)
        offset = 0
        failures = 0
        self.uploaded_bytes = 0
        with open(path, "rb") as f:

            def read(at: int) -> bytes:
                f.seek(at)
                return f.read(min(self.chunk_size, size - at))

            while True:
                try:
                    if offset < size:
                        chunk = await loop.run_in_executor(None, read, offset)
                        digest.update_at(offset, chunk)
                        location, offset = await self._patch(name, location, offset, chunk)
                        failures = 0
                        continue
                    await self._finish_upload(name, location, digest.hexdigest(size))
                    break
                except RegistryError as e:
                    failures += 1
                    if e.code not in TRANSIENT or failures >= self.backoff.attempts:
                        if failures > 1:  # the fix stays last, after "; "
                            head, sep, fix = str(e).rpartition("; ")
                            tries = f" (gave up after {failures} tries in a row)"
                            raise RegistryError(
                                f"{head}{tries}{sep}{fix}" if sep else f"{e}{tries}", e.code
                            ) from e
                        raise
                    wait = self.backoff.delay(failures)
                    self.log.warning(
                        "upload of %s to %s/%s failed at byte %d of %d (try %d of %d), "
                        "resuming in %.1fs: %s",
                        Path(path).name, self.host, name, offset, size, failures,
                        self.backoff.attempts, wait, e,
                    )  # fmt: skip
                    await asyncio.sleep(wait)
                    location, offset = await self._resume_point(name, location, offset)
        return Descriptor("", digest.hexdigest(size), size)

    async def _patch(self, name: str, location: str, offset: int, chunk: bytes) -> tuple[str, int]:
        """PATCH one chunk at ``offset``; the next upload URL and offset."""
        self.uploaded_bytes += len(chunk)
        r = await self.request(
            "PATCH",
            location,
            body=chunk,
            headers={
                "Content-Type": "application/octet-stream",
                "Content-Range": f"{offset}-{offset + len(chunk) - 1}",
                "Content-Length": str(len(chunk)),
            },
            scope=f"repository:{name}:pull,push",
            ok=(202,),
            retry=False,
        )
        held = _range_end(r.headers.get("Range", ""))
        after = offset + len(chunk) if not held else held + 1  # "0-0" after a chunk: 1 byte
        return self._absolute(r.headers.get("Location", location)), after

    async def _finish_upload(self, name: str, location: str, digest: str) -> None:
        """Close the upload with its digest (``PUT ?digest=``). When the answer is lost but
        the blob is there (a PUT that went through), that is success too."""
        try:
            await self.request(
                "PUT",
                self._with_query(location, digest=digest),
                body=b"",
                headers={"Content-Type": "application/octet-stream"},
                scope=f"repository:{name}:pull,push",
                ok=(201,),
                retry=False,
            )
        except RegistryError as e:
            if e.code in (*TRANSIENT, 404) and await self.blob_size(name, digest) is not None:
                return
            raise

    async def upload_offset(self, location: str, scope: str = "") -> tuple[str, int] | None:
        """How much of the upload at ``location`` the registry holds: (its upload URL now,
        the offset of the next byte), from ``GET`` on the upload URL (``204`` with
        ``Range: 0-<last byte>``). None when the registry no longer has that upload."""
        r = await self.request("GET", location, scope=scope, ok=(204, 400, 404))
        if r.code != 204:
            return None
        end = _range_end(r.headers.get("Range", ""))
        return self._absolute(r.headers.get("Location", location)), 0 if end is None else end + 1

    async def _resume_point(self, name: str, location: str, offset: int) -> tuple[str, int]:
        """Where a failed upload goes on: the registry's offset, or a new upload at 0."""
        found = await self.upload_offset(location, scope=f"repository:{name}:pull,push")
        if found is not None:
            url, held = found
            # "0-0" is both "nothing" and "one byte": never less than what was acknowledged
            return url, held if held > 1 else min(offset, held)
        self.log.warning(
            "registry %s dropped the upload to %s after a failure: starting it again from byte 0",
            self.host,
            name,
        )
        return await self._start_upload(name), 0

    async def fetch_blob_to_file(self, name: str, digest: str, path: str | os.PathLike) -> int:
        """Download a blob to ``path``, streaming, and check its digest; returns its size.

        A download that fails for a moment is tried again from the start (``backoff``).
        """

        async def once() -> tuple[str, int]:
            h = hashlib.sha256()
            size = 0
            with open(path, "wb") as f:

                def write(chunk: bytes) -> None:
                    nonlocal size
                    h.update(chunk)
                    f.write(chunk)
                    size += len(chunk)

                await self.request(
                    "GET",
                    f"/v2/{name}/blobs/{digest}",
                    scope=f"repository:{name}:pull",
                    ok=(200,),
                    streaming_callback=write,
                    retry=False,
                )
            return "sha256:" + h.hexdigest(), size

        got, size = await self.backoff.run(
            once, transient, f"registry {self.host}: download of {digest}"
        )
        if got != digest:
            raise RegistryError(
                f"blob {digest} from {self.host}/{name} arrived as {got}: the download is corrupt; "
                "retry, and check the registry's storage"
            )
        return size

    async def _start_upload(self, name: str) -> str:
        r = await self.request(
            "POST", f"/v2/{name}/blobs/uploads/", scope=f"repository:{name}:pull,push", ok=(202,)
        )
        location = r.headers.get("Location")
        if not location:
            raise RegistryError(f"registry {self.host} opened an upload without a Location header")
        return self._absolute(location)

    def _absolute(self, location: str) -> str:
        return location if "://" in location else urljoin(self.base, location)

    @staticmethod
    def _with_query(url: str, **params: str) -> str:
        return url + ("&" if "?" in url else "?") + urlencode(params)

    # -- manifests ----------------------------------------------------------------------

    async def put_manifest(self, name: str, reference: str, manifest: bytes) -> str:
        """PUT a manifest under a tag or digest; return its digest (checked against ours)."""
        r = await self.request(
            "PUT",
            f"/v2/{name}/manifests/{reference}",
            body=manifest,
            headers={"Content-Type": MANIFEST_TYPE},
            scope=f"repository:{name}:pull,push",
            ok=(201,),
        )
        ours = digest_bytes(manifest)
        theirs = r.headers.get("Docker-Content-Digest", ours)
        if theirs != ours:
            raise RegistryError(
                f"registry {self.host} stored manifest as {theirs}, expected {ours}"
            )
        return ours

    async def get_manifest(self, name: str, reference: str) -> tuple[bytes, str]:
        """GET a manifest by tag or digest: (raw bytes, digest of those bytes)."""
        r = await self.request(
            "GET",
            f"/v2/{name}/manifests/{reference}",
            headers={"Accept": MANIFEST_TYPE},
            scope=f"repository:{name}:pull",
            ok=(200,),
        )
        return r.body, digest_bytes(r.body)

    async def delete_manifest(self, name: str, digest: str) -> None:
        """Delete a manifest by digest (the registry must allow deletes)."""
        await self.request(
            "DELETE", f"/v2/{name}/manifests/{digest}", scope=f"repository:{name}:*", ok=(202, 404)
        )

    async def list_tags(self, name: str) -> list[str]:
        r = await self.request(
            "GET", f"/v2/{name}/tags/list", scope=f"repository:{name}:pull", ok=(200, 404)
        )
        if r.code == 404:
            return []
        return json.loads(r.body).get("tags") or []


@dataclass
class PushedImage:
    """A pushed, verified checkpoint image."""

    ref: str  # repository@digest
    digest: str
    image_bytes: int
    tag: str
    manifest: dict


async def push_archive(
    client: RegistryClient,
    repository: str,
    archive: str | os.PathLike,
    annotations: dict,
    tag: str,
    created: float,
    architecture: str = "amd64",
) -> PushedImage:
    """Push ``archive`` as a one-layer image (layer, config, manifest) and verify it.

    Verification reads everything back from the registry: the manifest by digest must
    hash to what we pushed and list our blobs, and every blob must be there (HEAD)
    with the right size. Only a verified image is returned.
    """
    ref = ImageRef.parse(repository)
    layer = await client.push_blob_file(ref.name, archive)
    layer.media_type = LAYER_TYPE
    config_bytes = image_config(layer.digest, created, architecture=architecture)
    config = await client.push_blob_bytes(ref.name, config_bytes)
    config.media_type = CONFIG_TYPE
    manifest_bytes = image_manifest(config, [layer], annotations)
    digest = await client.put_manifest(ref.name, tag, manifest_bytes)
    manifest = await verify_image(client, ref.name, digest, [config, layer])
    return PushedImage(
        ref=ref.with_digest(digest),
        digest=digest,
        image_bytes=layer.size + config.size + len(manifest_bytes),
        tag=tag,
        manifest=manifest,
    )


async def verify_image(
    client: RegistryClient, name: str, digest: str, blobs: list[Descriptor] | None = None
) -> dict:
    """GET the manifest by digest, compare digests, HEAD every blob; return the manifest.

    Raises RegistryError naming what is missing or different.
    """
    raw, got = await client.get_manifest(name, digest)
    if got != digest:
        raise RegistryError(f"manifest {digest} in {client.host}/{name} reads back as {got}")
    manifest = json.loads(raw)
    listed = [manifest["config"], *manifest["layers"]]
    if blobs is not None:
        want = sorted((b.digest, b.size) for b in blobs)
        have = sorted((d["digest"], d["size"]) for d in listed)
        if want != have:
            raise RegistryError(f"manifest {digest} lists {have}, expected {want}")
    for d in listed:
        size = await client.blob_size(name, d["digest"])
        if size is None:
            raise RegistryError(
                f"blob {d['digest']} of image {digest} is missing from {client.host}/{name}; "
                "the push did not complete: retry the checkpoint"
            )
        if size != d["size"]:
            raise RegistryError(
                f"blob {d['digest']} in {client.host}/{name} has {size} bytes, manifest says {d['size']}"
            )
    return manifest


async def pull_layer(client: RegistryClient, image: str, dest: str | os.PathLike) -> dict:
    """Fetch ``image`` (``repo@sha256:…``) by digest and write its single layer to ``dest``.

    Returns the manifest. The manifest's and the layer's digests are both checked.
    """
    ref = ImageRef.parse(image)
    if not ref.digest:
        raise RegistryError(
            f"image {image!r} has no digest: restores only accept repo@sha256:… references"
        )
    manifest = await verify_image(client, ref.name, ref.digest)
    layers = manifest.get("layers") or []
    if len(layers) != 1:
        raise RegistryError(f"image {image} has {len(layers)} layers: not a checkpoint image")
    await client.fetch_blob_to_file(ref.name, layers[0]["digest"], dest)
    return manifest
