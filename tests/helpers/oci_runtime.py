"""A real container runtime for tests: runc (Debian's 1.1.5) with our CRIU, pods as CRI-O builds them.

What a Kubernetes node does to run, checkpoint and restore a notebook container, done by
hand with the same parts:

- **image**: a root filesystem built from Debian packages (``mmdebstrap``) with Python,
  ``jupyter-server`` and ``ipykernel``, cached under :data:`CACHE` keyed by its inputs
  (built once per machine, about a minute; ``.ci/install-runtime.sh`` builds it ahead);
- **pod sandbox** (:class:`PodSandbox`): the network, IPC and UTS namespaces every
  container of a pod joins (what the pause container / ``pinns`` holds), with ``lo`` up
  and a veth pair giving the pod its own IP, reachable from the host like a pod IP;
- **container** (:class:`Container`): an OCI bundle whose root is an overlay of the image
  (read-only lower layer) and the container's own upper layer, as containers/storage
  mounts it; the sandbox's namespaces joined by path, its own PID and mount namespaces,
  a cgroup named as the kubelet names it (``…/kubepods-burstable-pod<uid>.slice/crio-<id>.scope``),
  bind mounts as the kubelet gives them (``/etc/hosts``, ``/dev/termination-log`` and a
  home volume), stdio as pipes whose other ends the test holds (what ``conmon`` does);
- **checkpoint** (:meth:`Container.checkpoint`): ``runc checkpoint --leave-running``
  (CRIU under the runtime), then the archive CRI-O writes for the kubelet's checkpoint
  API: ``checkpoint/``, ``config.dump``, ``spec.dump``, ``bind.mounts``, ``rootfs-diff.tar``,
  ``deleted.files``, ``dump.log``, ``stats-dump``;
- **runtime restore** (:func:`runtime_restore`): ``runc restore`` of such an archive into a
  new container, what CRI-O does for a checkpoint image (``restore_mode = "runtime"``).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import tarfile
import time
import uuid
from pathlib import Path

from tests.helpers.ports import worker_share

RUNC = shutil.which("runc") or "/usr/sbin/runc"
MMDEBSTRAP = shutil.which("mmdebstrap") or "/usr/bin/mmdebstrap"
CRIU = shutil.which("criu") or "/usr/local/sbin/criu"
#: Where the image's root filesystem is cached between runs (one folder per input hash).
CACHE = Path(os.environ.get("GPUSNAP_RUNTIME_CACHE", "/var/cache/gpusnap-test"))
SUITE = "bookworm"
PACKAGES = ("python3", "python3-jupyter-server", "python3-ipykernel")
#: The image name pods run; the annotation CRI-O reads on a checkpoint image.
IMAGE = "localhost/gpusnap-test/notebook:bookworm"
CRIO_CHECKPOINT_ANNOTATION = "io.kubernetes.cri-o.annotations.checkpoint.name"
#: The runc state folder CRI-O uses (``runtime_root``); the agent reads state.json there.
RUNC_ROOT = Path(os.environ.get("GPUSNAP_RUNC_ROOT", "/run/gpusnap-test-runc"))
#: CRIU options runc reads for every checkpoint/restore of these containers, as a node's
#: ``/etc/criu/runc.conf`` (docs/kubernetes.md): TCP connections are closed, not pinned.
CRIU_CONF = "tcp-close\nfile-locks\nnetwork-lock nftables\n"

# Mount points CRI-O leaves out of rootfs-diff.tar (libpod/diff.go's containerMounts).
_CONTAINER_MOUNTS = {
    "/dev",
    "/dev/shm",
    "/proc",
    "/run",
    "/run/.containerenv",
    "/run/secrets",
    "/sys",
}


def missing() -> str:
    """Why a real runtime cannot run here ("" when it can): what to install."""
    for tool, package in (
        (RUNC, "runc"),
        (MMDEBSTRAP, "mmdebstrap"),
        (CRIU, "criu (.ci/install-criu.sh)"),
    ):
        if not os.access(tool, os.X_OK):
            return f"{tool} not found: run .ci/install-runtime.sh (installs {package})"
    if os.geteuid() != 0:
        return "a container runtime needs root"
    return ""


# -- the image ----------------------------------------------------------------------------


def image_key() -> str:
    """Hash of everything the root filesystem is built from."""
    version = subprocess.run(
        [MMDEBSTRAP, "--version"], capture_output=True, text=True, check=False
    ).stdout.strip()
    text = json.dumps([SUITE, PACKAGES, version, "v1"])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def image_rootfs() -> Path:
    """The image's root filesystem, built once with mmdebstrap and kept under CACHE.

    Built into a temporary folder and renamed when complete, under a lock: concurrent
    test processes wait for one build; an interrupted build leaves nothing that looks done.
    """
    CACHE.mkdir(parents=True, exist_ok=True)
    done = CACHE / f"rootfs-{image_key()}"
    if (done / "usr/bin/python3").exists():
        return done
    with open(CACHE / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (done / "usr/bin/python3").exists():
            return done
        partial = CACHE / f".partial-{done.name}-{os.getpid()}"
        shutil.rmtree(partial, ignore_errors=True)
        subprocess.run(
            [
                MMDEBSTRAP,
                "--quiet",
                "--variant=essential",
                '--aptopt=APT::Install-Recommends "false"',
                "--include=" + ",".join(PACKAGES),
                SUITE,
                str(partial),
            ],
            check=True,
            stdin=subprocess.DEVNULL,
        )
        for stale in CACHE.glob("rootfs-*"):
            shutil.rmtree(stale, ignore_errors=True)  # an older key's image
        partial.rename(done)
    return done


# -- pods ---------------------------------------------------------------------------------


async def wait_http(url: str, token: str, timeout: float = 90) -> dict:
    """GET ``url`` with a Jupyter token until it answers 200; return its JSON."""
    import asyncio

    from tornado.httpclient import AsyncHTTPClient

    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        try:
            r = await AsyncHTTPClient().fetch(
                url, headers={"Authorization": f"token {token}"}, request_timeout=5
            )
            return json.loads(r.body)
        except Exception as e:  # not up yet
            last = f"{type(e).__name__}: {e}"
        await asyncio.sleep(0.2)
    raise AssertionError(f"{url} did not answer within {timeout:g}s ({last})")


def _sh(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(args, check=True, capture_output=True, text=True, **kw)


#: pod sandbox indices this test process has handed out (PodSandbox.new)
_used: set[int] = set()


class PodSandbox:
    """A pod's shared namespaces (net, IPC, UTS) held by a pause process, with its own IP.

    ``index`` (1…250) picks the pod's /30: the pod is 10.231.<index>.2, the host end of its
    veth 10.231.<index>.1.
    """

    def __init__(self, index: int, uid: str = ""):
        self.index = index
        self.uid = uid or str(uuid.uuid4())
        self.ip = f"10.231.{index}.2"
        self.host_ip = f"10.231.{index}.1"
        self.veth = f"gsnap{index}h"
        self.proc: subprocess.Popen | None = None
        self.pid = 0

    @classmethod
    def new(cls) -> PodSandbox:
        """A sandbox on an index no other pod on this machine uses, and none this test
        process used before while there is one left (a restore's new pod must not get its
        old pod's address back: as on a cluster, a new pod has a new IP)."""
        import random

        taken = {p.name for p in Path("/sys/class/net").iterdir()}
        start, end = worker_share(1, 251)  # one test process's share of the addresses
        free = [i for i in range(start, end) if f"gsnap{i}h" not in taken]
        index = random.choice([i for i in free if i not in _used] or free)
        _used.add(index)
        return cls(index).start()

    def start(self) -> PodSandbox:
        self.proc = subprocess.Popen(
            ["unshare", "--net", "--ipc", "--uts", "--fork", "--kill-child", "sleep", "infinity"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        deadline = time.monotonic() + 10
        while not self.pid:
            for child in _children(self.proc.pid):
                self.pid = child
            if time.monotonic() > deadline:
                raise AssertionError("the pod sandbox's pause process did not start")
            time.sleep(0.01)
        netns = f"/proc/{self.pid}/ns/net"
        subprocess.run(["ip", "link", "del", self.veth], capture_output=True, check=False)
        _sh(
            "ip",
            "link",
            "add",
            self.veth,
            "type",
            "veth",
            "peer",
            "name",
            "eth0",
            "netns",
            str(self.pid),
        )
        _sh("ip", "addr", "add", f"{self.host_ip}/30", "dev", self.veth)
        _sh("ip", "link", "set", self.veth, "up")
        inside = ["nsenter", f"--net={netns}", "ip"]
        _sh(*inside, "link", "set", "lo", "up")
        _sh(*inside, "addr", "add", f"{self.ip}/30", "dev", "eth0")
        _sh(*inside, "link", "set", "eth0", "up")
        _sh(*inside, "route", "add", "default", "via", self.host_ip)
        return self

    def ns(self, kind: str) -> str:
        return f"/proc/{self.pid}/ns/{kind}"

    def stop(self) -> None:
        subprocess.run(["ip", "link", "del", self.veth], capture_output=True, check=False)
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]


def cgroup_mounts() -> dict[str, Path]:
    """Cgroup hierarchies mounted here: controller (or ``unified``) → mount point."""
    out: dict[str, Path] = {}
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        fstype, _, options = right.split()[:3]
        point = Path(left.split()[4])
        if fstype == "cgroup2":
            out["unified"] = point
        elif fstype == "cgroup":
            for opt in options.split(","):
                if opt in ("rw", "ro", "relatime") or opt.startswith("release_agent"):
                    continue
                out[opt] = point
    return out


class Container:
    """A real runc container of a pod, laid out as CRI-O lays it out.

    ``args``: the container's command. Its stdio are pipes: :attr:`stdout` is the read end
    of the container's stdout and stderr (what conmon reads into the pod log).
    """

    def __init__(
        self,
        root: Path,
        sandbox: PodSandbox,
        args: list[str],
        name: str = "notebook",
        env: dict[str, str] | None = None,
        home: Path | None = None,
        volumes: bool = True,
    ):
        self.volumes = volumes  # False: no home volume mounted at /home/jovyan
        self.id = uuid.uuid4().hex + uuid.uuid4().hex
        self.name = name
        self.sandbox = sandbox
        self.args = args
        self.env = dict(env or {})
        self.dir = Path(root) / f"ctr-{self.id[:12]}"
        self.bundle = self.dir / "bundle"
        self.rootfs = self.bundle / "rootfs"
        self.upper = self.dir / "upper"
        self.home = home or self.dir / "home"
        self.log = self.dir / "ctr.log"
        self.stdout: int | None = None  # read end of the container's stdout/stderr pipe
        self._stdin_w: int | None = None
        self.pid = 0
        self.mounted = False

    @property
    def cgroup_path(self) -> str:
        """The container's cgroup as the kubelet's cgroupfs driver + CRI-O name it."""
        uid = self.sandbox.uid.replace("-", "_")
        return (
            "/kubepods.slice/kubepods-burstable.slice/"
            f"kubepods-burstable-pod{uid}.slice/crio-{self.id}.scope"
        )

    @property
    def status_id(self) -> str:
        """The pod status's containerID."""
        return f"cri-o://{self.id}"

    def mount_rootfs(self, lower: Path) -> None:
        for d in (self.rootfs, self.upper, self.dir / "work", self.home):
            d.mkdir(parents=True, exist_ok=True)
        _sh(
            "mount", "-t", "overlay", "overlay", "-o",
            f"lowerdir={lower},upperdir={self.upper},workdir={self.dir / 'work'}",
            str(self.rootfs),
        )  # fmt: skip
        self.mounted = True

    def spec(self) -> dict:
        """The OCI spec (config.json) CRI-O would generate for this container."""
        (self.dir / "hosts").write_text(
            f"127.0.0.1 localhost\n{self.sandbox.ip} pod-{self.sandbox.index}\n"
        )
        (self.dir / "termination-log").write_text("")
        (self.dir / "criu.conf").write_text(CRIU_CONF)
        env = {
            "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "HOME": "/home/jovyan",
        }
        env.update(self.env)
        return {
            "ociVersion": "1.0.2-dev",
            "process": {
                "terminal": False,
                "user": {"uid": 0, "gid": 0},
                "args": self.args,
                "env": [f"{k}={v}" for k, v in env.items()],
                "cwd": "/home/jovyan",
                "capabilities": {
                    k: [
                        "CAP_CHOWN",
                        "CAP_DAC_OVERRIDE",
                        "CAP_FOWNER",
                        "CAP_KILL",
                        "CAP_SETGID",
                        "CAP_SETUID",
                        "CAP_NET_BIND_SERVICE",
                    ]
                    for k in ("bounding", "effective", "permitted")
                },  # fmt: skip
                "noNewPrivileges": True,
            },
            "root": {"path": "rootfs", "readonly": False},
            "hostname": f"pod-{self.sandbox.index}",
            "mounts": [
                {"destination": "/proc", "type": "proc", "source": "proc"},
                {
                    "destination": "/dev",
                    "type": "tmpfs",
                    "source": "tmpfs",
                    "options": ["nosuid", "strictatime", "mode=755", "size=65536k"],
                },
                {
                    "destination": "/dev/pts",
                    "type": "devpts",
                    "source": "devpts",
                    "options": [
                        "nosuid",
                        "noexec",
                        "newinstance",
                        "ptmxmode=0666",
                        "mode=0620",
                        "gid=5",
                    ],
                },
                {
                    "destination": "/dev/shm",
                    "type": "tmpfs",
                    "source": "shm",
                    "options": ["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"],
                },
                {
                    "destination": "/dev/mqueue",
                    "type": "mqueue",
                    "source": "mqueue",
                    "options": ["nosuid", "noexec", "nodev"],
                },
                {
                    "destination": "/sys",
                    "type": "sysfs",
                    "source": "sysfs",
                    "options": ["nosuid", "noexec", "nodev", "ro"],
                },
                {
                    "destination": "/etc/hosts",
                    "type": "bind",
                    "source": str(self.dir / "hosts"),
                    "options": ["rbind", "rprivate", "rw"],
                },
                {
                    "destination": "/dev/termination-log",
                    "type": "bind",
                    "source": str(self.dir / "termination-log"),
                    "options": ["rbind", "rprivate", "rw"],
                },
            ]  # fmt: skip
            + (
                [
                    {
                        "destination": "/home/jovyan",
                        "type": "bind",
                        "source": str(self.home),
                        "options": ["rbind", "rprivate", "rw"],
                    }
                ]  # fmt: skip
                if self.volumes
                else []
            ),
            "annotations": {
                "io.kubernetes.pod.uid": self.sandbox.uid,
                "io.kubernetes.container.name": self.name,
                "org.criu.config": str(self.dir / "criu.conf"),
            },
            "linux": {
                "cgroupsPath": self.cgroup_path,
                "namespaces": [
                    {"type": "pid"},
                    {"type": "mount"},
                    {"type": "network", "path": self.sandbox.ns("net")},
                    {"type": "ipc", "path": self.sandbox.ns("ipc")},
                    {"type": "uts", "path": self.sandbox.ns("uts")},
                ],
                "maskedPaths": [
                    "/proc/acpi",
                    "/proc/kcore",
                    "/proc/keys",
                    "/proc/latency_stats",
                    "/proc/timer_list",
                    "/proc/sched_debug",
                    "/proc/scsi",
                    "/sys/firmware",
                ],
                "readonlyPaths": [
                    "/proc/bus",
                    "/proc/fs",
                    "/proc/irq",
                    "/proc/sys",
                    "/proc/sysrq-trigger",
                ],
            },  # fmt: skip
        }

    def _pipes(self) -> tuple[int, int]:
        """(stdin read end, stdout write end) for runc; the test keeps the other ends."""
        stdin_r, self._stdin_w = os.pipe()
        self.stdout, stdout_w = os.pipe()
        os.set_blocking(self.stdout, False)
        return stdin_r, stdout_w

    def _runc(self, *args: str, stdin: int | None = None, stdout: int | None = None, cwd=None):
        cmd = [RUNC, "--root", str(RUNC_ROOT), "--log", str(self.log), *args]
        proc = subprocess.run(
            cmd,
            stdin=stdin if stdin is not None else subprocess.DEVNULL,
            stdout=stdout if stdout is not None else subprocess.PIPE,
            stderr=stdout if stdout is not None else subprocess.PIPE,
            cwd=cwd,
            check=False,
            timeout=300,
        )
        if proc.returncode != 0:
            log = self.log.read_text()[-3000:] if self.log.exists() else ""
            raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}): {log}")
        return proc

    def start(self, lower: Path | None = None) -> Container:
        """Create the bundle and ``runc run -d`` it with pipes for stdio (conmon's part)."""
        self.mount_rootfs(lower or image_rootfs())
        (self.bundle / "config.json").write_text(json.dumps(self.spec(), indent=1))
        stdin_r, stdout_w = self._pipes()
        try:
            self._runc(
                "run", "-d", "--pid-file", str(self.dir / "pid"), "--bundle", str(self.bundle), self.id,
                stdin=stdin_r, stdout=stdout_w,
            )  # fmt: skip
        finally:
            os.close(stdin_r)
            os.close(stdout_w)
        self.pid = int((self.dir / "pid").read_text())
        return self

    def output(self) -> str:
        """What the container wrote to stdout/stderr since the last call."""
        chunks = []
        while self.stdout is not None:
            try:
                data = os.read(self.stdout, 65536)
            except BlockingIOError:
                break
            if not data:
                break
            chunks.append(data)
        return b"".join(chunks).decode(errors="replace")

    def state(self) -> dict:
        return json.loads(self._runc("state", self.id).stdout)

    # -- the checkpoint CRI-O takes for the kubelet --------------------------------------

    def checkpoint(self, dest: Path, name: str) -> Path:
        """``runc checkpoint --leave-running`` + the archive CRI-O writes; returns its path."""
        work = self.dir / f"checkpoint-work-{int(time.time() * 1000)}"
        images = work / "checkpoint"
        images.mkdir(parents=True)
        self._runc(
            "checkpoint",
            "--image-path",
            str(images),
            "--work-path",
            str(work),
            "--leave-running",
            self.id,
        )
        spec = json.loads((self.bundle / "config.json").read_text())
        (work / "spec.dump").write_text(json.dumps(spec))
        now = time.strftime("%Y-%m-%dT%H:%M:%S.000000000Z", time.gmtime())
        (work / "config.dump").write_text(
            json.dumps(
                {
                    "id": self.id,
                    "name": self.name,
                    "rootfsImage": IMAGE,
                    "rootfsImageRef": hashlib.sha256(IMAGE.encode()).hexdigest(),
                    "rootfsImageName": IMAGE,
                    "runtime": "runc",
                    "createdTime": now,
                    "checkpointedTime": now,
                    "restored": False,
                }
            )
        )
        bind = []
        for m in spec["mounts"]:
            if m["type"] != "bind" or m["destination"] in _CONTAINER_MOUNTS:
                continue
            st = os.stat(m["source"])
            bind.append(
                {
                    "source": m["source"],
                    "destination": m["destination"],
                    "file_type": "directory" if os.path.isdir(m["source"]) else "file",
                    "permissions": st.st_mode & 0o777,
                }
            )
        (work / "bind.mounts").write_text(json.dumps(bind))
        include = [
            "stats-dump",
            "dump.log",
            "checkpoint",
            "config.dump",
            "spec.dump",
            "bind.mounts",
        ]
        deleted = self._rootfs_diff(spec, work / "rootfs-diff.tar")
        include.append("rootfs-diff.tar")
        if deleted:
            (work / "deleted.files").write_text(json.dumps(deleted))
            include.append("deleted.files")
        if (images / "dump.log").exists() and not (work / "dump.log").exists():
            shutil.copy(images / "dump.log", work / "dump.log")
        archive = Path(dest) / f"{name}.tar"
        with tarfile.open(archive, "w") as tar:
            for entry in include:
                if (work / entry).exists():
                    tar.add(work / entry, arcname=entry)
        os.chmod(archive, 0o600)
        shutil.rmtree(work)
        return archive

    def _rootfs_diff(self, spec: dict, out: Path) -> list[str]:
        """The container's changes to its image (its overlay upper layer) as CRI-O tars them:
        changed and new files in ``rootfs-diff.tar``; deleted ones (whiteouts) returned."""
        skip = {m["destination"] for m in spec["mounts"] if m["type"] == "bind"} | _CONTAINER_MOUNTS
        deleted: list[str] = []
        with tarfile.open(out, "w") as tar:
            for folder, dirs, files in os.walk(self.upper):
                rel = Path(folder).relative_to(self.upper)
                for entry in sorted(dirs + files):
                    path = Path(folder) / entry
                    name = str(rel / entry) if str(rel) != "." else entry
                    if "/" + name in skip or any(("/" + name).startswith(s + "/") for s in skip):
                        continue
                    st = os.lstat(path)
                    if (st.st_mode & 0o170000) == 0o020000 and st.st_rdev == 0:  # whiteout
                        deleted.append("/" + name)
                        continue
                    tar.add(path, arcname=name, recursive=False)
        return deleted

    # -- what CRI-O does with a checkpoint image -----------------------------------------

    def restore_from(self, unpacked: Path, lower: Path | None = None) -> Container:
        """Create this container from a checkpoint archive unpacked at ``unpacked`` (a
        checkpoint image's layer) and ``runc restore -d`` it, as CRI-O does for a pod
        whose image carries ``io.kubernetes.cri-o.annotations.checkpoint.name``: a fresh
        writable layer over the image with the archive's ``rootfs-diff.tar`` applied and
        ``deleted.files`` removed, the checkpointed spec with this pod's namespaces,
        cgroup and volume sources, and new stdio pipes handed to CRIU for the old ones."""
        unpacked = Path(unpacked)
        old = json.loads((unpacked / "spec.dump").read_text())
        self.args = old["process"]["args"]
        self.mount_rootfs(lower or image_rootfs())
        with tarfile.open(unpacked / "rootfs-diff.tar") as tar:
            tar.extractall(self.rootfs, filter="tar")
        deleted = unpacked / "deleted.files"
        for name in json.loads(deleted.read_text()) if deleted.exists() else []:
            target = self.rootfs / name.lstrip("/")
            if target.is_dir() and not target.is_symlink():
                shutil.rmtree(target)
            else:
                target.unlink(missing_ok=True)
        spec = self.spec()
        spec["process"] = old["process"]
        (self.bundle / "config.json").write_text(json.dumps(spec, indent=1))
        stdin_r, stdout_w = self._pipes()
        try:
            self._runc(
                "restore", "-d", "--image-path", str(unpacked / "checkpoint"),
                "--work-path", str(self.dir), "--pid-file", str(self.dir / "pid"),
                "--bundle", str(self.bundle), self.id,
                stdin=stdin_r, stdout=stdout_w,
            )  # fmt: skip
        finally:
            os.close(stdin_r)
            os.close(stdout_w)
        self.pid = int((self.dir / "pid").read_text())
        return self

    def cgroup_pids(self) -> list[int]:
        """Every process in the container's cgroup (a restore's tree included)."""
        unified = cgroup_mounts().get("unified")
        if unified is None:
            return []
        try:
            text = (unified / self.cgroup_path.lstrip("/") / "cgroup.procs").read_text()
        except OSError:
            return []
        return [int(p) for p in text.split()]

    def kill(self) -> None:
        with contextlib.suppress(AssertionError):
            self._runc("kill", self.id, "KILL")

    def delete(self) -> None:
        """Stop the container and remove everything of it (pipes, rootfs mount, bundle):
        every process in its cgroup is killed first, as the kubelet does for a pod."""
        for pid in self.cgroup_pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 9)
        with contextlib.suppress(AssertionError, subprocess.TimeoutExpired):
            self._runc("delete", "--force", self.id)
        for fd in (self.stdout, self._stdin_w):
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self.stdout = self._stdin_w = None
        if self.mounted:
            subprocess.run(["umount", "-l", str(self.rootfs)], capture_output=True, check=False)
            self.mounted = False
        shutil.rmtree(self.dir, ignore_errors=True)
