"""The Lab panel and the service's pages in real Chromium, against a real hub and the real service.

Alice logs in through the Hub's login form, opens JupyterLab, and sees her server's idle countdown
in the status bar; she keeps it running and suspends it from the panel. The user page, the keep
link of the warning email and the admin page are used the same way, by clicking.
A forgotten tab stays open through the warning and the suspension, says so, and restores the
server in place; interaction in a tab counts as use, an untouched open tab does not.

Screenshots go to each test's own temporary folder (pytest's ``tmp_path``, kept for the last
three runs). ``GPUSNAP_UPDATE_SCREENSHOTS=1`` writes them to docs/images/ instead, to refresh
the pictures the docs show; commit them only when the change is wanted.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from playwright.async_api import async_playwright, expect

from tests.helpers.extension_env import spawner_environment
from tests.helpers.gpusnap_service import GpuSnapService, stop_recorded
from tests.helpers.realhub import TEST_PASSWORD

#: A time of day as the panel writes it (format.ts formatClock): "15:40", or "Thu 00:10" when
#: not today (a run near midnight).
CLOCK = r"([A-Z][a-z]{2} )?\d\d:\d\d"

pytestmark = [pytest.mark.browser, pytest.mark.e2e]

DOC_IMAGES = Path(__file__).resolve().parent.parent / "docs" / "images"


@pytest.fixture
def images(tmp_path) -> Path:
    """Where this test's screenshots go: docs/images/ only when asked (GPUSNAP_UPDATE_SCREENSHOTS=1)."""
    folder = (
        DOC_IMAGES
        if os.environ.get("GPUSNAP_UPDATE_SCREENSHOTS") == "1"
        else tmp_path / "screenshots"
    )
    folder.mkdir(parents=True, exist_ok=True)
    return folder


CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]

SETTINGS = """
c.GpuSnap.interval = 1
c.GpuSnap.idle_window = 1800
c.GpuSnap.min_running = 0
c.GpuSnap.warn_before = 300
c.GpuSnap.max_keep_running = 7200
c.GpuSnap.action = "stop"
c.GpuSnap.cpu_threshold = 95  # loading JupyterLab keeps the server's CPU busy for a while
"""

ROLES = """
c.JupyterHub.load_roles.append({"name": "gpusnap-admins", "scopes": ["custom:gpusnap:admin"], "users": ["ada"]})
c.JupyterHub.load_roles.append({"name": "gpusnap-readers", "scopes": ["custom:gpusnap:read"], "users": ["rita"]})
c.Spawner.default_url = "/lab"
"""

STATUS = ".jp-gpusnap-status"


def hub_config(service: GpuSnapService, root: Path) -> str:
    """The service, roles for an admin (ada) and a reader (rita), JupyterLab with our extension."""
    # the pages see a user's gpusnap scopes only if the service's OAuth client may ask for them
    config = service.hub_config()
    allowed = '"oauth_no_confirm": True, "oauth_client_allowed_scopes": ["custom:gpusnap:read", "custom:gpusnap:admin"],'
    assert '"oauth_no_confirm": True,' in config
    config = config.replace('"oauth_no_confirm": True,', allowed)
    # JupyterLab without its "news" toast, which would cover the panel in the screenshots
    settings = root / "lab-settings"
    notification = (
        settings / "@jupyterlab" / "apputils-extension" / "notification.jupyterlab-settings"
    )
    notification.parent.mkdir(parents=True, exist_ok=True)
    notification.write_text('{"fetchNews": "false", "checkForUpdates": false}')
    env = spawner_environment(service, root / "jupyter", JUPYTERLAB_SETTINGS_DIR=str(settings))
    return config + ROLES + env


