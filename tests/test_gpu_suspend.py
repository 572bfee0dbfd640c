"""Suspend and restore a process holding GPU memory through the local backend (GPU machine only).

Selected with ``-m gpu``; fails without an NVIDIA GPU, PyTorch, CRIU and root.
"""

from __future__ import annotations

import pytest
from gpu_suspend import Holder, kill  # noqa: E402

from jupyterhub_gpusnap.checkpoint.criu import find_criu  # noqa: E402
from jupyterhub_gpusnap.checkpoint.local import LocalBackend  # noqa: E402
from jupyterhub_gpusnap.gpu.nvml import Nvml  # noqa: E402
from jupyterhub_gpusnap.model import Server  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("storage", ["files", "chunks"])
async def test_gpu_process_suspended_and_restored_bit_identical(tmp_path, storage):
    """Eagerly (a lazy restore of a GPU process: tests/test_gpu_lazy_restore.py);
    ``chunks``: restored through CRIU's image streamer from compressed chunks."""
    nvml = Nvml()
    assert nvml.open(), "NVML is needed for this test"
    backend = LocalBackend(
        checkpoint_dir=str(tmp_path / "ckpt"),
        criu_path=find_criu(),
        min_free_bytes=0,
        storage=storage,
        restore_mode="eager",
    )
    await backend.setup()
    holder = Holder(1, tmp_path)
    before = holder.checksum()
    server = Server(user="gpu", name="t", state={"pid": holder.pid})
    info = await backend.checkpoint(server)
    holder.reap()
    assert info.status == "verified"
    assert info.gpu_bytes >= 2**30, info
    assert info.gpu_model and info.gpu_count == 1
    # the process's GPU memory is gone from the GPU (the image holds it now)
    assert info.extra["time_to_gpu_free_s"] > 0
    pid = (await backend.restore(info)).pid
    try:
        assert holder.checksum(pid) == before
        restored = await backend.get(info.id)
        assert restored.status == "restored" and restored.extra["storage"] == storage
        assert "mode" not in restored.extra["restore_phases"]  # eager
    finally:
        kill(pid)


async def test_busy_gpu_refuses_and_leaves_the_process_running(tmp_path):
    from jupyterhub_gpusnap.checkpoint.base import CheckpointRefused
    from tests.helpers.gpu_helpers import GpuProcess

    backend = LocalBackend(
        checkpoint_dir=str(tmp_path / "ckpt"),
        criu_path=find_criu(),
        min_free_bytes=0,
        lock_timeout_ms=1,
    )
    await backend.setup()
    proc = GpuProcess(["hold", "--gib", "1"])
    try:
        proc.busy()
        with pytest.raises(CheckpointRefused) as err:
            await backend.checkpoint(Server(user="gpu", name="busy", state={"pid": proc.pid}))
        assert err.value.retry
        proc.idle()
        assert proc.touch()  # still running and usable
        assert not await backend.list("gpu")  # nothing half-written left behind
    finally:
        proc.kill()
