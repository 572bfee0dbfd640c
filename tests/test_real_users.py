"""Real Unix users, the way docs/install.md tells admins to run it.

``SnapLocalProcessSpawner`` with system users made by ``useradd``, the single-user command
as JupyterHub names it (``jupyterhub-singleuser``, found by the spawner with the Hub on a
plain PATH), a real Hub and proxy, real kernels, real CRIU. Each server runs in the
sandbox (:mod:`jupyterhub_gpusnap.sandbox`) as its user.

Each user's server is suspended and restored as its user, with ``x = 42`` intact, and the
other user can read neither the snapshot nor the server's log. CRIU reads every dumped
process's resource limits, which the kernel allows for another user's process only with
CAP_SYS_RESOURCE; this project's CI machine (root in a container) lacks it, so this runs
on the CRIU that .ci/install-criu.sh builds, which reads them from /proc/<pid>/limits.
"""

from __future__ import annotations

import asyncio
import stat
from pathlib import Path

import psutil
import pytest

from jupyterhub_gpusnap.checkpoint.local import LocalBackend
from jupyterhub_gpusnap.checkpoint.manifest import Manifest
from jupyterhub_gpusnap.model import Server

pytestmark = [pytest.mark.e2e, pytest.mark.criu]

PLAIN_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
TOKEN_SCOPES = """
import json, os, urllib.request
req = urllib.request.Request(os.environ["JUPYTERHUB_API_URL"] + "/user",
                             headers={"Authorization": "token " + os.environ["JUPYTERHUB_API_TOKEN"]})
print(" ".join(json.load(urllib.request.urlopen(req))["scopes"]))
"""


def users_config(ckpt: Path) -> str:
    return f"""
c.JupyterHub.spawner_class = "jupyterhub_gpusnap.spawner.SnapLocalProcessSpawner"
c.LocalBackend.checkpoint_dir = {str(ckpt)!r}
c.LocalBackend.min_free_bytes = 0
c.Spawner.cmd = ["jupyterhub-singleuser"]
c.Spawner.args = [
    f"--ServerApp.jpserver_extensions={{ext}}=False"
    for ext in ("jupyterlab", "jupyter_lsp", "notebook_shim")
]
c.Spawner.default_url = "/api/status"
c.SnapLocalProcessSpawner.restore_timeout = 60
# as docs/install.md: users hold access to the service, so their servers' tokens can too
from jupyterhub_gpusnap.hubconfig import user_role
c.JupyterHub.load_roles.append(user_role("gpusnap"))
"""


def processes_of(uid: int) -> list[psutil.Process]:
    return [
        p for p in psutil.process_iter(["uids"]) if p.info["uids"] and p.info["uids"].real == uid
    ]


async def test_users_servers_run_as_themselves_and_come_back_as_themselves(
    hub_factory, tmp_path, system_users, traversable
):
    alice, bob = system_users(), system_users()
    ckpt = tmp_path / "ckpt"
    hub = await hub_factory(users_config(ckpt), env={"PATH": PLAIN_PATH})
    backend = LocalBackend(checkpoint_dir=str(ckpt), min_free_bytes=0)

    await hub.start_server(alice.pw_name)
    # the server's log folder came first: what the spawner made of checkpoint_dir is root's alone
    for folder in (ckpt, ckpt / alice.pw_name):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700, folder
    kid, out = await hub.execute(
        alice.pw_name,
        "import os\nx = 42\nprint(os.getuid(), os.getgid(), os.getpid(), os.path.expanduser('~'))",
    )
    uid, gid, pid_inside, home = out.split()
    # the spawner gives the server's token access to the service (its extension reports
    # the kernels there; the Hub config here does not set server_token_scopes)
    _, scopes = await hub.execute(alice.pw_name, TOKEN_SCOPES, kernel_id=kid)
    assert "access:services!service=gpusnap" in scopes.split(), scopes
    assert (int(uid), int(gid), home) == (alice.pw_uid, alice.pw_gid, alice.pw_dir), out
    assert int(pid_inside) > 2  # a kernel inside the server's own PID namespace
    model = await hub.get_server(alice.pw_name)
    init = psutil.Process(model["state"]["pid"])
    server = init.children()[0]
    assert init.uids().real == 0 and server.uids().real == alice.pw_uid
    assert server.exe() and "jupyterhub-singleuser" in " ".join(server.cmdline())

    info = await backend.checkpoint(Server(user=alice.pw_name, state=model["state"]))
    assert info.status == "verified"
    await hub.stop_server(alice.pw_name)
    assert not processes_of(alice.pw_uid)
    await hub.start_server(alice.pw_name)
    kid2, out = await hub.execute(alice.pw_name, "print(x, os.getuid())", kernel_id=kid)
    assert kid2 == kid and out.split() == ["42", str(alice.pw_uid)]
    m = Manifest.load(backend.folder(info.id))
    assert m.status == "restored"
    # the libraries her server wrote into were found from its image and read ahead
    # (LocalBackend.file_pages_ahead), under the names her sandboxed server saw
    assert m.extra["restore_phases"]["file_pages_bytes"] > 0, m.extra["restore_phases"]
    restored = psutil.Process((await hub.get_server(alice.pw_name))["state"]["pid"])
    assert restored.children()[0].uids().real == alice.pw_uid  # still her, not root
    secret_file = backend.folder(info.id) / "manifest.json"
    assert secret_file.exists()

    # bob's kernel can read neither alice's snapshot nor her server's log
    await hub.start_server(bob.pw_name)
    _, out = await hub.execute(
        bob.pw_name,
        "import os\nfor p in [{!r}, {!r}]:\n"
        "    try:\n        open(p).read(1); print('READ', p)\n"
        "    except PermissionError:\n        print('denied')\n".format(
            str(secret_file), str(backend.server_dir(alice.pw_name, "") / "server.log")
        ),
    )
    assert out.split() == ["denied", "denied"], out

    # a stop through the Hub ends every process of the user (the sandbox's init passes
    # SIGTERM on; nothing outlives what the Hub tracks)
    await hub.stop_server(bob.pw_name)
    assert not processes_of(bob.pw_uid)


