"""Email to users and admins, delivered through a real SMTP server (aiosmtpd, TLS + AUTH)."""

from __future__ import annotations

import asyncio
import logging
from datetime import date, datetime, timedelta, timezone

import pytest

from jupyterhub_gpusnap.notify import (
    DIGEST_KEY,
    Mailer,
    Notifier,
    format_minutes,
    format_size,
    format_time,
    redact,
)
from tests.helpers.smtp_server import SmtpServer, free_port

pytestmark = pytest.mark.email

NOW = datetime(2026, 11, 22, 21, 0, tzinfo=timezone.utc)
HUB = "https://hub.example.org"


class MemorySentLog:
    """The two methods of the service's Store that the Notifier uses, kept in a set."""

    def __init__(self) -> None:
        self.rows: set[tuple[str, str, str]] = set()

    def notification_sent(self, key: str, kind: str, event_ref: str) -> bool:
        return (key, kind, event_ref) in self.rows

    def record_notification(self, key: str, kind: str, event_ref: str) -> bool:
        if (key, kind, event_ref) in self.rows:  # the unique constraint
            return False
        self.rows.add((key, kind, event_ref))
        return True


@pytest.fixture
def log(caplog) -> logging.Logger:
    caplog.set_level(logging.DEBUG, logger="gpusnap-test")
    return logging.getLogger("gpusnap-test")


@pytest.fixture
def smtp(tmp_path):
    server = SmtpServer(tmp_path, tls="starttls").start()
    yield server
    server.stop()


@pytest.fixture
def smtps(tmp_path):
    server = SmtpServer(tmp_path, tls="implicit").start()
    yield server
    server.stop()


def make_mailer(server: SmtpServer, log: logging.Logger, **kwargs) -> Mailer:
    settings = dict(
        smtp_host=server.host,
        smtp_port=server.port,
        smtp_security="starttls" if server.tls == "starttls" else "tls",
        smtp_username=server.username,
        smtp_password=server.password,
        tls_ca_file=str(server.ca_file),
        from_address="GPU Hub <gpuhub@example.org>",
        reply_to="help@example.org",
        timeout=10,
        retries=2,
        retry_backoff=0.01,
        log=log,
    )
    settings.update(kwargs)
    return Mailer(**settings)


def make_notifier(mailer: Mailer, sent_log=None, **kwargs) -> Notifier:
    settings = dict(
        address_from="template",
        address_template="{username}@example.org",
        contact="hpc-support@example.org",
        log=mailer.log,
    )
    settings.update(kwargs)
    notifier = Notifier(sent_log if sent_log is not None else MemorySentLog(), mailer, **settings)
    notifier.clock = lambda: NOW
    return notifier


def context(user: str = "alice", name: str = "", **extra) -> dict:
    server = f"{user}/{name}"
    ctx = dict(
        username=user,
        server=server,
        server_url=f"{HUB}/user/{user}/{name}",
        keep_url=f"{HUB}/services/gpusnap/keep?server={server}",
        status_url=f"{HUB}/services/gpusnap/status/{server}",
        hub_url=f"{HUB}/hub/",
        idle_minutes=75,
        suspend_at=NOW + timedelta(minutes=30),
        reasons=["GPU below 5 % for 75 minutes", "CPU below 10 % for 75 minutes"],
        image_bytes=9556302233,  # 8.9 GiB
        gpu_bytes=2684354560,  # 2.5 GiB
        gpu_model="NVIDIA H100 80GB HBM3",
        kernels=["python3", "ir"],
        retention_days=14,
        suspended_at=NOW,
        error="",
    )
    ctx.update(extra)
    return ctx


# --- each kind, delivered over STARTTLS with login ----------------------------------------------


async def test_warning_over_starttls_with_login(smtp, log):
    notifier = make_notifier(make_mailer(smtp, log))
    assert await notifier.notify("warning", "alice", context(), "idle-1") is True

    [got] = smtp.messages
    assert got.login == "mailer"  # AUTH happened (aiosmtpd offers it only after STARTTLS)
    assert got.rcpt_tos == ["alice@example.org"]
    assert got.mail_from == "gpuhub@example.org"
    assert got.message["To"] == "alice@example.org"
    assert got.message["Reply-To"] == "help@example.org"
    assert got.message["Auto-Submitted"] == "auto-generated"
    assert got.message.get_content_type() == "multipart/alternative"
    assert (
        got.subject == "[JupyterHub] Your server alice/ will be suspended at 2026-11-22 21:30 UTC"
    )
    text, html = got.part("plain"), got.part("html")
    keep = f"{HUB}/services/gpusnap/keep?server=alice/"
    assert keep in text
    assert f'href="{keep}"' in html
    for body in (text, html):
        assert "1 hour 15 minutes" in body
        assert "GPU below 5 % for 75 minutes" in body
        assert "CPU below 10 % for 75 minutes" in body
        assert "2026-11-22 21:30 UTC" in body
        assert "(in 30 minutes)" in body
    assert "{#" not in text and "Context (passed" not in html


