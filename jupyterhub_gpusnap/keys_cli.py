"""``jupyterhub-gpusnap keys``: make encryption keys and see which ones checkpoints use.

    jupyterhub-gpusnap keys --new 2026-11            # print a new key-file line
    jupyterhub-gpusnap keys --checkpoint-dir DIR [--key-file FILE]
                                                     # key ids in use, and whether FILE has them

Rotation (docs/security.md): put a new line first in the key file, keep the old lines
until this command shows no checkpoint using them, then delete them.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

from traitlets import Unicode
from traitlets.config import Application

from .checkpoint.keys import KeyFileError, load_keys, new_key_line
from .checkpoint.manifest import MANIFEST, Manifest


def keys_in_use(checkpoint_dir: Path) -> Counter:
    """{key id: number of checkpoints whose chunks are sealed with it} ("plain": none)."""
    used: Counter = Counter()
    for path in Path(checkpoint_dir).glob(f"*/*/*/{MANIFEST}"):
        try:
            m = Manifest.load(path.parent)
        except (OSError, ValueError, TypeError):
            continue
        if m.storage == "chunks":
            used[m.key_id or "plain"] += 1
    return used


class KeysApp(Application):
    """``jupyterhub-gpusnap keys``: make encryption keys and see which ones checkpoints use."""

    name = "jupyterhub-gpusnap keys"
    description = __doc__.split("\n\n")[0] if __doc__ else ""
    examples = """
    jupyterhub-gpusnap keys --new 2026-11
    jupyterhub-gpusnap keys --checkpoint-dir /var/lib/jupyterhub-gpusnap/checkpoints --key-file /etc/jupyterhub-gpusnap/keys
    """
    aliases = {
        "new": "KeysApp.new",
        "checkpoint-dir": "KeysApp.checkpoint_dir",
        "key-file": "KeysApp.key_file",
    }

    new = Unicode("", help="Print a new '<id> <base64 key>' line for a key with this id.").tag(
        config=True
    )
    checkpoint_dir = Unicode(
        "/var/lib/jupyterhub-gpusnap/checkpoints",
        help="LocalBackend.checkpoint_dir: the checkpoints to look at.",
    ).tag(config=True)
    key_file = Unicode(
        "", help="LocalBackend.encryption_key_file, to check it has every key in use."
    ).tag(config=True)

    def run(self) -> int:
        """Print what was asked; the exit status (1: a key in use is missing, 2: an error)."""
        if self.new:
            try:
                print(new_key_line(self.new))
            except KeyFileError as e:
                print(f"error: {e}", file=sys.stderr)
                return 2
            return 0
        have: set[str] = set()
        if self.key_file:
            try:
                have = {k.id for k in load_keys(self.key_file)}
            except KeyFileError as e:
                print(f"error: {e}", file=sys.stderr)
                return 2
        used = keys_in_use(Path(self.checkpoint_dir))
        missing = 0
        print(f"{'key id':<24} {'checkpoints':>11}  in key file")
        for kid, n in sorted(used.items()):
            if kid == "plain":
                status = "(not encrypted)"
            elif not self.key_file:
                status = "?"
            elif kid in have:
                status = "yes"
            else:
                status = "NO: these checkpoints cannot be restored; put the key back"
                missing += 1
            print(f"{kid:<24} {n:>11}  {status}")
        for kid in sorted(have - set(used)):
            print(f"{kid:<24} {0:>11}  yes (unused: safe to delete unless it is the first line)")
        return 1 if missing else 0

    def start(self) -> None:
        sys.exit(self.run())


def main(argv: list[str] | None = None) -> int:
    """Run ``keys`` with ``argv`` (the words after ``keys``); its exit status."""
    app = KeysApp()
    app.initialize(argv)
    return app.run()


if __name__ == "__main__":
    sys.exit(main())
