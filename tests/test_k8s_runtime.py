"""Kubernetes with a real container runtime: runc + CRIU checkpoint a real notebook container,
the real agent ships the runtime's archive to a real registry and restores it into a real
placeholder container; the runtime itself restores the same image (restore_mode "runtime").

Nothing is faked but the API server and the kubelet's HTTP front, which hands out the
archive the runtime wrote (``runc checkpoint --leave-running`` + CRI-O's layout, see
oci_runtime.py). Pods are real runc containers in their own sandboxes (network, IPC, UTS
namespaces with their own IP), their root filesystems overlays of a Debian image with
``jupyter-server`` and ``ipykernel``, their stdio pipes as conmon gives them.
"""

from __future__ import annotations

import json
import os
import tarfile
from pathlib import Path

import pytest
from tornado.httpclient import AsyncHTTPClient

from jupyterhub_gpusnap.checkpoint.base import CheckpointInfo, RestoreTarget
from jupyterhub_gpusnap.checkpoint.kubernetes import KubernetesBackend
from jupyterhub_gpusnap.model import Server
from tests.helpers import oci_runtime
from tests.helpers.fake_kube import NODE, Cluster, cgroup2_mount
from tests.helpers.kernel_ws import execute, new_kernel
from tests.helpers.registry import Registry

pytestmark = [pytest.mark.k8s, pytest.mark.criu]

TOKEN = "runtime-test-token"
SERVER = [
    "python3", "-m", "jupyter_server", f"--ServerApp.token={TOKEN}", "--ServerApp.ip=0.0.0.0",
    "--ServerApp.port=8888", "--allow-root", "--ServerApp.open_browser=False",
]  # fmt: skip
#: What the notebook does before it is checkpointed: a variable, a new file in the image's
#: filesystem (rootfs-diff.tar), a deleted one (deleted.files), a file kept open on its
#: home volume (an external bind mount CRIU must find again).
SETUP = """
x = 42
open('/var/tmp/made-in-the-container', 'w').write('kept')
import os; os.remove('/etc/debian_version')
notes = open('/home/jovyan/notes.txt', 'a+')
print('ready')
"""
CHECK = """
import os
notes.write('more'); notes.flush()
print(x, open('/var/tmp/made-in-the-container').read(), os.path.exists('/etc/debian_version'))
"""


@pytest.fixture
def runtime():
    why = oci_runtime.missing()
    assert not why, why  # no skipping: install it (.ci/install-runtime.sh)
    return oci_runtime.image_rootfs()


@pytest.fixture
async def registry(tmp_path):
    r = await Registry(tmp_path / "registry").start()
    yield r
    r.stop()


class Pods:
    """Real pods of one test, torn down (every process of their cgroups killed) at the end."""

    def __init__(self, root: Path):
        self.root = root
        self.items: list[tuple[oci_runtime.PodSandbox, oci_runtime.Container]] = []

    def run(self, args: list[str], home: Path | None) -> oci_runtime.Container:
        """A pod running ``args``, with ``home`` mounted at /home/jovyan (None: no volume)."""
        sandbox = oci_runtime.PodSandbox.new()
        container = oci_runtime.Container(
            self.root, sandbox, args, home=home, volumes=home is not None
        )
        self.items.append((sandbox, container))
        return container.start()

    def restore(self, unpacked: Path, home: Path) -> oci_runtime.Container:
        sandbox = oci_runtime.PodSandbox.new()
        container = oci_runtime.Container(self.root, sandbox, [], home=home)
        self.items.append((sandbox, container))
        return container.restore_from(unpacked)

    def delete(self, container: oci_runtime.Container) -> None:
        for item in list(self.items):
            if item[1] is container:
                container.delete()
                item[0].stop()
                self.items.remove(item)

    def close(self) -> None:
        for sandbox, container in reversed(self.items):
            container.delete()
            sandbox.stop()


@pytest.fixture
def pods(tmp_path):
    p = Pods(tmp_path / "pods")
    yield p
    p.close()


async def start_cluster(tmp_path: Path) -> Cluster:
    """A cluster whose agent reads this machine's /proc, cgroups and runc state."""
    return await Cluster(tmp_path).start(
        PodMapper__proc_root="/proc",
        PodMapper__cgroup_root=str(cgroup2_mount()),
        AgentApp__runtime_state_dirs=[str(oci_runtime.RUNC_ROOT)],
    )