async def test_suspended_names_what_was_saved(smtp, log):
    notifier = make_notifier(make_mailer(smtp, log), timezone="Europe/Berlin")
    assert await notifier.notify("suspended", "bob", context("bob", "gpu"), "snap-7")

    [got] = smtp.messages
    assert got.rcpt_tos == ["bob@example.org"]
    assert got.subject.startswith("[JupyterHub] Your server bob/gpu was suspended")
    text, html = got.part("plain"), got.part("html")
    for body in (text, html):
        assert "2026-11-22 22:00 CET" in body  # 21:00 UTC in Berlin, zone named
        assert "snapshot: 8.9 GiB" in body
        assert "GPU memory: 2.5 GiB on NVIDIA H100 80GB HBM3" in body
        assert "2 kernels (python3, ir)" in body
        assert "kept for 14 days" in body
    assert f"{HUB}/user/bob/gpu" in text
    assert f'href="{HUB}/user/bob/gpu"' in html


async def test_restore_failed_says_what_happened_and_whom_to_ask(smtp, log):
    notifier = make_notifier(make_mailer(smtp, log))
    error = "criu restore: pid 4242 taken; hub said 403 for ?token=9f8e7d6c5b4a <script>"
    ctx = context("carol", error=error, retention_days=30)
    assert await notifier.notify("restore_failed", "carol", ctx, "snap-9")

    [got] = smtp.messages
    assert got.rcpt_tos == ["carol@example.org"]
    assert got.subject == "[JupyterHub] Your server carol/ could not be restored from its snapshot"
    for body in (got.part("plain"), got.part("html")):
        assert "criu restore: pid 4242 taken" in body
        assert "kept for 30 days" in body
        assert "hpc-support@example.org" in body
        assert "9f8e7d6c5b4a" not in body  # no token in an email
    html = got.part("html")
    assert (
        "<pre>criu restore: pid 4242 taken; hub said 403 for ?token=[redacted] &lt;script&gt;</pre>"
        in html
    )
    assert "<script>" not in html  # HTML-escaped


async def test_restored_only_when_enabled(smtp, log):
    mailer = make_mailer(smtp, log)
    sent_log = MemorySentLog()
    off = make_notifier(mailer, sent_log)
    assert off.send_restored is False
    assert await off.notify("restored", "dave", context("dave"), "snap-3") is False
    assert smtp.messages == []
    assert sent_log.rows == set()

    on = make_notifier(mailer, sent_log, send_restored=True)
    assert await on.notify("restored", "dave", context("dave"), "snap-3") is True
    [got] = smtp.messages
    assert got.subject == "[JupyterHub] Your server dave/ was restored from its snapshot"
    assert "2 kernels (python3, ir)" in got.part("plain")
    assert f"{HUB}/user/dave/" in got.part("plain")


async def test_admin_digest_once_a_day(smtp, log):
    sent_log = MemorySentLog()
    notifier = make_notifier(
        make_mailer(smtp, log),
        sent_log,
        digest_to=["admins@example.org", "gpu-team@example.org"],
        digest_hour=7,
        address_from="auth_state",
    )
    # a user with no address ends up in the digest
    assert (
        await notifier.notify("warning", "erin", context("erin"), "idle-1", auth_state={}) is False
    )

    assert notifier.digest_day(datetime(2026, 11, 22, 6, 59, tzinfo=timezone.utc)) is None
    day = notifier.digest_day(datetime(2026, 11, 22, 7, 0, tzinfo=timezone.utc))
    assert day == date(2026, 11, 22)
    stats = dict(
        gpu_hours=41.25,
        suspensions=6,
        restores=4,
        failures=1,
        failed_servers=[{"server": "frank/", "error": "GPU busy: lock timed out"}],
        hub_url=f"{HUB}/hub/",
    )
    assert await notifier.send_digest(stats, day) is True
    assert await notifier.send_digest(stats, day) is False  # once per day

    [got] = smtp.messages
    assert got.rcpt_tos == ["admins@example.org", "gpu-team@example.org"]
    assert got.subject == (
        "[JupyterHub] Daily GPU snapshot digest for 2026-11-22: 41.2 GPU-hours given back"
    )
    text = got.part("plain")
    assert "GPU-hours given back: 41.2" in text
    assert "suspensions:          6" in text
    assert "restores:             4" in text
    assert "failures:             1" in text
    assert "frank/: GPU busy: lock timed out" in text
    assert "  - erin" in text
    assert (DIGEST_KEY, "admin_digest", "2026-11-22") in sent_log.rows


