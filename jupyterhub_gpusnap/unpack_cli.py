"""``jupyterhub-gpusnap unpack``: write a chunk-stored checkpoint out as CRIU image files.

    jupyterhub-gpusnap unpack <checkpoint folder> <empty folder> [--key-file FILE]

For recovery by hand (docs/operations.md): the folder then holds the image exactly as CRIU
wrote it (every chunk checked against its checksum), ready for ``criu restore -D``.
Checkpoints kept as files need no unpacking.
"""

from __future__ import annotations

import argparse
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

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
        store = ChunkStore(root, pool, keys=keys, replica_root=replicas if replicas.is_dir() else None)
        return store.unpack(m.key_id, m.chunks, m.sizes, dest)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="jupyterhub-gpusnap unpack", description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint", help="the checkpoint's folder (<checkpoint_dir>/<user>/<server>/<time>)")
    p.add_argument("dest", help="an empty folder on a root-only file system (it will hold memory)")
    p.add_argument("--key-file", default="", help="LocalBackend.encryption_key_file, if encrypted")
    p.add_argument("--replica-dir", default="", help="LocalBackend.replica_dir, if set")
    a = p.parse_args(argv)
    dest = Path(a.dest)
    if dest.exists() and any(dest.iterdir()):
        print(f"error: {dest} is not empty", file=sys.stderr)
        return 2
    try:
        problems = unpack(Path(a.checkpoint), dest, a.key_file, a.replica_dir)
    except (OSError, ValueError, KeyFileError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for line in problems:
        print(f"error: {line}", file=sys.stderr)
    if not problems:
        print(f"unpacked into {dest}; restore with: criu restore -D {dest} --shell-job --tcp-close -d")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