@pytest.fixture
async def setup(hub_factory, tmp_path):
    # the panel test clicks in the Lab to open the panel, and a click is the user at work
    # (interaction_window): switched off here so the pages show an idle server's countdown;
    # test_interaction_in_the_tab_counts_and_an_untouched_tab_does_not covers interaction
    service = GpuSnapService(tmp_path / "gpusnap", SETTINGS + "c.GpuSnap.interaction_window = 0\n")
    hub = await hub_factory(hub_config(service, tmp_path))
    for user in ("alice", "bob"):
        await hub.start_server(user)
    await service.start(hub)
    for user in ("alice", "bob"):
        await service.wait_for(
            lambda u=user: service.server_status(f"{u}/"), what=f"{user} watched"
        )
    async with async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path="/usr/bin/chromium", args=CHROMIUM_ARGS)
        yield hub, service, browser
        await browser.close()
    await service.stop()


async def login(browser, hub, user: str):
    """A browser context logged in as `user` through the Hub's own login form."""
    context = await browser.new_context(viewport={"width": 1280, "height": 800})
    context.set_default_timeout(60_000)
    page = await context.new_page()
    await page.goto(hub.url + "hub/login?next=%2Fhub%2Fhome")  # no spawn for admins
    await page.fill("#username_input", user)
    await page.fill("#password_input", TEST_PASSWORD)
    await page.click("#login_submit")
    await page.wait_for_url(re.compile(r"/hub/home"))
    return context, page


async def test_lab_panel_and_pages(setup, images):
    hub, service, browser = setup
    context, lab = await login(browser, hub, "alice")

    # ---- the Lab status bar: idle, with the time it will be suspended
    await lab.goto(hub.server_url("alice") + "lab")
    item = lab.locator(STATUS)
    await expect(item).to_have_text(
        re.compile(r"^idle \d+ (s|min) — suspends at " + CLOCK + "$"), timeout=90_000
    )

    # ---- the panel opens from the status bar, with the countdown, signals and controls
    await item.click()
    panel = lab.locator("#gpusnap-panel")
    await expect(panel).to_be_visible()
    await expect(panel.locator(".jp-gpusnap-countdown")).to_have_text(
        re.compile(r"^\d+:\d\d(:\d\d)?$")
    )
    await expect(panel.get_by_role("row", name=re.compile("Kernels"))).to_contain_text("0 (0 busy)")
    options = await panel.locator("#jp-gpusnap-keep-for option").evaluate_all(
        "os => os.map(o => Number(o.value))"
    )
    assert options == [1800, 3600, 7200], options  # within the admin's maximum of 2 h

    await lab.wait_for_timeout(1500)  # one more second of countdown, then the picture
    await panel.screenshot(path=str(images / "panel.png"))

    # ---- the user page shows the same countdown
    user_page = await context.new_page()
    await user_page.goto(hub.url + "services/gpusnap/")
    await expect(user_page.get_by_role("heading", name="Your servers")).to_be_visible()
    card = user_page.locator("section.server", has_text="alice/")
    await expect(card.locator(".countdown")).to_have_text(re.compile(r"^\d+:\d\d(:\d\d)?$"))
    await expect(card.locator(".badge")).to_have_text("idle")
    await user_page.screenshot(path=str(images / "user-page.png"), full_page=True)

    # ---- keep running for 1 h from the panel: the status bar says until when, the service agrees
    await lab.bring_to_front()
    await panel.locator("#jp-gpusnap-keep-for").select_option("3600")
    await panel.get_by_role("button", name="Keep running").click()
    await expect(item).to_contain_text("kept running until", timeout=30_000)
    kept = await service.server_status("alice/")
    assert kept["keep_until"] is not None and kept["state"] == "active", kept
    assert [e for e in kept["events"] if e["kind"] == "keep"]

    # ---- the keep-running form of the user page moves it again
    await user_page.bring_to_front()
    await user_page.reload()
    first_keep = kept["keep_until"]
    await card.locator("select[name=seconds]").select_option("7200")
    await card.get_by_role("button", name="Keep running").click()
    await expect(user_page.locator("#gpusnap-message")).to_have_text("alice/: keep done.")

    async def moved():
        s = await service.server_status("alice/")
        return s if s["keep_until"] != first_keep else None

    later = await service.wait_for(moved, what="the keep-running time to move")
    assert later["keep_until"] > first_keep
    await expect(card.locator("time.keep-until")).to_be_visible()
    # someone else's server is not there to see
    resp = await user_page.goto(hub.url + "services/gpusnap/status/bob")
    assert resp.status == 404
    # the admin page needs the read scope
    resp = await user_page.goto(hub.url + "services/gpusnap/admin")
    assert resp.status == 403
    assert "custom:gpusnap:read" in await user_page.content()

    # ---- the warning email's link: a confirmation form, then a POST with the xsrf token
    await user_page.goto(hub.url + "services/gpusnap/keep/alice/")  # as the email links it
    await user_page.locator("#seconds").select_option("1800")
    await user_page.get_by_role("button", name="Keep it running").click()
    await expect(user_page.locator(".done")).to_contain_text("keeps running until")
    shortest = await service.server_status("alice/")
    assert shortest["keep_until"] < later["keep_until"]
    # the same POST without the form's xsrf token is not accepted
    forged = await user_page.request.post(
        hub.url + "services/gpusnap/keep/alice", form={"seconds": "7200"}, max_redirects=0
    )
    assert forged.status in (302, 403), forged.status
    assert (await service.server_status("alice/"))["keep_until"] == shortest["keep_until"]

    # ---- the admin page: ada sees every server and acts on bob's
    admin_ctx, admin = await login(browser, hub, "ada")
    await admin.goto(hub.url + "services/gpusnap/admin")
    rows = admin.locator("table.servers tbody tr")
    await expect(rows).to_have_count(2)
    bob_row = admin.locator("tr[data-server='bob/']")
    await bob_row.get_by_role("button", name="Exempt bob/").click()
    await expect(bob_row.get_by_role("button", name="Lift the exemption of bob/")).to_be_visible(
        timeout=30_000
    )
    await expect(bob_row.locator(".badge")).to_have_text("exempt")
    assert (await service.server_status("bob/"))["exempt"] is True
    admin.on("dialog", lambda d: d.accept())
    await (
        admin.locator("tr[data-server='bob/']")
        .get_by_role("button", name="Suspend bob/ now")
        .click()
    )

    async def bob_stopped():
        return await hub.get_server("bob") is None

    await service.wait_for(bob_stopped, what="bob's server to stop from the admin page")
    await admin_ctx.close()

    # a reader sees the page but cannot act
    reader_ctx, reader = await login(browser, hub, "rita")
    await reader.goto(hub.url + "services/gpusnap/admin")
    await expect(reader.locator("tr[data-server='alice/']")).to_be_visible()
    await expect(reader.get_by_role("button", name="Suspend alice/ now")).to_be_disabled()
    await reader_ctx.close()

    # ---- suspend now, from the Lab panel (the service's action here is "stop")
    await lab.bring_to_front()
    await panel.get_by_role("button", name="Suspend now").click()
    await lab.locator(".jp-Dialog").get_by_role("button", name="Suspend", exact=True).click()

    async def alice_stopped():
        return await hub.get_server("alice") is None

    await service.wait_for(alice_stopped, what="alice's server to stop after suspend-now")
    await service.wait_for(lambda: stop_recorded(service, "alice/"), what="the stop to be recorded")
    await context.close()