async def test_no_digest_without_recipients(smtp, log):
    notifier = make_notifier(make_mailer(smtp, log))
    assert notifier.digest_day(NOW) is None
    assert await notifier.send_digest({"gpu_hours": 1}, NOW.date()) is False
    assert smtp.messages == []


# --- transport ----------------------------------------------------------------------------------


# aiosmtpd warns about AUTH without its own TLS; the implicit-TLS listener is TLS throughout.
@pytest.mark.filterwarnings("ignore:Requiring AUTH while not requiring TLS")
async def test_implicit_tls(smtps, log):
    notifier = make_notifier(make_mailer(smtps, log))
    assert await notifier.notify("warning", "alice", context(), "idle-1") is True
    [got] = smtps.messages
    assert got.login == "mailer"
    assert got.rcpt_tos == ["alice@example.org"]


async def test_plain_relay_without_login(tmp_path, log):
    relay = SmtpServer(tmp_path, tls="none").start()
    try:
        mailer = Mailer(
            smtp_host=relay.host,
            smtp_port=relay.port,
            smtp_security="none",
            from_address="hub@example.org",
            log=log,
        )
        assert await mailer.send(["a@example.org", "b@example.org"], "hi", "text only") is True
        [got] = relay.messages
        assert got.login is None
        assert got.rcpt_tos == ["a@example.org", "b@example.org"]
        assert got.message.get_content_type() == "text/plain"
        assert got.part("plain").strip() == "text only"
    finally:
        relay.stop()


async def test_login_without_tls_is_refused_with_a_fix(smtp, log, caplog):
    failures: list[str] = []
    mailer = make_mailer(smtp, log, smtp_security="none", retries=3, on_failure=failures.append)
    assert await mailer.send("a@example.org", "s", "t") is False
    assert failures == ["auth"]  # permanent: no retries
    assert "retrying" not in caplog.text
    assert "Mailer.smtp_security" in caplog.text
    assert smtp.messages == []


async def test_password_file(smtp, log, tmp_path):
    secret = tmp_path / "smtp-password"
    secret.write_text(smtp.password + "\n")
    mailer = make_mailer(smtp, log, smtp_password="wrong", smtp_password_file=str(secret))
    assert await mailer.send("x@example.org", "hello", "body") is True
    assert smtp.messages[0].login == "mailer"


async def test_dead_smtp_server_returns_false_after_bounded_retries(log, caplog):
    failures: list[str] = []
    mailer = Mailer(
        smtp_host="127.0.0.1",
        smtp_port=free_port(),  # nothing listens here
        smtp_security="starttls",
        smtp_username="mailer",
        smtp_password="s3cret-pw",
        timeout=2,
        retries=2,
        retry_backoff=0.01,
        on_failure=failures.append,
        log=log,
    )
    sent_log = MemorySentLog()
    notifier = make_notifier(mailer, sent_log)

    assert await notifier.notify("suspended", "alice", context(), "snap-1") is False

    assert failures == ["connect"]
    assert mailer.failure_count == 1 and mailer.sent_count == 0
    retries = [r for r in caplog.records if "retrying in" in r.getMessage()]
    assert len(retries) == 2
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert any("after 3 attempts" in m and "alice/" in m and "smtp_host" in m for m in errors)
    assert "s3cret-pw" not in caplog.text
    # recorded before sending: a failed send is never repeated by the next loop
    assert ("alice/", "suspended", "snap-1") in sent_log.rows
    assert await notifier.notify("suspended", "alice", context(), "snap-1") is False
    assert failures == ["connect"]
    assert notifier.undeliverable["alice"].startswith("sending failed")


async def test_async_on_failure_is_awaited(log):
    seen: list[str] = []

    async def on_failure(reason: str) -> None:
        seen.append(reason)

    mailer = Mailer(
        smtp_host="127.0.0.1",
        smtp_port=free_port(),
        smtp_security="none",
        retries=0,
        on_failure=on_failure,
        log=log,
    )
    assert await mailer.send("a@example.org", "s", "t") is False
    assert seen == ["connect"]


async def test_wrong_password_is_not_retried(smtp, log, caplog):
    failures: list[str] = []
    mailer = make_mailer(smtp, log, smtp_password="not-it", retries=3, on_failure=failures.append)
    assert await mailer.send("a@example.org", "s", "t") is False
    assert failures == ["auth"]
    assert smtp.auth_failures >= 1  # the server said no
    assert "after 1 attempt:" in caplog.text  # permanent: one attempt, not four
    assert "retrying" not in caplog.text
    assert smtp.messages == []
    assert "smtp_password" in caplog.text  # the log names the fix
    assert "not-it" not in caplog.text