async def test_a_users_large_server_restores_lazily_through_the_hub_as_themselves(
    hub_factory, tmp_path, system_users, traversable
):
    """The path of a large notebook (``restore_mode = "auto"`` restores an image of 1 GiB or
    more lazily; here "lazy" for any size): the recommended spawner, a real user, the Hub's
    restore with the tree first and its memory through the memory shared with CRIU's
    lazy-pages daemon (``LocalBackend.lazy_shared_mib``'s default). The kernel comes back
    as her, its variables and its data intact."""
    alice = system_users()
    ckpt = tmp_path / "ckpt"
    config = users_config(ckpt) + 'c.LocalBackend.restore_mode = "lazy"\n'
    hub = await hub_factory(config, env={"PATH": PLAIN_PATH})
    backend = LocalBackend(checkpoint_dir=str(ckpt), min_free_bytes=0, restore_mode="lazy")

    await hub.start_server(alice.pw_name)
    # ``zeros``: a zero-filled buffer (written, so in the image), as GPU processes hold
    hold = ("import hashlib, os\ndata = os.urandom(128 << 20)\nzeros = b'\\0' * (64 << 20)\n"
            "h = hashlib.sha256(data).hexdigest()\nx = 42\nprint(os.getuid())")  # fmt: skip
    kid, out = await hub.execute(alice.pw_name, hold)
    assert out.split() == [str(alice.pw_uid)]
    model = await hub.get_server(alice.pw_name)
    info = await backend.checkpoint(Server(user=alice.pw_name, state=model["state"]))
    task = backend.page_sums.get(info.id)  # the page sums a lazy restore of files needs
    if task is not None:
        assert await task
    await hub.stop_server(alice.pw_name)
    assert not processes_of(alice.pw_uid)

    await hub.start_server(alice.pw_name)
    check = "print(x, os.getuid(), hashlib.sha256(data).hexdigest() == h, zeros.count(0))"
    kid2, out = await hub.execute(alice.pw_name, check, kernel_id=kid)
    assert kid2 == kid and out.split() == ["42", str(alice.pw_uid), "True", str(64 << 20)], out
    phases = Manifest.load(backend.folder(info.id)).extra["restore_phases"]
    assert phases["mode"] == "lazy" and phases["lazy_shared_bytes"] == 64 << 20, phases
    assert phases["lazy_bytes"] >= 128 << 20
    assert phases["lazy_staging"]["file_pages_bytes"] > 0, phases  # read ahead in the staging
    # the zero-filled blocks were served without reading them, once every page was in
    for _ in range(300):
        phases = Manifest.load(backend.folder(info.id)).extra["restore_phases"]
        if "lazy_zero_bytes" in phases:
            break
        await asyncio.sleep(0.1)
    assert phases.get("lazy_zero_bytes", 0) >= 32 << 20, phases
    restored = psutil.Process((await hub.get_server(alice.pw_name))["state"]["pid"])
    assert restored.children()[0].uids().real == alice.pw_uid
