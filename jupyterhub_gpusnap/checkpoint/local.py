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

``restore_mode = "lazy"`` (and ``"auto"``, the default, for images of
``lazy_restore_min_bytes`` or more; docs/lazy-restore.md) runs the tree before its memory is back,
each page checked as it arrives (lazy.py); a damaged page then kills the running tree and
marks the checkpoint failed. Its GPU memory comes back behind the first answer.

The steps are :class:`~.base.CheckpointBackend`'s protocol. This module holds the backend's
configuration, its state and its checkpoints (list, mark, delete, ``do_expired`` for
retention); their folders and permissions are :mod:`.local_layout`, the suspension's
hooks (``do_preflight`` to ``do_resume``; ``do_unfinished``/``do_dumped`` for crash
recovery) :mod:`.local_suspend`, the restore :mod:`.local_restore`, the lazy restore
:mod:`.local_lazy`. Where the image is kept (``storage``: files or chunks) is
:mod:`.image_store`.
"""

from __future__ import annotations

import asyncio
import gc
import os
import re
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from traitlets import Bool, Enum, Float, Integer, List, TraitError, Unicode, validate

from ..model import server_key
from . import criu
from . import scrub as chunk_scrub
from .base import (
    CheckpointBackend,
    CheckpointError,
    CheckpointInfo,
    CheckpointRefused,
    Kept,
    expired,
    protected,
)
from .chunks import PAGE, STORE, ChunkStore
from .image_store import (
    ChunksStore,
    FilesStore,
    ImageStore,
    clear_staging,
)
from .keys import Key, KeyFileError, load_keys
from .local_layout import LocalLayoutMixin, encode_name
from .local_lazy import LazyRestoreMixin
from .local_restore import LocalRestoreMixin
from .local_suspend import LocalSuspendMixin
from .manifest import (
    CHUNK_BYTES,
    MANIFEST,
    Manifest,
)
from .page_server import SHARED_MIN
from .streamer import PIPE_BYTES

REPLICAS = ".chunks-replica"  # replica_dir's default, in checkpoint_dir
# Shared by every LocalBackend of the process. The Hub makes a backend per spawner (one per
# user's server): each kept a pool of hash_threads threads, and each checked CRIU again.
_POOLS: dict[int, ThreadPoolExecutor] = {}  # LocalBackend.pool, by size
_POOLS_LOCK = threading.Lock()
_CRIU_OK: dict[tuple[str, str], str] = {}  # (criu_path, criu_min_version) -> version
_GC_FROZEN = False  # LocalBackend.gc_freeze: done once per process


class LocalBackend(
    LazyRestoreMixin, LocalRestoreMixin, LocalSuspendMixin, LocalLayoutMixin, CheckpointBackend
):
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
        deletes the checkpoint of a suspended server (kept until it is restored) nor a checkpoint
        whose restore failed (kept max_age_days from the failure, for an admin to rescue).""",
    ).tag(config=True)

    max_age_days = Float(
        30.0,
        help="""Days a checkpoint whose restore failed is kept after the failure, whatever
        keep_last says, so an admin can rescue its work (docs/operations.md); emails quote
        this number. Other checkpoints no one needs are deleted once older than this too. A
        suspended server's checkpoint is never deleted by age: it is kept until it is restored
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
        and the checkpoint stays restorable: stop that process and start the server again.""",
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
        on a hub whose cores are busy with other servers, at the cost of slower suspends.
        One pool of this many threads per process, shared by all its backends (the Hub
        has one per spawner).""",
    ).tag(config=True)

    gc_freeze = Bool(
        True,
        help="""At warm-up (the Hub's first spawner; the service's start), once per process:
        collect garbage, then move every object the process has to Python's permanent
        generation (gc.freeze()), so that later full collections skip them (a one-time pause
        of about 0.2 s in the bench's Hub, 277,000 objects). Without it the
        first lazy restore in a Hub paid a full collection of the Hub's objects during its
        staging (0.19 s of a 0.39 s staging, H100). Objects the process holds at warm-up and
        drops later are then not freed (the Hub's start-up objects: modules, configuration;
        they are kept anyway). Set False to leave the collector as Python runs it.""",
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
        stored once under <checkpoint_dir>/.chunks, so data shared between checkpoints (the
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
        checkpoints but costs more per-chunk work and files; 2 MiB suits GPU servers.""",
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
        ["auto", "eager", "lazy"],
        "auto",
        help="""How a suspended server's memory comes back. 'auto' (default): 'lazy' for a
        checkpoint of lazy_restore_min_bytes or more (a GPU notebook's: its kernel answers
        in 1.0-1.9 s at 1 to 24 GiB of tensors on an H100, against 2.2-29 s eagerly),
        'eager' for a smaller one (back in about a second either way). 'eager': all of it,
        checked, before the server runs (about 0.8 s per GiB on an H100 machine). 'lazy': the
        server runs as soon as its processes are restored (0.2-0.3 s whatever its size, on a
        2-core test machine) and its memory follows on demand and in the background, each
        page checked before the process gets it; every page is back 0.9-2.3x the time of an
        eager restore, and the Hub process serves the pages meanwhile (CPU: one sha256 pass
        over the image). Costs with storage = 'files': page checksums are written after each
        suspension (one more read of the image and 0.8-1.3 CPU-seconds per GiB, in the
        background; a restore that comes first is eager). A damaged page found after the
        server runs kills the restored server (no process runs on wrong memory): the
        checkpoint is marked failed naming the damaged block or chunk, and the next start is
        a fresh server. GPU memory comes back behind the server's first answer (a cell
        that touches the GPU waits for it; see lazy_gpu_restore). Falls back to an eager
        restore (logged) when the checkpoint has no page checksums, when CRIU lacks the
        lazy-restore patches of .ci/criu-patches (install it with .ci/install-criu.sh), or
        when it cannot restore lazily (needs 'criu check --feature uffd-noncoop').
        Set it the same in the service's and the Hub's configuration
        (docs/lazy-restore.md).""",
    ).tag(config=True)

    lazy_restore_min_bytes = Integer(
        1 << 30,
        min=0,
        help="""restore_mode = 'auto': the size of image (bytes, the checkpoint's
        image_bytes) from which a checkpoint is restored lazily; smaller ones are restored
        eagerly. Default 1 GiB: below it an eager restore takes about a second, and a lazy
        one saves little. Checkpoints of GPU servers hold a host copy of the GPU memory,
        so they are this size from 1 GiB of tensors on. Files-stored checkpoints of this
        size get their page checksums written after the suspension.""",
    ).tag(config=True)

    lazy_gpu_restore = Enum(
        ["overlap", "after_pages", "at_once"],
        "overlap",
        help="""restore_mode = 'lazy', GPU servers: when the driver restores the GPU memory of
        a server already handed out (its CUDA calls wait until then). 'overlap' (default):
        while the last pages arrive, started so that it ends about when they do (from the
        transfer's rate so far and the snapshot's GPU bytes at 4 GiB/s); the driver's reads
        fetch what is not in yet ahead of the rest. 'after_pages': once every page is in
        (the driver reads memory that is all there; the full restore takes the two one after
        the other). 'at_once': as soon as the server is handed out (the driver's reads then
        compete with the kernel's first page faults: at 8 GiB the kernel answered after
        10.4 s instead of 1.8 s). Used where restores run (the Hub); measured on an H100 in
        docs/lazy-restore.md ("GPU").""",
    ).tag(config=True)

    lazy_copiers = Integer(
        0,
        min=0,
        max=16,
        help="""restore_mode = 'lazy': threads of CRIU's lazy-pages daemon that copy the pages
        arriving in the background into the restored server (CRIU patch 0011) while the
        daemon receives the next ones. 0 (default): the daemon copies them itself, one at a
        time. Copiers need cores to spare beside the page server and the server's own
        work: on a 2-core machine 4 copiers brought no gain from files and made restores
        from chunks 15 % slower; on an H100 host they made no difference beyond the noise
        (the daemon waits longer for its next answer than a copy takes), so they are off by
        default. A page a process waits for is always copied at once by
        the daemon itself. Each copier holds up to two 8 MiB buffers (64 MiB per restore at
        4). Only with lazy_shared_mib = 0: pages in shared memory are copied by the daemon
        itself. Used where restores run (the Hub); docs/lazy-restore.md ("Copier
        threads").""",
    ).tag(config=True)

    lazy_shared_mib = Integer(
        64,
        min=0,
        help="""restore_mode = 'lazy': MiB of memory shared between the page server and CRIU's
        lazy-pages daemon that the restored server's pages go through instead of the socket
        (CRIU patch 0012). Through the socket each page is copied twice more (into it and out
        of it) before the daemon copies it into the server; through this memory the daemon
        copies it straight from there. 0: the socket (as before, and with a CRIU without
        0012). On a 2-core machine every page of a 1 GiB server was back about 20 % sooner;
        on an H100 host no sooner beyond the noise, with less of the page server's time
        spent waiting to send (docs/lazy-restore.md, "Shared memory"). At least 16 (the background transfer
        fills half of it at most, so that a page fault's answer waits behind no more); it
        is memory of the host where restores run (the Hub), per restore under way. The
        daemon then copies on one thread: lazy_copiers is for lazy_shared_mib = 0.""",
    ).tag(config=True)

    file_pages_ahead = Bool(
        True,
        help="""Before CRIU restores a server, have the kernel read ahead, all at once, the
        library pages it will write the server's own pages into (the data a process wrote
        in its private file mappings: each such write first reads the library's page, one
        fault at a time, from the disk when the page cache is cold). The places come from
        the image (its memory areas, files and pagemaps); only regular files that exist
        under the image's names are read (POSIX_FADV_WILLNEED). False: CRIU reads them as
        it goes.""",
    ).tag(config=True)

    @validate("lazy_shared_mib")
    def _check_lazy_shared_mib(self, proposal):
        value = proposal["value"]
        if 0 < value < SHARED_MIN >> 20:
            raise TraitError(
                f"LocalBackend.lazy_shared_mib = {value}: use 0 (pages through the socket) "
                f"or at least {SHARED_MIN >> 20}, e.g. 64"
            )
        return value

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
        (the same data in another checkpoint), read the stored copy back and check it before
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
        help="""storage = 'chunks': a chunk that the checkpoints of at least this many servers
        need (suspended ones, and failed restores kept for rescue) is stored twice, in
        replica_dir, so that one damaged copy breaks no restore: the more checkpoints depend on
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
        self._locks: dict[str, asyncio.Lock] = {}
        self._active: set[str] = set()  # servers whose checkpoint() runs in this process
        self._reserved: dict[str, int] = {}  # disk bytes held per suspension under way
        self._cuda_obj = None
        self._cuda_missing = False
        self._stores: dict[str, ImageStore] = {}
        self.restored: dict[int, criu.Restored] = {}
        #: checkpoint id -> the task writing its page checksums (for a lazy restore)
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
        """The thread pool that reads and hashes images (``hash_threads`` threads), one per
        size for the whole process: the Hub makes a backend per spawner (one per user's
        server), and each kept its own threads."""
        n = self.hash_threads or os.cpu_count() or 1
        with _POOLS_LOCK:
            pool = _POOLS.get(n)
            if pool is None:
                pool = _POOLS[n] = ThreadPoolExecutor(
                    max_workers=n, thread_name_prefix="gpusnap-hash"
                )
        return pool

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
            store = self._stores[storage] = (ChunksStore if storage == "chunks" else FilesStore)(
                self
            )
        return store

    def _chunk_damaged(
        self, space: str, cid: str, found_by: str, repaired: bool, what: str
    ) -> None:
        """A chunk was found damaged while written or read (the store's threads call this)."""
        chunk_scrub.count_damage(found_by, repaired)
        if repaired:
            how = (
                "replaced by the fresh data" if found_by == "write" else "repaired from its replica"
            )
            self.log.warning("chunk %s… (%s) was damaged: %s; %s", cid[:12], space, what, how)
        else:
            self.log.error(
                "chunk %s… (%s) is damaged and has no intact copy: %s", cid[:12], space, what
            )

    async def _require_criu(self) -> str:
        """The CRIU version, checked once per binary (``criu --version`` costs a fork+exec);
        refused at once if the binary has gone since."""
        key = (self.criu_path, self.criu_min_version)
        version = _CRIU_OK.get(key)
        if version is None or criu.find_criu(self.criu_path) is None or os.geteuid() != 0:
            _CRIU_OK.pop(key, None)
            version = await criu.require_criu(self.criu_path, self.criu_min_version)
            _CRIU_OK[key] = version
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

    # ---------------------------------------------------------------- contract
    async def setup(self) -> None:
        """Create checkpoint_dir (or make it private), log what is missing, resolve
        checkpoints left ``writing``."""
        self._mkdir(self.root)
        await asyncio.to_thread(self._tighten_all)
        await self.warm_up()
        clear_staging(self.restore_staging_dir, self.log)
        await self.recover()

    def _freeze_gc(self) -> None:
        """gc_freeze: one collection, then gc.freeze(), once per process."""
        global _GC_FROZEN
        if not self.gc_freeze or _GC_FROZEN:
            return
        _GC_FROZEN = True
        t = time.monotonic()
        gc.collect()
        gc.freeze()
        self.log.info(
            "%d objects moved out of the garbage collector's full collections in %.2fs "
            "(LocalBackend.gc_freeze)", gc.get_freeze_count(), time.monotonic() - t,
        )  # fmt: skip

    async def warm_up(self) -> None:
        """Check CRIU (and, when restores may be lazy, its lazy-restore patches), load and
        initialise the CUDA driver and NVML, once for the process, logging what is missing:
        not in the first restore's time (in the Hub, whose spawners each have a backend, the
        first restore after a start took 0.2-0.3 s longer for it on the H100) nor in the
        first suspension's time to a free GPU; and (gc_freeze) take the process's objects out
        of the garbage collector's full collections, which the first lazy restore paid for.
        Never raises."""
        self._freeze_gc()
        try:
            version = await self._require_criu()
            self.log.info("CRIU %s ready; checkpoints in %s", version, self.root)
            eager = self.restore_mode == "eager"
            lacking = "" if eager else await asyncio.to_thread(
                criu.lazy_patches_lacking, self.criu_path
            )  # fmt: skip
            if lacking:
                self.log.warning(
                    "%s: every restore will be eager (restore_mode = %r asks for lazy ones); "
                    "install CRIU with .ci/install-criu.sh",
                    lacking,
                    self.restore_mode,
                )
            # the optional speed-ups (those a setting asks for, and those always used), each
            # with what a CRIU without it does
            optional = [
                ("lazy_copiers", criu.COPIER_PATCHES, "copier threads",
                 "its lazy-pages daemon copies on one thread"),
                ("lazy_shared_mib", criu.SHARED_PATCHES, "answers in shared memory",
                 "the pages of lazy restores go through the socket"),
                (None, criu.IDLE_PATCHES,
                 "the lazy-pages daemon sleeps while it has nothing to ask for",
                 "its daemon polls instead, taking a core for each lazy restore's transfer"),
                (None, criu.ZERO_PATCHES, "zero-filled memory mapped as zero pages",
                 "lazy restores ask for zero-filled memory too, and the page server "
                 "sends it"),
                (None, criu.DEPTH_PATCHES, "32 background requests in flight per process",
                 "its daemon keeps 8 in flight, and the short runs of pages between holes (a "
                 "Python heap's) take more round trips"),
            ]  # fmt: skip
            for setting, patches, what, instead in optional:
                if eager or lacking or (setting and not getattr(self, setting)):
                    continue
                missing = await asyncio.to_thread(
                    criu.lazy_patches_missing, self.criu_path, patches
                )
                if missing:
                    asked = (
                        f"LocalBackend.{setting} = {getattr(self, setting)}: " if setting else ""
                    )
                    self.log.warning(
                        "%s%s lacks patch %s (%s) of .ci/criu-patches, or has an earlier "
                        "version of it; %s; install CRIU with .ci/install-criu.sh",
                        asked, criu.find_criu(self.criu_path) or "criu", missing[0][:4], what,
                        instead,
                    )  # fmt: skip
        except CheckpointRefused as e:
            self.log.error("local checkpoints disabled until fixed: %s", e)
        except Exception as e:  # not expected: the first restore will say more
            self.log.warning("cannot check CRIU now: %s", e)
        cuda = self.cuda()
        if cuda is None:
            return
        if not await asyncio.to_thread(cuda.available):
            self.log.info("no CUDA checkpoint API on this host: CPU-only checkpoints")
            return
        try:
            await asyncio.to_thread(cuda.gpu_inventory)
        except Exception as e:
            self.log.info("no NVML on this host (%s): GPU memory left out of estimates", e)

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
            Kept(
                self._id(f), server_key(m.user, m.server), m.status, m.created, _rescue_since(f, m)
            )
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
