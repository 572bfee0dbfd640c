"""The manifest of one local checkpoint folder, and the checksums that prove its image intact.

One folder per checkpoint holds CRIU's image files, CRIU's own logs and
``manifest.json``. The manifest is the folder's truth: who (user, server), when,
what state (``writing`` → ``verified`` → ``restored`` | ``failed``), the sizes, the
GPU it came from, and a sha256 of every image file. It is written atomically
(temporary file + rename, mode 0600) so a crash never leaves half a manifest.

Checksums are taken once after the dump, with each file flushed to disk and
dropped from the page cache, then verified by reading the files again: the second
read comes from the disk, so a verified image is one the disk really holds.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

MANIFEST = "manifest.json"
STATUSES = ("writing", "verified", "restored", "failed")

# Files in a checkpoint folder that are not part of the image (written at or after restore).
_NOT_IMAGE = {MANIFEST, "restore.pid", "stats-restore"}
_CHUNK = 4 << 20


def is_image_file(name: str) -> bool:
    """True for CRIU image files; False for logs, the manifest and restore-time files."""
    return not (name in _NOT_IMAGE or name.endswith(".log") or name.startswith("."))


@dataclass
class Manifest:
    """What ``manifest.json`` holds (see the module docstring)."""

    user: str
    server: str
    created: float
    status: str = "writing"
    criu_version: str = ""
    driver_version: str = ""
    gpu_model: str = ""
    gpu_count: int = 0
    gpu_bytes: int = 0
    image_bytes: int = 0
    files: dict[str, str] = field(default_factory=dict)
    pid: int = 0
    ip: str = ""
    port: int = 0
    error: str = ""
    tcp_mode: str = "close"
    shell_job: bool = False
    cuda_pids: list[int] = field(default_factory=list)
    time_to_gpu_free_s: float | None = None
    dump_seconds: float | None = None
    verified_at: float | None = None
    restored_at: float | None = None
    # The server's Hub API token, read from its environment: the restored server still
    # uses it. The image holds it anyway; it never leaves this root-only folder otherwise.
    api_token: str = ""
    extra: dict = field(default_factory=dict)

    def save(self, folder: Path | str) -> None:
        """Write atomically as ``<folder>/manifest.json`` (mode 0600)."""
        folder = Path(folder)
        tmp = folder / f".{MANIFEST}.tmp"
        data = json.dumps(asdict(self), indent=1, sort_keys=True).encode()
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, folder / MANIFEST)

    @classmethod
    def load(cls, folder: Path | str) -> Manifest:
        """Read ``<folder>/manifest.json``; unknown keys go to ``extra`` (newer writers)."""
        raw = json.loads((Path(folder) / MANIFEST).read_text())
        known = {f.name for f in fields(cls)}
        extra = raw.pop("extra", {}) or {}
        extra.update({k: v for k, v in raw.items() if k not in known})
        return cls(**{k: v for k, v in raw.items() if k in known}, extra=extra)


def image_files(folder: Path | str) -> list[Path]:
    """The image files of a checkpoint folder, sorted by name."""
    return sorted(p for p in Path(folder).iterdir() if p.is_file() and is_image_file(p.name))


def _sha256(path: Path, settle: bool) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_CHUNK), b""):
            h.update(chunk)
        if settle:
            os.fsync(f.fileno())
            # Drop the cached pages so that verification re-reads what the disk holds.
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    return h.hexdigest()


def checksum_image(folder: Path | str) -> tuple[dict[str, str], int]:
    """Checksum every image file, flushing it to disk; return ({name: sha256}, total bytes).

    Also tightens permissions to 0600 (images hold the server's memory: secrets).
    Blocking: run it in a thread.
    """
    sums: dict[str, str] = {}
    total = 0
    for path in image_files(folder):
        os.chmod(path, 0o600)
        sums[path.name] = _sha256(path, settle=True)
        total += path.stat().st_size
    dir_fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return sums, total


def verify_image(folder: Path | str, expected: dict[str, str]) -> list[str]:
    """Re-read the image and compare with ``expected``; return the problems (empty: intact).

    Blocking: run it in a thread.
    """
    folder = Path(folder)
    problems = []
    if not expected:
        return ["the manifest lists no image files"]
    present = {p.name for p in image_files(folder)}
    for name in sorted(present - set(expected)):
        problems.append(f"{name}: not in the manifest")
    for name, digest in sorted(expected.items()):
        path = folder / name
        if not path.is_file():
            problems.append(f"{name}: missing")
            continue
        got = _sha256(path, settle=False)
        if got != digest:
            problems.append(f"{name}: sha256 {got[:12]}… differs from {digest[:12]}…")
    for required in ("inventory.img", "pstree.img"):
        if required not in expected:
            problems.append(f"{required}: missing from the image (not a CRIU dump)")
    return problems