TEMPLATES = Path(__file__).resolve().parent.parent / "jupyterhub_gpusnap" / "templates" / "hub"


@pytest.mark.criu
async def test_suspend_from_the_panel_and_come_back_restored(hub_factory, tmp_path, images):
    """The Snap spawner and CRIU: suspend-now checkpoints the server; the return restores it,
    and the panel says so, with the snapshot's size and how long the restore took."""
    ckpt = tmp_path / "ckpt"
    backend = f"c.LocalBackend.checkpoint_dir = {str(ckpt)!r}\nc.LocalBackend.min_free_bytes = 0\n"
    service = GpuSnapService(
        tmp_path / "gpusnap", SETTINGS.replace('"stop"', '"suspend"') + backend
    )
    hub = await hub_factory(
        hub_config(service, tmp_path)
        + backend
        + f"""
c.JupyterHub.spawner_class = "jupyterhub_gpusnap.spawner.SnapSimpleLocalProcessSpawner"
c.SnapSimpleLocalProcessSpawner.restore_timeout = 90
c.JupyterHub.template_paths = [{str(TEMPLATES)!r}]
c.Spawner.default_url = "/lab"
"""
    )
    await hub.start_server("alice")
    kernel, out = await hub.execute("alice", "x = 6 * 7\nprint(x)")
    assert out.strip() == "42"
    await service.start(hub)
    await service.wait_for(lambda: service.server_status("alice/"), what="alice watched")
    async with async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path="/usr/bin/chromium", args=CHROMIUM_ARGS)
        context, lab = await login(browser, hub, "alice")
        await lab.goto(hub.server_url("alice") + "lab")
        item = lab.locator(STATUS)
        await expect(item).to_contain_text(re.compile("GPU snapshot: active|idle"), timeout=90_000)
        await item.click()
        panel = lab.locator("#gpusnap-panel")
        await panel.get_by_role("button", name="Suspend now").click()
        await lab.locator(".jp-Dialog").get_by_role("button", name="Suspend", exact=True).click()

        async def suspended():
            s = await service.server_status("alice/")
            return s if s and s["state"] == "suspended" else None

        await service.wait_for(
            suspended, timeout=120, what="alice's server to be checkpointed and stopped"
        )
        assert await hub.get_server("alice") is None

        # the Hub's home page and the service's page say so, in plain words, and offer Restore
        await lab.goto(hub.url + "hub/home")
        await expect(lab.locator("#gpusnap-suspended")).to_contain_text(
            "Your kernels, their variables"
        )
        await expect(lab.locator("#start")).to_have_text("Restore My Server")
        await lab.goto(hub.url + "services/gpusnap/")
        card = lab.locator("section.server", has_text="alice/")
        await expect(card.locator(".state-words")).to_have_text(
            re.compile(r"^Suspended at .+ to free the GPU; your kernels are saved\.$")
        )
        await expect(card.get_by_role("button", name="Restore")).to_have_attribute(
            "href", "/hub/spawn/alice"
        )

        # the return: the Hub's spawn restores the snapshot, and Lab opens again
        await lab.goto(hub.url + "hub/spawn?next=" + "/user/alice/lab")
        await lab.wait_for_url(re.compile(r"/user/alice/lab"), timeout=120_000)
        await expect(item).to_contain_text(
            re.compile(r"^restored from snapshot of " + CLOCK + "$"), timeout=120_000
        )
        await item.click()
        restored = panel.locator(".jp-gpusnap-history tr", has_text="restored")
        # when it was restored, and the snapshot's size
        await expect(restored.locator("td").nth(0)).to_have_text(re.compile("^" + CLOCK + "$"))
        await expect(restored.locator("td").nth(2)).to_have_text(re.compile(r"^\d+(\.\d)? [KMG]iB"))
        await expect(panel.locator(".jp-gpusnap-history tr", has_text="suspended")).to_have_count(1)
        # the kernel came back with its variables
        _, out = await hub.execute("alice", "print(x + 1)", kernel_id=kernel)
        assert out.strip() == "43"
        await panel.screenshot(path=str(images / "panel-restored.png"))

        # the admin page lists the snapshot
        _, admin = await login(browser, hub, "ada")
        # the Hub's home page links to the gpusnap pages
        link = admin.locator("#gpusnap-link a")
        await expect(link).to_have_attribute("href", "/services/gpusnap/")
        await link.click()
        await expect(admin.get_by_role("heading", name="Your servers")).to_be_visible()
        await admin.goto(hub.url + "services/gpusnap/admin")
        row = admin.locator("tr[data-server='alice/']")
        await expect(row.locator("td").nth(6)).to_have_text(re.compile(r"^\d+(\.\d)? [KMG]iB"))
        await expect(admin.locator(".stats")).to_contain_text("1 snapshots")
        await admin.screenshot(path=str(images / "admin-page.png"), full_page=True)
        await browser.close()
    await service.stop()