async def test_untrusted_certificate_names_the_fix(smtp, log, caplog):
    failures: list[str] = []
    mailer = make_mailer(smtp, log, tls_ca_file="", retries=3, on_failure=failures.append)
    assert await mailer.send("a@example.org", "s", "t") is False
    assert failures == ["tls"]
    assert "tls_ca_file" in caplog.text
    assert smtp.messages == []

    trusting = make_mailer(smtp, log, tls_ca_file="", tls_verify=False)
    assert await trusting.send("a@example.org", "s", "t") is True


async def test_notify_soon_runs_in_background(smtp, log):
    notifier = make_notifier(make_mailer(smtp, log))
    task = notifier.notify_soon("warning", "alice", context(), "idle-1")
    await notifier.drain(timeout=30)
    assert task.done() and task.result() is True
    assert len(smtp.messages) == 1


# --- exactly once -------------------------------------------------------------------------------


async def test_same_event_twice_sends_once(smtp, log):
    notifier = make_notifier(make_mailer(smtp, log))
    assert await notifier.notify("warning", "alice", context(), "idle-1") is True
    assert await notifier.notify("warning", "alice", context(), "idle-1") is False
    assert len(smtp.messages) == 1
    # another event, or another kind of the same event, is a new message
    assert await notifier.notify("warning", "alice", context(), "idle-2") is True
    assert await notifier.notify("suspended", "alice", context(), "idle-2") is True
    subjects = [m.subject for m in smtp.messages]
    assert [" will be suspended" in s for s in subjects] == [True, True, False]
    assert " was suspended" in subjects[2]


async def test_restart_does_not_resend(smtp, log):
    sent_log = MemorySentLog()
    first = make_notifier(make_mailer(smtp, log), sent_log)
    assert await first.notify("suspended", "alice", context(), "snap-1") is True

    restarted = make_notifier(make_mailer(smtp, log), sent_log)
    assert await restarted.notify("suspended", "alice", context(), "snap-1") is False
    assert len(smtp.messages) == 1


async def test_racing_senders_send_once(smtp, log):
    sent_log = MemorySentLog()
    a = make_notifier(make_mailer(smtp, log), sent_log)
    b = make_notifier(make_mailer(smtp, log), sent_log)
    results = await asyncio.gather(
        a.notify("warning", "alice", context(), "idle-1"),
        b.notify("warning", "alice", context(), "idle-1"),
    )
    assert sorted(results) == [False, True]
    assert len(smtp.messages) == 1


async def test_with_the_service_store(smtp, log, tmp_path):
    from jupyterhub_gpusnap.store import Store

    db = f"sqlite:///{tmp_path / 'gpusnap.sqlite'}"
    first = make_notifier(make_mailer(smtp, log), Store(db))
    assert await first.notify("warning", "alice", context(), "idle-1") is True
    assert await first.notify("warning", "alice", context(), "idle-1") is False

    second = make_notifier(make_mailer(smtp, log), Store(db))  # a service restart
    assert await second.notify("warning", "alice", context(), "idle-1") is False
    assert len(smtp.messages) == 1


async def test_failed_send_is_released_in_the_store_and_sent_later(log, tmp_path):
    from jupyterhub_gpusnap.store import Store

    store = Store(f"sqlite:///{tmp_path / 'gpusnap.sqlite'}")
    server = SmtpServer(tmp_path)  # its port, not listening yet
    notifier = make_notifier(make_mailer(server, log, retries=1), store)
    assert await notifier.notify("suspended", "alice", context(), "snap-1") is False
    assert store.notification_sent("alice/", "suspended", "snap-1") is False

    server.start()
    try:
        assert await notifier.notify("suspended", "alice", context(), "snap-1") is True
        assert await notifier.notify("suspended", "alice", context(), "snap-1") is False
        assert len(server.messages) == 1
    finally:
        server.stop()


