"""Where the node agent keeps a checkpoint: the storage axis on Kubernetes, apart from
the dumper (the kubelet).

One interface, :class:`ArchiveStore`, two stores, chosen once per checkpoint from the
request's target (:meth:`Shipper.for_target`) or per restore from the checkpoint's id
(:meth:`Shipper.for_image`):

- :class:`RegistryStore`: an OCI registry; the archive becomes a one-layer checkpoint
  image (see :mod:`jupyterhub_gpusnap.checkpoint.oci`), its id ``repo@sha256:…``.
- :class:`PvcStore`: a folder on a PVC; the archive copied next to a small JSON record
  of its digest, its id the copy's path.

A store ships a finished kubelet archive (:meth:`ArchiveStore.ship`), says what a
checkpoint's GPU memory needs without fetching it (:meth:`ArchiveStore.gpu_needs`) and
fetches it back, verified and unpacked (:meth:`ArchiveStore.fetch`). Either way the copy
is verified by digest before the node's archive is deleted: a failed ship leaves nothing
half-done that anyone could mistake for a checkpoint. The settings they share are
:class:`Shipper`'s traits.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shutil
import tarfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from traitlets import Integer, Unicode
from traitlets.config import LoggingConfigurable

from ..checkpoint import oci
from ..gpu.compat import GpuNeeds
from ..kube.errors import AgentError
from .errors import need


@dataclass
class Shipped:
    """Where a checkpoint went: ``id`` is ``repo@sha256:…`` or the archive's path on the PVC."""

    id: str
    digest: str
    image_bytes: int
    location: str


def _copy_hashing(src: Path, dst: Path, block: int) -> tuple[str, int]:
    h = hashlib.sha256()
    size = 0
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        while chunk := fin.read(block):
            h.update(chunk)
            fout.write(chunk)
            size += len(chunk)
        fout.flush()
        os.fsync(fout.fileno())
    return "sha256:" + h.hexdigest(), size


def extract_archive(archive: Path, dest: Path) -> Path:
    """Unpack a checkpoint archive into ``dest``; return its CRIU images folder.

    Uses tarfile's ``data`` filter: members that would land outside ``dest`` (absolute
    paths, ``..``, links pointing out), devices and setuid bits are refused.
    """
    dest.mkdir(parents=True, exist_ok=True)
    try:
        with tarfile.open(archive, "r:") as tar:
            tar.extractall(dest, filter="data")
    except tarfile.FilterError as e:
        raise AgentError(
            f"checkpoint archive {archive.name} has an unsafe path: {e}",
            "the image is not a kubelet checkpoint archive: check where it came from",
            422,
        ) from e
    except tarfile.TarError as e:
        raise AgentError(
            f"checkpoint archive {archive.name} is not a readable tar: {e}",
            "the image is not a kubelet checkpoint archive",
            422,
        ) from e
    images = dest / "checkpoint"
    if not (images / "inventory.img").exists():
        raise AgentError(
            f"checkpoint archive {archive.name} has no checkpoint/inventory.img",
            "the image is not a kubelet checkpoint archive (expected config.dump, spec.dump, checkpoint/)",
            422,
        )
    return images


class Shipper(LoggingConfigurable):
    """The settings of the node agent's stores, and the store a checkpoint uses."""

    registry_scheme = Unicode(
        "https",
        help="'https' for real registries; 'http' only for an in-cluster registry on a trusted network.",
    ).tag(config=True)

    docker_config_path = Unicode(
        "",
        help="Docker config JSON with push/pull credentials, e.g. a kubernetes.io/dockerconfigjson "
        "Secret mounted at /etc/gpusnap/registry/.dockerconfigjson. Empty: anonymous.",
    ).tag(config=True)

    registry_ca_file = Unicode("", help="CA bundle of the registry's TLS certificate.").tag(
        config=True
    )

    chunk_size = Integer(
        64 << 20,
        help="Bytes per chunk when uploading an archive; the most memory one upload uses.",
    ).tag(config=True)

    architecture = Unicode(
        "amd64", help="Architecture written in the image config (the node's, in GOARCH spelling)."
    ).tag(config=True)

    def client(self, host: str) -> oci.RegistryClient:
        return oci.RegistryClient(
            host,
            scheme=self.registry_scheme,
            docker_config_path=self.docker_config_path,
            ca_file=self.registry_ca_file,
            chunk_size=self.chunk_size,
            parent=self,
        )

    def for_target(self, target: dict, pvc_paths: Iterable[str]) -> ArchiveStore:
        """The store a checkpoint request's ``target`` names, refused before anything is
        frozen: 400 for an unknown ``kind``, 403 for a PVC folder not in ``pvc_paths``
        (``AgentApp.pvc_paths``; always while it is empty)."""
        kind = target.get("kind")
        if kind == "registry":
            return RegistryStore(self, target.get("repository"))
        if kind == "pvc":
            return PvcStore(self, pvc_folder(target, list(pvc_paths)))
        raise AgentError(
            "target.kind must be 'registry' or 'pvc'",
            "send target {kind: registry, repository} or {kind: pvc, path}",
            400,
        )

    def for_image(self, image: str) -> ArchiveStore:
        """The store that holds checkpoint ``image``: a path on a PVC (``/…``) or a
        registry reference (``host/path@sha256:…``)."""
        return PvcStore(self) if image.startswith("/") else RegistryStore(self)


