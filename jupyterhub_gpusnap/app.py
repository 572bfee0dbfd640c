"""The jupyterhub-gpusnap service: a traitlets Application running one tick every `interval` seconds.

Run it as a JupyterHub service (managed: the Hub starts it with ``command``; or external:
set JUPYTERHUB_API_TOKEN, JUPYTERHUB_API_URL and JUPYTERHUB_SERVICE_URL yourself).
``jupyterhub-gpusnap --generate-config`` writes every setting with its help text.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from urllib.parse import urlparse

from sqlalchemy.exc import ArgumentError, SQLAlchemyError
from tornado import web
from tornado.httpserver import HTTPServer
from traitlets import Bool, Dict, Enum, Float, List, TraitError, Type, Unicode, default, validate
from traitlets.config import Application

from . import __version__
from .checkpoint.base import CheckpointBackend
from .handlers.base import MAX_BODY_SIZE
from .hub import HubClient
from .hubconfig import CUSTOM_SCOPES, REQUIRED_SCOPES  # noqa: F401  (re-exported)
from .policy import Policy, Rule
from .service import Service
from .signals.base import SignalSource
from .store import Store
from .watcher import Watcher

#: the event kinds the admin digest counts as failures (a suspension cut short by a restart too)
FAILURE_EVENTS = ("suspend_failed", "restore_failed", "suspend_interrupted")


def gpu_hours_freed(events: list[dict], since: float, now: float) -> float:
    """GPU-hours that suspended servers gave back between ``since`` and ``now``.

    Each suspension counts from its ``suspend`` event until the server's next ``restore``
    or ``restore_failed`` event (or ``now``), times the GPUs its checkpoint recorded, cut
    to the window: a server suspended for three days adds at most 24 h per GPU to a
    daily digest.
    """
    held: dict[str, tuple[float, int]] = {}
    total = 0.0

    def add(start: float, end: float, gpus: int) -> float:
        return max(0.0, min(end, now) - max(start, since)) * gpus

    for e in sorted(events, key=lambda e: (e["time"], e.get("id", 0))):
        if e["kind"] == "suspend":
            held[e["key"]] = (e["time"], int((e.get("detail") or {}).get("gpu_count") or 0))
        elif e["kind"] in ("restore", "restore_failed") and e["key"] in held:
            start, gpus = held.pop(e["key"])
            total += add(start, e["time"], gpus)
    total += sum(add(start, now, gpus) for start, gpus in held.values())
    return total / 3600


class GpuSnap(Application):
    """Finds truly idle notebook servers and suspends them to disk instead of killing them."""

    name = "jupyterhub-gpusnap"
    version = __version__
    description = __doc__

    aliases = {
        "config": "GpuSnap.config_file",
        "interval": "GpuSnap.interval",
        "idle-window": "GpuSnap.idle_window",
        "db-url": "GpuSnap.db_url",
        "log-level": "Application.log_level",
    }
    flags = {
        "generate-config": (
            {"GpuSnap": {"generate_config": True}},
            "Print a config file with every setting and exit.",
        ),
        "debug": ({"Application": {"log_level": 10}}, "Log debug messages."),
    }

    @property
    def classes(self):
        """Classes whose settings --generate-config prints."""
        from .checkpoint.local import LocalBackend
        from .notify import Mailer, Notifier
        from .signals.jupyter import JupyterSignal
        from .signals.local import LocalProcessSignal
        from .signals.nvml import NvmlSignal
        from .signals.prometheus import PrometheusSignal

        return [
            GpuSnap,
            Watcher,
            HubClient,
            LocalBackend,
            JupyterSignal,
            LocalProcessSignal,
            NvmlSignal,
            PrometheusSignal,
            Mailer,
            Notifier,
        ]

    # Decisions (state changes, warnings, suspensions, restores) are logged at INFO, routine polling
    # at DEBUG, so the default level shows what the service does and nothing it merely looks at.
    # The format is JupyterHub's, so a managed service's lines read alike in the Hub's log.
    log_level = Enum(
        (0, 10, 20, 30, 40, 50, "DEBUG", "INFO", "WARN", "ERROR", "CRITICAL"),
        default_value=logging.INFO,
        help="Log level by value or name. INFO (the default) logs one line per state change and "
        "action, naming the server; DEBUG also logs each tick's readings.",
    ).tag(config=True)
    log_format = Unicode(
        "[%(levelname)1.1s %(asctime)s.%(msecs).03d %(name)s %(module)s:%(lineno)d] %(message)s",
        help="The log line's format (Python logging); the default starts with the level and the time.",
    ).tag(config=True)

    config_file = Unicode(
        "gpusnap_config.py",
        help="The config file to load (Python, traitlets style: c.GpuSnap.interval = 60).",
    ).tag(config=True)
    generate_config = Bool(
        False, help="Print a config file with every setting and its help, then exit."
    ).tag(config=True)

    interval = Float(
        60,
        help="Seconds between two ticks. Each tick lists running servers, reads their signals and applies the policy.",
    ).tag(config=True)

    @validate("interval")
    def _check_interval(self, proposal):
        # 0 or less would tick in a busy loop, hammering the Hub API
        if proposal.value <= 0:
            raise ValueError(
                f"GpuSnap.interval must be a number of seconds > 0, e.g. 60; got {proposal.value!r}"
            )
        return proposal.value

    db_url = Unicode(
        "sqlite:///gpusnap.sqlite",
        help="SQLAlchemy URL of the service's database (server states, events, sent emails). "
        "SQLite by default; e.g. postgresql://gpusnap@db/gpusnap for a hub with a database server.",
    ).tag(config=True)

    proxy_url = Unicode(
        help="The URL of the proxy as the service reaches it, e.g. http://127.0.0.1:8000 or "
        "http://proxy-public: where JupyterPollSignal polls servers, and the default of public_url "
        "(links in emails). Default: JUPYTERHUB_PUBLIC_HUB_URL's scheme and host, else the Hub "
        "API URL's host on port 8000.",
    ).tag(config=True)

    @default("proxy_url")
    def _proxy_url(self):
        if os.environ.get("JUPYTERHUB_PUBLIC_HUB_URL"):
            u = urlparse(os.environ["JUPYTERHUB_PUBLIC_HUB_URL"])
            return f"{u.scheme}://{u.netloc}"
        api = urlparse(os.environ.get("JUPYTERHUB_API_URL", "http://127.0.0.1:8081/hub/api"))
        return f"{api.scheme}://{api.hostname}:8000"

    public_url = Unicode(
        help="The public URL of the hub as users see it (for links in emails), e.g. https://hub.example.org. "
        "Default: proxy_url.",
    ).tag(config=True)

    @default("public_url")
    def _public_url(self):
        return self.proxy_url

    bind_url = Unicode(
        help="Where the service's web app listens. Default: JUPYTERHUB_SERVICE_URL (set by the Hub), else http://127.0.0.1:10101.",
    ).tag(config=True)

    @default("bind_url")
    def _bind_url(self):
        return os.environ.get("JUPYTERHUB_SERVICE_URL", "http://127.0.0.1:10101")

    service_prefix = Unicode(
        help="URL prefix of the service's pages and API. Default: JUPYTERHUB_SERVICE_PREFIX, else /services/gpusnap/.",
    ).tag(config=True)

    @default("service_prefix")
    def _service_prefix(self):
        return os.environ.get("JUPYTERHUB_SERVICE_PREFIX", "/services/gpusnap/")

    # ---------------------------------------------------------------- the policy
    idle_window = Float(
        3600,
        help="Seconds a server must be idle by every signal (kernels, terminals, CPU, GPU) before it is suspended. "
        "This is the default rule's value; `rules` can set other values per user, group or profile.",
    ).tag(config=True)
    park_window = Float(
        None,
        allow_none=True,
        help="Seconds of idleness after which a server's GPU memory is moved to host RAM while it keeps running "
        "(park). Must be shorter than idle_window. None (default) disables parking.",
    ).tag(config=True)
    warn_before = Float(
        900,
        help="Seconds before the suspension when the user is warned (email, Lab panel). 0 disables the warning.",
    ).tag(config=True)
    min_running = Float(
        600, help="Never act on a server that has been running for less than this many seconds."
    ).tag(config=True)
    cpu_threshold = Float(
        10.0,
        help="CPU use (percent of one core, whole process tree) above which the server counts as working, "
        "even when its GPU is idle.",
    ).tag(config=True)
    gpu_threshold = Float(
        5.0,
        help="GPU SM utilisation (percent) above which the server counts as working. Memory held does not count.",
    ).tag(config=True)
    interaction_window = Float(
        None,
        allow_none=True,
        help="Seconds after the user's last key, click or scroll in a visible JupyterLab tab during which "
        "their server is not suspended, even when its kernels, CPU and GPU are quiet: someone reading or "
        "scrolling through results is using the server. The Lab extension reports this interaction "
        "(at most twice a minute, never from a hidden tab or an open tab nobody touches). "
        "None (default): the same as idle_window. Lower it (e.g. 900) to let readers hold a GPU for less "
        "time than a running kernel; 0 ignores interaction (only kernels, terminals, CPU and GPU count).",
    ).tag(config=True)
    max_keep_running = Float(
        8 * 3600,
        help="The longest a user may keep their server running past the idle policy (keep-running-until), in seconds.",
    ).tag(config=True)
    action = Unicode(
        "suspend",
        help="What happens to a server that stays idle: 'suspend' (checkpoint, then stop), "
        "'stop' (stop without a checkpoint, like jupyterhub-idle-culler) or 'none' (watch and report only).",
    ).tag(config=True)

    @validate("action")
    def _check_action(self, proposal):
        if proposal.value not in ("suspend", "stop", "none"):
            raise ValueError(
                f"GpuSnap.action must be 'suspend', 'stop' or 'none', got {proposal.value!r}"
            )
        return proposal.value

    rules = List(
        Dict(),
        help="""Rules matched in order by user, group or profile; the first match wins, the default rule
        (built from the settings above) applies to everyone else. Each rule is a dict, e.g.

            c.GpuSnap.rules = [
                {"name": "staff", "groups": ["staff"], "exempt": True},
                {"name": "students-gpu", "profiles": ["gpu"], "idle_window": 1800, "park_window": 300},
                {"name": "cpu-only", "profiles": ["cpu"], "action": "stop", "idle_window": 7200},
            ]

        Keys: name, users (globs), groups, profiles, exempt, action, idle_window, park_window,
        warn_before, min_running, cpu_threshold, gpu_threshold, max_keep_running, interaction_window.""",
    ).tag(config=True)

    # -------------------------------------------------------------- the parts
    backend_class = Type(
        "jupyterhub_gpusnap.checkpoint.local.LocalBackend",
        klass=CheckpointBackend,
        help="How servers are checkpointed: jupyterhub_gpusnap.checkpoint.local.LocalBackend (CRIU on this host, "
        "the default) or jupyterhub_gpusnap.checkpoint.kubernetes.KubernetesBackend (kubelet + node agent).",
    ).tag(config=True)

    signal_classes = List(
        Type(klass=SignalSource),
        help="Signal sources read for every server each tick. Default: Jupyter (kernels and terminals, as "
        "each server's gpusnap extension reports them), local CPU (psutil over the process tree) and GPU "
        "(NVML). On Kubernetes use the agent or Prometheus sources instead of the local ones. For servers "
        "whose image lacks the gpusnap server extension, list "
        "jupyterhub_gpusnap.signals.jupyter.JupyterPollSignal instead of JupyterSignal (it polls them "
        "through the proxy) and give the service's role access:servers (service_role(..., "
        "jupyter_poll=True)); docs/security.md says what that lets the service's token do.",
    ).tag(config=True)

    @default("signal_classes")
    def _signal_classes(self):
        from .signals.jupyter import JupyterSignal
        from .signals.local import LocalProcessSignal
        from .signals.nvml import NvmlSignal

        return [JupyterSignal, LocalProcessSignal, NvmlSignal]

    email = Bool(
        False,
        help="Send emails (warning, suspended, restore failed). Configure c.Mailer and c.Notifier.",
    ).tag(config=True)

    retention_interval = Float(
        3600,
        help="Seconds between two runs of the checkpoint retention (LocalBackend.keep_last, max_age_days). "
        "The checkpoint a suspended server needs for its restore is never deleted.",
    ).tag(config=True)

    tick_on_start = Bool(
        True, help="Run the first tick right after start-up rather than after one interval."
    ).tag(config=True)

    metrics_require_auth = Bool(
        True,
        help="Require a token with custom:gpusnap:read for /metrics. Turn off only where the service port "
        "is reachable by Prometheus alone (a network policy).",
    ).tag(config=True)

    # ---------------------------------------------------------------- wiring
    def default_rule(self) -> Rule:
        return Rule.from_dict(
            {
                "name": "default",
                "action": self.action,
                "idle_window": self.idle_window,
                "park_window": self.park_window,
                "warn_before": min(self.warn_before, max(self.idle_window - 1, 0)),
                "min_running": self.min_running,
                "cpu_threshold": self.cpu_threshold,
                "gpu_threshold": self.gpu_threshold,
                "max_keep_running": self.max_keep_running,
                "interaction_window": self.interaction_window,
            }
        )

    def build_policy(self) -> Policy:
        """The policy from the settings; a ValueError names the setting (GpuSnap.rules or GpuSnap.*) to fix."""
        try:
            rules = [
                Rule.from_dict(r, default_name=f"rules[{i}]") for i, r in enumerate(self.rules)
            ]
        except ValueError as e:
            raise ValueError(f"GpuSnap.rules: {e}") from None
        try:
            default_rule = self.default_rule()
        except ValueError as e:
            raise ValueError(f"GpuSnap settings (the default rule): {e}") from None
        try:
            return Policy(rules=rules, default=default_rule)
        except ValueError as e:
            raise ValueError(f"GpuSnap.rules: {e}") from None

    def _load_settings(self, argv) -> None:
        """Command line, then the config file; a config file named on the command line must exist."""
        super().initialize(argv)
        explicit = "config_file" in self.config.get("GpuSnap", {})
        if self.config_file and os.path.exists(self.config_file):
            self.load_config_file(self.config_file)
        elif explicit:
            raise ValueError(
                f"GpuSnap.config_file: {self.config_file} does not exist; pass the path of your gpusnap_config.py "
                "(jupyterhub-gpusnap --generate-config writes one)"
            )

    #: a config file that does not load is an error, not a silent fall-back to the defaults
    raise_config_file_errors = True

    def initialize(self, argv=None):
        self._last_retention = 0.0
        self._last_digest = None
        self._scrub_task = None  # the backend's scrub, run beside the ticks (it may take hours)
        # a bad value (e.g. GpuSnap.action = "kill") is one line naming the setting, not a traceback
        try:
            self._load_settings(argv)
        except (TraitError, ValueError) as e:
            self.log.critical("Invalid configuration: %s", e)
            self.exit(1)
        except Exception as e:  # a config file that does not run (syntax error, NameError, …)
            self.log.critical(
                "Cannot load the config file %s: %s: %s", self.config_file, type(e).__name__, e
            )
            self.exit(1)
        if self.generate_config:
            print(self.generate_config_file())
            self.exit(0)
        try:
            self.policy = self.build_policy()
        except ValueError as e:
            self.log.critical("Invalid configuration: %s", e)
            self.exit(1)
        self.hub = HubClient(
            parent=self,
            api_url=os.environ.get("JUPYTERHUB_API_URL", "http://127.0.0.1:8081/hub/api"),
            api_token=os.environ.get("JUPYTERHUB_API_TOKEN", ""),
        )
        if not self.hub.api_token:
            self.log.critical(
                "No Hub API token: JUPYTERHUB_API_TOKEN is unset. Run me as a JupyterHub service "
                "(c.JupyterHub.services with a command), or, as an external service, export "
                "JUPYTERHUB_API_TOKEN set to the service's api_token"
            )
            self.exit(1)
        try:
            self.store = Store(self.db_url)
        except (ArgumentError, ValueError, OSError, SQLAlchemyError) as e:
            self.log.critical(
                "Invalid configuration: GpuSnap.db_url = %r cannot be used: %s. Set it to a database the service "
                "can write, e.g. sqlite:////var/lib/gpusnap/gpusnap.sqlite (the folder must exist) or "
                "postgresql://gpusnap@db/gpusnap",
                self.db_url,
                e,
            )
            self.exit(1)
        self.sources = [cls(parent=self) for cls in self.signal_classes]
        for source in self.sources:
            # sources that talk to servers default to the service's own URL and token
            configured = self.config.get(type(source).__name__, {})
            if source.has_trait("proxy_url") and "proxy_url" not in configured:
                source.proxy_url = self.proxy_url
            if source.has_trait("api_token") and "api_token" not in configured:
                source.api_token = self.hub.api_token
        jupyter = self.jupyter_signal
        if jupyter is not None:  # what the servers last reported, until they report again
            for status in self.store.all():
                jupyter.carry_over(status.key, status.last_sample)
        self.backend = None
        if self.action == "suspend" or any(
            r.get("action", self.action) == "suspend" and not r.get("exempt") for r in self.rules
        ):
            try:
                self.backend = self.backend_class(parent=self)
            except (TraitError, ValueError) as e:
                self.log.critical("Invalid configuration: %s", e)
                self.exit(1)
        self.notifier = None
        if self.email:
            from .notify import ServiceNotifier

            self.notifier = ServiceNotifier(
                parent=self,
                sent_log=self.store,
                public_url=self.public_url,
                service_prefix=self.service_prefix,
                max_keep_running=self.max_keep_running,
                hub=self.hub,
                backend=self.backend,
            )
        self.watcher = Watcher(
            parent=self,
            hub=self.hub,
            store=self.store,
            policy=self.policy,
            sources=self.sources,
            backend=self.backend,
            notifier=self.notifier,
        )
        self.service = Service(self.watcher, self.store, self.policy, action=self.action)

    @property
    def jupyter_signal(self):
        """The JupyterSignal among the sources (servers' reports go there), or None."""
        from .signals.jupyter import JupyterSignal

        return next((s for s in getattr(self, "sources", []) if isinstance(s, JupyterSignal)), None)

    def make_web_app(self) -> web.Application:
        from .handlers import make_handlers

        prefix = (
            self.service_prefix if self.service_prefix.endswith("/") else self.service_prefix + "/"
        )
        return web.Application(
            make_handlers(prefix),
            gpusnap=self,
            cookie_secret=os.urandom(32),
            static_path=os.path.join(os.path.dirname(__file__), "static"),
            static_url_prefix=prefix + "static/",
            template_path=os.path.join(os.path.dirname(__file__), "templates", "pages"),
            xsrf_cookies=False,
        )

    async def tick(self) -> None:
        try:
            await self.watcher.tick()
        except Exception:
            self.log.exception("Tick failed")
        await self.housekeeping()

    async def housekeeping(self) -> None:
        """Retention of old checkpoints, the chunk store's scrub (a task of its own) and the
        admin's daily digest, when they are due."""
        now = time.time()
        if self.backend is not None and now - self._last_retention >= self.retention_interval:
            self._last_retention = now
            try:
                deleted = await self.backend.apply_retention()
                if deleted:
                    self.log.info(
                        "Retention deleted %d checkpoint(s): %s", len(deleted), ", ".join(deleted)
                    )
            except Exception as e:
                self.log.error("Checkpoint retention failed: %s", e)
            if self._scrub_task is None or self._scrub_task.done():
                self._scrub_task = asyncio.ensure_future(self._scrub())
        if self.notifier is not None:
            day = self.notifier.digest_day()
            if day is not None and day != self._last_digest:
                self._last_digest = day
                await self.notifier.send_digest(self.digest_context(now), day)

    async def _scrub(self) -> None:
        """The backend's scrub (replicas of shared chunks; a full pass when due); a failure is
        logged and the next housekeeping round tries again."""
        try:
            await self.backend.scrub()  # it logs its own summary
        except Exception as e:
            self.log.error("Checkpoint scrub failed: %s", e)

    def digest_context(self, now: float) -> dict:
        """The admin digest's numbers over the last 24 hours, from the event log."""
        since = now - 86400
        events = [e for e in self.store.events(None, limit=100000) if e["time"] >= since]
        count = lambda kind: sum(1 for e in events if e["kind"] == kind)  # noqa: E731
        return {
            "suspensions": count("suspend"),
            "restores": count("restore"),
            "failures": sum(count(kind) for kind in FAILURE_EVENTS),
            "gpu_hours": round(
                gpu_hours_freed(self.store.events(None, limit=100000), since, now), 1
            ),
            "failed_servers": [
                {"server": e["key"], "error": (e["detail"] or {}).get("error", "")}
                for e in events
                if e["kind"] in FAILURE_EVENTS
            ],
            "hub_url": self.public_url,
        }

    async def run(self) -> None:
        for source in self.sources:
            await source.setup()
        if self.backend is not None:
            await self.backend.setup()
        app = self.make_web_app()
        url = urlparse(self.bind_url)
        # a longer body is refused before it is read (handlers/base.py)
        server = HTTPServer(app, xheaders=True, max_body_size=MAX_BODY_SIZE)
        server.listen(url.port or 80, url.hostname or "127.0.0.1")
        self.log.info(
            "%s %s listening on %s, prefix %s, tick every %gs",
            self.name,
            __version__,
            self.bind_url,
            self.service_prefix,
            self.interval,
        )
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        if not self.tick_on_start:
            await asyncio.wait([asyncio.ensure_future(stop.wait())], timeout=self.interval)
        while not stop.is_set():
            await self.tick()
            try:
                await asyncio.wait_for(stop.wait(), self.interval)
            except asyncio.TimeoutError:
                pass
        self.log.info("Shutting down; waiting for suspensions under way")
        await self.watcher.wait_idle()
        if self._scrub_task is not None and not self._scrub_task.done():
            # a chunk being repaired is finished by its thread; a full pass cut short runs again
            # after the restart
            self._scrub_task.cancel()
            await asyncio.gather(self._scrub_task, return_exceptions=True)
        if self.notifier is not None:
            await self.notifier.drain()
        server.stop()
        for source in self.sources:
            await source.close()

    def start(self):
        asyncio.run(self.run())


#: ``jupyterhub-gpusnap NAME …``: the admin commands beside the service, as traitlets
#: subcommands (each an Application of its own, imported only when named).
SUBCOMMANDS = {
    "doctor": (
        "jupyterhub_gpusnap.doctor.DoctorApp",
        "Check a Kubernetes cluster's readiness for gpusnap and say what to fix.",
    ),
    "keys": (
        "jupyterhub_gpusnap.keys_cli.KeysApp",
        "Make encryption keys; show which keys the checkpoints use.",
    ),
    "unpack": (
        "jupyterhub_gpusnap.unpack_cli.UnpackApp",
        "Write a chunk-stored checkpoint out as CRIU image files (recovery by hand).",
    ),
}


class GpuSnapCommand(Application):
    """``jupyterhub-gpusnap``: the service (:class:`GpuSnap`), or one of its
    :data:`SUBCOMMANDS` when the first word names one. It reads the command line as the
    service does (same options, same help) but applies nothing: the service checks its
    settings itself, with its own error messages."""

    name = GpuSnap.name
    version = __version__
    description = GpuSnap.description
    aliases = GpuSnap.aliases
    flags = GpuSnap.flags
    subcommands = Dict(SUBCOMMANDS)

    @property
    def classes(self):
        """The service's classes, so that ``--help-all`` lists its settings."""
        return GpuSnap.classes.fget(self)


def main(argv=None):
    command = GpuSnapCommand()
    command.parse_command_line(argv)  # a subcommand: traitlets starts it as command.subapp
    if command.subapp is not None:
        return command.subapp.start()
    app = GpuSnap()
    app.initialize(argv)
    app.start()


if __name__ == "__main__":
    main()