@pytest.mark.e2e
async def test_service_cycle_with_a_real_hub(hub_factory, smtp, log, tmp_path):
    """warning -> suspended -> restored for a real hub user whose address is in auth_state."""
    import secrets

    from jupyterhub_gpusnap.app import GpuSnap
    from jupyterhub_gpusnap.checkpoint.base import CheckpointInfo
    from jupyterhub_gpusnap.hub import HubClient
    from jupyterhub_gpusnap.model import State
    from jupyterhub_gpusnap.notify import ServiceNotifier
    from jupyterhub_gpusnap.policy import ServerStatus
    from jupyterhub_gpusnap.store import Store

    hub = await hub_factory(
        "c.Authenticator.enable_auth_state = True\n",
        env={"JUPYTERHUB_CRYPT_KEY": secrets.token_hex(32)},
    )
    await hub.ensure_user("alice")
    auth_state = {"access_token": "gho_not_for_email", "oauth_user": {"email": "alice@uni.example"}}
    code, body = await hub.api("PATCH", "/users/alice", {"auth_state": auth_state})
    assert code == 200, body

    app = GpuSnap(
        public_url=hub.url, service_prefix="/services/gpusnap/", max_keep_running=8 * 3600
    )
    app.hub = HubClient(api_url=hub.api_url, api_token=hub.admin_token)
    db = f"sqlite:///{tmp_path / 'gpusnap.sqlite'}"

    def service_notifier(store: Store) -> ServiceNotifier:
        n = ServiceNotifier(
            sent_log=store,
            public_url=app.public_url,
            service_prefix=app.service_prefix,
            max_keep_running=app.max_keep_running,
            hub=app.hub,
            mailer=make_mailer(smtp, log),
            address_from="auth_state",
            auth_state_key="oauth_user.email",
            send_restored=True,
            retention_days=21,
            log=log,
        )
        n.clock = lambda: NOW
        return n

    t = NOW.timestamp()
    status = ServerStatus(
        key="alice/",
        user="alice",
        state=State.warned,
        state_since=t,
        last_active=t - 75 * 60,
        started=t - 5 * 3600,
        last_sample={"gpu_percent": 0.0, "cpu_percent": 0.4, "kernels": 2},
    )
    info = CheckpointInfo(
        id="alice--20261122T2115",
        user="alice",
        server_name="",
        created=t + 15 * 60,
        status="verified",
        image_bytes=9556302233,
        gpu_bytes=2684354560,
        gpu_model="NVIDIA H100 80GB HBM3",
        gpu_count=1,
        extra={"kernels": ["python3", "python3"]},
    )

    async def cycle(notifier: ServiceNotifier) -> list[bool]:
        results = []
        warn = {"suspend_at": t + 15 * 60, "idle_seconds": 75 * 60}
        results.append(await (await notifier.notify_event("warning", status, "1", warn)))
        status.state = State.suspended
        results.append(
            await (await notifier.notify_event("suspended", status, "2", info.as_dict()))
        )
        status.state, status.restored_at = State.active, t + 3600
        results.append(await (await notifier.notify_event("restored", status, "3", info.as_dict())))
        return results

    assert await cycle(service_notifier(Store(db))) == [True, True, True]
    assert await cycle(service_notifier(Store(db))) == [False, False, False]  # a restart

    warning, suspended, restored = smtp.messages
    for got in (warning, suspended, restored):
        assert got.rcpt_tos == ["alice@uni.example"]
        assert "gho_not_for_email" not in got.message.as_string()
    assert (
        warning.subject
        == "[JupyterHub] Your server alice/ will be suspended at 2026-11-22 21:15 UTC"
    )
    text = warning.part("plain")
    assert f"{hub.url}services/gpusnap/keep/alice/" in text
    assert "(up to 8 hours)" in text
    assert "idle for 1 hour 15 minutes" in text
    assert "GPU 0 % busy" in text and "2 kernels, none busy" in text

    assert suspended.subject.startswith("[JupyterHub] Your server alice/ was suspended")
    text = suspended.part("plain")
    assert "suspended at 2026-11-22 21:15 UTC" in text
    assert "snapshot: 8.9 GiB" in text
    assert "GPU memory: 2.5 GiB on NVIDIA H100 80GB HBM3" in text
    assert "2 kernels (python3, python3)" in text
    assert "kept for 21 days" in text
    assert hub.server_url("alice") in text

    assert restored.subject == "[JupyterHub] Your server alice/ was restored from its snapshot"
    assert "restored at 2026-11-22 22:00 UTC" in restored.part("plain")


# --- addresses and opt-out ----------------------------------------------------------------------


async def test_address_from_auth_state_path(smtp, log):
    notifier = make_notifier(
        make_mailer(smtp, log), address_from="auth_state", auth_state_key="oauth_user.email"
    )
    auth_state = {"access_token": "gho_secret", "oauth_user": {"email": "a.lice@uni.example"}}
    assert await notifier.resolve_address("alice", auth_state) == "a.lice@uni.example"
    assert await notifier.resolve_address("alice", {"oauth_user": {}}) is None
    assert await notifier.resolve_address("alice", {"oauth_user": "x"}) is None
    assert await notifier.resolve_address("alice", None) is None

    assert await notifier.notify("warning", "alice", context(), "idle-1", auth_state=auth_state)
    assert smtp.messages[0].rcpt_tos == ["a.lice@uni.example"]
    assert "gho_secret" not in smtp.messages[0].message.as_string()