def pvc_folder(target: dict, pvc_paths: list[str]) -> Path:
    """``target.path`` of a checkpoint to a PVC, if it is one of ``pvc_paths`` (403 if not,
    and always while ``pvc_paths`` is empty)."""
    folder = Path(need(target, "path"))
    allowed = {os.path.realpath(p) for p in pvc_paths}
    if not allowed:
        raise AgentError(
            "checkpoints to a PVC are off on this agent: AgentApp.pvc_paths is empty",
            "mount the checkpoint PVC into the agent pod and list its folder in "
            "AgentApp.pvc_paths (e.g. ['/snapshots'])",
            403,
        )
    if os.path.realpath(folder) not in allowed:
        raise AgentError(
            f"target.path {folder} is not one of AgentApp.pvc_paths ({', '.join(pvc_paths)})",
            "use a path listed in AgentApp.pvc_paths",
            403,
        )
    return folder


class ArchiveStore:
    """Where a kubelet checkpoint archive is kept off the node, verified by digest.

    Subclasses implement :meth:`ship`, :meth:`gpu_needs` and :meth:`_verified_archive`;
    :meth:`fetch` is shared. Failures are :class:`AgentError`s whose code says whose
    fault it is: 4xx the request's or the image's, 5xx the store's (the registry's, the
    volume's), after which the node keeps the archive (see :mod:`.kept`).
    """

    def __init__(self, shipper: Shipper):
        self.shipper = shipper

    async def ship(
        self,
        archive: Path,
        *,
        server: str,
        container: str,
        gpu_bytes: int,
        created: float,
        gpu: GpuNeeds | None = None,
    ) -> Shipped:
        """Copy ``archive`` into the store and verify the copy by digest.

        ``gpu``: what the checkpoint's GPU memory needs, kept with it
        (:mod:`~jupyterhub_gpusnap.gpu.compat`) for :meth:`gpu_needs` to read back.
        ``archive`` is left as it was, whatever happens: deleting it is the caller's
        decision.
        """
        raise NotImplementedError

    async def gpu_needs(self, image: str) -> GpuNeeds | None:
        """What checkpoint ``image`` records of its GPU state, read without fetching it.
        None when the image records nothing about GPUs (taken by an older agent)."""
        raise NotImplementedError

    async def _verified_archive(self, image: str, dest: Path) -> Path:
        """Checkpoint ``image``'s archive, its digest checked: where it is, or fetched into
        ``dest``."""
        raise NotImplementedError

    async def fetch(self, image: str, dest: Path) -> Path:
        """Fetch a checkpoint (``repo@sha256:…`` or a PVC path), verify it, unpack it; return the images dir."""
        dest.mkdir(parents=True, exist_ok=True)
        archive = await self._verified_archive(image, dest)
        loop = asyncio.get_running_loop()
        images = await loop.run_in_executor(None, extract_archive, archive, dest / "archive")
        if archive.parent == dest:
            archive.unlink()
        return images


