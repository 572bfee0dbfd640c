"""The README's first command, exactly as written, as root with a plain PATH (no venv on it):
a browser logs in through the demo Hub's login page, gets a running server through the proxy,
and Ctrl-C then stops everything the demo started (docs/install.md, "Hub shutdown")."""

from __future__ import annotations

import asyncio
import os
import re
import secrets
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
from tornado.httpclient import AsyncHTTPClient

from tests.helpers.realhub import Browser

pytestmark = [pytest.mark.e2e, pytest.mark.criu]

ROOT = Path(__file__).resolve().parent.parent
DEMO_DIR = ROOT / "demo-data"
PLAIN_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
URL = "http://127.0.0.1:8000"
# the Hub (public, proxy API, internal), the gpusnap service, the SMTP sink
PORTS = (8000, 8001, 8081, 10101, 8025)


def readme_first_command() -> str:
    text = (ROOT / "README.md").read_text()
    block = re.search(r"^## Quick start\n.*?```bash\n(.*?)```", text, re.S | re.M)
    assert block, "README.md has no Quick start with a bash block"
    return block[1].splitlines()[0].split("#")[0].strip()


def port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def demo_processes(user: str) -> dict[int, str]:
    """Processes of this demo: run in or naming its folder, or serving ``user``; pid → cmdline."""
    found = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            cmdline = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            environ = (d / "environ").read_bytes().split(b"\0")
            cwd = os.readlink(d / "cwd")
        except OSError:
            continue
        if (
            str(DEMO_DIR) in cmdline
            or cwd.startswith(str(DEMO_DIR))
            or f"JUPYTERHUB_USER={user}".encode() in environ
            or ("configurable-http-proxy" in cmdline and "--port 8000" in cmdline)
        ):
            found[int(d.name)] = cmdline.strip()
    return found


async def wait_for(what: str, check, proc: subprocess.Popen, log: Path, timeout: float):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = await check()
        if result:
            return result
        assert proc.poll() is None, f"the demo exited {proc.returncode}:\n{log.read_text()[-6000:]}"
        await asyncio.sleep(1)
    raise AssertionError(f"timed out waiting for {what}:\n{log.read_text()[-6000:]}")


async def test_readme_demo_reaches_a_server_and_ctrl_c_stops_everything(tmp_path):
    command = readme_first_command()
    assert command == ".ci/demo"  # as root, no sudo: many root shells have none
    assert os.geteuid() == 0, "the demo needs root (CRIU); run the suite as root"
    busy = [p for p in PORTS if not port_free(p)]
    assert not busy, f"ports {busy} are taken: the demo needs them (is a demo running already?)"

    user = "readme" + secrets.token_hex(3)
    log = tmp_path / "demo.log"
    env = {"PATH": PLAIN_PATH, "HOME": os.environ.get("HOME", "/root"), "LANG": "C.UTF-8"}
    with open(log, "wb") as out:
        # its own process group, like a terminal's foreground job: Ctrl-C is SIGINT to the group
        proc = subprocess.Popen(
            ["bash", "-c", command],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    client = AsyncHTTPClient(force_instance=True)
    browser = Browser(URL)
    try:

        async def login_page():
            try:
                resp = await client.fetch(f"{URL}/hub/login", raise_error=False, request_timeout=5)
            except OSError:  # not listening yet
                return False
            return resp.code == 200

        # the first run installs what is missing (setup), later ones only check
        await wait_for("the demo Hub's login page", login_page, proc, log, timeout=900)
        await browser.login(user, "demo")
        resp = await browser.request("/hub/spawn")
        assert resp.code < 400, (resp.code, browser.history[-5:])

        async def server_status():
            # a page first: it takes the browser through the server's OAuth login (API paths
            # answer 403 to a browser that has not been through it)
            page = await browser.request(f"/user/{user}/lab")
            if page.code != 200:
                return None
            resp = await browser.request(f"/user/{user}/api/status")
            return resp if resp.code == 200 and b'"kernels"' in (resp.body or b"") else None

        status = await wait_for(
            f"{user}'s server through the proxy", server_status, proc, log, timeout=120
        )
        assert b"readme" in (await browser.request(f"/user/{user}/lab")).body
        assert status.effective_url.startswith(f"{URL}/user/{user}/api/status")

        running = demo_processes(user)
        cmdlines = " | ".join(running.values())
        # what Ctrl-C must stop is all there, so its absence afterwards means something
        assert "configurable-http-proxy" in cmdlines, running
        assert "jupyterhub_gpusnap.app" in cmdlines, running
        assert "jupyterhub-singleuser" in cmdlines or "singleuser" in cmdlines, running

        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C
        # a guard against a hang, not a speed requirement: the Hub may take its time
        try:
            rc = proc.wait(180)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"the demo did not exit after Ctrl-C:\n{log.read_text()[-6000:]}"
            ) from None
        text = log.read_text()
        assert rc == 0, text[-6000:]
        assert "stopping the demo" in text and "demo stopped" in text, text[-3000:]
        assert "the Hub did not stop in time" not in text, text[-6000:]

        left = demo_processes(user)
        assert left == {}, f"left running after Ctrl-C: {left}"
        busy = [p for p in PORTS if not port_free(p)]
        assert busy == [], f"ports still taken after Ctrl-C: {busy}"
    finally:
        browser.close()
        client.close()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for pid in demo_processes(user):  # leave nothing behind for the next test
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
