"""The local backend: CRIU on this host plus the CUDA driver's checkpoint API.

For single-machine hubs (LocalProcessSpawner, GPU boxes). One folder per checkpoint::

    <checkpoint_dir>/<user>/<server_name or _default>/<UTC timestamp>/
        manifest.json   CRIU image files   dump.log   restore-*.log

A checkpoint goes: refuse early if it cannot work (CRIU, process, disk) → GPU memory
to host memory (the GPU is free from here) → ``criu dump --leave-stopped`` (the tree
stays frozen) → verified → only then the frozen tree is killed. Any failure before
``verified`` sends SIGCONT and resumes the GPU state: the server goes on and the image
is kept, marked ``failed``, for diagnosis.

"Verified" means, before the frozen tree is killed: every file CRIU must write is there
and non-empty, CRIU's log ends with its success line, every file's checksum is recorded
in the manifest, and every file (and the folder) is ``fsync``'ed — the disk holds it.
The checksums are taken from the page cache, in parallel (``hash_threads``), while the
files are flushed: a checkpoint costs about what a bare ``criu dump`` and ``fsync`` cost.
The image is *not* read back from the disk: a disk that acknowledges an fsync and then
returns other data is caught at restore, where every checksum is checked (the server then
starts afresh and the image is kept, marked ``failed``). Admins who want the image read
back from the disk before the processes end set ``verify_read_back = True`` (about one
more full read of the image, from the disk, per checkpoint).

A restore checks the manifest, every file's size and the checksums of the small files
first (a damaged one stops it before CRIU runs), then runs ``criu restore`` while the
same thread pool hashes the ``pages-*.img`` files: both read the same files, so the page
cache makes it one read from the disk. If a checksum differs, the restored tree is
killed before the server is handed back, and the restore fails (the spawner starts a
fresh server). GPU memory is only restored once every checksum matched.

``restore_mode = "lazy"`` (docs/lazy-restore.md) runs the tree before its memory is back,
each page checked as it arrives (lazy.py); a damaged page then kills the running tree and
marks the checkpoint failed. Its GPU memory comes back behind the first answer.

The steps are :class:`~.base.CheckpointBackend`'s protocol; this module supplies its hooks
(``do_preflight`` to ``do_resume``; ``do_unfinished``/``do_dumped`` for crash recovery;
``do_expired`` for retention). Where the image is kept (``storage``: files or chunks) is
:mod:`.image_store`; the lazy restore is :mod:`.local_lazy`.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import re
import shutil
import signal
import socket
import stat
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from urllib.parse import quote, unquote

import psutil
from traitlets import Bool, Enum, Float, Integer, List, TraitError, Unicode, validate

from .. import sandbox
from ..gpu.compat import gpu_mismatch
from ..model import Server, server_key
from ..procs import boot_clock, started_since, tree_pids
from . import criu
from . import scrub as chunk_scrub
from .base import (
    CheckpointBackend,
    CheckpointError,
    CheckpointInfo,
    CheckpointRefused,
    Kept,
    Restored,
    RestoreTarget,
    Suspension,
    expired,
    protected,
)
from .chunks import PAGE, STORE, ChunkStore, Follower
from .image_store import (
    ChunksStore,
    FilesStore,
    ImageSource,
    ImageStore,
    RestoreJob,
    clear_staging,
    drop_image_files,
)
from .keys import Key, KeyFileError, load_keys
from .local_lazy import LazyRestoreMixin
from .manifest import (
    CHUNK_BYTES,
    MANIFEST,
    Manifest,
    check_complete,
    verify_image,
)
from .streamer import PIPE_BYTES

DEFAULT_NAME = "_default"
REPLICAS = ".chunks-replica"  # replica_dir's default, in checkpoint_dir
_TS = "%Y%m%dT%H%M%S"


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




def is_alive(pid: int) -> bool:
    """True if ``pid`` runs (or is stopped); a zombie counts as dead."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def is_frozen(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP)
    except psutil.Error:
        return False


def environ_of(pid: int, name: str) -> str:
    """One variable of the environment ``pid`` started with ('' if unknown)."""
    try:
        return psutil.Process(pid).environ().get(name, "")
    except psutil.Error:
        return ""


def listen_address(pid: int) -> tuple[str, int]:
    """The (ip, port) the server in the tree of ``pid`` listens on: the first process,
    root first and then by depth, that listens (the sandbox's init never does, the
    Jupyter server does before its kernels)."""
    for p in tree_pids(pid):
        try:
            conns = psutil.Process(p).net_connections(kind="tcp")
        except psutil.Error:
            continue
        listening = sorted(
            (c.laddr.port, c.laddr.ip) for c in conns if c.status == psutil.CONN_LISTEN
        )
        if listening:
            port, ip = listening[0]
            return ip, port
    return "", 0


def port_holder(ip: str, port: int) -> str | None:
    """None if ``ip:port`` can be listened on now, else who holds it ("pid N (name)")."""
    ip = ip if ip not in ("", "0.0.0.0") else "127.0.0.1"
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((ip, port))
            return None
        except OSError:
            pass
    with contextlib.suppress(psutil.Error, OSError):
        for c in psutil.net_connections(kind="tcp"):
            if c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN and c.pid:
                return f"pid {c.pid} ({psutil.Process(c.pid).name()})"
    return "another process"


@dataclass
class LocalSuspension(Suspension):
    """A local suspension: the checkpoint's folder and manifest, the tree, what was frozen."""

    folder: Path = Path()
    manifest: Manifest | None = None
    pids: list[int] = field(default_factory=list)
    cuda_pids: list[int] = field(default_factory=list)
    follower: Follower | None = None
    # found after a crash (recover): whether the server's root process runs, frozen
    root_alive: bool = True
    frozen: bool = True


