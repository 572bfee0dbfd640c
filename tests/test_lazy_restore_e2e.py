"""Lazy restore (LocalBackend.restore_mode = "lazy") end to end, through a real Hub.

A real Jupyter server with a live kernel holding 200 MB, suspended as the service does it
(LocalBackend.checkpoint, then the Hub's stop), started again through the Hub: the same
kernel answers and its data is intact, its memory having come back lazily. Then a damaged
page in the part that comes back after the server runs: no process with wrong memory ever
answers, the snapshot is marked failed naming the damaged block, and the user's next start
is a fresh, working server.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from tornado.httpclient import AsyncHTTPClient, HTTPRequest

from jupyterhub_gpusnap.checkpoint import lazy
from jupyterhub_gpusnap.checkpoint.chunks import STORE
from jupyterhub_gpusnap.checkpoint.manifest import Manifest, is_pages_file
from jupyterhub_gpusnap.checkpoint.page_sums import sums_name
from jupyterhub_gpusnap.checkpoint.pagemap import read_pagemaps
from tests.helpers.local_hub import service_backend, snap_config, suspend
from tests.helpers.realhub import HubError

pytestmark = [pytest.mark.e2e, pytest.mark.criu]

LAZY = """
c.LocalBackend.restore_mode = "lazy"
c.Spawner.poll_interval = 1
c.JupyterHub.authenticate_prometheus = False
"""

HOLD = (
    "import hashlib, os\n"
    "data = os.urandom(200 << 20)\n"
    "h = hashlib.sha256(data).hexdigest()\n"
    "x = 42\n"
    "print('ok')"
)
CHECK = "print(x, hashlib.sha256(data).hexdigest() == h)"


async def suspend_with_sums(hub, backend, user: str):
    """Suspend as the service does; wait for the page checksums it writes afterwards."""
    info = await suspend(hub, backend, user)
    task = backend.page_sums.get(info.id)
    if task is not None:
        assert await task
    folder = backend.folder(info.id)
    m = Manifest.load(folder)
    pages = [n for n in m.files if is_pages_file(n)]
    if m.storage == "files":
        assert pages and all((folder / sums_name(n)).is_file() for n in pages)
    return info, folder, m


async def wait_for(what, timeout: float = 60.0, every: float = 0.2):
    for _ in range(int(timeout / every)):
        got = await what()
        if got:
            return got
        await asyncio.sleep(every)
    return await what()


def image_of(backend, folder: Path, m: Manifest):
    if m.storage == "chunks":
        return lazy.ChunksImage(backend.chunk_store(), m.key_id, m.chunks, m.sizes)
    return lazy.FilesImage(folder, m.files, m.sizes, m.chunk_bytes)


def chunk_at(m: Manifest, name: str, offset: int) -> str:
    pos = 0
    for cid, n in m.chunks[name]:
        if pos <= offset < pos + n:
            return cid
        pos += n
    raise AssertionError(f"no chunk of {name} holds {offset}")


def lazy_page(backend, folder: Path, m: Manifest, pid: int, addr: int) -> tuple[str, int]:
    """(pages file, offset) of the page in the middle of the kernel's 200 MB (process
    ``pid`` as the image names it, the data at ``addr``), which a lazy restore leaves to
    the page server."""
    pool = ThreadPoolExecutor(2)
    scratch = Path(tempfile.mkdtemp(prefix="gpusnap-pm-"))
    try:
        image = image_of(backend, folder, m)
        _, sources = lazy.stage(image, scratch, pool)
        for s in sources.values():
            s.close()
        pms = read_pagemaps(scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        pool.shutdown()
    pm = next(pm for pm in pms if pm.pid == pid)
    vaddr = (addr + (100 << 20)) // 4096 * 4096
    run = next(r for r in pm.runs if r.vaddr <= vaddr < r.end)
    assert run.lazy, "the kernel's data is left to the page server"
    ((offset, _),) = pm.locate(vaddr, 1)
    return pm.pages_file, offset + 123


def flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


@pytest.mark.parametrize("storage", ["files", "chunks"])
async def test_a_lazy_restore_brings_the_kernel_back_and_a_damaged_page_fails_safely(
    hub_factory, tmp_path, storage
):
    ckpt = tmp_path / "ckpt"
    hub = await hub_factory(snap_config(ckpt, LAZY + f"c.LocalBackend.storage = {storage!r}\n"))
    backend = service_backend(ckpt, restore_mode="lazy", storage=storage)
    await hub.start_server("alice")
    kid, out = await hub.execute("alice", HOLD, timeout=120)
    assert out.strip() == "ok"

    # round 1: the same kernel, its 200 MB intact, restored lazily
    info, folder, _ = await suspend_with_sums(hub, backend, "alice")
    await hub.start_server("alice")
    kid2, out = await hub.execute("alice", CHECK, kernel_id=kid, timeout=120)
    assert kid2 == kid and out.strip() == "42 True"
    m = Manifest.load(folder)
    assert m.status == "restored", m.error
    phases = m.extra["restore_phases"]
    assert phases["mode"] == "lazy" and phases["lazy_bytes"] >= 190 << 20, phases
    assert "restored lazily as pid" in hub.log_text()

    async def all_in():
        p = Manifest.load(folder).extra.get("restore_phases", {})
        return p if "lazy_all_in_s" in p else None

    phases = await wait_for(all_in)
    assert phases, hub.log_tail()
    assert phases["lazy_served_bytes"] == phases["lazy_bytes"]
    assert "lazy_pending" not in Manifest.load(folder).extra

    # round 2: a damaged page among those that come back after the server runs
    _, out = await hub.execute("alice", "print(os.getpid(), id(data) + 32)", kernel_id=kid)
    pid, addr = map(int, out.split())  # a bytes object's data follows its 32-byte header
    info, folder, m = await suspend_with_sums(hub, backend, "alice")
    name, offset = lazy_page(backend, folder, m, pid, addr)
    if storage == "files":
        flip(folder / name, offset)
        named = f"{name}: the 64 KiB block at offset {offset // 65536 * 65536}"
    else:
        cid = chunk_at(m, name, offset)
        blob = backend.root / STORE / m.key_id / cid[:2] / cid
        flip(blob, blob.stat().st_size // 2)
        named = f"{name}: chunk {cid[:12]}"
    try:
        await hub.start_server("alice")
    except HubError as e:
        # the restored server was killed while the Hub still waited for its first answer:
        # the Hub reports a failed spawn (a 500; when the spawn took longer than its
        # slow_spawn_timeout, JupyterHub 6.1 says so through an InvalidStateError of its own)
        assert str(e).startswith("spawn alice/: 500 "), e
    # the kernel reads all of its data: it must never answer (it would answer False)
    try:
        _, answer = await hub.execute("alice", CHECK, kernel_id=kid, timeout=60)
    except Exception as e:  # the restored server was killed, or a fresh one runs
        answer = f"no answer: {type(e).__name__}"
    assert answer.startswith("no answer"), f"a process ran on damaged memory: {answer!r}"

    async def failed():
        return Manifest.load(folder).status == "failed"

    assert await wait_for(failed), hub.log_tail()
    error = Manifest.load(folder).error
    assert named in error, error
    assert "lazy restore failed" in error and "killed" in error, error
    if storage == "files":
        assert (folder / name).exists()  # kept for diagnosis
    assert f"checkpoint {info.id}: lazy restore failed" in hub.log_text()

    # the Hub sees the killed server gone (poll); or, when the page was met before the
    # server answered, the spawner already started a fresh one
    async def settled():
        if await hub.get_server("alice") is None:
            return True
        status, kernels = await hub.user_request("alice", "api/kernels")
        return status == 200 and kernels == []

    assert await wait_for(settled), hub.log_tail()
    await hub.start_server("alice")
    status, kernels = await hub.user_request("alice", "api/kernels")
    assert status == 200 and kernels == []
    _, out = await hub.execute("alice", "print('fresh', 'x' in globals())")
    assert out.strip() == "fresh False"
    assert await backend.latest("alice", "") is None  # nothing left to restore
    # counted where the restores ran: the Hub's /hub/metrics
    resp = await AsyncHTTPClient().fetch(HTTPRequest(hub.url + "hub/metrics"))
    text = resp.body.decode()
    assert 'gpusnap_lazy_restores_total{result="ok"} 1.0' in text, text[-2000:]
    assert 'gpusnap_lazy_restores_total{result="failed"} 1.0' in text
