"""The folders of :class:`~.local.LocalBackend`'s checkpoints and who may read them::

    <checkpoint_dir>/<user>/<server_name or _default>/<UTC timestamp>/

Names as path components (:func:`encode_name`), the checkpoints found on the disk (newest
first), and the folders made and kept 0700 (checkpoints hold servers' memory, and the
folder names name users and servers). :class:`~.local.LocalBackend` supplies the traits
and state these use (``root``, ``replica_root``, ``log``).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from urllib.parse import quote, unquote

from .manifest import MANIFEST, Manifest

DEFAULT_NAME = "_default"


def encode_name(name: str) -> str:
    """A user or server name as one safe path component (``""`` → ``_default``)."""
    if not name:
        return DEFAULT_NAME
    enc = quote(name, safe="")
    if enc[0] in "._":  # never ".", ".." or a clash with "_default"
        enc = f"%{ord(enc[0]):02X}" + enc[1:]
    return enc


def decode_name(enc: str) -> str:
    return "" if enc == DEFAULT_NAME else unquote(enc)


class LocalLayoutMixin:
    """The checkpoints' folders of :class:`~.local.LocalBackend`, found and made private."""

    def _folders(self, user: str | None = None, server_name: str | None = None):
        if not self.root.is_dir():
            return
        users = (
            [self.root / encode_name(user)]
            if user is not None
            else sorted(p for p in self.root.iterdir() if not p.name.startswith("."))
        )
        for udir in users:
            if not udir.is_dir():
                continue
            servers = (
                [udir / encode_name(server_name)]
                if server_name is not None
                else sorted(udir.iterdir())
            )
            for sdir in servers:
                if not sdir.is_dir():
                    continue
                for folder in sdir.iterdir():
                    if (folder / MANIFEST).is_file():
                        yield folder

    def _load_all(self, user: str | None = None, server_name: str | None = None):
        """[(folder, manifest)], newest first."""
        out = []
        for folder in self._folders(user, server_name):
            try:
                out.append((folder, Manifest.load(folder)))
            except (OSError, ValueError, TypeError) as e:
                self.log.warning("unreadable checkpoint manifest in %s: %s", folder, e)
        out.sort(key=lambda fm: (fm[1].created, fm[0].name), reverse=True)
        return out

    def _mkdir(self, path: Path) -> None:
        """Create ``path`` and its missing parents, each 0700; those of its folders inside
        checkpoint_dir that exist already (checkpoint_dir included) are made 0700 too: one
        created by an older version, by hand or for a server's log may be open to others."""
        missing = []
        p = path
        while not p.exists():
            missing.append(p)
            p = p.parent
        for q in [p, *p.parents]:
            if q != self.root and self.root not in q.parents:
                break
            self._tighten(q)
        for p in reversed(missing):
            p.mkdir(mode=0o700, exist_ok=True)
            os.chmod(p, 0o700)

    def make_private_dirs(self, path: Path | str) -> None:
        """Create a folder for a server's files (its log) as checkpoint_dir's own are made:
        missing parts 0700, and those inside checkpoint_dir made 0700 if they were open."""
        self._mkdir(Path(path))

    def _tighten(self, folder: Path) -> None:
        """Make a folder of checkpoint_dir 0700 (logged) if group or others may enter it."""
        try:
            mode = stat.S_IMODE(folder.stat().st_mode)
            if mode & 0o077:
                os.chmod(folder, 0o700)
                self.log.warning(
                    "%s was mode %04o, readable by other users: made 0700 (checkpoints hold "
                    "servers' memory, and the folder names name users and servers)", folder, mode,
                )  # fmt: skip
        except OSError as e:
            self.log.error("cannot make %s private (0700): %s", folder, e)

    def _tighten_all(self) -> None:
        """At start-up: every folder of checkpoint_dir (the checkpoints and the chunk store,
        not what is inside a checkpoint's folder) made 0700, each change logged."""
        self._tighten(self.root)
        replicas = self.replica_root
        if replicas is not None and replicas.is_dir() and self.root not in replicas.parents:
            self._tighten(replicas)  # elsewhere (a second disk): its own folder
        for top in sorted(self.root.iterdir()):
            if not top.is_dir() or top.is_symlink():
                continue
            self._tighten(top)
            for sub in sorted(p for p in top.iterdir() if p.is_dir() and not p.is_symlink()):
                self._tighten(sub)
                for leaf in (p for p in sub.iterdir() if p.is_dir() and not p.is_symlink()):
                    self._tighten(leaf)
