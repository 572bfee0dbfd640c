"""The node agent's GPU steps on a real GPU: a process holding torch tensors in a pod-like
namespace is locked and checkpointed through the CUDA driver, dumped, restored into a
placeholder's namespaces and cgroup, and its GPU memory comes back bit-identical.

Selected with ``-m gpu`` (GPU machine only; about a minute, timings printed). The GPU
machine has no container runtime, so a "pod" here is what a runtime would build, made
with the local sandbox (jupyterhub_gpusnap/sandbox.py): its own PID and mount namespaces
with their own /proc and stdio opened inside, inside fresh network, IPC and UTS namespaces,
in a cgroup v2 folder named like a pod container's (``…pod<uid>.slice/cri-containerd-<id>.scope``).
The kubelet's HTTP front is the fake one; its "runtime" dumps that tree with CRIU
(``--leave-running``) into the archive layout. Everything else is the real agent over its
HTTP API: ``POST /v1/checkpoint`` (NVML finds the pod's GPU process, the driver locks and
checkpoints it: the GPU memory is freed), the archive on a PVC folder with the GPU model
and driver recorded, then ``POST /v1/restore`` into a placeholder pod (its namespaces and
cgroup joined, the GPU check, ``cuCheckpointProcessRestore`` + ``Unlock``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import time
import types
import uuid
from pathlib import Path

import pytest

from jupyterhub_gpusnap import sandbox
from tests.helpers.fake_kube import CRIU, NODE, Cluster, cgroup2_mount

pytestmark = pytest.mark.gpu

GiB = 1024**3

#: The GPU process: tensors of random data on the GPU; it answers a request file in
#: ``folder`` (the sandbox opens its stdio inside, so files on a host folder are its channel).
HOLDER = r"""
import hashlib, os, sys, time
import torch
folder, gib = sys.argv[1], float(sys.argv[2])
torch.cuda.init()
data = [torch.rand(int(gib * 2**30) // 4 // 4, device="cuda") for _ in range(4)]
torch.cuda.synchronize()
def answer(text):
    tmp = os.path.join(folder, "answer.tmp")
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, os.path.join(folder, "answer"))
answer(f"READY {os.getpid()}")
while True:
    req = os.path.join(folder, "request")
    if os.path.exists(req):
        os.unlink(req)
        h = hashlib.sha256()
        for t in data:
            h.update(t.view(torch.uint8).cpu().numpy().tobytes())
        answer(f"SUM {h.hexdigest()} {torch.cuda.memory_allocated()}")
    time.sleep(0.05)
"""


class CgroupPod:
    """A pod's container made without a runtime: ``command`` started inside a cgroup v2
    folder named as the kubelet names a container's, so the agent maps its processes to
    the pod. For the fake kubelet it is also the runtime: :meth:`checkpoint`."""

    def __init__(self, command: list[str], folder: Path):
        self.uid = str(uuid.uuid4())
        self.id = uuid.uuid4().hex + uuid.uuid4().hex
        self.status_id = f"containerd://{self.id}"
        self.sandbox = types.SimpleNamespace(uid=self.uid, ip="127.0.0.1")
        mount = cgroup2_mount()
        self.pod_dir = (
            mount / "kubepods.slice" / "kubepods-burstable.slice"
            / f"kubepods-burstable-pod{self.uid.replace('-', '_')}.slice"
        )  # fmt: skip
        self.cgroup = self.pod_dir / f"cri-containerd-{self.id}.scope"
        self.cgroup.mkdir(parents=True)
        procs = str(self.cgroup / "cgroup.procs")

        def enter():
            with open(procs, "w") as f:
                f.write("0")

        self.folder = folder
        self.proc = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL, start_new_session=True, preexec_fn=enter,
        )  # fmt: skip

    def pids(self) -> list[int]:
        try:
            return [int(p) for p in (self.cgroup / "cgroup.procs").read_text().split()]
        except OSError:
            return []

    def root(self) -> int:
        """The sandbox's init: the process whose parent is the launcher."""
        for pid in self.pids():
            try:
                ppid = int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1])
            except OSError:
                continue
            if ppid == self.proc.pid:
                return pid
        raise AssertionError(f"no sandbox init in {self.pids()}")

    def checkpoint(self, dest: Path, name: str) -> Path:
        """What the runtime does for the kubelet: dump the tree ``--leave-running`` (the
        sandbox's mounts external) into ``checkpoint/`` of an archive."""
        work = self.folder / f"ck-{name}"
        images = work / "checkpoint"
        images.mkdir(parents=True)
        root = self.root()
        subprocess.run(
            [CRIU, "dump", "-t", str(root), "-D", str(images), "--leave-running", "-o", "dump.log",
             "-v4", "--tcp-close", "--file-locks", *sandbox.dump_args(root)],
            check=True, capture_output=True,
        )  # fmt: skip
        archive = Path(dest) / f"{name}.tar"
        with tarfile.open(archive, "w") as tar:
            tar.add(images, arcname="checkpoint")
        os.chmod(archive, 0o600)
        shutil.rmtree(work)
        return archive

    def stop(self) -> None:
        """Delete the pod: kill everything in its cgroup, remove the folders."""
        deadline = time.monotonic() + 30
        while self.cgroup.exists():
            for pid in self.pids():
                try:
                    os.kill(pid, 9)
                except ProcessLookupError:
                    pass
            try:
                self.cgroup.rmdir()
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        self.proc.wait()
        for folder in (self.pod_dir, self.pod_dir.parent, self.pod_dir.parent.parent):
            try:
                folder.rmdir()
            except OSError:
                break