async def test_address_from_template_and_callables(smtp, log):
    mailer = make_mailer(smtp, log)
    templ = make_notifier(
        mailer, address_from="template", address_template="{username}@lab.example"
    )
    assert await templ.resolve_address("bob") == "bob@lab.example"

    def directory(username, auth_state):
        return {"bob": "robert@lab.example"}.get(username)

    sync = make_notifier(mailer, address_from="callable", address_callable=directory)
    assert await sync.resolve_address("bob", None) == "robert@lab.example"
    assert await sync.resolve_address("nobody", None) is None

    async def lookup(username, auth_state):
        await asyncio.sleep(0)
        return f"{username}.{auth_state['dept']}@lab.example"

    asynchronous = make_notifier(mailer, address_from="callable", address_callable=lookup)
    assert await asynchronous.resolve_address("bob", {"dept": "bio"}) == "bob.bio@lab.example"
    assert await asynchronous.notify("suspended", "bob", context("bob"), "s1", {"dept": "bio"})
    assert smtp.messages[0].rcpt_tos == ["bob.bio@lab.example"]


async def test_malformed_addresses_are_refused(smtp, log):
    for bad in ("not an address", "a@b.org\nBcc: everyone@example.org", "<a@b.org>", ""):
        notifier = make_notifier(
            make_mailer(smtp, log),
            address_from="callable",
            address_callable=lambda u, s, bad=bad: bad,
        )
        assert await notifier.resolve_address("x") is None, bad


async def test_user_without_address_is_logged_once(smtp, log, caplog):
    notifier = make_notifier(make_mailer(smtp, log), address_from="auth_state")
    for ref in ("idle-1", "idle-2", "idle-3"):
        assert (
            await notifier.notify("warning", "gina", context("gina"), ref, auth_state={}) is False
        )
    warnings = [r.getMessage() for r in caplog.records if "No email address" in r.getMessage()]
    assert len(warnings) == 1
    assert "gina/" in warnings[0] and "enable_auth_state" in warnings[0]
    assert notifier.undeliverable == {"gina": "no email address"}
    assert smtp.messages == []

    # an address appears: mailed, and no longer listed as undeliverable
    ok = await notifier.notify(
        "warning", "gina", context("gina"), "idle-4", auth_state={"email": "gina@example.org"}
    )
    assert ok is True
    assert notifier.undeliverable == {}


async def test_opt_out_honoured_when_allowed(smtp, log):
    mailer = make_mailer(smtp, log)
    sent_log = MemorySentLog()
    allowed = make_notifier(mailer, sent_log, allow_opt_out=True)
    assert (
        await allowed.notify("warning", "hana", context("hana"), "idle-1", opted_out=True) is False
    )
    assert smtp.messages == []
    assert sent_log.rows == set()

    enforced = make_notifier(mailer, sent_log, allow_opt_out=False)
    assert await enforced.notify("warning", "hana", context("hana"), "idle-1", opted_out=True)
    assert smtp.messages[0].rcpt_tos == ["hana@example.org"]


# --- templates ----------------------------------------------------------------------------------


async def test_admin_template_override(smtp, log, tmp_path):
    overrides = tmp_path / "email-templates"
    overrides.mkdir()
    (overrides / "warning.subject.txt").write_text(
        "GPU reclaim notice for {{ server }} in {{ minutes_left }} min\n"
    )
    (overrides / "_base.html").write_text(
        "<html><body><img alt='Uni Lab'>{% block content %}{% endblock %}</body></html>\n"
    )
    notifier = make_notifier(make_mailer(smtp, log), template_paths=[str(overrides)])
    assert await notifier.notify("warning", "alice", context(), "idle-1")

    [got] = smtp.messages
    assert got.subject == "[JupyterHub] GPU reclaim notice for alice/ in 30 min"
    assert "<img alt='Uni Lab'>" in got.part("html")  # the admin's layout
    assert f"{HUB}/services/gpusnap/keep?server=alice/" in got.part("plain")  # built-in text


async def test_broken_admin_template_sends_nothing_and_claims_nothing(smtp, log, tmp_path, caplog):
    overrides = tmp_path / "email-templates"
    overrides.mkdir()
    (overrides / "warning.txt").write_text("Hello {{ username \n")
    sent_log = MemorySentLog()
    notifier = make_notifier(make_mailer(smtp, log), sent_log, template_paths=[str(overrides)])
    assert await notifier.notify("warning", "alice", context(), "idle-1") is False
    assert sent_log.rows == set()  # can be sent once the template is fixed
    assert "template error" in caplog.text and str(overrides) in caplog.text

    (overrides / "warning.txt").write_text("Hello {{ username }}, see {{ keep_url }}\n")
    notifier.template_paths = [str(overrides)]  # reloads
    assert await notifier.notify("warning", "alice", context(), "idle-1") is True
    assert smtp.messages[0].part("plain").startswith("Hello alice, see https://")


