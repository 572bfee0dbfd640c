"""``jupyterhub-gpusnap unpack``: write a chunk-stored checkpoint out as CRIU image files.

    jupyterhub-gpusnap unpack <checkpoint folder> <empty folder> [--key-file FILE]

For recovery by hand (docs/operations.md): the folder then holds the image exactly as CRIU
wrote it (every chunk checked against its checksum), ready for ``criu restore -D``.
Checkpoints kept as files need no unpacking.
"""

from __future__ import annotations

import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from traitlets import Unicode
from traitlets.config import Application

from .checkpoint.chunks import STORE, ChunkStore
from .checkpoint.keys import KeyFileError, load_keys
from .checkpoint.local import REPLICAS
from .checkpoint.manifest import Manifest


def unpack(folder: Path, dest: Path, key_file: str = "", replica_dir: str = "") -> list[str]:
    """Unpack the checkpoint in ``folder`` into ``dest``; the problems (empty: done).

    A damaged chunk is read from its replica (``replica_dir``, by default where
    LocalBackend keeps them) when there is one, as a restore does.
    """
    m = Manifest.load(folder)
    if m.storage != "chunks":
        return [f"{folder} is kept as files (storage {m.storage!r}): restore from it directly"]
    checkpoint_dir = folder.parent.parent.parent  # <checkpoint_dir>/<user>/<server>/<time>
    root = checkpoint_dir / STORE
    replicas = Path(replica_dir) if replica_dir else checkpoint_dir / REPLICAS
    keys = load_keys(key_file) if key_file else []
    dest.mkdir(mode=0o700, parents=True, exist_ok=True)
    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        store = ChunkStore(
            root, pool, keys=keys, replica_root=replicas if replicas.is_dir() else None
        )
        return store.unpack(m.key_id, m.chunks, m.sizes, dest)


class UnpackApp(Application):
    """``jupyterhub-gpusnap unpack CHECKPOINT DEST``: a chunk-stored checkpoint as CRIU image files."""

    name = "jupyterhub-gpusnap unpack"
    description = __doc__.split("\n\n")[0] if __doc__ else ""
    examples = """
    jupyterhub-gpusnap unpack <checkpoint_dir>/<user>/<server>/<time> /root/rescue --key-file /etc/jupyterhub-gpusnap/keys
    """
    aliases = {"key-file": "UnpackApp.key_file", "replica-dir": "UnpackApp.replica_dir"}

    key_file = Unicode("", help="LocalBackend.encryption_key_file, if encrypted.").tag(config=True)
    replica_dir = Unicode("", help="LocalBackend.replica_dir, if set.").tag(config=True)

    def run(self) -> int:
        """Unpack; the exit status (1: a chunk could not be read, 2: an error)."""
        if len(self.extra_args) != 2:
            print(
                "usage: jupyterhub-gpusnap unpack CHECKPOINT DEST [--key-file FILE] [--replica-dir DIR]\n"
                "  CHECKPOINT: the checkpoint's folder (<checkpoint_dir>/<user>/<server>/<time>)\n"
                "  DEST: an empty folder on a root-only file system (it will hold memory)",
                file=sys.stderr,
            )
            return 2
        checkpoint, dest = (Path(a) for a in self.extra_args)
        if dest.exists() and any(dest.iterdir()):
            print(f"error: {dest} is not empty", file=sys.stderr)
            return 2
        try:
            problems = unpack(checkpoint, dest, self.key_file, self.replica_dir)
        except (OSError, ValueError, KeyFileError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        for line in problems:
            print(f"error: {line}", file=sys.stderr)
        if not problems:
            print(
                f"unpacked into {dest}; restore with: criu restore -D {dest} --shell-job --tcp-close -d"
            )
        return 1 if problems else 0

    def start(self) -> None:
        sys.exit(self.run())


def main(argv: list[str] | None = None) -> int:
    """Run ``unpack`` with ``argv`` (the words after ``unpack``); its exit status."""
    app = UnpackApp()
    app.initialize(argv)
    return app.run()


if __name__ == "__main__":
    sys.exit(main())