NOTEBOOK = {
    "cells": [{"cell_type": "code", "execution_count": None, "id": "c1", "metadata": {},
               "outputs": [], "source": "x"}],
    "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}},
    "nbformat": 4,
    "nbformat_minor": 5,
}  # fmt: skip


async def open_notebook_with_kernel(hub, user: str, path: str, code: str) -> str:
    """A notebook with one cell (``x``) and a running kernel of its own session that ran ``code``."""
    status, _ = await hub.user_request(user, f"api/contents/{path}", "PUT",
                                       {"type": "notebook", "format": "json", "content": NOTEBOOK})  # fmt: skip
    assert status in (200, 201), status
    status, session = await hub.user_request(user, "api/sessions", "POST", {
        "path": path, "name": path, "type": "notebook", "kernel": {"name": "python3"}})  # fmt: skip
    assert status == 201, (status, session)
    kernel = session["kernel"]["id"]
    await hub.execute(user, code, kernel_id=kernel)
    return kernel


async def session_kernel(hub, user: str, path: str) -> str | None:
    status, sessions = await hub.user_request(user, "api/sessions")
    assert status == 200, status
    return next((s["kernel"]["id"] for s in sessions if s["path"] == path), None)


@pytest.mark.criu
async def test_a_forgotten_tab_says_suspended_and_restores_in_place(hub_factory, tmp_path, images):
    """Alice leaves a notebook open and walks away. The untouched tab stays open through the
    warning and the suspension; it then says that the server was suspended to free the GPU and
    that her kernels are saved (not JupyterLab's "Server unavailable… Restart?"), and its
    Restore brings the server back in this very tab: the same notebook, reconnected to the same
    kernel, answers ``x`` with 42, without a reload and without a second tab."""
    ckpt = tmp_path / "ckpt"
    backend = f"c.LocalBackend.checkpoint_dir = {str(ckpt)!r}\nc.LocalBackend.min_free_bytes = 0\n"
    settings = SETTINGS.replace('"stop"', '"suspend"').replace(
        "idle_window = 1800", "idle_window = 40"
    )
    settings = settings.replace("warn_before = 300", "warn_before = 20")
    service = GpuSnapService(tmp_path / "gpusnap", settings + backend)
    hub = await hub_factory(
        hub_config(service, tmp_path)
        + backend
        + f"""
c.JupyterHub.spawner_class = "jupyterhub_gpusnap.spawner.SnapSimpleLocalProcessSpawner"
c.SnapSimpleLocalProcessSpawner.restore_timeout = 90
c.JupyterHub.template_paths = [{str(TEMPLATES)!r}]
"""
    )
    await hub.start_server("alice")
    kernel = await open_notebook_with_kernel(hub, "alice", "forgotten.ipynb", "x = 6 * 7")
    await service.start(hub)
    await service.wait_for(lambda: service.server_status("alice/"), what="alice watched")

    async def state_is(*states):
        s = await service.server_status("alice/")
        return s if s and s["state"] in states else None

    async with async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path="/usr/bin/chromium", args=CHROMIUM_ARGS)
        context, lab = await login(browser, hub, "alice")
        navigations = []
        lab.on(
            "framenavigated", lambda f: navigations.append(f.url) if f == lab.main_frame else None
        )
        await lab.goto(hub.server_url("alice") + "lab/tree/forgotten.ipynb")
        item = lab.locator(STATUS)
        cell = lab.locator(".jp-Notebook .jp-Cell").first
        await expect(cell).to_be_visible(timeout=90_000)
        await lab.evaluate("window.gpusnapSameDocument = 'yes'")  # gone if the tab reloads
        loads = len(navigations)

        # ---- the warning, in the untouched tab; nothing was reported as interaction
        warned = await service.wait_for(lambda: state_is("warned"), timeout=120, what="the warning")
        assert warned["last_interaction"] is None, warned
        await expect(item).to_have_text(
            re.compile(r"^idle \d+ (s|min) — suspends at " + CLOCK + "$")
        )
        await lab.screenshot(path=str(images / "forgotten-tab-1-warned.png"))

        # ---- the suspension: the tab says what happened and offers Restore
        suspended = await service.wait_for(
            lambda: state_is("suspended"), timeout=180, what="the suspension"
        )
        assert await hub.get_server("alice") is None
        dialog = lab.locator(".jp-Dialog")
        await expect(dialog).to_contain_text("Your server is suspended", timeout=60_000)
        await expect(dialog).to_contain_text(
            re.compile("suspended at " + CLOCK + " to free the GPU; your kernels are saved")
        )
        await expect(lab.get_by_text("Server unavailable or unreachable")).to_have_count(0)
        await expect(item).to_have_text(
            re.compile("^suspended at " + CLOCK + " — your kernels are saved$")
        )
        assert "suspends at" not in await item.inner_text()
        await lab.screenshot(path=str(images / "forgotten-tab-2-suspended.png"))

        # ---- Restore, from the tab
        await dialog.get_by_role("button", name="Restore").click()
        await expect(item).to_have_text(
            re.compile(r"^restored from snapshot of " + CLOCK + "$"), timeout=180_000
        )
        assert (await service.server_status("alice/"))["restored_at"] is not None
        assert suspended["checkpoint_id"]

        # ---- the same notebook, reconnected to the same kernel, answers x
        await cell.click()
        await lab.keyboard.press("Shift+Enter")
        await expect(cell.locator(".jp-OutputArea-output")).to_have_text("42", timeout=60_000)
        assert await session_kernel(hub, "alice", "forgotten.ipynb") == kernel
        assert await lab.evaluate("window.gpusnapSameDocument") == "yes"  # no reload
        assert len(navigations) == loads, navigations[loads:]
        assert context.pages == [lab]  # no second tab
        await lab.screenshot(path=str(images / "forgotten-tab-3-restored.png"))
        await browser.close()
    await service.stop()