class LocalBackend(LazyRestoreMixin, CheckpointBackend):
    """Checkpoints servers running on this host with CRIU (+ the CUDA checkpoint API)."""

    checkpoint_dir = Unicode(
        "/var/lib/jupyterhub-gpusnap/checkpoints",
        help="""Folder holding one sub-folder per checkpoint (<user>/<server>/<UTC time>/).
        Needs room for each suspended server's host memory plus its GPU memory; created
        0700, owned by root. Images contain everything the server had in memory, secrets
        included: keep it on a local, root-only disk.""",
    ).tag(config=True)

    keep_last = Integer(
        2,
        help="""Checkpoints kept per server (newest first) by retention, of those no one needs
        any more (restored ones, and failed suspensions, whose server kept running). It never
        deletes the snapshot of a suspended server (kept until it is restored) nor a snapshot
        whose restore failed (kept max_age_days from the failure, for an admin to rescue).""",
    ).tag(config=True)

    max_age_days = Float(
        30.0,
        help="""Days a snapshot whose restore failed is kept after the failure, whatever
        keep_last says, so an admin can rescue its work (docs/operations.md); emails quote
        this number. Other checkpoints no one needs are deleted once older than this too. A
        suspended server's snapshot is never deleted by age: it is kept until it is restored
        (or its server is deleted).""",
    ).tag(config=True)

    min_free_bytes = Integer(
        1 << 30,
        help="""Free disk space (bytes) that must remain in checkpoint_dir after a checkpoint.
        A checkpoint is refused when free space < estimated image size (host RSS of the
        server's processes + their GPU memory) + this.""",
    ).tag(config=True)

    criu_path = Unicode(
        "",
        help="""Path of the criu binary (>= 4.2). Empty: 'criu' on PATH, then
        /usr/local/sbin/criu (where .ci/install-criu.sh installs it).""",
    ).tag(config=True)

    criu_min_version = Unicode(
        "4.2",
        help="Oldest CRIU accepted. 4.1 cannot dump TCP sockets on recent kernels; 3.x fails on kernels >= 6.13.",
    ).tag(config=True)

    lock_timeout_ms = Integer(
        5000,
        help="""Milliseconds the CUDA driver may wait for running GPU work before refusing to
        lock a server's processes; a refusal means 'busy', and the service retries later.""",
    ).tag(config=True)

    tcp_mode = Enum(
        ["close", "established"],
        "close",
        help="""What CRIU does with open TCP connections. 'close' (recommended): they are
        dropped and clients (kernels over ZMQ, the Hub, browsers) reconnect. 'established':
        they are frozen and restored (needs nftables; leaves a lock table until restore, and
        a connection to a Hub restarted meanwhile fails once).""",
    ).tag(config=True)

    dump_extra_args = List(
        Unicode(),
        help="""Extra arguments for every 'criu dump' (e.g. ['--action-script', '/path/hook.sh']
        or ['--ext-unix-sk']).""",
    ).tag(config=True)

    @validate("dump_extra_args")
    def _check_dump_extra_args(self, proposal):
        for arg in proposal["value"]:
            if re.fullmatch(r"-v[0-2]", arg):
                raise TraitError(
                    f"LocalBackend.dump_extra_args has {arg!r}: below -v3 CRIU does not log "
                    "'Dumping finished successfully', which a checkpoint needs to be verified (every "
                    "suspension would fail); leave the verbosity out or use -v3 or more"
                )
        return proposal["value"]

    restore_extra_args = List(Unicode(), help="Extra arguments for every 'criu restore'.").tag(
        config=True
    )

    port_wait_timeout = Float(
        30.0,
        help="""Seconds a restore waits for the suspended server's old processes to be gone
        and its port to be free again (a server holding much memory takes seconds to exit).
        If the port is still taken then, the spawn fails naming the process that holds it,
        and the snapshot stays restorable: stop that process and start the server again.""",
    ).tag(config=True)

    dump_timeout = Float(
        1800.0,
        help="Seconds a 'criu dump' may take before it is stopped and the server resumed.",
    ).tag(config=True)

    kill_timeout = Float(
        10.0,
        help="Seconds to wait for a checkpointed (frozen) tree to disappear after SIGKILL.",
    ).tag(config=True)

    hash_threads = Integer(
        0,
        help="""Threads that checksum image files (at checkpoint and at restore) and, with
        storage = 'chunks', compress, encrypt and unpack chunks. 0: one per CPU (os.cpu_count()). Hashing a 10 GB image takes about 10 CPU-seconds; lower this
        on a hub whose cores are busy with other servers, at the cost of slower suspends.""",
    ).tag(config=True)

    chunk_bytes = Integer(
        CHUNK_BYTES,
        help="""Bytes per checksum chunk: each chunk of an image file is hashed on its own,
        in parallel. Recorded in each manifest (changing it does not affect existing
        checkpoints).""",
    ).tag(config=True)

    verify_read_back = Bool(
        False,
        help="""Before ending a checkpointed server's processes, also drop the image from
        the page cache and read it all back from the disk to compare the checksums.
        Off by default: the image is fsync'ed and checksummed from memory, and every
        checksum is checked again at restore (a damaged image then fails the restore and
        the user gets a fresh server, losing that state). Turn it on for disks you do not
        trust to return what they acknowledged; each checkpoint then reads its whole
        image once more from the disk (about image size / disk read speed).""",
    ).tag(config=True)

    writeback_during_dump = Bool(
        False,
        help="""Ask the kernel to start writing image files to the disk while CRIU is still
        dumping (sync_file_range), so that the final fsync has less left to wait for. Off by
        default: on an H100 machine whose disk flushes faster than CRIU dumps, it made a
        suspension's time to disk 1.24-1.30x a bare dump + fsync (8 and 24 GiB), against
        0.95-0.98x without it, because CRIU's writes then wait for pages under writeback
        (docs/performance.md). Try it where the disk is much slower than the dump.""",
    ).tag(config=True)

    storage = Enum(
        ["files", "chunks"],
        "files",
        help="""How images are kept. 'files': CRIU's image files as written (nothing to set
        up beyond CRIU; the fastest restore of incompressible data and on hosts with few
        cores). 'chunks': cut into content-defined chunks, zstd-compressed in parallel and
        stored once under <checkpoint_dir>/.chunks, so data shared between snapshots (the
        same model in many servers, a server suspended again) takes disk space once; model
        weights restore faster than from 'files' on many-core hosts (raise
        fs.pipe-max-size, see restore_pipe_bytes); needed for encryption_key_file. Existing
        checkpoints keep the storage they were written with (docs/performance.md).""",
    ).tag(config=True)

    compression_level = Integer(
        1,
        help="""zstd level for storage = 'chunks' (1 fastest … 19 smallest; 0 stores chunks
        uncompressed). Level 1 compresses faster than most disks write; data that does not
        shrink by 3 % is stored uncompressed whatever this says. Higher levels write less
        and suspend slower; restores decompress in parallel at any level. 0 saves the
        decompression's CPU at restore, for about a third more disk for model weights
        (docs/performance.md).""",
    ).tag(config=True)

    average_chunk_bytes = Integer(
        2 << 20,
        help="""Average chunk size for storage = 'chunks' (a power of two, >= 64 KiB; chunks
        are between a quarter and four times this). Smaller finds more shared data between
        snapshots but costs more per-chunk work and files; 2 MiB suits GPU servers.""",
    ).tag(config=True)

    @validate("average_chunk_bytes")
    def _check_average_chunk_bytes(self, proposal):
        value = proposal["value"]
        if value < 64 << 10 or value & (value - 1):
            raise TraitError(
                f"LocalBackend.average_chunk_bytes = {value}: use a power of two >= 65536 "
                "(e.g. 2097152 for 2 MiB)"
            )
        return value

    restore_streaming = Bool(
        True,
        help="""storage = 'chunks': restore with 'criu restore --stream', fed from the chunk
        store while the chunks are read, checked and decompressed, so reading the image and
        CRIU's work overlap (the restore then takes about as long as the slower of the two).
        False: unpack the whole image into restore_staging_dir first, then run CRIU on it
        (needs free room of the image's size there); use it only with a CRIU built without
        image streaming.""",
    ).tag(config=True)

    restore_mode = Enum(
        ["eager", "lazy"],
        "eager",
        help="""How a suspended server's memory comes back. 'eager' (default): all of it,
        checked, before the server runs (about 0.8 s per GiB on an H100 machine). 'lazy': the
        server runs as soon as its processes are restored (0.2-0.3 s whatever its size, on a
        2-core test machine) and its memory follows on demand and in the background, each
        page checked before the process gets it; every page is back 0.9-2.3x the time of an
        eager restore, and the Hub process serves the pages meanwhile (CPU: one sha256 pass
        over the image). Costs with storage = 'files': page checksums are written after each
        suspension (one more read of the image and 0.8-1.3 CPU-seconds per GiB, in the
        background; a restore that comes first is eager). A damaged page found after the
        server runs kills the restored server (no process runs on wrong memory): the
        snapshot is marked failed naming the damaged block or chunk, and the next start is
        a fresh server. GPU memory is restored after the processes run, before the server
        is handed out. Falls back to an eager restore (logged) when the snapshot has no page
        checksums or CRIU cannot restore lazily (needs 'criu check --feature uffd-noncoop').
        Set it the same in the service's and the Hub's configuration
        (docs/lazy-restore.md).""",
    ).tag(config=True)

    restore_pipe_bytes = Integer(
        PIPE_BYTES,
        help="""Size of the pipe each image file goes through to CRIU in a streamed restore
        (restore_streaming). A deep pipe lets the streamer run ahead of CRIU instead of the
        two taking turns every megabyte (docs/performance.md has the figures). Sizes above
        /proc/sys/fs/pipe-max-size (1 MiB by default) need CAP_SYS_RESOURCE, which container
        runtimes drop: raise the limit on the node (sysctl -w fs.pipe-max-size=16777216)
        or the largest allowed size is used (logged once, with that fix). 64 KiB to 256 MiB.""",
    ).tag(config=True)

    @validate("restore_pipe_bytes")
    def _check_restore_pipe_bytes(self, proposal):
        value = proposal["value"]
        if not 64 << 10 <= value <= 256 << 20:
            raise TraitError(
                f"LocalBackend.restore_pipe_bytes = {value}: use 65536 to 268435456 bytes "
                "(e.g. 16777216 for 16 MiB)"
            )
        return value

    restore_staging_dir = Unicode(
        "/dev/shm",
        help="""Where a restore of an image kept as chunks (storage = 'chunks') works, in a new
        root-only folder deleted right after: CRIU's socket and log with restore_streaming;
        without it, the whole image unpacked for CRIU. A memory file system (the default
        /dev/shm) keeps an unpacked copy off the disk and out of the kernel's dirty-page
        throttling; when it lacks room, or is empty here, the checkpoint's own folder is
        used (and /tmp for the socket). Unpacking needs free memory of about the image size
        while a restore runs.""",
    ).tag(config=True)

    encryption_key_file = Unicode(
        "",
        help="""File with the AES-256 keys that encrypt checkpoint chunks at rest (needs
        storage = 'chunks'); empty: not encrypted. One '<id> <base64 key>' per line, newest
        first, mode 0600; make a line with 'jupyterhub-gpusnap keys --new <id>'. Rotate by
        adding a new first line; keep old lines while checkpoints use them
        ('jupyterhub-gpusnap keys' lists them). The Hub (which restores) and the service
        (which checkpoints) both need it.""",
    ).tag(config=True)

    verify_dedup = Bool(
        True,
        help="""storage = 'chunks': when a checkpoint finds one of its chunks stored already
        (the same data in another snapshot), read the stored copy back and check it before
        trusting it; a damaged copy is replaced by the fresh data (a repair, counted in
        gpusnap_chunks_damaged_total{found_by="write"}). Costs a read of the shared data per
        suspension (docs/operations.md, 'Scrub and repair', has the figures); off trusts the
        stored copy until the scrub or a restore reads it.""",
    ).tag(config=True)

    replica_dir = Unicode(
        "",
        help="""storage = 'chunks': where second copies of chunks are kept (see
        replicate_min_servers), in the same layout and sealed the same way as the chunks.
        Empty: <checkpoint_dir>/.chunks-replica, which survives damaged sectors and flipped
        bits but not the loss of the disk; a folder on a second disk survives that too
        (the manifests are in checkpoint_dir, so back that up as well). Root-only (0700).""",
    ).tag(config=True)

    replicate_min_servers = Integer(
        2,
        min=0,
        help="""storage = 'chunks': a chunk that the snapshots of at least this many servers
        need (suspended ones, and failed restores kept for rescue) is stored twice, in
        replica_dir, so that one damaged copy breaks no restore: the more snapshots depend on
        a chunk, the more it is worth. 2 (default): shared chunks. 1: every chunk, each
        written twice at the suspension itself (about twice the disk and write time). 0: no
        replicas. Replicas of newly shared chunks are made by the next scrub() call (the
        service's housekeeping, hourly).""",
    ).tag(config=True)

    scrub_interval = Float(
        7 * 86400.0,
        help="""storage = 'chunks': seconds between two full scrubs, which re-read every
        stored chunk and its replica, repair either from the other, and mark the checkpoints
        that need a chunk damaged beyond repair as failed (logged, counted in
        gpusnap_chunks_damaged_total and gpusnap_checkpoints_damaged). 0: no scheduled full
        scrub (scrub(full=True) still runs one).""",
    ).tag(config=True)

    scrub_bytes_per_second = Integer(
        64 << 20,
        min=0,
        help="""storage = 'chunks': most bytes per second a scrub reads, so that it does not
        slow suspensions and restores down (a full scrub of S bytes of chunks and replicas
        takes at least S / this). 0: as fast as the disk goes.""",
    ).tag(config=True)

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        if self.encryption_key_file:
            if self.storage != "chunks":
                raise KeyFileError(
                    "LocalBackend.encryption_key_file needs LocalBackend.storage = 'chunks' "
                    "(only chunks are encrypted): set both"
                )
            load_keys(self.encryption_key_file)  # a bad key file fails at start-up
        self._pool_obj: ThreadPoolExecutor | None = None
        self._criu_ok: dict[tuple[str, str], str] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._active: set[str] = set()  # servers whose checkpoint() runs in this process
        self._reserved: dict[str, int] = {}  # disk bytes held per suspension under way
        self._cuda_obj = None
        self._cuda_missing = False
        self._stores: dict[str, ImageStore] = {}
        self.restored: dict[int, criu.Restored] = {}
        #: checkpoint id -> the task writing its page checksums (restore_mode = 'lazy')
        self.page_sums: dict[str, asyncio.Future] = {}
        #: checkpoint id -> the task waiting for a lazy restore's last page
        self.lazy_restores: dict[str, asyncio.Future] = {}

    # ---------------------------------------------------------------- helpers
    @property
    def root(self) -> Path:
        return Path(self.checkpoint_dir)

    def server_dir(self, user: str, server_name: str) -> Path:
        return self.root / encode_name(user) / encode_name(server_name)

    def folder(self, checkpoint_id: str) -> Path:
        """The folder of a checkpoint id (``<user>/<server>/<time>``), checked to lie inside."""
        parts = checkpoint_id.split("/")
        if len(parts) != 3 or any(p in ("", ".", "..") for p in parts):
            raise CheckpointError(f"not a local checkpoint id: {checkpoint_id!r}")
        return self.root.joinpath(*parts)

    def _id(self, folder: Path) -> str:
        return "/".join(folder.relative_to(self.root).parts)

    def location(self, checkpoint_id: str) -> str:
        """The folder of a checkpoint (raises :class:`CheckpointError` for a malformed id)."""
        return str(self.folder(checkpoint_id))

    @property
    def log_root(self) -> str:
        """Servers' logs go under checkpoint_dir (``server_log_template``)."""
        return self.checkpoint_dir

    @property
    def pool(self) -> ThreadPoolExecutor:
        """The thread pool that hashes image chunks (``hash_threads`` threads)."""
        if self._pool_obj is None:
            n = self.hash_threads or os.cpu_count() or 1
            self._pool_obj = ThreadPoolExecutor(max_workers=n, thread_name_prefix="gpusnap-hash")
        return self._pool_obj

    def keys(self) -> list[Key]:
        """The keys of ``encryption_key_file`` (read on each use: rotation needs no restart)."""
        return load_keys(self.encryption_key_file) if self.encryption_key_file else []

    @property
    def replica_root(self) -> Path | None:
        """Where chunks' second copies go (None: replicate_min_servers = 0)."""
        if self.replicate_min_servers <= 0:
            return None
        return Path(self.replica_dir) if self.replica_dir else self.root / REPLICAS

    def chunk_store(self) -> ChunkStore:
        """The chunk store under checkpoint_dir, with the current keys."""
        return ChunkStore(
            self.root / STORE,
            self.pool,
            level=self.compression_level,
            keys=self.keys(),
            avg_pages=self.average_chunk_bytes // PAGE,
            replica_root=self.replica_root,
            replicate_all=self.replicate_min_servers == 1,
            verify_dedup=self.verify_dedup,
            on_damage=self._chunk_damaged,
        )

    def image_store(self, storage: str) -> ImageStore:
        """The store of a checkpoint's image (``storage``: ``files`` or ``chunks``)."""
        store = self._stores.get(storage)
        if store is None:
            store = self._stores[storage] = (ChunksStore if storage == "chunks" else FilesStore)(self)
        return store

    def _chunk_damaged(self, space: str, cid: str, found_by: str, repaired: bool, what: str) -> None:
        """A chunk was found damaged while written or read (the store's threads call this)."""
        chunk_scrub.count_damage(found_by, repaired)
        if repaired:
            how = "replaced by the fresh data" if found_by == "write" else "repaired from its replica"
            self.log.warning("chunk %s… (%s) was damaged: %s; %s", cid[:12], space, what, how)
        else:
            self.log.error("chunk %s… (%s) is damaged and has no intact copy: %s", cid[:12], space, what)

    async def _require_criu(self) -> str:
        """The CRIU version, checked once per binary (``criu --version`` costs a fork+exec);
        refused at once if the binary has gone since."""
        key = (self.criu_path, self.criu_min_version)
        version = self._criu_ok.get(key)
        if version is None or criu.find_criu(self.criu_path) is None or os.geteuid() != 0:
            self._criu_ok.pop(key, None)
            version = await criu.require_criu(self.criu_path, self.criu_min_version)
            self._criu_ok[key] = version
        return version

    def _lock(self, key: str) -> asyncio.Lock:
        return self._locks.setdefault(key, asyncio.Lock())

    def cuda(self):
        """The CUDA checkpoint layer (None when the module is not installed)."""
        if self._cuda_obj is None and not self._cuda_missing:
            try:
                from ..gpu.cuda import CudaCheckpoint
            except ImportError as e:
                self.log.warning("GPU checkpointing unavailable (%s): CPU state only", e)
                self._cuda_missing = True
                return None
            self._cuda_obj = CudaCheckpoint(parent=self, lock_timeout_ms=self.lock_timeout_ms)
        return self._cuda_obj

    def info(self, folder: Path, m: Manifest) -> CheckpointInfo:
        return CheckpointInfo(
            id=self._id(folder),
            user=m.user,
            server_name=m.server,
            created=m.created,
            status=m.status,
            image_bytes=m.image_bytes,
            gpu_bytes=m.gpu_bytes,
            gpu_model=m.gpu_model,
            gpu_count=m.gpu_count,
            location=str(folder),
            error=m.error,
            extra={
                "pid": m.pid,
                "ip": m.ip,
                "port": m.port,
                "tcp_mode": m.tcp_mode,
                "criu_version": m.criu_version,
                "driver_version": m.driver_version,
                "time_to_gpu_free_s": m.time_to_gpu_free_s,
                "dump_seconds": m.dump_seconds,
                "restored_at": m.restored_at,
                "restore_s": m.extra.get("restore_s"),
                "restore_phases": m.extra.get("restore_phases"),
                # a lazy restore handed out: memory (and GPU memory) still coming back
                "lazy_pending": bool(m.extra.get("lazy_pending")),
                "gpu_pending": bool(m.extra.get("gpu_pending")),
                "seal_seconds": getattr(m, "seal_seconds", None),
                "storage": m.storage,
                "stored_bytes": m.stored_bytes,
                "new_bytes": m.new_bytes,
                "encrypted": bool(m.storage == "chunks" and m.key_id not in ("", "plain")),
                # days a failed restore's snapshot is kept (emails quote it); a verified
                # one is kept until restored, however long that is: no number to give
                "retention_days": (
                    _days(self.max_age_days) if _rescue_since(folder, m) is not None else None
                ),
                "damaged_chunks": m.extra.get("damaged_chunks", []),
            },
        )

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

    # ---------------------------------------------------------------- contract
    async def setup(self) -> None:
        """Create checkpoint_dir (or make it private), log what is missing, resolve
        checkpoints left ``writing``."""
        self._mkdir(self.root)
        await asyncio.to_thread(self._tighten_all)
        try:
            version = await self._require_criu()
            self.log.info("CRIU %s ready; checkpoints in %s", version, self.root)
        except CheckpointRefused as e:
            self.log.error("local checkpoints disabled until fixed: %s", e)
        cuda = self.cuda()
        if cuda is not None and not cuda.available():
            self.log.info("no CUDA checkpoint API on this host: CPU-only checkpoints")
        elif cuda is not None:
            try:  # open NVML now, not in the first suspension's time to a free GPU
                await asyncio.to_thread(cuda.gpu_inventory)
            except Exception as e:
                self.log.info("no NVML on this host (%s): GPU memory left out of estimates", e)
        clear_staging(self.restore_staging_dir, self.log)
        await self.recover()

    async def check(self, server: Server) -> None:
        """Refuse (:class:`CheckpointRefused`) when ``server`` cannot be checkpointed now."""
        await self._preflight(server)

    async def _preflight(self, server: Server, reserve: bool = False) -> tuple[str, list[int], int, dict]:
        """Checks before touching anything; returns (criu version, tree pids, estimate,
        GPU inventory). Everything here runs before the GPU is freed: keep it quick.
        ``reserve``: hold the estimate of disk space for this server until
        :meth:`_locked_checkpoint` ends (other suspensions then count it as taken)."""
        version = await self._require_criu()
        pid = server.pid
        if not pid:
            raise CheckpointRefused(
                f"{server.key}: no pid in the spawner state (needs a local spawner and the "
                "admin:server_state scope)"
            )
        if not is_alive(pid):
            raise CheckpointRefused(f"{server.key}: process {pid} is not running")
        pending = self._load_all(server.user, server.name)
        if pending and pending[0][1].status == "writing":
            raise CheckpointRefused(
                f"{server.key}: a checkpoint is already being written ({self._id(pending[0][0])})",
                retry=True,
            )
        pids = tree_pids(pid)
        why = "; ".join(sandbox.unreachable_files(pids)[:3]) or criu.limits_unreadable(pids)
        if why:
            raise CheckpointRefused(f"{server.key}: cannot be checkpointed: {why}")
        rss = 0
        for p in pids:
            try:
                rss += psutil.Process(p).memory_info().rss
            except psutil.Error:
                pass
        inventory: dict = {}
        cuda = self.cuda()
        if cuda is not None:
            try:  # one NVML pass: the estimate and the manifest's GPU facts
                inventory = await asyncio.to_thread(cuda.gpu_inventory, pids)
            except Exception as e:  # no NVML: the estimate is CPU-only
                self.log.debug("GPU inventory of %s unavailable: %s", server.key, e)
        estimate = rss + int(inventory.get("gpu_bytes", 0))
        self._mkdir(self.root)
        # From here to the reservation nothing awaits: two suspensions cannot both take
        # the same free space.
        self._check_disk(server.key, estimate)
        if reserve:
            self._reserved[server.key] = estimate
        return version, pids, estimate, inventory

    def _check_disk(self, key: str, estimate: int) -> None:
        """Refuse unless checkpoint_dir's disk holds ``estimate`` + min_free_bytes beyond
        what suspensions under way have reserved (their estimates, held until they end)."""
        free = shutil.disk_usage(self.root).free
        others = {k: n for k, n in self._reserved.items() if k != key}
        held = sum(others.values())
        need = estimate + self.min_free_bytes
        if free - held >= need:
            return
        gib = lambda n: f"{n / 2**30:.1f} GiB"  # noqa: E731
        needs = (
            f"need {gib(estimate)} for the image + {gib(self.min_free_bytes)} "
            "(LocalBackend.min_free_bytes)"
        )
        if free >= need:  # it fits once the suspensions under way are done
            raise CheckpointRefused(
                f"{key}: not enough disk in {self.root} now: {gib(free)} free, "
                f"{gib(held)} of it reserved by suspensions under way "
                f"({', '.join(sorted(others))}), {needs}. Nothing was frozen; it is tried "
                "again later. If it persists, free space, move checkpoint_dir, or lower "
                "Watcher.suspend_concurrency",
                retry=True,
            )
        raise CheckpointRefused(
            f"{key}: not enough disk in {self.root}: {gib(free)} free"
            + (f" ({gib(held)} of it reserved by suspensions under way)" if held else "")
            + f", {needs}; free space, move checkpoint_dir, or lower keep_last/max_age_days"
        )

    async def checkpoint(self, server: Server) -> CheckpointInfo:
        """Checkpoint, verify, then kill ``server``'s tree (see the module docstring).

        Cancelling the caller (e.g. ``asyncio.wait_for`` timing out) does not abort a
        checkpoint half-way, which could leave the server frozen: it runs to its end
        (verified and ended, or failed and resumed) and the outcome is logged.
        ``dump_timeout`` bounds the dump itself.
        """
        task = asyncio.ensure_future(self._locked_checkpoint(server))
        task.add_done_callback(lambda t: self._log_orphan(server.key, t))
        return await asyncio.shield(task)

    async def _locked_checkpoint(self, server: Server) -> CheckpointInfo:
        async with self._lock(server.key):
            self._active.add(server.key)
            try:
                return await super().checkpoint(server)
            finally:
                self._active.discard(server.key)
                self._reserved.pop(server.key, None)  # the dump has ended: its space is real

    def _log_orphan(self, key: str, task: asyncio.Task) -> None:
        """Retrieve the outcome of a checkpoint whose caller stopped waiting."""
        if task.cancelled():
            return
        error = task.exception()
        if error is not None and not isinstance(error, CheckpointError):
            self.log.error("%s: checkpoint crashed: %r", key, error)

    async def do_preflight(self, server: Server) -> LocalSuspension:
        """The checks (:meth:`_preflight`, its disk estimate held for this suspension),
        then the checkpoint's folder and its manifest, ``writing`` (what :meth:`recover`
        finds after a crash)."""
        t0 = time.monotonic()  # time_to_gpu_free_s counts from here
        version, pids, _, inv = await self._preflight(server, reserve=True)
        pid = server.pid
        created = time.time()
        stamp = datetime.fromtimestamp(created, timezone.utc).strftime(_TS)
        folder = (
            self.server_dir(server.user, server.name)
            / f"{stamp}.{int(created * 1e6) % 1_000_000:06d}Z"
        )
        self._mkdir(folder)
        m = Manifest(
            user=server.user,
            server=server.name,
            created=created,
            criu_version=version,
            pid=pid,
            tcp_mode=self.tcp_mode,
            shell_job=criu.needs_shell_job(pid),
            gpu_model=inv.get("gpu_model", ""),
            gpu_count=int(inv.get("gpu_count", 0)),
            gpu_bytes=int(inv.get("gpu_bytes", 0)),
            driver_version=inv.get("driver_version", ""),
            # the storage it is written for, from the start: a failed or interrupted chunk
            # checkpoint's raw files (plaintext memory) are then known to be deleted
            storage=self.storage,
        )
        m.extra["tree"] = pids
        m.extra["started"] = boot_clock()  # processes older than this are the suspended server
        m.extra["mount_namespace"] = sandbox.own_mount_namespace(pid)
        m.extra["gpu_devices"] = list(inv.get("gpu_devices", []))
        # Not fsync'ed: it must outlive a crash of the service (recover() then resumes the
        # tree); a crash of the machine loses the suspended GPU state anyway.
        m.save(folder, durable=False)
        self.log.info(
            "%s: checkpoint %s writing (pid %s, %d processes)",
            server.key,
            self._id(folder),
            pid,
            len(pids),
        )
        return LocalSuspension(
            server, started=t0, id=self._id(folder), folder=folder, manifest=m, pids=pids
        )

    async def do_freeze(self, s: LocalSuspension) -> None:
        """GPU memory to host memory (the CUDA checkpoint API): the GPU is free from here.
        A busy GPU refuses (the driver rolled back): the folder goes, nothing changed."""
        cuda = self.cuda()
        if cuda is not None:
            try:
                s.cuda_pids = await cuda.suspend(s.pids, lock_timeout_ms=self.lock_timeout_ms)
            except CheckpointRefused as e:
                # Nothing changed (the driver rolled back): not a failed image, just not now.
                shutil.rmtree(s.folder, ignore_errors=True)
                self.log.info("%s: checkpoint refused: %s", s.server.key, e)
                raise
        s.manifest.cuda_pids = s.cuda_pids
        s.manifest.time_to_gpu_free_s = round(time.monotonic() - s.started, 3)

    async def do_dump(self, s: LocalSuspension) -> None:
        """``criu dump --leave-stopped`` (packed into chunks while CRIU writes, with
        ``storage = 'chunks'``)."""
        m, folder, pid = s.manifest, s.folder, s.server.pid
        cuda = self.cuda()
        # What the GPU step does not need, read after it rather than before.
        m.ip, m.port = listen_address(pid)
        m.api_token = self._seal_token(environ_of(pid, "JUPYTERHUB_API_TOKEN"))
        if cuda is not None and m.gpu_count and not m.driver_version:
            m.driver_version = cuda.driver_version() or ""
        m.save(folder)
        t1 = time.monotonic()
        store = self.image_store(self.storage)
        s.follower = await store.begin(folder)
        with store.writeback(folder):
            await criu.dump(
                pid,
                folder,
                criu=self.criu_path,
                tcp=self.tcp_mode,
                leave_stopped=True,
                extra=[*sandbox.dump_args(pid), *self.dump_extra_args],
                timeout=self.dump_timeout,
            )
        m.dump_seconds = round(time.monotonic() - t1, 3)

    async def do_verify(self, s: LocalSuspension) -> None:
        """Complete, checksummed, durable (:meth:`_verify_dump`), and the tree still frozen."""
        await self._verify_dump(s.folder, s.manifest, s.follower)
        if s.phase == "recover":
            return  # do_dumped checked the tree
        if not all(is_frozen(p) or not is_alive(p) for p in s.pids[:1]):
            raise CheckpointError(f"process {s.server.pid} is no longer frozen after the dump")

    async def do_record(self, s: LocalSuspension) -> CheckpointInfo:
        m = s.manifest
        m.status = "verified"
        m.verified_at = time.time()
        m.save(s.folder)
        return self.info(s.folder, m)

    async def do_end(self, s: LocalSuspension, info: CheckpointInfo) -> None:
        """Only now, the image safe: the frozen tree is killed; a chunk checkpoint's raw
        files go, a lazy-mode one gets its page checksums in the background."""
        m, folder = s.manifest, s.folder
        if s.phase == "recover":  # completed after a crash: a still-frozen tree goes
            if s.frozen:
                await self.kill_tree(s.pids)
            self.log.warning("%s: checkpoint %s completed at recovery", s.server.key, s.id)
            return
        await self.kill_tree(s.pids)
        self.image_store(m.storage).after_verified(folder)
        if m.storage == "files" and self.restore_mode == "lazy":
            # nobody waits for them: a restore that comes first is eager
            cid = self._id(folder)
            self.page_sums[cid] = asyncio.ensure_future(
                self._write_page_sums(folder, m, s.server.key)
            )
        self.log.info(
            "%s: checkpoint %s verified (%.1f MiB, GPU free after %.2fs, dump %.2fs, "
            "checksums and fsync %.2fs, %s); processes ended",
            s.server.key, self._id(folder), m.image_bytes / 2**20, m.time_to_gpu_free_s,
            m.dump_seconds, m.seal_seconds, m.verification,
        )  # fmt: skip

    async def _undo_interrupted(self, s: LocalSuspension, why: str) -> None:
        """A suspension a crash interrupted, not to be completed: the tree resumed if it
        runs (its GPU state may be checkpointed even if the service died before recording
        it), the checkpoint failed."""
        m, folder, key = s.manifest, s.folder, s.server.key
        if s.root_alive:
            await self._fail(folder, m, key, s.pids, m.cuda_pids or s.pids, why)
            return
        m.status, m.error = "failed", why + " and the process is gone"
        if m.storage == "chunks":
            drop_image_files(folder)
        m.save(folder)
        self.log.error("%s: checkpoint %s failed at recovery: %s", key, s.id, m.error)

    async def do_resume(self, s: LocalSuspension, error: Exception) -> Exception:
        """SIGCONT, GPU memory back, the image kept ``failed`` (:meth:`_fail`); the error
        says why and that the server keeps running."""
        key = s.server.key
        if s.phase == "recover":
            await self._undo_interrupted(s, str(error))
            return error
        if s.phase == "freeze":
            await self._fail(s.folder, s.manifest, key, s.pids, [], f"GPU checkpoint failed: {error}")
            return CheckpointError(f"{key}: GPU checkpoint failed, server left running: {error}")
        if s.follower is not None:
            await asyncio.to_thread(s.follower.close)
        why = await self._fail(s.folder, s.manifest, key, s.pids, s.cuda_pids, str(error))
        if isinstance(error, CheckpointError):
            return CheckpointError(f"{key}: {why}; the server keeps running")
        return CheckpointError(
            f"{key}: checkpoint failed ({type(error).__name__}: {why}); the server keeps running"
        )

    async def _verify_dump(self, folder: Path, m: Manifest, follower: Follower | None = None) -> None:
        """Make a finished dump "verified" (see the module docstring) or raise CheckpointError:
        complete (CRIU's files and its success line), then sealed by the image store.

        Fills ``files``, ``sizes``, ``chunk_bytes``, ``image_bytes`` and ``verification``.
        """
        t = time.monotonic()
        problems = await asyncio.to_thread(check_complete, folder)
        if problems:
            raise CheckpointError("image verification failed: " + "; ".join(problems[:5]))
        await self.image_store(self.storage).seal(folder, m, follower)
        m.seal_seconds = round(time.monotonic() - t, 3)

    def _seal_token(self, token: str) -> str:
        """The server's API token as the manifest keeps it: sealed when encrypting at rest."""
        keys = self.keys() if token else []
        if not keys:
            return token
        return "sealed:" + keys[0].seal(token.encode(), b"api_token").hex()

    async def scrub(self, full: bool | None = None) -> dict:
        """Check the chunk store and keep shared chunks twice (:meth:`.ChunksStore.scrub`);
        the report as a dict (empty when there is no chunk store)."""
        found = await asyncio.to_thread(
            lambda: [
                (self._id(folder), folder, m, _rescue_since(folder, m) is not None)
                for folder, m in self._load_all()
            ]
        )
        return await self.image_store("chunks").scrub(found, full)

    async def _fail(
        self, folder: Path, m: Manifest, key: str, pids: list[int], cuda_pids: list[int], why: str
    ) -> str:
        """Let the server go on (SIGCONT, GPU memory back) and keep the image as ``failed``;
        the reason recorded (``why`` and what was found and done about it)."""
        self.resume_tree(pids)
        if cuda_pids and self.cuda() is not None:
            try:
                await self.cuda().resume(cuda_pids)
            except Exception as e:
                why += f"; resuming GPU memory failed too: {e}"
        full = _disk_full(why, folder)
        if m.storage == "chunks" and not full:
            # CRIU's raw files of a chunk checkpoint are the server's memory unencrypted and
            # of no use once it failed (the server runs on): never left on the disk
            freed = await asyncio.to_thread(drop_image_files, folder)
            if freed:
                why += f"; its raw image files ({freed / 2**20:.1f} MiB of the server's memory) were deleted"
        while True:
            if full:
                # A half-written image is of no use (the server runs on) and keeps every
                # other suspension from fitting: give the space back, keep logs and manifest.
                # (CRIU's log is on the same disk, so it may be cut short before it says
                # why; the disk is asked too, and a record that does not fit says so.)
                freed = await asyncio.to_thread(drop_image_files, folder)
                why += (
                    f"; the disk holding {self.root} is full (No space left on device): the "
                    f"partial image ({freed / 2**20:.1f} MiB) was deleted. Free space there, "
                    "move LocalBackend.checkpoint_dir, or lower keep_last/max_age_days"
                )
            m.status, m.error = "failed", why
            try:
                m.save(folder)
            except OSError as e:
                if not full and e.errno in (errno.ENOSPC, errno.EDQUOT):
                    full = True  # no room even for the record: free the image, record again
                    continue
                # apply_retention()'s recover() records it once it can
                self.log.error("%s: cannot record failure in %s: %s", key, folder, e)
            break
        self.log.error("%s: checkpoint %s failed, server resumed: %s", key, self._id(folder), why)
        return why

    @staticmethod
    def resume_tree(pids: list[int]) -> None:
        """SIGCONT every process of a tree (undoes ``--leave-stopped``)."""
        for p in pids:
            try:
                os.kill(p, signal.SIGCONT)
            except OSError:
                pass

    async def kill_tree(self, pids: list[int]) -> None:
        """SIGKILL a (frozen) tree and wait until it is gone; reap our own children."""
        for p in pids:
            try:
                os.kill(p, signal.SIGKILL)
            except OSError:
                pass
        deadline = time.monotonic() + self.kill_timeout
        me = os.getpid()
        while True:
            left = []
            for p in pids:
                try:
                    proc = psutil.Process(p)
                    if proc.ppid() == me:
                        os.waitpid(p, os.WNOHANG)
                    if proc.status() != psutil.STATUS_ZOMBIE:
                        left.append(p)
                except (psutil.Error, ChildProcessError):
                    continue
            if not left:
                return
            if time.monotonic() > deadline:
                self.log.warning(
                    "processes %s still present %gs after SIGKILL", left, self.kill_timeout
                )
                return
            await asyncio.sleep(0.05)

    async def get(self, checkpoint_id: str) -> CheckpointInfo | None:
        """One checkpoint by id, or None."""
        folder = self.folder(checkpoint_id)
        try:
            return self.info(folder, Manifest.load(folder))
        except (OSError, ValueError):
            return None

    async def latest(self, user: str, server_name: str) -> CheckpointInfo | None:
        """The newest verified checkpoint of ``user/server_name`` (None if the newest
        checkpoint is restored or failed: the server moved on since)."""
        for folder, m in self._load_all(user, server_name):
            if m.status == "verified":
                return self.info(folder, m)
            if m.status in ("restored", "failed"):
                return None
        return None

    async def resume_token(self, checkpoint_id: str) -> str:
        """The Hub API token the checkpointed server holds ('' if it had none)."""
        try:
            m = Manifest.load(self.folder(checkpoint_id))
        except (OSError, ValueError):
            return ""
        token = m.api_token
        if token.startswith("sealed:"):
            sealed = bytes.fromhex(token[len("sealed:") :])
            try:
                keys = self.keys()
            except KeyFileError as e:
                raise CheckpointRefused(f"checkpoint {checkpoint_id}: {e}") from e
            for key in keys:
                try:
                    return key.open(sealed, b"api_token").decode()
                except ValueError:
                    continue
            raise CheckpointRefused(
                f"cannot restore checkpoint {checkpoint_id} now: it is sealed with key {m.key_id!r}, "
                f"which is not in LocalBackend.encryption_key_file ({self.encryption_key_file or 'unset'}): "
                "put that key back; the snapshot is kept and the next start restores it"
            )
        return token

    async def writing(self, user: str, server_name: str) -> CheckpointInfo | None:
        """The checkpoint of this server being written right now, if any."""
        found = self._load_all(user, server_name)
        if found and found[0][1].status == "writing":
            return self.info(*found[0])
        return None

    async def wait_settled(
        self, user: str, server_name: str, timeout: float, interval: float = 0.25
    ) -> CheckpointInfo | None:
        """Wait (at most ``timeout`` s) until no checkpoint of this server is ``writing``
        (and, for one this backend runs, until its processes are ended).

        Returns the checkpoint still writing when time ran out, else None.
        """
        deadline = time.monotonic() + timeout
        while True:
            pending = await self.writing(user, server_name)
            # a checkpoint of this process is settled once its processes are ended too
            busy = server_key(user, server_name) in self._active
            if (pending is None and not busy) or time.monotonic() > deadline:
                return pending
            await asyncio.sleep(interval)

    async def list(self, user: str | None = None) -> list[CheckpointInfo]:
        return [self.info(f, m) for f, m in self._load_all(user)]

    async def mark(self, checkpoint_id: str, status: str, error: str = "") -> None:
        """Set a checkpoint's status (``failed`` with ``error`` after a failed restore)."""
        folder = self.folder(checkpoint_id)
        m = Manifest.load(folder)
        if error:
            # a restore that failed twice over (a lazy restore's server killed, then the
            # spawner's own check): the first reason is the cause, keep it first
            first = m.error if m.status == "failed" and status == "failed" else ""
            m.error = f"{first}; then: {error}" if first and first != error else error
        m.status = status
        if status == "restored":
            m.restored_at = time.time()
        if status == "failed":  # a failed restore's snapshot is kept max_age_days from now
            m.extra["failed_at"] = time.time()
        m.save(folder)

    async def delete(self, checkpoint_id: str) -> None:
        await self._delete(checkpoint_id)
        await self.image_store("chunks").sweep()

    async def _delete(self, checkpoint_id: str) -> None:
        folder = self.folder(checkpoint_id)
        try:
            m = Manifest.load(folder)
        except OSError:
            raise CheckpointError(f"no checkpoint {checkpoint_id}") from None
        if m.status == "writing":
            raise CheckpointError(f"checkpoint {checkpoint_id} is being written; delete it later")
        await asyncio.to_thread(shutil.rmtree, folder)
        self.log.info("%s: checkpoint %s deleted", server_key(m.user, m.server), checkpoint_id)
        for parent in (folder.parent, folder.parent.parent):
            try:
                parent.rmdir()
            except OSError:
                break

    def _kept(self, found: list[tuple[Path, Manifest]]) -> list[Kept]:
        """What retention knows of each checkpoint (:func:`~.base.expired`)."""
        return [
            Kept(self._id(f), server_key(m.user, m.server), m.status, m.created, _rescue_since(f, m))
            for f, m in found
        ]

    @property
    def retention_days(self) -> float:
        """Days a snapshot whose restore failed is kept after the failure (``max_age_days``):
        the number emails quote ("kept for N days")."""
        return self.max_age_days

    async def do_expired(self, now: float) -> list[str]:
        """What ``keep_last``/``max_age_days`` allow to go (see their help): never a
        suspended server's image, nor a failed restore's before ``max_age_days`` from its
        failure. :meth:`apply_retention` has run :meth:`recover` first (checkpoints left
        ``writing`` that no checkpoint of this process is writing, e.g. a failure that could
        not be recorded on a full disk)."""
        return expired(self._kept(self._load_all()), now, self.keep_last, self.max_age_days)

    async def do_delete(self, checkpoint_id: str) -> None:
        await self._delete(checkpoint_id)

    async def do_after_retention(self) -> None:
        await self.image_store("chunks").sweep()

    def reserved_ports(self) -> set[int]:
        """Ports of suspended servers: a restore needs its old port free again."""
        found = self._load_all()
        keep = protected(self._kept(found))
        return {m.port for f, m in found if m.port and self._id(f) in keep}

    # ---------------------------------------------------------------- restore
    async def restore(
        self, info: CheckpointInfo, timeout: float = 600.0, into: RestoreTarget | None = None
    ) -> Restored:
        """Restore a verified checkpoint on this host (``into`` is not used: a local
        checkpoint comes back where it was taken); the running server's pid, ip and port.

        Checks sizes and the small files' checksums first, then runs CRIU while the
        ``pages-*.img`` checksums are computed (see the module docstring). On any failure
        raises :class:`CheckpointError` with nothing left running (the caller marks the
        checkpoint failed and starts afresh). On success the checkpoint is marked
        ``restored``.

        With ``restore_mode = "lazy"`` the tree runs before its memory is back (every page
        checked as it arrives, :meth:`_restore_lazily`); a damaged page found after that
        kills the tree and marks the checkpoint failed (docs/lazy-restore.md).
        """
        pid, ip, port = await self._restore(info, timeout)
        return Restored(pid=pid, ip=ip, port=port)

    async def _restore(self, info: CheckpointInfo, timeout: float) -> tuple[int, str, int]:
        restore_started = time.time()
        folder = Path(info.location) if info.location else self.folder(info.id)
        m = Manifest.load(folder)
        key = server_key(m.user, m.server)
        if m.status != "verified":
            raise CheckpointError(f"{key}: checkpoint {info.id} is {m.status}, not verified")
        adopted = await self._adopt(folder, m, key, info.id)
        if adopted is not None:
            return adopted
        await self._require_criu()
        await self._wait_for_old_server(m, key)
        if m.cuda_pids and self.cuda() is not None:
            try:
                here = await asyncio.to_thread(self.cuda().gpu_inventory)
            except Exception as e:
                here = {"error": str(e)}
            why = gpu_mismatch(m, here)
            if why:
                raise CheckpointError(f"{key}: checkpoint {info.id} cannot be restored here: {why}")

        if self.restore_mode == "lazy":
            done = await self._restore_lazily(info, folder, m, key, restore_started, timeout)
            if done is not None:
                return done

        job = RestoreJob(info, folder, m, key, restore_started, timeout)
        async with self.image_store(m.storage).restore_source(job) as source:
            return await self._restore_tree(job, source)

    async def _adopt(self, folder: Path, m: Manifest, key: str, cid: str) -> tuple[int, str, int] | None:
        """The server an interrupted restore of this checkpoint left running, if any.

        A restore whose caller died (the Hub killed after CRIU started) leaves CRIU to finish
        on its own: the tree runs, nobody knows it, and restoring again would clash with it.
        If ``restore.pid`` names a live process started since that restore began (both on
        the kernel's boot clock, exact to a clock tick) and listening on the checkpoint's
        port, it is that server: it is checked like any restore (every checksum; its GPU
        memory resumed) and handed out instead of a second copy.
        """
        pid = criu.read_pidfile(folder / "restore.pid")
        if not pid or not is_alive(pid):
            return None
        if started_since(pid, m.extra.get("restore_started")) is not True:
            return None  # the pid was reused by something older, or by another boot
        if listen_address(pid)[1] != m.port:
            return None
        self.log.warning("%s: adopting pid %s, left running by an interrupted restore of %s", key, pid, cid)
        problems = []
        if m.storage == "files":
            problems = await asyncio.to_thread(
                verify_image, folder, m.files, chunk_bytes=m.chunk_bytes, sizes=m.sizes, pool=self.pool
            )
        try:
            if problems:
                raise CheckpointError(f"{key}: image {cid} is damaged: " + "; ".join(problems[:5]))
            if m.cuda_pids and self.cuda() is not None:
                await self.cuda().resume(tree_pids(pid))
        except BaseException:
            await self.kill_tree(tree_pids(pid))
            raise
        m.status = "restored"
        m.restored_at = time.time()
        m.extra["restored_pid"] = pid
        m.extra["adopted"] = True
        m.save(folder)
        return pid, m.ip, m.port

    async def _wait_for_old_server(self, m: Manifest, key: str) -> None:
        """Wait until the suspended server's old processes are gone and its port is free
        (at most ``port_wait_timeout``); else refuse, the checkpoint left verified."""
        deadline = time.monotonic() + self.port_wait_timeout
        stamp = m.extra.get("started")
        while True:
            old = [
                p for p in (m.extra.get("tree") or [])
                if is_alive(p) and started_since(p, stamp) is False
            ]  # fmt: skip
            holder = port_holder(m.ip, m.port) if m.port else None
            if not old and holder is None:
                return
            if time.monotonic() > deadline:
                what = (
                    f"port {m.port}, which the suspended server listens on, is taken by {holder}"
                    if holder
                    else f"its old processes {old} are still exiting"
                )
                raise CheckpointRefused(
                    f"{key}: cannot restore yet: {what} after {self.port_wait_timeout:g}s. The "
                    "snapshot is kept; stop that process (or wait) and start the server again"
                )
            await asyncio.sleep(0.1)

    async def _restore_tree(self, job: RestoreJob, source: ImageSource) -> tuple[int, str, int]:
        """criu restore (from ``source.images``; through its streamer's socket when it has
        one) + GPU restore of a checked image (the second half of :meth:`restore`)."""
        info, folder, m, key = job.info, job.folder, job.manifest, job.key
        check_pages, damaged, streamer = source.check_pages, job.damaged, source.streamer
        phases = {"prepare_s": round(time.time() - job.started, 3)}
        m.extra["restore_started"] = boot_clock()  # what _adopt recognises this restore by
        m.save(folder)
        t = time.monotonic()
        try:
            restored = await criu.restore(
                source.images,
                folder / "restore.pid",
                criu=self.criu_path,
                tcp=m.tcp_mode,
                shell_job=m.shell_job,
                extra=[
                    *sandbox.restore_args(bool(m.extra.get("mount_namespace"))),
                    *self.restore_extra_args,
                    *(["--stream"] if streamer else []),
                ],
                timeout=job.timeout,
            )
        except CheckpointError as e:
            # A damaged page file is the likelier cause of a failed restore: say so.
            try:
                problems = await check_pages()
            except Exception:
                problems = []
            if problems:
                raise damaged(problems) from e
            raise
        phases["criu_s"] = round(time.monotonic() - t, 3)
        self.restored[restored.pid] = restored
        for p, r in list(self.restored.items()):
            if r.reap() is not None:
                self.restored.pop(p, None)
        # The page checksums (from the page cache CRIU just filled) and the GPU restore run
        # together; a damaged image still ends the restored tree before anyone sees it.
        hashing = check_pages()
        gpu = None
        if m.cuda_pids and self.cuda() is not None:
            gpu = asyncio.ensure_future(self.cuda().resume(tree_pids(restored.pid)))

        async def end(error: BaseException) -> None:
            if gpu is not None:
                await asyncio.gather(gpu, return_exceptions=True)
            await self._end_restored(restored)
            raise error

        try:
            problems = await asyncio.shield(hashing)
        except Exception as e:
            await end(CheckpointError(f"{key}: cannot check image {info.id}: {e}"))
        except BaseException as e:  # cancelled: nobody will hand this tree out
            await end(e)
        if problems:
            await end(damaged(problems))
        if streamer is not None:  # its senders have ended (check_pages waited for them)
            # which side a streamed restore waited on: the chunk store or CRIU
            phases["pipe_bytes"] = streamer.pipe_got
            phases["stream_waited_storage_s"] = round(streamer.waited["storage_s"], 3)
            phases["stream_waited_criu_s"] = round(streamer.waited["criu_s"], 3)
            self.image_store("chunks").note_small_pipe(streamer)
        phases["checks_after_criu_s"] = round(time.monotonic() - t - phases["criu_s"], 3)
        if gpu is not None:
            try:
                await gpu
            except Exception as e:
                await self.kill_tree(tree_pids(restored.pid))
                raise CheckpointError(f"{key}: restoring GPU memory failed: {e}") from e
        m.status = "restored"
        m.restored_at = time.time()
        m.extra["restored_pid"] = restored.pid
        m.extra["restore_s"] = round(m.restored_at - job.started, 3)
        # where a restore's time goes, for admins and bench/gpu_suspend.py: the GPU restore
        # runs alongside the checks, so gpu_done_s counts from the end of criu
        phases["gpu_done_s"] = round(time.monotonic() - t - phases["criu_s"], 3) if gpu else 0.0
        m.extra["restore_phases"] = phases
        m.save(folder)
        self.log.info(
            "%s: checkpoint %s restored as pid %s on %s:%s",
            key,
            info.id,
            restored.pid,
            m.ip,
            m.port,
        )
        return restored.pid, m.ip, m.port

    async def _end_restored(self, restored: criu.Restored) -> None:
        """Kill a restored tree that must not be handed out, and let its criu exit."""
        await self.kill_tree(tree_pids(restored.pid))
        try:
            await asyncio.wait_for(asyncio.to_thread(restored.criu.wait), self.kill_timeout)
        except asyncio.TimeoutError:
            self.log.warning(
                "criu restore (pid %s) still running after its tree was killed", restored.criu.pid
            )
        self.restored.pop(restored.pid, None)

    # ---------------------------------------------------------------- recovery
    async def do_unfinished(self) -> list[LocalSuspension]:
        """Checkpoints left ``writing`` by a service that died mid-dump (not those this
        process writes now). On the way, what a crash left of others: raw image files of
        packed or failed-and-encrypted checkpoints go, and lazy restores the Hub left
        unfinished are resolved (:meth:`_recover_lazy`, :meth:`_recover_gpu_behind`)."""
        left = []
        for folder, m in self._load_all():
            if m.status != "writing" and (
                m.storage == "chunks" or (m.status == "failed" and self.encryption_key_file)
            ):
                # raw files a crash left after packing, or of a failed checkpoint on a host
                # that encrypts at rest (older versions recorded "files" until packed)
                drop_image_files(folder)
            if m.status == "restored" and m.extra.get("lazy_pending"):
                self._recover_lazy(folder, m)
            elif m.status == "restored" and m.extra.get("gpu_pending"):
                await self._recover_gpu_behind(folder, m)
            if m.status != "writing":
                continue
            key = server_key(m.user, m.server)
            if key in self._active:  # being written by this process right now
                continue
            root_alive = is_alive(m.pid)
            left.append(
                LocalSuspension(
                    Server(user=m.user, name=m.server, state={"pid": m.pid}),
                    id=self._id(folder),
                    folder=folder,
                    manifest=m,
                    pids=[p for p in (m.extra.get("tree") or [m.pid]) if is_alive(p)],
                    root_alive=root_alive,
                    frozen=root_alive and is_frozen(m.pid),
                )
            )
        return left

    async def do_dumped(self, s: LocalSuspension) -> bool:
        """CRIU said it finished, and the tree is still frozen (or gone)."""
        return _dump_finished(s.folder) and (s.frozen or not s.root_alive)


