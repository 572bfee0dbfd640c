"""The service's log with the documented config (no log level set): one timestamped INFO line per
state change and action, naming the server, and nothing per tick (docs/operations.md, "Logs")."""

from __future__ import annotations

import asyncio
import os
import re
import sys

import pytest

from tests.helpers.gpusnap_service import GpuSnapService

pytestmark = pytest.mark.e2e

SETTINGS = """
c.GpuSnap.interval = 1
c.GpuSnap.idle_window = 6
c.GpuSnap.warn_before = 3
c.GpuSnap.min_running = 0
c.GpuSnap.action = "stop"
"""

# [I 2026-11-25 13:20:21.888 GpuSnap watcher:278] alice/: active -> idle (...)
LINE = re.compile(
    r"^\[([DIWEC]) (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3}) GpuSnap [\w.]+:\d+\] (.*)$"
)


class ServiceAtDefaultLevel(GpuSnapService):
    """The service started as an admin starts it: the config file, no --debug, no --log-level."""

    async def start(self, hub) -> None:
        self.hub = hub
        cfg = self.root / "gpusnap_config.py"
        cfg.write_text(
            "c = get_config()  # noqa\n"
            f"c.GpuSnap.db_url = 'sqlite:///{self.root / 'gpusnap.sqlite'}'\n"
            f"c.GpuSnap.proxy_url = {hub.url.rstrip('/')!r}\n" + self.settings
        )
        env = dict(
            os.environ,
            JUPYTERHUB_API_TOKEN=self.token,
            JUPYTERHUB_API_URL=hub.api_url,
            JUPYTERHUB_SERVICE_URL=f"http://127.0.0.1:{self.port}",
            JUPYTERHUB_SERVICE_PREFIX="/services/gpusnap/",
            PYTHONUNBUFFERED="1",
        )
        with open(self.log_file, "ab") as log:
            self.proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "jupyterhub_gpusnap.app",
                "--config",
                str(cfg),
                cwd=self.root,
                env=env,
                stdout=log,
                stderr=log,
                start_new_session=True,
            )

        async def answers():
            assert self.proc.returncode is None, self.log_text()
            try:
                status, _ = await self.api("GET", "api/info")
            except OSError:
                return False
            return status in (200, 403)

        await self.wait_for(answers, timeout=30, what="the service to answer")


async def test_default_log_has_one_timestamped_line_per_state_change_and_action(
    hub_factory, tmp_path
):
    service = ServiceAtDefaultLevel(tmp_path / "gpusnap", SETTINGS)
    hub = await hub_factory(service.hub_config())
    await hub.start_server("alice")
    await service.start(hub)
    try:

        async def stopped():
            return await hub.get_server("alice") is None

        await service.wait_for(stopped, timeout=90, what="alice's idle server to be stopped")
        # a few more ticks with nothing to decide
        await asyncio.sleep(3)
        code, events = await service.api("GET", "api/events?server=alice/")
        assert code == 200
    finally:
        await service.stop()

    lines = service.log_text().splitlines()
    parsed = [LINE.match(line) for line in lines]
    # every line of the service's own logger starts with its level and time
    assert all(parsed), [line for line, m in zip(lines, parsed, strict=True) if not m]
    assert not [m[3] for m in parsed if m[1] == "D"], "DEBUG lines at the default level"
    info = [m[3] for m in parsed if m[1] == "I"]
    assert any(t.startswith("jupyterhub-gpusnap ") and "listening on" in t for t in info), info

    alice = [text for text in info if text.startswith("alice/")]
    recorded = sorted(events["events"], key=lambda e: e["id"])
    kinds = [e["kind"] for e in recorded]
    assert "stop" in kinds and "warn" in kinds, kinds
    # each state change the service recorded has its line, in the same order
    changes = [(e["detail"]["from"], e["detail"]["to"]) for e in recorded if e["kind"] == "state"]
    logged = [(m[1], m[2]) for m in (re.match(r"alice/: (\w+) -> (\w+) \(", t) for t in alice) if m]
    assert logged == changes, alice
    assert ("active", "warned") in changes or ("idle", "warned") in changes, changes
    # the warning's line says when the suspension comes; the stop has its own line
    assert "suspends at" in next(t for t in alice if "-> warned" in t)
    assert len([t for t in alice if t.startswith("alice/: stopped")]) == 1, alice
    # one line per change and action, nothing else about alice: ticks that decide nothing log
    # nothing at INFO (several ran after the stop, and between the changes)
    assert len(alice) == len(changes) + 1, alice