class RegistryStore(ArchiveStore):
    """Checkpoints as one-layer OCI images in a registry.

    ``repository``: where :meth:`ship` pushes (``host[:port]/path``, the request's
    ``target.repository``, checked when shipping); a restore needs none (the image's
    reference names its registry).
    """

    def __init__(self, shipper: Shipper, repository: object = None):
        super().__init__(shipper)
        self.repository = repository

    async def ship(
        self,
        archive: Path,
        *,
        server: str,
        container: str,
        gpu_bytes: int,
        created: float,
        gpu: GpuNeeds | None = None,
    ) -> Shipped:
        """Push ``archive`` as a checkpoint image under the repository and verify it.

        ``gpu`` is written as manifest annotations. Requests that fail for a moment are
        tried again and a failed chunk resumes where the registry is
        (:class:`~jupyterhub_gpusnap.checkpoint.oci.RegistryClient`, ``Backoff``); a push
        that fails for good raises a 502 AgentError with the registry's error and fix.
        """
        repository = need({"repository": self.repository}, "repository")
        try:
            ref = oci.ImageRef.parse(repository)
        except ValueError as e:
            raise AgentError(str(e), "set target.repository to host[:port]/path", 400) from e
        client = self.shipper.client(ref.registry)
        annotations = oci.checkpoint_annotations(
            container, server, gpu_bytes, created, extra=(gpu or GpuNeeds()).annotations()
        )
        try:
            pushed = await oci.push_archive(
                client,
                ref.repository,
                archive,
                annotations,
                oci.tag_for(server or container, created),
                created,
                architecture=self.shipper.architecture,
            )
        except oci.RegistryError as e:
            raise AgentError(f"pushing the checkpoint failed: {e}", _registry_fix(e), 502) from e
        return Shipped(pushed.ref, pushed.digest, pushed.image_bytes, ref.repository)

    async def gpu_needs(self, image: str) -> GpuNeeds | None:
        """The registry manifest's annotations, checked against the digest."""
        try:
            ref = oci.ImageRef.parse(image)
        except ValueError as e:
            raise AgentError(str(e), "pass the image as host/path@sha256:…", 400) from e
        if not ref.digest:
            return None  # fetch() refuses it, naming the fix
        try:
            raw, got = await self.shipper.client(ref.registry).get_manifest(ref.name, ref.digest)
        except oci.RegistryError as e:
            raise AgentError(
                f"reading checkpoint {image} failed: {e}", _registry_fix(e), 502
            ) from e
        if got != ref.digest:
            raise AgentError(
                f"manifest of {image} reads back as {got}",
                "the registry returned another image: check the registry",
                502,
            )
        try:
            annotations = json.loads(raw).get("annotations") or {}
        except (ValueError, AttributeError) as e:
            raise AgentError(
                f"manifest of {image} is not JSON: {e}", "the image is not a checkpoint image", 422
            ) from e
        return GpuNeeds.from_annotations(annotations)

    async def _verified_archive(self, image: str, dest: Path) -> Path:
        """The image's layer pulled into ``dest`` (checked against its digest)."""
        archive = dest / "layer.tar"
        try:
            ref = oci.ImageRef.parse(image)
            await oci.pull_layer(self.shipper.client(ref.registry), image, archive)
        except ValueError as e:
            raise AgentError(str(e), "pass the image as host/path@sha256:…", 400) from e
        except oci.RegistryError as e:
            raise AgentError(
                f"pulling checkpoint {image} failed: {e}", _registry_fix(e), 502
            ) from e
        return archive