# Less free space than this after a failed dump counts as a full disk (CRIU stops at
# its first failed write, a few MiB of pages at most short of the end).
DISK_FULL_MARGIN = 16 << 20


def _disk_full(why: str, folder: Path) -> bool:
    """True if a failure's text says the disk (or the quota) is full, or the disk holding
    ``folder`` has under DISK_FULL_MARGIN free (CRIU's log on a full disk may be cut
    short before it says so)."""
    if "No space left on device" in why or "Disk quota exceeded" in why:
        return True
    try:
        st = os.statvfs(folder)
    except OSError:
        return False
    return st.f_bavail * st.f_frsize < DISK_FULL_MARGIN


def _days(days: float) -> float | int:
    return int(days) if float(days).is_integer() else days


def _rescue_since(folder: Path, m: Manifest) -> float | None:
    """For a snapshot that was verified and then failed (its restore failed, or a scrub
    found it damaged beyond repair): when it failed, from which retention keeps it
    ``max_age_days``. None for any other checkpoint."""
    if m.status != "failed" or not m.verified_at:
        return None
    when = m.extra.get("failed_at")
    if isinstance(when, (int, float)):
        return float(when)
    try:  # recorded by a version without failed_at: the manifest was last written then
        return (folder / MANIFEST).stat().st_mtime
    except OSError:
        return m.verified_at


def _dump_finished(folder: Path) -> bool:
    try:
        text = (folder / "dump.log").read_text(errors="replace")
    except OSError:
        return False
    return bool(re.search(r"Dumping finished successfully", text))
