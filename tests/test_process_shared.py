"""What every backend of one process shares: the Hub makes a LocalBackend per spawner (one per
user's server). Each kept its own pool of hash_threads threads, checked CRIU, loaded the CUDA
driver and opened NVML again, and the first restore in the Hub paid for the driver and the
checks (0.2-0.3 s on the H100). Now: one pool per size, one CRIU check, one driver, one NVML
per process, and the first spawner warms them up in the background."""

from __future__ import annotations

import asyncio
import logging

from jupyterhub_gpusnap import spawner
from jupyterhub_gpusnap.checkpoint import criu, local
from jupyterhub_gpusnap.checkpoint.local import LocalBackend
from jupyterhub_gpusnap.gpu import cuda, nvml
from jupyterhub_gpusnap.gpu.cuda import CudaCheckpoint


def test_backends_share_one_pool_per_size(tmp_path):
    a = LocalBackend(checkpoint_dir=str(tmp_path / "a"), hash_threads=3)
    b = LocalBackend(checkpoint_dir=str(tmp_path / "b"), hash_threads=3)
    c = LocalBackend(checkpoint_dir=str(tmp_path / "c"), hash_threads=5)
    assert a.pool is b.pool and a.pool._max_workers == 3
    assert c.pool is not a.pool and c.pool._max_workers == 5


async def test_criu_is_checked_once_per_process(tmp_path, monkeypatch):
    checked = []

    async def require_criu(path, minimum):
        checked.append(path)
        return "4.2.1"

    monkeypatch.setattr(local, "_CRIU_OK", {})
    monkeypatch.setattr(criu, "require_criu", require_criu)
    monkeypatch.setattr(criu, "find_criu", lambda path: "/usr/local/sbin/criu")
    for name in ("a", "b"):
        assert await LocalBackend(checkpoint_dir=str(tmp_path / name))._require_criu() == "4.2.1"
    assert len(checked) == 1


class FakeDriver:
    def __init__(self, opened: list):
        self.opened = opened

    def cuInit(self, flags):  # noqa: N802 (the driver's name)
        self.opened.append("cuInit")
        return 0


def test_the_cuda_driver_is_loaded_and_initialised_once_per_process(monkeypatch):
    opened = []

    def load(path):
        opened.append(path)
        if path.startswith("/gone"):
            raise OSError(f"{path}: cannot open shared object file")
        return FakeDriver(opened)

    monkeypatch.setattr(cuda, "_DRIVERS", {})
    monkeypatch.setattr(cuda, "_load_libcuda", load)
    layers = [CudaCheckpoint(libcuda_path="/drv/libcuda.so.1") for _ in range(3)]
    assert all(layer.available() for layer in layers)
    assert opened == ["/drv/libcuda.so.1", "cuInit"]
    assert layers[0]._load() is layers[2]._load()
    # a host without the driver: said once, the same way for every layer
    gone = [CudaCheckpoint(libcuda_path="/gone/libcuda.so.1") for _ in range(2)]
    assert not any(layer.available() for layer in gone)
    assert opened.count("/gone/libcuda.so.1") == 1
    assert gone[0].reason == gone[1].reason and "no NVIDIA driver on this host" in gone[0].reason
    # a driver handed in (embedding, tests) stays that layer's own
    own = CudaCheckpoint(driver=FakeDriver(opened))
    assert own.available() and own._load() is not layers[0]._load()


def test_the_cuda_layers_share_one_nvml(monkeypatch):
    monkeypatch.setattr(nvml, "_SHARED", None)
    monkeypatch.setattr(nvml.Nvml, "open", lambda self: False)
    a, b = CudaCheckpoint(), CudaCheckpoint()
    assert a._nvml() is b._nvml() is nvml.Nvml.shared()


async def test_the_first_spawner_warms_the_backend_up_once(monkeypatch):
    warmed = []

    async def warm_up(self):
        warmed.append(self)

    monkeypatch.setattr(spawner, "_WARM_UP", None)
    monkeypatch.setattr(LocalBackend, "warm_up", warm_up)
    spawners = [spawner.SnapLocalProcessSpawner() for _ in range(3)]
    backends = [s.backend for s in spawners]
    await asyncio.sleep(0.05)
    assert warmed == [backends[0]]
    assert spawner._WARM_UP.done()


async def test_warming_up_without_criu_logs_and_returns(tmp_path, caplog):
    backend = LocalBackend(checkpoint_dir=str(tmp_path), criu_path=str(tmp_path / "no-criu"))
    with caplog.at_level(logging.INFO):
        await backend.warm_up()
    assert "local checkpoints disabled until fixed" in caplog.text


async def test_warming_up_freezes_the_process_objects_once(tmp_path, monkeypatch, caplog):
    # the first lazy restore in a Hub paid a full collection of the Hub's objects (0.19 s of
    # its staging on the H100): warm-up moves them out of the collector's full collections
    import gc

    monkeypatch.setattr(local, "_GC_FROZEN", False)
    gc.unfreeze()
    try:
        off = LocalBackend(checkpoint_dir=str(tmp_path / "off"), gc_freeze=False,
                           criu_path=str(tmp_path / "no-criu"))  # fmt: skip
        await off.warm_up()
        assert gc.get_freeze_count() == 0
        kept = [object() for _ in range(1000)]  # held across the warm-up: frozen with the rest
        on = LocalBackend(checkpoint_dir=str(tmp_path / "on"), criu_path=str(tmp_path / "no-criu"))
        with caplog.at_level(logging.INFO):
            await on.warm_up()
        frozen = gc.get_freeze_count()
        assert frozen > len(kept)
        assert "moved out of the garbage collector's full collections" in caplog.text
        # once per process: the next backend's warm-up leaves the collector alone
        kept.extend(object() for _ in range(1000))
        await LocalBackend(checkpoint_dir=str(tmp_path / "b"),
                           criu_path=str(tmp_path / "no-criu")).warm_up()  # fmt: skip
        assert gc.get_freeze_count() <= frozen  # not the 1000 new ones (frozen ones may go)
    finally:
        gc.unfreeze()