async def test_unknown_kind_is_refused_without_raising(smtp, log):
    notifier = make_notifier(make_mailer(smtp, log))
    assert await notifier.notify("party", "alice", context(), "x") is False
    assert smtp.messages == []


def test_formatting():
    assert format_size(9556302233) == "8.9 GiB"
    assert format_size(512) == "512 B"
    assert format_size(3 * 1024**2) == "3.0 MiB"
    assert format_size(None) == "unknown"
    assert format_minutes(45) == "45 minutes"
    assert format_minutes(61) == "1 hour 1 minute"
    assert format_minutes(60 * 24 + 120) == "1 day 2 hours"
    from zoneinfo import ZoneInfo

    assert format_time(NOW, ZoneInfo("UTC")) == "2026-11-22 21:00 UTC"
    assert format_time(NOW.timestamp(), ZoneInfo("America/New_York")) == "2026-11-22 16:00 EST"
    assert format_time("2026-11-22T21:00:00Z", ZoneInfo("Asia/Kolkata")) == "2026-11-23 02:30 IST"
    assert format_time(NOW, ZoneInfo("Asia/Dubai")) == "2026-11-23 01:00 UTC+04 (Asia/Dubai)"


def test_redact():
    assert "abc123" not in redact("GET /hub/api?token=abc123 failed")
    assert "abc123" not in redact("Authorization: token abc123")
    assert "pw" not in redact("smtp://user:pw@mail.example.org")
    assert redact("criu: pid 42 in use") == "criu: pid 42 in use"


# Sentences our code puts into failure messages (users' emails, the admin digest): each must
# reach the reader word for word, though they speak of tokens, keys and passwords.
OUR_SENTENCES = [
    "checkpoint alice/_default/20261125T133638.847123Z records no Hub API token to resume with",
    "alice/: cannot restore alice/_default/20261125T133638.847123Z now: chunk sealed with key "
    "'k2026', which is not in the key file: put that key back. The snapshot is kept; once the "
    "key is back in LocalBackend.encryption_key_file the next start restores it",
    "cannot restore checkpoint alice/gpu/20261125T133638.847123Z now: it is sealed with key "
    "'k1', which is not in LocalBackend.encryption_key_file (/etc/jupyterhub-gpusnap/keys): "
    "put that key back; the snapshot is kept and the next start restores it",
    "send 'Authorization: Bearer <token>'",
    "the API server did not accept our token for GET /api/v1/namespaces/jhub/pods/jupyter-alice",
    "check token_file: it must be a valid ServiceAccount token",
    "no token for the node agent (/var/run/secrets/kubernetes.io/serviceaccount/token: No such "
    "file or directory): set AgentConnection.agent_api_token",
    "encryption key file /etc/jupyterhub-gpusnap/keys, line 2: expected '<id> <base64 key>'",
    "chunk fails authentication under key 'k1'",
    "alice/gpu: 3.2 GiB free in /var/lib/jupyterhub-gpusnap/checkpoints/alice/gpu, the image "
    "needs 8.9 GiB: free space, move checkpoint_dir, or lower keep_last/max_age_days",
    "alice/: cannot start the image streamer in /dev/shm/gpusnap-restore-k3j_x8qa: "
    "[Errno 28] No space left on device",
    "checkpoint alice/_default/20261125T133638.847123Z cannot be restored here: it was taken "
    "on NVIDIA H100 80GB HBM3 with driver 580.159.04 (this host: NVIDIA-A100-SXM4-80GB)",
    "pod jupyter-user-40example-2ecom is not on node gpu-node-7",
    "the server's token was not revoked: HTTP 403: Forbidden",
]


@pytest.mark.parametrize("sentence", OUR_SENTENCES)
def test_redact_leaves_our_sentences_readable(sentence):
    assert redact(sentence) == sentence