def backend_for(cluster: Cluster, registry: Registry) -> KubernetesBackend:
    return KubernetesBackend(
        config=cluster.hub_config(
            KubernetesBackend__repository_template=f"{registry.host}/gpusnap/{{username}}",
            KubernetesBackend__registry_scheme="http",
            KubernetesBackend__timeout=120,
        )
    )


async def notebook_with_state(pods: Pods, home: Path) -> tuple[oci_runtime.Container, str]:
    """A running notebook container whose kernel holds x = 42; returns it and the kernel id."""
    server = pods.run(SERVER, home)
    base = f"http://{server.sandbox.ip}:8888/"
    await oci_runtime.wait_http(base + "api/status", TOKEN)
    kernel = await new_kernel(base, TOKEN)
    out, _ = await execute(base, TOKEN, kernel, SETUP, timeout=60)
    assert out.strip() == "ready", out + server.output()
    return server, kernel


async def test_agent_ships_the_runtimes_checkpoint_and_restores_it_into_a_placeholder_container(
    runtime, registry, pods, tmp_path
):
    cluster = await start_cluster(tmp_path)
    criu_parents = []
    try:
        home = tmp_path / "home-pvc"  # the user's PVC: both pods mount it at /home/jovyan
        home.mkdir()
        server, kernel = await notebook_with_state(pods, home)
        cluster.add_user_pod("alice", runtime=server)
        backend = backend_for(cluster, registry)
        alice = Server(
            user="alice", name="", state={"pod_name": "jupyter-alice", "namespace": "jhub"}
        )

        info: CheckpointInfo = await backend.checkpoint(alice)

        assert info.status == "verified" and info.extra["node"] == NODE
        # the kubelet's archive is the runtime's, in CRI-O's layout, and gone once shipped
        (names,) = cluster.kube.archives
        for entry in ("checkpoint/inventory.img", "checkpoint/descriptors.json", "config.dump",
                      "spec.dump", "bind.mounts", "rootfs-diff.tar", "deleted.files", "dump.log"):  # fmt: skip
            assert entry in names, (entry, names)
        assert list(cluster.kube.checkpoints.iterdir()) == []
        # --leave-running: the server and its kernel go on after the checkpoint
        base = f"http://{server.sandbox.ip}:8888/"
        out, _ = await execute(base, TOKEN, kernel, "print(x + 1)", timeout=60)
        assert out.strip() == "43"
        out, _ = await execute(base, TOKEN, kernel, "x = 42; print(x)", timeout=60)

        # the Hub deletes the pod (every process of it is gone, its IP with it)
        pods.delete(server)
        cluster.kube.pods.pop(("jhub", "jupyter-alice"))

        # a placeholder without the user's volume cannot take the checkpoint: 409, named
        bare = pods.run(["sleep", "infinity"], None)
        cluster.add_user_pod("alice", placeholder_for=info.id, runtime=bare)
        code, body = await cluster.restore_into(info.id)
        assert code == 409 and "/home/jovyan" in body["error"], body
        assert "volumes" in body["fix"]
        assert bare.cgroup_pids() == [bare.pid]  # nothing was restored into it
        # the unpacked checkpoint (the server's memory) is not left on the node
        assert not [p for p in (tmp_path / "restore").rglob("*") if p.is_file()]
        cluster.kube.pods.pop(("jhub", "jupyter-alice"))
        pods.delete(bare)

        # another volume at the same place (not the user's PVC): CRIU cannot find the files
        # the server had open there; the restore fails, its log kept, the memory not
        other = tmp_path / "other-volume"
        other.mkdir()
        wrong = pods.run(["sleep", "infinity"], other)
        cluster.add_user_pod("alice", placeholder_for=info.id, runtime=wrong)
        code, body = await cluster.restore_into(info.id)
        assert code == 500 and "criu restore" in body["error"], body
        left = [p for p in (tmp_path / "restore").rglob("*") if p.is_file()]
        assert left and all(p.suffix == ".log" for p in left), left
        assert str(left[0]) in body["error"]
        cluster.kube.pods.pop(("jhub", "jupyter-alice"))
        pods.delete(wrong)

        # the spawner's placeholder: same image and volumes, `sleep infinity`, another pod
        placeholder = pods.run(["sleep", "infinity"], home)
        cluster.add_user_pod("alice", placeholder_for=info.id, runtime=placeholder)
        # without the runtime's state the agent cannot reach the placeholder's files
        cluster.agent.runtime_state_dirs = []
        code, body = await cluster.restore_into(info.id)
        assert code == 409 and "own mount namespace" in body["error"], body
        assert "AgentApp.runtime_state_dirs" in body["fix"]
        cluster.agent.runtime_state_dirs = [str(oci_runtime.RUNC_ROOT)]

        pid = (await backend.restore(info, into=RestoreTarget("jhub", "jupyter-alice"))).pid
        criu_parents = list(cluster.agent._restored)

        # in the placeholder's pod: its network (pod IP), IPC and UTS namespaces, its cgroup
        for ns in ("net", "ipc", "uts"):
            assert os.readlink(f"/proc/{pid}/ns/{ns}") == os.readlink(
                f"/proc/{placeholder.pid}/ns/{ns}"
            )
        assert os.readlink(f"/proc/{pid}/ns/pid") != os.readlink(f"/proc/{placeholder.pid}/ns/pid")
        assert pid in placeholder.cgroup_pids()
        # the same kernel answers on the placeholder's pod IP, with the container's files
        base = f"http://{placeholder.sandbox.ip}:8888/"
        out, _ = await execute(base, TOKEN, kernel, CHECK, timeout=60)
        assert out.split() == ["42", "kept", "False"], out + placeholder.output()
        assert (home / "notes.txt").read_text() == "more"
        # the restored server writes to the placeholder's stdout (kubectl logs shows it)
        assert "ServerApp" in placeholder.output()
        assert not list((tmp_path / "restore").glob("*/checkpoint"))  # scratch removed
    finally:
        for _sandbox, container in pods.items:
            container.delete()
        for r in criu_parents:  # criu exits once its restored tree is gone
            r.criu.wait(timeout=30)
        await cluster.stop()


