"""JupyterSignal against real ``jupyter server`` processes with real ipykernel kernels."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest
from jupyter_client import AsyncKernelClient

from jupyterhub_gpusnap.model import Server
from jupyterhub_gpusnap.signals.jupyter import (
    MAX_REPORT_ITEMS,
    JupyterPollSignal,
    JupyterSignal,
    Report,
    ReportError,
    parse_iso8601,
)
from tests.helpers.ports import free_port

TOKEN = "test-token-0123456789"
PREFIX = "/user/alice/"


@dataclass
class JupyterServer:
    port: int
    runtime_dir: Path
    process: subprocess.Popen

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def api(self, method: str, path: str, track: bool = False) -> object:
        """Call the server's REST API with its token (activity-neutral unless ``track``)."""
        query = "" if track else "?no_track_activity=1"
        request = urllib.request.Request(
            f"{self.url}{PREFIX}{path}{query}",
            method=method,
            headers={"Authorization": f"token {TOKEN}"},
            data=b"{}" if method == "POST" else None,
        )
        with urllib.request.urlopen(request, timeout=30) as response:
            body = response.read()
        return json.loads(body) if body else None


def start_server(root: Path, *extra: str) -> JupyterServer:
    root.mkdir()
    env = dict(
        os.environ,
        JUPYTER_RUNTIME_DIR=str(root / "runtime"),
        JUPYTER_CONFIG_DIR=str(root / "config"),
        JUPYTER_PLATFORM_DIRS="1",
        HOME=str(root),
    )
    port = free_port()
    with (root / "server.log").open("wb") as log:  # the child keeps its own copy
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "jupyter_server",
                "--no-browser",
                "--ip=127.0.0.1",
                f"--port={port}",
                "--port-retries=0",
                f"--ServerApp.token={TOKEN}",
                "--ServerApp.allow_root=True",
                f"--ServerApp.base_url={PREFIX}",
                f"--ServerApp.root_dir={root}",
                *extra,
            ],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=log,
        )
    server = JupyterServer(port, root / "runtime", process)
    deadline = time.monotonic() + 60
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"jupyter server exited: {(root / 'server.log').read_text()}")
        try:
            server.api("GET", "api/status")
            return server
        except (urllib.error.URLError, ConnectionError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def stop_server(server: JupyterServer) -> None:
    server.process.terminate()
    try:
        server.process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        server.process.kill()
        server.process.wait()


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """One server with terminals, one with terminals disabled, started side by side."""
    base = tmp_path_factory.mktemp("jupyter")
    started = []
    try:
        started.append(start_server(base / "with-terminals"))
        started.append(start_server(base / "no-terminals", "--ServerApp.terminals_enabled=False"))
        yield started
    finally:
        for server in started:
            stop_server(server)


@pytest.fixture
def jupyter(servers) -> JupyterServer:
    return servers[0]


@pytest.fixture
async def kernel(jupyter):
    """A fresh kernel on the server with a client connected, as a browser tab would be."""
    model = jupyter.api("POST", "api/kernels")
    client = AsyncKernelClient(
        connection_file=str(jupyter.runtime_dir / f"kernel-{model['id']}.json")
    )
    client.load_connection_file()
    client.start_channels(hb=False)  # a missed heartbeat on a loaded machine is no death
    try:
        await client.wait_for_ready(timeout=30)
        # The server learns the kernel's state from its own iopub subscription, which may
        # join after the kernel_info's "idle" went out (ZMQ's slow joiner, seen on a loaded
        # machine): ask again until the server's view is idle, as a browser tab's requests would.
        deadline = time.monotonic() + 30
        while jupyter.api("GET", f"api/kernels/{model['id']}")["execution_state"] != "idle":
            assert time.monotonic() < deadline, "the server never saw the new kernel idle"
            await client.kernel_info(reply=True, timeout=10)
            await asyncio.sleep(0.2)
        yield model["id"], client
    finally:
        client.stop_channels()
        jupyter.api("DELETE", f"api/kernels/{model['id']}")


def alice() -> Server:
    return Server(user="alice", url=PREFIX)


def source_for(server: JupyterServer, token: str = TOKEN) -> JupyterSignal:
    return JupyterPollSignal(proxy_url=server.url, api_token=token)


async def wait_for(source: JupyterSignal, predicate, what: str):
    """Sample until ``predicate(sample)`` holds; a kernel changes state asynchronously."""
    deadline = time.monotonic() + 30
    while True:
        sample = await source.sample(alice())
        if predicate(sample):
            return sample
        if time.monotonic() > deadline:
            raise AssertionError(f"never saw {what}; last sample: {sample}")
        await asyncio.sleep(0.2)


async def test_idle_kernel_reads_idle(jupyter, kernel):
    source = source_for(jupyter)
    sample = await wait_for(source, lambda s: s.kernels == 1 and s.kernels_busy == 0, "idle kernel")
    assert sample.errors == {}
    assert sample.terminals == 0
    listed = jupyter.api("GET", "api/kernels")
    assert sample.jupyter_last_activity == max(parse_iso8601(k["last_activity"]) for k in listed)


async def test_running_cell_reads_busy_until_interrupted(jupyter, kernel):
    kernel_id, client = kernel
    source = source_for(jupyter)
    await wait_for(source, lambda s: s.kernels_busy == 0, "the kernel idle")
    client.execute("import time; time.sleep(30)")
    busy = await wait_for(source, lambda s: s.kernels_busy == 1, "the kernel busy")
    assert busy.kernels == 1 and busy.errors == {}
    # a silent cell stays busy, however old its last message: read it as if an hour later
    later = await source.sample(alice(), time.time() + 3600)
    assert later.kernels_busy == 1
    jupyter.api("POST", f"api/kernels/{kernel_id}/interrupt")
    await wait_for(source, lambda s: s.kernels_busy == 0, "the kernel idle after interrupt")


async def test_kernel_nobody_connected_to_is_busy_only_while_starting(jupyter):
    kernel_id = jupyter.api("POST", "api/kernels")["id"]
    try:
        source = source_for(jupyter)
        listed = jupyter.api("GET", f"api/kernels/{kernel_id}")
        assert listed["execution_state"] == "starting"  # jupyter_server's view until a client talks
        started = parse_iso8601(listed["last_activity"])
        fresh = await source.sample(alice(), started + 1)
        assert fresh.kernels == 1 and fresh.kernels_busy == 1
        stale = await source.sample(alice(), started + source.starting_grace + 1)
        assert stale.kernels == 1 and stale.kernels_busy == 0
    finally:
        jupyter.api("DELETE", f"api/kernels/{kernel_id}")


async def test_polling_does_not_count_as_activity(jupyter, kernel):
    source = source_for(jupyter)
    await wait_for(source, lambda s: s.kernels == 1 and s.kernels_busy == 0, "idle kernel")
    await asyncio.sleep(0.5)  # let the kernel's start-up messages pass
    before = jupyter.api("GET", "api/status")["last_activity"]
    for _ in range(5):
        sample = await source.sample(alice())
        assert sample.errors == {}
        await asyncio.sleep(0.05)
    assert jupyter.api("GET", "api/status")["last_activity"] == before
    # the same request without no_track_activity does move it: the check above can fail
    jupyter.api("GET", "api/kernels", track=True)
    assert jupyter.api("GET", "api/status")["last_activity"] != before


async def test_terminal_is_counted_with_its_activity(jupyter):
    terminal = jupyter.api("POST", "api/terminals")
    try:
        # the shell's prompt moves the terminal's activity: bracket the reading with listings
        before = parse_iso8601(jupyter.api("GET", "api/terminals")[0]["last_activity"])
        sample = await source_for(jupyter).sample(alice())
        after = parse_iso8601(jupyter.api("GET", "api/terminals")[0]["last_activity"])
        assert sample.errors == {}
        assert sample.terminals == 1 and sample.kernels == 0
        assert parse_iso8601(terminal["last_activity"]) <= before
        assert before <= sample.jupyter_last_activity <= after
    finally:
        jupyter.api("DELETE", f"api/terminals/{terminal['name']}")


async def test_terminals_disabled_reads_zero_terminals(servers):
    without = servers[1]
    with pytest.raises(urllib.error.HTTPError) as e:
        without.api("GET", "api/terminals")
    assert e.value.code == 404
    sample = await source_for(without).sample(alice())
    assert sample.errors == {}
    assert sample.terminals == 0 and sample.kernels == 0 and sample.kernels_busy == 0
    assert sample.jupyter_last_activity is None


async def test_wrong_token_is_a_sample_error(jupyter):
    sample = await source_for(jupyter, token="wrong").sample(alice())
    assert sample.kernels is None and sample.kernels_busy is None
    assert "HTTP 403" in sample.errors["jupyter"]
    assert "access:servers" in sample.errors["jupyter"]


async def test_unreachable_server_is_a_sample_error():
    source = JupyterPollSignal(proxy_url=f"http://127.0.0.1:{free_port()}", api_token=TOKEN)
    sample = await source.sample(alice())
    assert "cannot reach" in sample.errors["jupyter"]


def test_urls_carry_no_track_activity():
    source = JupyterSignal(proxy_url="http://hub.example:8000/")
    assert (
        source.url(Server(user="bob", name="gpu", url="/user/bob/gpu/"), "api/kernels")
        == "http://hub.example:8000/user/bob/gpu/api/kernels?no_track_activity=1"
    )


@pytest.mark.parametrize(
    "stamp, epoch",
    [
        ("2026-11-22T20:41:49.500000Z", 1795380109.5),
        ("2026-11-22T20:41:49+00:00", 1795380109.0),
        ("2026-11-22T20:41:49", 1795380109.0),
        (None, None),
    ],
)
def test_parse_iso8601(stamp, epoch):
    assert parse_iso8601(stamp) == epoch


# ---------------------------------------------------------------- the servers' own reports


def report(kernels=(), terminals=(), interval=60, received=None) -> Report:
    body = {"kernels": list(kernels), "terminals": list(terminals), "interval": interval}
    return Report.from_body(body, time.time() if received is None else received)


async def test_a_server_that_never_reported_gives_no_signal():
    sample = await JupyterSignal().sample(alice())
    assert sample.kernels is None and "has not reported" in sample.errors["jupyter"]
    assert "jupyterhub_gpusnap.serverext" in sample.errors["jupyter"]


async def test_a_report_is_the_signal_until_it_is_stale():
    source = JupyterSignal()
    now = time.time()
    source.record(
        "alice/",
        report(
            [
                {"execution_state": "busy", "last_activity": "2026-11-22T20:41:49Z"},
                {"execution_state": "idle", "last_activity": "2026-11-22T20:40:00Z"},
            ],
            [{"last_activity": "2026-11-22T20:41:50Z"}],
        ),
    )
    sample = await source.sample(alice(), now)
    assert (sample.kernels, sample.kernels_busy, sample.terminals) == (2, 1, 1), sample
    assert sample.jupyter_last_activity == parse_iso8601("2026-11-22T20:41:50Z")
    assert sample.errors == {}
    # three of the server's intervals without a report: no signal (never "idle")
    source.record("alice/", report(interval=10, received=time.time() - 31))
    sample = await source.sample(alice(), now)
    assert sample.kernels is None and "ago" in sample.errors["jupyter"], sample
    # a tick forgets servers no longer running once their report is stale (a fresh one may
    # come from a server restored before the Hub lists it again)
    source.record("alice/", report())
    await source.prefetch([Server(user="bob")])
    assert list(source.reports) == ["alice/"]
    source.record("alice/", report(interval=10, received=time.time() - 31))
    await source.prefetch([Server(user="alice")])
    assert list(source.reports) == ["alice/"]  # running: its staleness is the signal's to say
    await source.prefetch([Server(user="bob")])
    assert source.reports == {}


async def test_the_poll_signal_reads_a_fresh_report_and_polls_the_rest():
    # nothing listens there: a poll would be an error
    source = JupyterPollSignal(proxy_url=f"http://127.0.0.1:{free_port()}", api_token=TOKEN)
    source.record("alice/", report([{"execution_state": "busy", "last_activity": None}]))
    sample = await source.sample(alice())
    assert sample.kernels_busy == 1 and sample.errors == {}, sample
    source.forget("alice/")
    sample = await source.sample(alice())
    assert "cannot reach" in sample.errors["jupyter"]


@pytest.mark.parametrize(
    "body, word",
    [
        ({"terminals": []}, "'kernels'"),
        ({"kernels": {}, "terminals": []}, "'kernels'"),
        ({"kernels": [], "terminals": [1]}, "object"),
        ({"kernels": [{"execution_state": 1}], "terminals": []}, "execution_state"),
        ({"kernels": [{"last_activity": "yesterday"}], "terminals": []}, "ISO 8601"),
        ({"kernels": [{"last_activity": 12}], "terminals": []}, "ISO 8601"),
        ({"kernels": [], "terminals": [], "interval": 0}, "'interval'"),
        ({"kernels": [], "terminals": [], "interval": 10**400}, "'interval'"),
        ({"kernels": [{}] * (MAX_REPORT_ITEMS + 1), "terminals": []}, "at most"),
    ],
)
def test_a_malformed_report_says_what_to_send(body, word):
    with pytest.raises(ReportError, match=word):
        Report.from_body(body, 0.0)


async def test_a_restarted_service_carries_the_stored_reading_over_until_the_server_reports():
    source = JupyterSignal()
    now = time.time()
    stored = {
        "time": now - 20,
        "kernels": 3,
        "kernels_busy": 1,
        "terminals": 1,
        "jupyter_last_activity": 1795380109.5,
    }
    source.carry_over("alice/", stored)
    sample = await source.sample(alice(), now)
    assert (sample.kernels, sample.kernels_busy, sample.terminals) == (3, 1, 1), sample
    assert sample.jupyter_last_activity == 1795380109.5 and sample.errors == {}
    # a reading from long ago, or one without the Jupyter signal, carries nothing over
    for old in ({**stored, "time": now - 3600}, {"time": now, "kernels": None}):
        other = JupyterSignal()
        other.carry_over("alice/", old)
        assert "jupyter" in (await other.sample(alice(), now)).errors
    # a real report is never replaced by an old reading
    source.record("alice/", report())
    source.carry_over("alice/", stored)
    assert (await source.sample(alice(), now)).kernels == 0
