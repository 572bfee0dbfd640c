"""A GPU notebook restored lazily through the Hub (needs an NVIDIA GPU, PyTorch, root).

``LocalBackend.restore_mode = "lazy"`` with the spawner docs/install.md recommends and a real
Unix user: a real kernel holds 2 GiB of torch tensors on the GPU, is checkpointed (GPU memory
through the driver, the tree through CRIU) and stopped; the user starts it again. The server
is handed out before its memory is back: the kernel answers a cell that touches no tensor,
its GPU memory follows behind the first answer (the processes wait in the driver's
checkpointed state, where a CUDA call blocks), and a cell that reads every tensor gets the
same checksum. The snapshot records the lazy restore, the GPU memory's time behind it and
the whole restore's time; the GPU is usable afterwards.
"""

from __future__ import annotations

import asyncio
import pwd

import pytest

from jupyterhub_gpusnap.checkpoint.manifest import Manifest
from tests.helpers.gpu_notebook import ALLOCATE, GiB, gpu_used
from tests.helpers.local_hub import service_backend, suspend

pytestmark = [pytest.mark.gpu, pytest.mark.e2e, pytest.mark.criu]


@pytest.mark.parametrize("storage", ["files", "chunks"])
async def test_gpu_notebook_restored_lazily_answers_then_gets_its_gpu_memory_back(
    hub_factory, tmp_path, system_users, traversable, storage
):
    import pynvml

    pynvml.nvmlInit()
    ckpt = tmp_path / "checkpoints"
    user = system_users().pw_name
    spawner = "SnapLocalProcessSpawner"
    hub = await hub_factory(
        f"""
c.JupyterHub.spawner_class = "jupyterhub_gpusnap.spawner.{spawner}"
c.LocalBackend.checkpoint_dir = {str(ckpt)!r}
c.LocalBackend.min_free_bytes = 0
c.LocalBackend.restore_mode = "lazy"
c.LocalBackend.storage = {storage!r}
c.Spawner.cmd = ["jupyterhub-singleuser"]
c.Spawner.args = [f"--ServerApp.jpserver_extensions={{e}}=False" for e in ("jupyterlab", "jupyter_lsp", "notebook_shim")]
c.Spawner.default_url = "/api/status"
c.{spawner}.restore_timeout = 120
"""
    )
    backend = service_backend(ckpt, restore_mode="lazy", storage=storage)
    try:
        before, _ = gpu_used()
        await hub.start_server(user, timeout=120)
        kernel, out = await hub.execute(user, ALLOCATE.replace("range(1)", "range(2)"),
                                        timeout=180)  # fmt: skip
        checksum, uid = out.split()
        assert int(uid) == pwd.getpwnam(user).pw_uid != 0

        info = await suspend(hub, backend, user)
        if storage == "files":  # a lazy restore of raw files needs their page sums
            assert await backend.page_sums[info.id]
        folder = backend.folder(info.id)
        assert Manifest.load(folder).cuda_pids
        used_after, _ = gpu_used()
        assert used_after < before + GiB // 2, (before, used_after)

        try:
            await hub.start_server(user, timeout=240)
            same, out = await hub.execute(user, "print(x)", kernel_id=kernel, timeout=120)
        except Exception as e:
            raise AssertionError(
                f"no restored kernel ({e!r}); the Hub's log:\n{hub.log_tail()}"
            ) from e
        assert (same, out.strip()) == (kernel, "42")
        m = Manifest.load(folder)
        assert m.status == "restored", m.error
        assert m.extra["restore_phases"]["mode"] == "lazy", (m.extra, hub.log_tail())
        # the tensors, read at once: a CUDA call made before the GPU memory is back waits
        _, out = await hub.execute(
            user, "print(digest(), torch.equal((xs[1] * 2) / 2, xs[1]))",
            kernel_id=kernel, timeout=180,
        )  # fmt: skip
        assert out.split() == [checksum, "True"], hub.log_tail()

        for _ in range(600):
            m = Manifest.load(folder)
            if not (m.extra.get("lazy_pending") or m.extra.get("gpu_pending")):
                break
            await asyncio.sleep(0.1)
        phases = m.extra["restore_phases"]
        assert m.status == "restored", m.error
        assert "gpu_pending" not in m.extra and "lazy_pending" not in m.extra, (
            m.extra,
            hub.log_tail(),
        )
        assert phases["gpu_behind_s"] > 0 and phases["full_restore_s"] > 0, phases
        assert "GPU memory back after" in hub.log_text()
        used_back, _ = gpu_used()
        assert used_back - before >= 2 * GiB
        _, out = await hub.execute(user, "print((torch.ones(4, device='cuda') * 3).sum().item())",
                                   kernel_id=kernel, timeout=60)  # fmt: skip
        assert out.strip() == "12.0"
    finally:
        pynvml.nvmlShutdown()