async def test_interaction_in_the_tab_counts_and_an_untouched_tab_does_not(hub_factory, tmp_path):
    """Keys, clicks and wheel scrolling in a visible Lab tab reach the service as interaction,
    which holds off the suspension for interaction_window; an open tab nobody touches, and
    events a script makes, report nothing."""
    settings = SETTINGS + "c.GpuSnap.interaction_window = 1200\n"
    service = GpuSnapService(tmp_path / "gpusnap", settings)
    hub = await hub_factory(hub_config(service, tmp_path))
    await hub.start_server("alice")
    await service.start(hub)
    await service.wait_for(lambda: service.server_status("alice/"), what="alice watched")
    async with async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path="/usr/bin/chromium", args=CHROMIUM_ARGS)
        context, lab = await login(browser, hub, "alice")
        await lab.goto(hub.server_url("alice") + "lab")
        item = lab.locator(STATUS)
        await expect(item).to_have_text(
            re.compile(r"^idle \d+ (s|min) — suspends at"), timeout=90_000
        )

        # untouched, and a script's events: the service keeps counting the tab as idle
        await lab.evaluate("""() => {
            for (const type of ['keydown', 'pointerdown', 'wheel']) {
                document.body.dispatchEvent(new Event(type, {bubbles: true}));
            }
        }""")

        async def idle_a_while():
            s = await service.server_status("alice/")
            return s if s["state"] == "idle" and s["idle_seconds"] >= 8 else None

        untouched = await service.wait_for(
            idle_a_while, what="ticks with the tab open and untouched"
        )
        assert untouched["last_interaction"] is None, untouched
        quiet_since = untouched["idle_since"]

        # a real click and key in the tab: the service hears of it, and the deadline moves
        await lab.locator(".jp-LauncherCard").first.hover()
        await lab.mouse.wheel(0, 200)
        await lab.keyboard.press("Escape")

        async def touched():
            s = await service.server_status("alice/")
            return s if s["last_interaction"] else None

        used = await service.wait_for(touched, what="the interaction to reach the service")

        async def moved():
            s = await service.server_status("alice/")
            return (
                s if s["idle_since"] and s["idle_since"] > quiet_since and s["suspend_at"] else None
            )

        after = await service.wait_for(moved, what="the idle clock to restart at the interaction")
        assert after["idle_since"] == after["last_interaction"] == used["last_interaction"], after
        events = [e for e in after["events"] if e["kind"] == "state"]
        assert any(e["detail"]["reason"] == "JupyterLab in use" for e in events), events
        await browser.close()
    await service.stop()
