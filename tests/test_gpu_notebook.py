"""A GPU notebook end to end, the path a user takes (needs an NVIDIA GPU, PyTorch, root).

A real Hub and proxy, the real service (Jupyter, CPU and NVML signals; warning email
through a real SMTP server; the local CRIU backend with the CUDA driver's checkpoint), the
spawner docs/install.md recommends (``SnapLocalProcessSpawner``) with a real Unix user,
``jupyterhub-singleuser`` found by the spawner, and a real kernel that puts torch tensors
on the GPU through the proxy. The server goes idle, is warned, checkpointed (the GPU memory
is free, by NVML) and stopped; the user starts it again and, by default, gets it back lazily
(restore_mode = "auto"); the same kernel answers with the same tensor checksum and can use
the GPU.

The host's root may lack CAP_SYS_RESOURCE (the GPU test machine's does): the CRIU that
.ci/install-criu.sh builds then reads the user's resource limits from /proc (see
tests/test_real_users.py).
"""

from __future__ import annotations

import pwd

import pynvml
import pytest

from jupyterhub_gpusnap.checkpoint.local import LocalBackend
from jupyterhub_gpusnap.checkpoint.manifest import Manifest, is_pages_file
from jupyterhub_gpusnap.checkpoint.page_sums import sums_name
from jupyterhub_gpusnap.procs import tree_pids
from tests.helpers.gpu_notebook import ALLOCATE, GiB, gpu_used
from tests.helpers.gpusnap_service import GpuSnapService
from tests.helpers.local_hub import settings
from tests.helpers.smtp_server import SmtpServer

pytestmark = [pytest.mark.gpu, pytest.mark.e2e, pytest.mark.criu]


async def test_gpu_notebook_is_suspended_by_the_service_and_comes_back(
    hub_factory, tmp_path, system_users, traversable
):
    pynvml.nvmlInit()
    ckpt = tmp_path / "checkpoints"
    (tmp_path / "smtp").mkdir()
    smtp = SmtpServer(tmp_path / "smtp").start()
    service = GpuSnapService(
        tmp_path / "gpusnap",
        settings(ckpt, smtp)
        .replace("c.GpuSnap.idle_window = 8", "c.GpuSnap.idle_window = 20")
        .replace("c.GpuSnap.warn_before = 3", "c.GpuSnap.warn_before = 8"),
    )
    user = system_users().pw_name
    spawner = "SnapLocalProcessSpawner"
    hub = await hub_factory(
        f"""
c.JupyterHub.spawner_class = "jupyterhub_gpusnap.spawner.{spawner}"
c.LocalBackend.checkpoint_dir = {str(ckpt)!r}
c.LocalBackend.min_free_bytes = 0
c.Spawner.cmd = ["jupyterhub-singleuser"]
c.Spawner.args = [f"--ServerApp.jpserver_extensions={{e}}=False" for e in ("jupyterlab", "jupyter_lsp", "notebook_shim")]
c.Spawner.default_url = "/api/status"
c.{spawner}.restore_timeout = 120
"""
        + service.hub_config()
    )
    try:
        before_alloc, _ = gpu_used()
        await hub.start_server(user, timeout=120)
        kernel, out = await hub.execute(user, ALLOCATE, timeout=180)
        checksum, uid = out.split()
        tree = set(tree_pids((await hub.get_server(user))["state"]["pid"]))
        used, holders = gpu_used()
        assert used - before_alloc >= GiB and tree & holders, (used, holders, tree)
        assert int(uid) == pwd.getpwnam(user).pw_uid != 0  # the kernel runs as the user

        await service.start(hub)

        async def suspended():
            status = await service.server_status(f"{user}/")
            return status if status and status["state"] == "suspended" else None

        status = await service.wait_for(suspended, timeout=240, what="the server to be suspended")
        assert await hub.get_server(user) is None
        used_after, holders_after = gpu_used()
        assert not (tree & holders_after), "no process of the server holds the GPU"
        assert used_after < before_alloc + GiB // 4, (before_alloc, used, used_after)
        warned = [m for m in smtp.messages if m.rcpt_tos == [f"{user}@example.org"]]
        assert warned and "suspend" in warned[0].subject.lower(), [m.subject for m in warned]
        assert status["checkpoint_id"]
        # a GPU notebook's checkpoint (1 GiB of tensors: about 2 GB) is restored lazily by
        # default, once its page sums are written (a restore that comes before is eager)
        backend = LocalBackend(checkpoint_dir=str(ckpt))
        folder = backend.folder(status["checkpoint_id"])
        m = Manifest.load(folder)
        assert m.image_bytes >= backend.lazy_restore_min_bytes, m.image_bytes
        assert m.storage == "files"

        async def page_sums():
            return all((folder / sums_name(n)).is_file() for n in m.files if is_pages_file(n))

        await service.wait_for(page_sums, timeout=60, what="the page sums")

        # the user comes back: same kernel, same tensors, the GPU usable
        await hub.start_server(user, timeout=240)
        same, out = await hub.execute(
            user,
            "print(digest(), x, torch.equal((xs[0] * 2) / 2, xs[0]))",
            kernel_id=kernel,
            timeout=180,
        )
        assert same == kernel
        got, x, gpu_ok = out.split()
        assert (got, x, gpu_ok) == (checksum, "42", "True")
        used_back, holders_back = gpu_used()
        assert used_back - before_alloc >= GiB
        phases = Manifest.load(folder).extra["restore_phases"]
        assert phases["mode"] == "lazy" and phases["lazy_bytes"] >= GiB, phases
    finally:
        await service.stop()
        smtp.stop()
        pynvml.nvmlShutdown()
