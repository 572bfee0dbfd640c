"""``jupyterhub-gpusnap-agent``: the node agent's traitlets Application and its HTTP API.

Runs as a privileged, hostPID DaemonSet on GPU nodes. JSON in, JSON out; every
request carries ``Authorization: Bearer <token>``; errors are
``{"error": …, "fix": …}`` with a 4xx/5xx status.

- ``GET /healthz`` → ``{"ok", "node", "criu", "driver"}``
- ``GET /v1/signals?pod=NS/POD…`` → per-pod ``cpu_percent``, ``gpu_percent``,
  ``gpu_memory_bytes``, ``gpu_count``
- ``POST /v1/checkpoint`` → freeze GPU memory, kubelet checkpoint, ship + verify,
  delete the node's archive; on failure the GPU is resumed and the container runs on
  (an archive whose push failed on the registry's or PVC's side stays on the node until a
  checkpoint of that container ships, at most ``kept_archive_max_age``; see :mod:`.kept`).
  The image records what its GPU memory needs (GPU model, devices, driver; see
  :mod:`~jupyterhub_gpusnap.gpu.compat`), and so does the reply (``gpu``)
- ``POST /v1/restore`` → refuse (409) a checkpoint whose GPU memory this node's GPUs
  or driver cannot take, fetch by digest, unpack, ``criu restore`` into the placeholder
  pod's container (its root, net/ipc/uts namespaces and cgroup), resume GPU memory
- ``POST /v1/park`` / ``/v1/unpark`` → GPU memory of a pod to host memory and back
- ``GET /v1/gpus`` → per GPU of the node ``index``, ``uuid``, ``total_bytes``,
  ``free_bytes`` and ``pods`` (``namespace/pod`` → bytes held on it), with
  ``checkpoint_api`` (whether pods here can be parked); ``{"gpus": [], "reason"}``
  without NVML. What make-room on Kubernetes reads.
- ``GET /v1/doctor`` → node-side readiness checks
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import os
import re
import time
from pathlib import Path

from tornado import web
from tornado.httpserver import HTTPServer
from traitlets import (
    Bool,
    Dict,
    Enum,
    Float,
    Instance,
    Integer,
    List,
    TraitError,
    Unicode,
    default,
    validate,
)
from traitlets.config import Application

from .. import __version__
from ..checkpoint import criu as criu_tools
from ..checkpoint.base import CheckpointError, CheckpointInfo, CheckpointRefused, RestoreTarget
from ..gpu.cuda import CudaCheckpoint
from ..gpu.nvml import Nvml
from ..gpu.park import Parking
from ..gpu.park import park as park_pids
from ..gpu.park import unpark as unpark_pids
from ..gpu.view import agent_payload, read_devices
from ..kube.api import KubeAPI
from ..kube.errors import AgentError
from ..model import Server
from .errors import need
from .handlers import (
    CheckpointHandler,
    DoctorHandler,
    GpusHandler,
    HealthHandler,
    ParkHandler,
    RestoreHandler,
    SignalsHandler,
    UnparkHandler,
)
from .kept import KeptArchives
from .kubelet import KubeletClient
from .node_backend import NodeBackend
from .placeholder import JOINABLE_NAMESPACES, PLACEHOLDER_ANNOTATION
from .pods import CpuMeter, PodMapper, container_id
from .rbac import Need, agent_rbac_needs
from .ship import Shipper


class AgentApp(Application):
    """The node agent: per-pod signals, checkpoint shipping and restores on one node."""

    name = "jupyterhub-gpusnap-agent"
    version = __version__
    description = __doc__

    classes = [KubeAPI, KubeletClient, Shipper, PodMapper, CudaCheckpoint]
    aliases = {
        "port": "AgentApp.port",
        "ip": "AgentApp.ip",
        "node": "AgentApp.node_name",
        "config": "AgentApp.config_file",
        "log-level": "Application.log_level",
    }

    config_file = Unicode(
        "", help="Python config file to load (c.AgentApp.…, c.KubeletClient.…, c.Shipper.…)."
    ).tag(config=True)

    ip = Unicode("0.0.0.0", help="Address the agent listens on (the pod IP with 0.0.0.0).").tag(
        config=True
    )

    port = Integer(
        9780, help="Port of the agent's HTTP API (the hub side calls <pod IP>:9780)."
    ).tag(config=True)

    node_name = Unicode(
        help="Name of the node this agent runs on. Default: $NODE_NAME, set from the downward API "
        "(env: - name: NODE_NAME, valueFrom: fieldRef: fieldPath: spec.nodeName).",
    ).tag(config=True)

    @default("node_name")
    def _default_node(self) -> str:
        return os.environ.get("NODE_NAME", "")

    auth = Enum(
        ["token", "tokenreview"],
        "token",
        help="How callers prove who they are. 'token': a shared secret (api_token or api_token_file) "
        "in 'Authorization: Bearer'. 'tokenreview': a Kubernetes ServiceAccount token, checked with "
        "a TokenReview (needs RBAC 'create' on tokenreviews.authentication.k8s.io); the token's "
        "username must be in allowed_users.",
    ).tag(config=True)

    api_token = Unicode(
        "", help="The shared secret for auth='token'. Prefer api_token_file (a mounted Secret)."
    ).tag(config=True)

    api_token_file = Unicode(
        "", help="File holding the shared secret for auth='token' (e.g. a mounted Secret key)."
    ).tag(config=True)

    allowed_users = List(
        Unicode(),
        help="For auth='tokenreview': usernames allowed to call the agent, e.g. "
        "['system:serviceaccount:jhub:hub', 'system:serviceaccount:jhub:gpusnap'].",
    ).tag(config=True)

    tokenreview_cache_seconds = Float(
        60.0, help="Seconds a successful TokenReview is trusted before asking the API server again."
    ).tag(config=True)

    tokenreview_refusal_cache_seconds = Float(
        10.0,
        help="Seconds a token the API server did not authenticate, or whose user is not in "
        "allowed_users, is refused again without another TokenReview (0: review every time). "
        "Keeps a caller retrying a bad token from loading the API server.",
    ).tag(config=True)

    tokenreview_max_per_second = Float(
        5.0,
        help="Most TokenReviews per second the agent sends for tokens it has not seen (bursts "
        "of twice that are allowed). Beyond it a request with an unknown token is answered "
        "429 without asking the API server; tokens already reviewed are not counted. Raise "
        "it if many legitimate callers start at once; 0: no limit.",
    ).tag(config=True)

    checkpoint_dir = Unicode(
        "/var/lib/kubelet/checkpoints",
        help="Where the kubelet's checkpoint archives are visible to the agent (mount the host's "
        "/var/lib/kubelet/checkpoints there). The kubelet names archives by their host path; the "
        "agent opens the file of the same name in this folder.",
    ).tag(config=True)

    restore_dir = Unicode(
        "/var/lib/gpusnap/restore",
        help="Scratch folder (hostPath, on a disk with room for the largest checkpoint) where "
        "images are unpacked for a restore.",
    ).tag(config=True)

    criu_path = Unicode("criu", help="The CRIU binary (>= 4.2) used for restores.").tag(config=True)

    criu_restore_args = List(
        Unicode(),
        help="Extra arguments for 'criu restore' (it always runs with --tcp-close and "
        "--file-locks: TCP connections the dump held are dropped, clients such as ZMQ reconnect).",
    ).tag(config=True)

    restore_timeout = Float(
        600.0, help="Seconds a 'criu restore' may take before it is stopped."
    ).tag(config=True)

    restore_into = Enum(
        ["placeholder", "agent"],
        "placeholder",
        help="Where POST /v1/restore puts the restored process tree. 'placeholder' (the "
        "default, for clusters): into the running container of the pod named in the request "
        "(SnapKubeSpawner's placeholder pod): criu restore runs with that container's root "
        "(--root /proc/<pid>/root), joins its namespaces (restore_join_namespaces) and is "
        "started inside its cgroup; the restore is refused (409) while that container has "
        "no process on this node. 'agent': into the agent's own namespaces and cgroup "
        "(--root restore_root when set); only for a single machine without pods.",
    ).tag(config=True)

    restore_join_namespaces = List(
        Unicode(),
        list(JOINABLE_NAMESPACES),
        help="Namespaces of the placeholder container that a restore joins (criu restore "
        "--join-ns NS:/proc/<pid>/ns/NS), with restore_into='placeholder'. Any of 'net' "
        "(the pod IP the Hub and proxy know), 'ipc', 'uts'; CRIU cannot join a PID namespace.",
    ).tag(config=True)

    @validate("restore_join_namespaces")
    def _check_join(self, proposal):
        bad = [ns for ns in proposal["value"] if ns not in JOINABLE_NAMESPACES]
        if bad:
            raise TraitError(
                f"AgentApp.restore_join_namespaces: {bad} cannot be joined; use any of "
                f"{list(JOINABLE_NAMESPACES)}"
            )
        return proposal["value"]

    restore_requires_placeholder = Bool(
        True,
        help="With restore_into='placeholder', restore only into a pod annotated "
        f"{PLACEHOLDER_ANNOTATION}=<the image being restored> (SnapKubeSpawner sets it on its "
        "placeholder pods), so that a restore can never take over another running pod. "
        "Turn off only for placeholder pods made by other tools.",
    ).tag(config=True)

    runtime_state_dirs = List(
        Unicode(),
        ["/run/runc", "/run/containerd/runc/k8s.io"],
        help="Folders where the node's OCI runtime (runc) keeps its containers' state "
        "(<folder>/<container id>/state.json): CRI-O with runc uses /run/runc, containerd "
        "/run/containerd/runc/k8s.io. A restore reads the placeholder container's root "
        "filesystem and volume paths there (CRIU cannot take them from another mount "
        "namespace through /proc/<pid>/root). Mount them into the agent pod (hostPath) at "
        "the same paths under host_root.",
    ).tag(config=True)

    host_root = Unicode(
        "",
        help="Where the node's root filesystem is visible to the agent, e.g. '/host' for a "
        "hostPath '/' mounted with mountPropagation: HostToContainer (the placeholder's "
        "root filesystem and volumes are mounts the runtime makes later). Prefixed to "
        "runtime_state_dirs and to every path read from the runtime's state. Empty: the "
        "agent sees the node's paths as they are.",
    ).tag(config=True)

    restore_root = Unicode(
        "",
        help="Root filesystem to restore into (criu --root) with restore_into='agent'. "
        "Empty: the agent's own root. With restore_into='placeholder' the placeholder "
        "container's root (/proc/<pid>/root) is used instead.",
    ).tag(config=True)

    default_timeout = Integer(
        120,
        help="Checkpoint timeout in seconds when a request gives none (passed to the kubelet; "
        "the CRI default is 120).",
    ).tag(config=True)

    pvc_paths = List(
        Unicode(),
        help="Folders (mounted checkpoint PVCs) a checkpoint request may use as target.path with "
        "target.kind 'pvc', e.g. ['/snapshots']. Empty (the default): checkpoints to a PVC are "
        "refused, so that no caller can have the agent, root on the node, write into any "
        "folder it names.",
    ).tag(config=True)

    kept_archive_max_age = Float(
        86400.0,
        help="Seconds a kubelet archive kept on the node after a push that failed on the "
        "registry's or PVC's side (5xx) may stay there when no later checkpoint of its "
        "container ships (a shipped checkpoint deletes it at once). Older ones are deleted "
        "when the agent starts and while it runs: they hold a server's memory in the "
        "kubelet's folder, which nothing else cleans. 0: keep them until a checkpoint of "
        "their container ships.",
    ).tag(config=True)

    @validate("kept_archive_max_age")
    def _check_kept_age(self, proposal):
        if proposal["value"] < 0:
            raise TraitError(
                f"AgentApp.kept_archive_max_age must be 0 or more seconds (0: no age limit), "
                f"not {proposal['value']}"
            )
        return proposal["value"]

    cpu_sample_seconds = Float(
        1.0,
        help="When a pod is read for the first time, seconds between the two cpu.stat readings "
        "that give its CPU percent.",
    ).tag(config=True)

    extra_settings = Dict(help="Extra tornado Application settings.").tag(config=True)

    api = Instance(KubeAPI)
    kubelet = Instance(KubeletClient)
    shipper = Instance(Shipper)
    mapper = Instance(PodMapper)
    cuda = Instance(CudaCheckpoint)

    @default("api")
    def _api(self):
        return KubeAPI(parent=self)

    @default("kubelet")
    def _kubelet(self):
        return KubeletClient(self.api, parent=self)

    @default("shipper")
    def _shipper(self):
        return Shipper(parent=self)

    @default("mapper")
    def _mapper(self):
        return PodMapper(parent=self)

    @default("cuda")
    def _cuda(self):
        return CudaCheckpoint(parent=self, nvml=self.nvml)

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.nvml = Nvml()
        self.cpu = CpuMeter()
        self._gpu_since: dict[str, int] = {}
        self._busy: dict[str, str] = {}
        # token hash -> (username, or the refusal to repeat, and when it expires)
        self._reviews: dict[str, tuple[str | AgentError, float]] = {}
        self._review_budget: tuple[float, float] | None = None  # (reviews left, at when)
        self._criu: str | None = None
        self._restored: list = []
        self._sweeper: asyncio.Task | None = None
        self.server: HTTPServer | None = None
        #: the node's checkpoints: the kubelet dumps, a registry or PVC keeps (its crash
        #: recovery included)
        self.backend = NodeBackend(self)

    # -- start-up -----------------------------------------------------------------------

    def initialize(self, argv=None) -> None:
        """Parse the command line, then load config_file; the command line wins over the file."""
        self.parse_command_line(argv)
        if self.config_file:
            self.load_config_file(self.config_file)
            self.update_config(self.cli_config)

    def make_app(self) -> web.Application:
        handlers = [
            (r"/healthz", HealthHandler),
            (r"/v1/signals", SignalsHandler),
            (r"/v1/checkpoint", CheckpointHandler),
            (r"/v1/restore", RestoreHandler),
            (r"/v1/park", ParkHandler),
            (r"/v1/unpark", UnparkHandler),
            (r"/v1/gpus", GpusHandler),
            (r"/v1/doctor", DoctorHandler),
        ]
        return web.Application(
            handlers, agent=self, log_function=self._log_request, **self.extra_settings
        )

    def _log_request(self, handler: web.RequestHandler) -> None:
        status = handler.get_status()
        level = (
            self.log.info
            if status < 400 or handler.request.path == "/healthz"
            else self.log.warning
        )
        if handler.request.path == "/healthz" and status < 400:
            level = self.log.debug
        level(
            "%d %s %s %.1fms",
            status,
            handler.request.method,
            handler.request.uri,
            1000 * handler.request.request_time(),
        )

    async def start_http(self) -> HTTPServer:
        """Listen on ip:port; returns the server (tests use port 0 and read the bound port)."""
        if self.auth == "token" and not self.shared_secret():
            raise AgentError(
                "no api_token configured", "set AgentApp.api_token_file to a mounted Secret", 500
            )
        if self.auth == "tokenreview" and not self.allowed_users:
            raise AgentError(
                "auth = 'tokenreview' with no allowed_users",
                "list the hub's and the service's ServiceAccount usernames in allowed_users",
                500,
            )
        self._criu = await criu_tools.criu_version(self.criu_path)
        await self.resume_interrupted()
        self.sweep_kept()
        self._sweeper = asyncio.ensure_future(self._sweep_kept_periodically())
        self.server = HTTPServer(self.make_app())
        self.server.listen(self.port, self.ip)
        if self.port == 0:
            self.port = next(iter(self.server._sockets.values())).getsockname()[1]
        self.log.info(
            "gpusnap agent on node %s listening on %s:%d (criu %s, driver %s)",
            self.node_name or "?",
            self.ip,
            self.port,
            self._criu,
            self.nvml.driver_version(),
        )
        return self.server

    @property
    def in_progress_dir(self) -> Path:
        """Records of checkpoints under way (on the restore_dir hostPath: they outlive the agent)."""
        return Path(self.restore_dir) / ".in-progress"

    async def resume_interrupted(self) -> list[int]:
        """After a crash: give back the GPU memory of pods whose checkpoint the agent was
        taking when it died (their servers run on, so their GPU work must not stay frozen);
        delete the half-shipped archives. The base's crash recovery does it, over the
        backend's hooks (:mod:`.node_backend`). Returns the pids resumed."""
        self.backend.resumed = []
        await self.backend.recover()
        return self.backend.resumed

    @property
    def kept_archives(self) -> KeptArchives:
        """Archives kept on the node after a failed push (markers on the restore_dir hostPath)."""
        return KeptArchives(Path(self.restore_dir) / ".kept-archives", self.log)

    def sweep_kept(self) -> list[Path]:
        """Delete archives kept longer than kept_archive_max_age."""
        return self.kept_archives.sweep(self.kept_archive_max_age)

    async def _sweep_kept_periodically(self) -> None:
        # a quarter of the age limit between sweeps (at most an hour): an archive goes at
        # most 25% past its limit
        while True:
            await asyncio.sleep(min(3600.0, max(0.1, self.kept_archive_max_age / 4 or 3600.0)))
            try:
                self.sweep_kept()
            except Exception:
                self.log.exception("sweeping kept checkpoint archives failed; trying again later")

    async def stop_http(self) -> None:
        self._restored = [r for r in self._restored if r.reap() is None]
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        if self.server:
            self.server.stop()
            await self.server.close_all_connections()

    def start(self) -> None:
        async def run():
            await self.start_http()
            await asyncio.Event().wait()

        asyncio.run(run())

    # -- auth ---------------------------------------------------------------------------

    def shared_secret(self) -> str:
        if self.api_token_file:
            return Path(self.api_token_file).read_text().strip()
        return self.api_token

    async def authenticate(self, token: str) -> str:
        """Return who ``token`` is, or raise a 401/403 AgentError."""
        if not token:
            raise AgentError("no bearer token", "send 'Authorization: Bearer <token>'", 401)
        if self.auth == "token":
            if hmac.compare_digest(token.encode(), self.shared_secret().encode()):
                return "token"
            raise AgentError("wrong token", "use the agent's shared secret (api_token_file)", 401)
        key = hashlib.sha256(token.encode()).hexdigest()
        now = time.monotonic()
        cached = self._reviews.get(key)
        if cached and cached[1] > now:
            if isinstance(cached[0], AgentError):
                raise cached[0]
            return cached[0]
        self._spend_review(now)
        status = await self.api.token_review(token)
        refusal = None
        user = (status.get("user") or {}).get("username", "")
        if not status.get("authenticated"):
            refusal = AgentError(
                f"the API server did not authenticate the token: {status.get('error', '')}",
                "send a valid ServiceAccount token",
                401,
            )
        elif user not in self.allowed_users:
            refusal = AgentError(
                f"{user} may not call the gpusnap agent", "add it to AgentApp.allowed_users", 403
            )
        now = time.monotonic()
        if len(self._reviews) > 1000:
            self._reviews = {k: v for k, v in self._reviews.items() if v[1] > now}
        if refusal is not None:
            if self.tokenreview_refusal_cache_seconds > 0:
                self._reviews[key] = (refusal, now + self.tokenreview_refusal_cache_seconds)
            raise refusal
        self._reviews[key] = (user, now + self.tokenreview_cache_seconds)
        return user

    def _spend_review(self, now: float) -> None:
        """Take one TokenReview from the budget (tokenreview_max_per_second, bursts of
        twice that), or refuse the request with 429."""
        rate = self.tokenreview_max_per_second
        if rate <= 0:
            return
        burst = max(1.0, 2 * rate)
        left, at = self._review_budget or (burst, now)
        left = min(burst, left + (now - at) * rate)
        if left < 1:
            self._review_budget = (left, now)
            raise AgentError(
                f"too many requests with tokens the agent has not seen: TokenReviews are "
                f"limited to {rate:g} per second",
                "retry in a second; if it persists, look in the agent's log for who calls it "
                "with bad tokens (or raise AgentApp.tokenreview_max_per_second)",
                429,
            )
        self._review_budget = (left - 1, now)

    # -- the work -----------------------------------------------------------------------

    async def node_pods(self) -> dict[str, dict]:
        """Pods scheduled on this node, by ``namespace/name``. One try: the readers
        (signals, GPU memory, doctor) are called periodically, their next call is the retry."""
        pods = await self.api.list_pods(
            field_selector=f"spec.nodeName={self.node_name}", retry=False
        )
        return {f"{p['metadata']['namespace']}/{p['metadata']['name']}": p for p in pods}

    async def signals(self, keys: list[str]) -> dict:
        pods = await self.node_pods()
        procs = await asyncio.to_thread(self.mapper.scan)
        gpu_ok = await asyncio.to_thread(self.nvml.open)
        out: dict[str, dict] = {}
        first: list[tuple[str, str]] = []
        for key in keys:
            entry = {
                "cpu_percent": None,
                "gpu_percent": None,
                "gpu_memory_bytes": None,
                "gpu_count": None,
            }
            out[key] = entry
            pod = pods.get(key)
            if pod is None:
                entry["error"] = f"pod {key} is not on node {self.node_name}"
                continue
            uid = pod["metadata"]["uid"]
            found = procs.get(uid)
            if found is None:
                entry["error"] = f"no processes of pod {key} on this node"
                continue
            try:
                usage = self.mapper.cpu_usage_usec(found.cgroup)
                entry["cpu_percent"] = self.cpu.update(uid, usage)
                if entry["cpu_percent"] is None:
                    first.append((key, uid))
            except (OSError, ValueError) as e:
                entry["error"] = f"cpu.stat of pod {key}: {e}"
            if gpu_ok:
                entry.update(await asyncio.to_thread(self._gpu_of, uid, found.pids))
        if first:
            await asyncio.sleep(self.cpu_sample_seconds)
            for key, uid in first:
                try:
                    usage = self.mapper.cpu_usage_usec(procs[uid].cgroup)
                except (OSError, ValueError) as e:  # the pod went away meanwhile
                    out[key]["error"] = f"cpu.stat of pod {key}: {e}"
                    continue
                out[key]["cpu_percent"] = self.cpu.update(uid, usage)
        self.cpu.forget({p["metadata"]["uid"] for p in pods.values()})
        return {"pods": out}

    def _gpu_of(self, uid: str, pids: list[int]) -> dict:
        memory = self.nvml.process_memory(pids)
        since = self._gpu_since.get(uid, 0)
        percent = None
        newest = since
        for index in memory:
            p, ts = self.nvml.process_utilization(index, pids, since)
            newest = max(newest, ts)
            if p is not None:
                percent = max(percent or 0, p)
        self._gpu_since[uid] = newest
        if memory and percent is None:
            percent = 0.0
        return {
            "gpu_percent": float(percent) if percent is not None else (0.0 if memory else None),
            "gpu_memory_bytes": sum(sum(d.values()) for d in memory.values()),
            "gpu_count": len(memory),
        }

    async def gpus(self) -> dict:
        """This node's GPUs: free and total memory, and the bytes each pod holds on each.

        What make-room reads on Kubernetes (the service has no GPU): one pod list, one
        /proc scan and one pass over the devices, however many pods run here.
        ``checkpoint_api`` says whether pods here can be parked at all.
        """
        if not await asyncio.to_thread(self.nvml.open):
            reason = self.nvml.reason or "NVML unavailable"
            return {"node": self.node_name, "gpus": [], "reason": reason}
        pods = await self.node_pods()
        procs = await asyncio.to_thread(self.mapper.scan)
        owners = {
            key: procs[pod["metadata"]["uid"]].pids
            for key, pod in pods.items()
            if pod["metadata"]["uid"] in procs
        }
        views = await asyncio.to_thread(read_devices, self.nvml, owners, self.node_name)
        out: dict = {"node": self.node_name, "gpus": [agent_payload(v) for v in views]}
        out["checkpoint_api"] = await asyncio.to_thread(self.cuda.available)
        if not out["checkpoint_api"]:
            out["checkpoint_api_reason"] = self.cuda.reason
        return out

    async def pod_on_node(self, namespace: str, name: str) -> dict:
        pod = await self.api.get_pod(namespace, name)
        node = (pod.get("spec") or {}).get("nodeName", "")
        if node != self.node_name:
            raise AgentError(
                f"pod {namespace}/{name} runs on node {node or '(none)'}, not {self.node_name}",
                f"call the agent on node {node}",
                409,
            )
        return pod

    async def container_pids(self, pod: dict, container: str) -> list[int]:
        """Host PIDs of one container of ``pod`` (all the pod's when the ID is not known)."""
        procs = (await asyncio.to_thread(self.mapper.scan)).get(pod["metadata"]["uid"])
        if procs is None:
            return []
        for status in (pod.get("status") or {}).get("containerStatuses") or []:
            if status.get("name") == container and status.get("containerID"):
                return procs.containers.get(container_id(status["containerID"]), procs.pids)
        return procs.pids

    def rbac_needs(self) -> list[Need]:
        """The cluster-wide RBAC rules this agent uses with its configuration."""
        return agent_rbac_needs(
            self.auth,
            self.kubelet.kubelet_route,
            bool(self.kubelet.kubelet_host and self.kubelet.kubelet_port),
        )

    def claim(self, key: str, what: str) -> None:
        if key in self._busy:
            raise AgentError(
                f"{key} is busy: {self._busy[key]} in progress", "retry when it has finished", 409
            )
        self._busy[key] = what

    async def checkpoint(self, body: dict) -> dict:
        """Checkpoint a pod's container through :class:`~.node_backend.NodeBackend` into
        the store ``body["target"]`` names; the reply the service records."""
        ns, name = need(body, "namespace"), need(body, "pod")
        container = need(body, "container")
        try:
            timeout = int(body.get("timeout") or self.default_timeout)
        except (TypeError, ValueError) as e:
            raise AgentError(
                "timeout must be a whole number of seconds", "send e.g. 120", 400
            ) from e
        # refused before anything is frozen
        store = self.shipper.for_target(body.get("target") or {}, self.pvc_paths)
        key = f"{ns}/{name}"
        self.claim(key, "checkpoint")
        try:
            pod = await self.pod_on_node(ns, name)
            info = await self.backend.checkpoint(
                pod_server(pod), pod=pod, container=container, timeout=timeout, store=store
            )
        finally:
            self._busy.pop(key, None)
        return {
            "id": info.id,
            "digest": info.extra["digest"],
            "image_bytes": info.image_bytes,
            "gpu_bytes": info.gpu_bytes,
            "gpu": info.extra["gpu"],
            "status": info.status,
            "node": info.extra["node"],
        }

    async def restore(self, body: dict) -> dict:
        """Restore checkpoint ``body["image"]`` into pod ``namespace/pod`` through
        :meth:`NodeBackend.restore() <.node_backend.NodeBackend.restore>`; optional body
        field ``container`` names the placeholder's container (default: the pod's only one)."""
        ns, name = need(body, "namespace"), need(body, "pod")
        image = need(body, "image")
        container = body.get("container") or ""
        if not isinstance(container, str):
            raise AgentError("container must be a string", "send the container's name", 400)
        key = f"{ns}/{name}"
        self.claim(key, "restore")
        try:
            restored = await self.backend.restore(
                # the agent knows the pod, not its server: namespace/pod as the key
                CheckpointInfo(id=image, user=ns, server_name=name, created=0.0, status="verified"),
                timeout=self.restore_timeout,
                into=RestoreTarget(ns, name, container),
            )
        finally:
            self._busy.pop(key, None)
        return {"restored": True, "pid": restored.pid, **restored.detail}

    async def park(self, body: dict, resume: bool) -> dict:
        """Park (or unpark) a pod's GPU memory with the same code the service uses on one
        machine (:mod:`jupyterhub_gpusnap.gpu.park`): host-memory headroom checked first, only
        processes holding GPU memory locked, 409 when the GPU is busy or RAM is short."""
        ns, name = need(body, "namespace"), need(body, "pod")
        if not await asyncio.to_thread(self.cuda.available):
            raise AgentError(
                f"no CUDA checkpoint API on node {self.node_name}: {self.cuda.reason}",
                "park works on GPU nodes with NVIDIA driver >= 570",
                409,
            )
        pod = await self.pod_on_node(ns, name)
        procs = (await asyncio.to_thread(self.mapper.scan)).get(pod["metadata"]["uid"])
        pids = procs.pids if procs else []
        settings = Parking(parent=self, cuda=self.cuda)
        try:
            if resume:
                result = await unpark_pids(pids, self.cuda)
            else:
                result = await park_pids(
                    pids, self.cuda, settings.lock_timeout_ms, settings.host_memory_margin
                )
        except CheckpointRefused as e:
            raise AgentError(
                f"{ns}/{name}: {e}",
                "nothing changed; try again later (a cell is running on the GPU, or host RAM "
                "is short: see Parking.host_memory_margin)",
                409,
            ) from e
        except CheckpointError as e:
            raise AgentError(f"{ns}/{name}: {e}", "see the agent's log", 500) from e
        return {
            "pids": result.pids,
            "bytes": result.bytes_moved,
            "seconds": round(result.seconds, 3),
        }

    async def doctor(self) -> dict:
        checks = []

        def check(name: str, ok: bool, detail: str, fix: str = "") -> None:
            checks.append(
                {"name": name, "ok": bool(ok), "detail": detail, "fix": "" if ok else fix}
            )

        version = await criu_tools.criu_version(self.criu_path)
        major_ok = bool(version) and tuple(int(x) for x in re.findall(r"\d+", version)[:2]) >= (
            4,
            2,
        )
        check(
            "criu",
            major_ok,
            f"criu {version}" if version else f"{self.criu_path} not found",
            "install CRIU >= 4.2 in the agent image (older releases fail on kernels >= 6.13)",
        )
        cg = Path(self.mapper.cgroup_root) / "cgroup.controllers"
        check(
            "cgroup-v2",
            cg.exists(),
            f"{cg} {'found' if cg.exists() else 'missing'}",
            "mount the host's /sys/fs/cgroup (cgroup v2) at PodMapper.cgroup_root",
        )
        procs = await asyncio.to_thread(self.mapper.scan)
        check(
            "host-pids",
            bool(procs),
            f"{len(procs)} pods with processes visible",
            "run the agent with hostPID: true and /proc at PodMapper.proc_root",
        )
        ckdir = Path(self.checkpoint_dir)
        check(
            "checkpoint-dir",
            ckdir.is_dir() and os.access(ckdir, os.W_OK),
            str(ckdir),
            "mount the host's /var/lib/kubelet/checkpoints read-write at checkpoint_dir",
        )
        driver = await asyncio.to_thread(self.nvml.driver_version)
        check(
            "nvidia-driver",
            bool(driver),
            driver or (self.nvml.reason or "NVML unavailable"),
            "install the NVIDIA driver on GPU nodes and expose it to the agent (runtimeClass nvidia)",
        )
        cuda = await asyncio.to_thread(self.cuda.available)
        check(
            "cuda-checkpoint-api",
            cuda,
            "available" if cuda else self.cuda.reason,
            "NVIDIA driver >= 570 provides cuCheckpointProcess*",
        )
        try:
            # what the agent itself does (list pods on its node), not a read it is not granted
            pods = await self.node_pods()
            check("api-server", True, f"{len(pods)} pods on node {self.node_name} readable")
        except AgentError as e:
            check("api-server", False, e.message, e.fix)
        for rule in self.rbac_needs():
            try:
                status = await self.api.access_review(rule.review())
                allowed = bool(status.get("allowed"))
                detail = rule.why if allowed else f"not allowed: {rule.why}"
            except AgentError as e:
                allowed, detail = False, f"review failed: {e.message}"
            check(
                f"rbac: {rule.name}",
                allowed,
                detail,
                f"add verbs [{rule.verb}] on {rule.name.split(' ', 1)[1]} to the agent's "
                "ClusterRole (helm-values/agent/rbac.yaml)",
            )
        return {"checks": checks}


def pod_server(pod: dict) -> Server:
    """The Hub server a pod runs, from KubeSpawner's annotations; ``namespace/pod`` as
    the server's key for a pod without them."""
    meta = pod["metadata"]
    annotations = meta.get("annotations") or {}
    user = annotations.get("hub.jupyter.org/username")
    if user:
        return Server(user=user, name=annotations.get("hub.jupyter.org/servername", ""))
    return Server(user=meta["namespace"], name=meta["name"])


def main(argv: list[str] | None = None) -> None:
    """Console entry point: ``jupyterhub-gpusnap-agent --node=$NODE_NAME``."""
    app = AgentApp.instance()
    app.initialize(argv)
    app.start()


if __name__ == "__main__":
    main()