class PvcStore(ArchiveStore):
    """Checkpoints as archives in a folder of a mounted PVC, each next to a JSON record of
    its digest and, under ``annotations``, the same GPU annotations a registry image
    carries.

    ``folder``: where :meth:`ship` copies to (one of ``AgentApp.pvc_paths``); a restore
    needs none (the checkpoint's id is its path).
    """

    def __init__(self, shipper: Shipper, folder: Path | None = None):
        super().__init__(shipper)
        self.folder = folder

    async def ship(
        self,
        archive: Path,
        *,
        server: str,
        container: str,
        gpu_bytes: int,
        created: float,
        gpu: GpuNeeds | None = None,
    ) -> Shipped:
        """Copy ``archive`` into the folder, fsync, re-read and compare digests."""
        folder = self.folder
        if folder is None or not folder.is_dir():
            raise AgentError(
                f"PVC path {folder} is not a folder on this node",
                "mount the checkpoint PVC into the agent pod at target.path",
                400,
            )
        name = oci.tag_for(server or archive.stem, created)
        dest = folder / f"{name}.tar"
        record = folder / f"{name}.json"
        partial = folder / f".{name}.tar.partial"
        loop = asyncio.get_running_loop()
        try:
            digest, size = await loop.run_in_executor(
                None, _copy_hashing, archive, partial, self.shipper.chunk_size
            )
            again, _ = await loop.run_in_executor(None, oci.sha256_file, partial)
            if again != digest:
                raise AgentError(
                    f"the copy on {folder} reads back as {again}, written as {digest}",
                    "the PVC's storage is corrupting data: check the volume",
                    502,
                )
            os.replace(partial, dest)
            record.write_text(
                json.dumps(
                    {
                        "digest": digest,
                        "size": size,
                        "server": server,
                        "gpu_bytes": gpu_bytes,
                        "created": created,
                        "annotations": (gpu or GpuNeeds()).annotations(),
                    }
                )
            )
        except OSError as e:
            partial.unlink(missing_ok=True)
            raise AgentError(
                f"copying the checkpoint to {folder} failed: {e}",
                "check the PVC's free space and that it is mounted read-write",
                507,
            ) from e
        except AgentError:
            partial.unlink(missing_ok=True)
            raise
        return Shipped(str(dest), digest, size, str(folder))

    async def gpu_needs(self, image: str) -> GpuNeeds | None:
        """The PVC record's annotations."""
        return GpuNeeds.from_annotations(_pvc_record(image).get("annotations") or {})

    async def _verified_archive(self, image: str, dest: Path) -> Path:
        """The archive where it is on the PVC, its digest compared with its record's."""
        archive = Path(image)
        loop = asyncio.get_running_loop()
        try:
            want = _pvc_record(image)["digest"]
            got, _ = await loop.run_in_executor(None, oci.sha256_file, archive)
        except (OSError, KeyError) as e:
            raise _pvc_unreadable(image, e) from e
        if got != want:
            raise AgentError(
                f"checkpoint {image} is corrupt ({got}, recorded {want})",
                "the archive changed on the PVC: it cannot be restored",
                422,
            )
        return archive


def _pvc_unreadable(image: str, e: Exception) -> AgentError:
    return AgentError(
        f"cannot read checkpoint {image}: {e}",
        "mount the checkpoint PVC into the agent pod at the same path",
        404,
    )


def _pvc_record(image: str) -> dict:
    """The JSON record next to a checkpoint archive on the checkpoint PVC."""
    try:
        record = json.loads(Path(image).with_suffix(".json").read_text())
    except (OSError, ValueError) as e:
        raise _pvc_unreadable(image, e) from e
    if not isinstance(record, dict):
        raise _pvc_unreadable(image, ValueError("the record is not a JSON object"))
    return record


def _registry_fix(e: oci.RegistryError) -> str:
    return str(e).rpartition("; ")[2] if "; " in str(e) else "check the registry's log"


def delete_local(archive: Path, log) -> None:
    """Delete the kubelet's archive (root-only, never cleaned by the kubelet, holds memory contents)."""
    try:
        archive.unlink()
    except FileNotFoundError:
        pass
    except OSError as e:
        log.warning("could not delete checkpoint archive %s: %s", archive, e)


def sweep_archives(
    folder: Path, namespace: str, pod: str, container: str, log, keep: Path | None = None
) -> list[Path]:
    """Delete every kubelet archive of one container (``checkpoint-<pod>_<ns>-<ctr>-<time>.tar``)
    but ``keep``.

    Called after each checkpoint of that container, when no other checkpoint of it can
    be in flight: it removes archives a kubelet finished after the agent stopped waiting,
    and those kept after a failed push. ``keep``: the archive of a push that just failed,
    which stays until a checkpoint of the container ships (at most one per container).
    """
    removed = []
    for path in folder.glob(f"checkpoint-{pod}_{namespace}-{container}-[0-9][0-9][0-9][0-9]-*.tar"):
        if keep is not None and path.name == keep.name:
            continue
        delete_local(path, log)
        removed.append(path)
    if removed:
        log.info(
            "removed %d stale checkpoint archive(s) of %s/%s/%s",
            len(removed),
            namespace,
            pod,
            container,
        )
    return removed


def remove_tree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


__all__ = [
    "ArchiveStore",
    "PvcStore",
    "RegistryStore",
    "Shipped",
    "Shipper",
    "delete_local",
    "extract_archive",
    "pvc_folder",
    "remove_tree",
    "sweep_archives",
]
