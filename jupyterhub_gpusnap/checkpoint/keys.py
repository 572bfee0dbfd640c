"""Encryption at rest for checkpoint images: the key file and AES-GCM sealing of chunks.

A checkpoint image holds everything the server had in memory, secrets included. With
``LocalBackend.encryption_key_file`` set, every stored chunk is sealed with AES-256-GCM
(the ``cryptography`` package). The key file (a Kubernetes Secret mounted as a file
works) holds one key per line, newest first::

    # <key id> <32 random bytes, base64>
    2026-11 9vJv0u8oQ3w3...=
    2026-05 M2f1cZkq8J0B...=

New chunks are sealed with the first key; older keys only open chunks they sealed, so
rotating is: put a new line first, keep the old lines until no checkpoint uses them
(``jupyterhub-gpusnap keys`` lists which are used; retention removes old checkpoints
after ``max_age_days``), then delete the old lines. ``jupyterhub-gpusnap keys --new ID``
prints a fresh line. The file must be readable by its owner only (0600 or 0400).

Chunk ids are keyed with a value derived from the key, so a reader of the disk without
the key cannot test whether a known piece of data is stored; identical data stored under
the same key is still stored once (that is what shares it between snapshots).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

_ID = re.compile(r"[A-Za-z0-9._-]{1,64}")
KEY_BYTES = 32
NONCE_BYTES = 12


class KeyFileError(ValueError):
    """The key file is missing, readable by others, or malformed (the message names the fix)."""


@dataclass(frozen=True)
class Key:
    """One AES-256 key and the id it is stored under."""

    id: str
    secret: bytes

    @property
    def id_salt(self) -> bytes:
        """What keys chunk ids under this key (never the key itself)."""
        return hashlib.sha256(b"jupyterhub-gpusnap chunk id\0" + self.secret).digest()

    def seal(self, plain: bytes, aad: bytes) -> bytes:
        """nonce + AES-GCM(plain) with ``aad`` authenticated (tag appended)."""
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM

        nonce = os.urandom(NONCE_BYTES)
        return nonce + AESGCM(self.secret).encrypt(nonce, plain, aad)

    def open(self, sealed: bytes, aad: bytes) -> bytes:
        """The plaintext of :meth:`seal`'s output; raises ``ValueError`` if it was altered."""
        from cryptography.exceptions import InvalidTag
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM

        try:
            return AESGCM(self.secret).decrypt(sealed[:NONCE_BYTES], sealed[NONCE_BYTES:], aad)
        except InvalidTag:
            raise ValueError(f"chunk fails authentication under key {self.id!r}") from None


def new_key_line(key_id: str) -> str:
    """A fresh key-file line ``<id> <base64 key>``."""
    if not _ID.fullmatch(key_id):
        raise KeyFileError(f"key id {key_id!r}: use 1-64 letters, digits, '.', '_' or '-'")
    return f"{key_id} {base64.b64encode(os.urandom(KEY_BYTES)).decode()}"


def load_keys(path: str | Path) -> list[Key]:
    """The keys of ``path``, newest (the one that seals new chunks) first."""
    path = Path(path)
    try:
        st = path.stat()
        text = path.read_text()
    except OSError as e:
        raise KeyFileError(
            f"encryption key file {path}: {e.strerror or e}; create it with "
            f"'jupyterhub-gpusnap keys --new <id> > {path}; chmod 600 {path}' or unset "
            "LocalBackend.encryption_key_file"
        ) from None
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise KeyFileError(
            f"encryption key file {path} is readable by others (mode {stat.S_IMODE(st.st_mode):o}): "
            f"run 'chmod 600 {path}'"
        )
    keys: list[Key] = []
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split()
        if len(parts) != 2 or not _ID.fullmatch(parts[0]):
            raise KeyFileError(
                f"encryption key file {path}, line {n}: expected '<id> <base64 key>' "
                "(make one with 'jupyterhub-gpusnap keys --new <id>')"
            )
        try:
            secret = base64.b64decode(parts[1], validate=True)
        except (binascii.Error, ValueError):
            secret = b""
        if len(secret) != KEY_BYTES:
            raise KeyFileError(
                f"encryption key file {path}, line {n}: key {parts[0]!r} is not {KEY_BYTES} bytes "
                "of base64 (make one with 'jupyterhub-gpusnap keys --new <id>')"
            )
        if any(k.id == parts[0] for k in keys):
            raise KeyFileError(f"encryption key file {path}: key id {parts[0]!r} appears twice")
        keys.append(Key(parts[0], secret))
    if not keys:
        raise KeyFileError(
            f"encryption key file {path} holds no key: add one with "
            f"'jupyterhub-gpusnap keys --new <id> >> {path}'"
        )
    return keys