async def pull_image(registry: Registry, ref: str, dest: Path) -> dict:
    """Pull a checkpoint image as a node's runtime does (distribution API, by digest) and
    unpack its layer into ``dest``; returns the manifest."""
    repo, _, digest = ref.partition("/")[2].partition("@")
    client = AsyncHTTPClient(force_instance=True, max_body_size=8 << 30)
    r = await client.fetch(
        f"http://{registry.host}/v2/{repo}/manifests/{digest}",
        headers={"Accept": "application/vnd.oci.image.manifest.v1+json"},
    )
    manifest = json.loads(r.body)
    (layer,) = manifest["layers"]
    blob = dest.parent / "layer.tar"
    with open(blob, "wb") as f:
        await client.fetch(
            f"http://{registry.host}/v2/{repo}/blobs/{layer['digest']}",
            streaming_callback=lambda chunk: f.write(chunk) and None,
            request_timeout=300,
        )
    client.close()
    dest.mkdir(parents=True)
    with tarfile.open(blob) as tar:
        tar.extractall(dest, filter="tar")
    return manifest


async def test_runtime_restores_the_checkpoint_image_itself(runtime, registry, pods, tmp_path):
    """restore_mode = "runtime": the image the agent pushed is what CRI-O restores from."""
    cluster = await start_cluster(tmp_path)
    try:
        home = tmp_path / "home-pvc"
        home.mkdir()
        server, kernel = await notebook_with_state(pods, home)
        cluster.add_user_pod("alice", runtime=server)
        backend = backend_for(cluster, registry)
        alice = Server(
            user="alice", name="", state={"pod_name": "jupyter-alice", "namespace": "jhub"}
        )
        info = await backend.checkpoint(alice)
        pods.delete(server)

        manifest = await pull_image(registry, info.id, tmp_path / "image")
        # CRI-O takes an image as a checkpoint by this annotation, naming the container
        assert manifest["annotations"][oci_runtime.CRIO_CHECKPOINT_ANNOTATION] == "notebook"
        restored = pods.restore(tmp_path / "image", home)

        base = f"http://{restored.sandbox.ip}:8888/"
        await oci_runtime.wait_http(base + "api/status", TOKEN)
        out, _ = await execute(base, TOKEN, kernel, CHECK, timeout=60)
        assert out.split() == ["42", "kept", "False"], out + restored.output()
        assert "ServerApp" in restored.output()  # its stdout: the new pod's pipes
    finally:
        await cluster.stop()