def test_redact_removes_real_secrets():
    import base64
    import secrets

    hub_token = secrets.token_hex(16)  # what JupyterHub issues
    key = base64.b64encode(bytes(range(7, 39))).decode()  # an encryption key line's key
    urlsafe = "Zk3qP0wXvY7aR2sN9dLmT5hQ8jB4cE6g"  # secrets.token_urlsafe(24)-like
    cases = {
        f"Hub said 403 for GET /hub/api/user?token={hub_token}": hub_token,
        f"Authorization: token {hub_token}": hub_token,
        f"request failed: Authorization: Bearer {urlsafe}": urlsafe,
        f"JUPYTERHUB_API_TOKEN={hub_token} in the environment": hub_token,
        f'manifest said {{"api_token": "{hub_token}"}}': hub_token,
        "login failed with smtp_password=Tr0ub4dor&3 for mailer": "Tr0ub4dor",
        "password: correcthorsebattery": "correcthorsebattery",
        "X-Api-Key: 9QzL-51xT_kd0pWm": "9QzL-51xT_kd0pWm",
        "postgresql://gpusnap:hunter2@db/gpusnap refused": "hunter2",
        f"key file line: k1 {key}": key,
        f"token {hub_token} was revoked": hub_token,
        f"unsealed {urlsafe} by accident": urlsafe,
    }
    for text, secret in cases.items():
        out = redact(text)
        assert secret not in out, (text, out)
        assert "[redacted]" in out
    # the words around a secret stay
    assert redact(f"token {hub_token} was revoked") == "token [redacted] was revoked"
    assert redact(f"Authorization: token {hub_token}") == "Authorization: token [redacted]"


async def test_emails_quote_the_backends_retention(smtp, log, tmp_path):
    """The restore_failed and suspended emails say how long the backend really keeps a
    snapshot (LocalBackend.max_age_days), and no number for a backend that deletes none."""
    from types import SimpleNamespace

    from jupyterhub_gpusnap.checkpoint.base import CheckpointBackend
    from jupyterhub_gpusnap.checkpoint.local import LocalBackend
    from jupyterhub_gpusnap.model import State
    from jupyterhub_gpusnap.notify import ServiceNotifier
    from jupyterhub_gpusnap.policy import ServerStatus

    t = NOW.timestamp()
    status = ServerStatus(key="carol/", user="carol", state=State.active, state_since=t,
                          last_active=t, started=t, restored_at=t, failure="criu restore failed")  # fmt: skip
    detail = {"created": t - 3600, "error": "criu restore failed"}

    async def mail(backend, **settings) -> list:
        app = SimpleNamespace(public_url=HUB, service_prefix="/services/gpusnap/", backend=backend)
        notifier = ServiceNotifier(sent_log=MemorySentLog(), public_url=app.public_url,
                                   service_prefix=app.service_prefix, backend=app.backend,
                                   mailer=make_mailer(smtp, log),
                                   address_from="template", address_template="{username}@example.org",
                                   log=log, **settings)  # fmt: skip
        notifier.clock = lambda: NOW
        before = len(smtp.messages)
        assert await (await notifier.notify_event("restore_failed", status, "r1", detail))
        assert await (await notifier.notify_event("suspended", status, "s1", detail))
        return smtp.messages[before:]

    local = LocalBackend(checkpoint_dir=str(tmp_path / "ckpt"), max_age_days=30)
    failed, suspended = await mail(local)
    for body in (failed.part("plain"), failed.part("html")):
        assert "kept for 30 days" in body and "14" not in body
    assert "The snapshot is kept for 30 days" in suspended.part("plain")

    local.max_age_days = 7.5
    failed, _ = await mail(local)
    assert "kept for 7.5 days" in failed.part("plain")

    # a backend with no retention by age: the emails promise no number of days
    failed, suspended = await mail(CheckpointBackend())
    for body in (failed.part("plain"), failed.part("html"), suspended.part("plain")):
        assert " days" not in body, body
    assert "Your snapshot is not lost: it is kept, so an admin" in failed.part("plain")

    # an admin whose registry deletes snapshots after 21 days says so
    failed, _ = await mail(CheckpointBackend(), retention_days=21)
    assert "kept for 21 days" in failed.part("plain")


async def test_admin_digest_redacts_failure_messages(smtp, log):
    hub_token = "0123456789abcdef0123456789abcdef"
    notifier = make_notifier(make_mailer(smtp, log), digest_to=["admins@example.org"])
    failed = [
        {"server": "frank/", "error": f"restore failed: Hub said 403 for ?token={hub_token}"},
        {"server": "gina/", "error": OUR_SENTENCES[0]},
    ]
    stats = dict(gpu_hours=1, suspensions=1, restores=0, failures=2, failed_servers=failed)
    assert await notifier.send_digest(stats, NOW.date()) is True
    [got] = smtp.messages
    for body in (got.part("plain"), got.part("html")):
        assert hub_token not in body
        assert "frank/" in body and "Hub said 403 for ?token=[redacted]" in body
        assert "records no Hub API token to resume with" in body  # readable


def test_bad_timezone_names_the_fix():
    from traitlets import TraitError

    with pytest.raises(TraitError, match="IANA"):
        Notifier(MemorySentLog(), timezone="Mars/Olympus")