def ask(folder: Path, timeout: float = 120) -> str:
    (folder / "answer").unlink(missing_ok=True)
    (folder / "request").write_text("")
    return wait_answer(folder, timeout)


def wait_answer(folder: Path, timeout: float = 120) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            return (folder / "answer").read_text()
        except FileNotFoundError:
            time.sleep(0.05)
    raise AssertionError(f"the GPU process did not answer within {timeout:g}s")


async def test_agent_checkpoints_and_restores_a_gpu_process_into_a_placeholder(tmp_path):
    gib = float(os.environ.get("GPUSNAP_GPU_TEST_GIB", "1"))
    python = os.environ.get("GPU_HELPER_PYTHON") or sys.executable
    channel = tmp_path / "channel"
    channel.mkdir()
    pvc = tmp_path / "pvc"
    pvc.mkdir()
    cluster = await Cluster(tmp_path).start(
        PodMapper__proc_root="/proc",
        PodMapper__cgroup_root=str(cgroup2_mount()),
        AgentApp__criu_restore_args=list(sandbox.MOUNT_ARGS),  # the sandbox's mounts
        AgentApp__pvc_paths=[str(pvc)],
    )
    holder = [python, "-c", HOLDER, str(channel), str(gib)]
    pod = CgroupPod(
        [
            "unshare",
            "--net",
            "--ipc",
            "--uts",
            "--",
            *sandbox.command(holder, str(tmp_path / "server.log"), python=python),
        ],
        tmp_path,
    )
    placeholder = None
    timings: dict[str, float] = {}
    try:
        ready = wait_answer(channel, 180)
        assert ready.startswith("READY"), ready
        first = ask(channel)
        _, checksum, allocated = first.split()
        assert int(allocated) >= gib * GiB
        # the agent's NVML and driver are the machine's real ones
        cluster.kube.add_pod("jhub", "jupyter-alice", NODE, runtime=pod,
                             labels={"hub.jupyter.org/username": "alice"},
                             annotations={"hub.jupyter.org/username": "alice"})  # fmt: skip

        started = time.monotonic()
        code, body = await cluster.agent_call(
            "POST", "/v1/checkpoint",
            {"namespace": "jhub", "pod": "jupyter-alice", "container": "notebook",
             "target": {"kind": "pvc", "path": str(pvc)}},
            timeout=600,
        )  # fmt: skip
        timings["checkpoint (lock + GPU to host + dump + ship)"] = time.monotonic() - started
        assert code == 200, body
        assert body["gpu_bytes"] >= gib * GiB and body["gpu"]["count"] == 1, body
        # the GPU memory is freed: NVML sees none for the pod's processes
        held = cluster.agent.nvml.process_memory(pod.pids())
        assert sum(sum(d.values()) for d in held.values()) == 0, held

        pod.stop()  # the Hub deletes the pod
        cluster.kube.pods.pop(("jhub", "jupyter-alice"))
        placeholder = CgroupPod(
            ["unshare", "--net", "--ipc", "--uts", "--", "sleep", "infinity"], tmp_path
        )
        cluster.kube.add_pod("jhub", "jupyter-alice", NODE, runtime=placeholder,
                             annotations={"gpusnap.jupyter.org/placeholder-for": body["id"]})  # fmt: skip
        (waiting,) = placeholder.pids()

        started = time.monotonic()
        code, done = await cluster.restore_into(body["id"])
        timings["restore (fetch + CRIU + GPU restore + unlock)"] = time.monotonic() - started
        assert code == 200, done
        restored = done["pid"]
        # in the placeholder's cgroup and namespaces (a PID namespace of its own)
        assert restored in placeholder.pids() and done["placeholder_pid"] == waiting
        for ns in ("net", "ipc", "uts"):
            assert os.readlink(f"/proc/{restored}/ns/{ns}") == os.readlink(
                f"/proc/{waiting}/ns/{ns}"
            )

        started = time.monotonic()
        again = ask(channel)
        timings["first answer after restore (checksum of the tensors)"] = time.monotonic() - started
        _, checksum_after, allocated_after = again.split()
        assert checksum_after == checksum  # bit-identical
        assert allocated_after == allocated
    finally:
        for what, seconds in timings.items():
            print(f"{what}: {seconds:.2f} s ({gib:g} GiB)")
        pod.stop()
        if placeholder is not None:
            placeholder.stop()
        for r in cluster.agent._restored:
            r.criu.wait(timeout=60)
        await cluster.stop()
