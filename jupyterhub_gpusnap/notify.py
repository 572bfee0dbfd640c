"""Email users before and after their server is suspended, and admins once a day.

Two parts, one job each:

- :class:`Mailer` delivers one message over SMTP (aiosmtplib): plain, STARTTLS or
  implicit TLS, optional login, bounded retries with exponential backoff. It never
  raises into the caller: a failure is logged, counted and reported to ``on_failure``,
  because an email must never block or undo a checkpoint.
- :class:`Notifier` decides *whether* and *to whom* a message goes (address lookup,
  opt-out, exactly-once through the service's database) and renders it from Jinja2
  templates (text + HTML) that an admin can override file by file.

Exactly-once: :meth:`Notifier.notify` claims the event in ``sent_log`` (the service's
``Store``) *before* sending. A crash between the claim and the send loses at most one
email; it never sends two, also across restarts and between racing senders (the
database's unique constraint decides who claimed it).
"""

from __future__ import annotations

import asyncio
import email.utils
import inspect
import math
import re
import socket
import ssl
from collections.abc import Callable
from datetime import date, datetime, timezone
from email.message import EmailMessage
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import quote
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

import aiosmtplib
import jinja2
import traitlets
from traitlets import (
    Bool,
    CaselessStrEnum,
    Float,
    Instance,
    Integer,
    List,
    TraitError,
    Unicode,
    default,
    observe,
    validate,
)
from traitlets.config import LoggingConfigurable

from .model import server_key

#: Messages sent to the server's user.
USER_KINDS = ("warning", "suspended", "restore_failed", "restored")
#: The daily message to admins (``Notifier.digest_to``).
DIGEST_KIND = "admin_digest"
#: ``sent_log`` key under which daily digests are recorded (not a server).
DIGEST_KEY = "*"

TEMPLATE_DIR = Path(__file__).parent / "templates" / "email"

_ADDRESS_RE = re.compile(r"[^@\s<>,;:\"'()\[\]]+@[^@\s<>,;:\"'()\[\]]+")

# Scrubbing error text before it reaches an email (or a log line): credentials go, words stay.
# A value: what follows a key up to a space, quote or separator; never a placeholder (<token>).
_VALUE = r"(?!<|\[redacted\])[^\s\"'&,;()<>\[\]]+"
# Names that hold a credential, alone or at the end of a compound name (smtp_password, api-key).
_KEY = (
    r"(?:[a-z0-9]+[_-])*(?:token|password|passwd|pwd|secret|api[_-]?key|access[_-]?key"
    r"|private[_-]?key|credentials?)"
)
# Authorization headers: the scheme stays, the credential goes.
_AUTH_RE = re.compile(
    r"(?i)\b((?:proxy-)?authorization[\"']?\s*[:=]\s*[\"']?(?:(?:bearer|token|basic)\s+)?)"
    r"(?!(?:bearer|token|basic)\s)(" + _VALUE + ")"
)
# key=value, key: value, "key": "value", ?key=value
_KEYVALUE_RE = re.compile(
    r"(?i)(?<![\w-])(" + _KEY + r")([\"']?\s*([=:])\s*[\"']?)(" + _VALUE + ")"
)
# a scheme's credential given as a word: "Bearer <credential>", "token <credential>"
_SCHEME_RE = re.compile(r"(?i)\b(bearer|token|basic)(\s+)(" + _VALUE + ")")
# user:password@ in a URL
_USERINFO_RE = re.compile(r"(?i)(\b[a-z][a-z0-9+.-]*://[^/\s:@]+:)[^@\s/]+@")
# long hex strings (Hub tokens are 32 hex digits, sealed tokens longer)
_HEX_RE = re.compile(r"(?<![\w+/=-])[0-9a-fA-F]{32,}(?![\w+/=-])")
# long base64 / base64url runs (keys, JWT parts); judged by looks_random()
_B64_RE = re.compile(r"(?<![\w+/=.-])[A-Za-z0-9+/_-]{20,}={0,2}(?![\w+/=-])")
_REDACTED = "[redacted]"


def looks_random(word: str) -> bool:
    """True for a word that reads like a generated secret rather than a name or a path.

    The word's longest part between ``/`` (a path is judged by its own parts) must be 16
    characters or more, mix letters and digits, be no dashed or underscored name (two
    or more of its ``-``/``_`` pieces words in one case, or three or more short pieces),
    and use its alphabet evenly: the Shannon entropy of its characters at least 80 % of
    the most its length allows. Random base64 passes (but for about 1 in 100 strings of
    32 random bytes); paths, identifiers, class names, UUIDs and timestamps do not.
    """
    part = max(word.split("/"), key=len)
    n = len(part)
    if n < 16 or not (any(c.isdigit() for c in part) and any(c.isalpha() for c in part)):
        return False
    pieces = re.split(r"[-_]", part)
    words = sum(
        1
        for piece in pieces
        if len(piece) >= 3 and piece.isalpha() and (piece.islower() or piece.isupper())
    )
    if words >= 2 or (len(pieces) >= 3 and max(map(len, pieces)) <= 10):
        return False  # a dashed name: gpusnap-restore-x1, NVIDIA-H100-80GB-HBM3, a UUID
    counts: dict[str, int] = {}
    for c in part:
        counts[c] = counts.get(c, 0) + 1
    entropy = -sum(k / n * math.log2(k / n) for k in counts.values())
    return entropy >= 0.8 * math.log2(min(n, 64))


def _secretish(value: str) -> bool:
    """A bare value that looks like a credential: random-looking, or long with digits."""
    value = value.strip("\"'.")
    if _HEX_RE.fullmatch(value) or looks_random(value):
        return True
    return len(value) >= 16 and any(c.isdigit() for c in value) and any(c.isalpha() for c in value)


def _key_value(m: re.Match) -> str:
    key, sep, value = m.group(1), m.group(3), m.group(4)
    # key=value (a query string, a config line) or a quoted key (JSON) is always a credential;
    # "key: value" in prose ("no token: put the key back") only when the value looks like one
    structured = sep == "=" or m.group(2)[:1] in "\"'" or "_" in key or "-" in key
    plain_secret = key.lower() in ("password", "passwd", "pwd", "secret")
    if structured or plain_secret or _secretish(value):
        return f"{key}{m.group(2)}{_REDACTED}"
    return m.group(0)


def redact(text: str) -> str:
    """Remove credentials from ``text`` (error messages, URLs), keep the words around them.

    Removed: values of credential keys (``token=…``, ``api_token: …``, ``"password": "…"``,
    ``?token=…``), ``Authorization:`` headers (``token …``, ``Bearer …``, ``Basic …``),
    ``user:password@`` in URLs, long hex strings (Hub tokens) and random-looking base64
    strings (keys). Kept: ordinary sentences that mention tokens and keys ("records no
    Hub API token to resume with", "sealed with key 'k1'"), paths and checkpoint ids.
    """
    text = _AUTH_RE.sub(lambda m: m.group(1) + _REDACTED, text)
    text = _KEYVALUE_RE.sub(_key_value, text)
    text = _SCHEME_RE.sub(
        lambda m: m.group(1) + m.group(2) + _REDACTED if _secretish(m.group(3)) else m.group(0),
        text,
    )
    text = _USERINFO_RE.sub(r"\1" + _REDACTED + "@", text)
    text = _HEX_RE.sub(_REDACTED, text)
    return _B64_RE.sub(lambda m: _REDACTED if looks_random(m.group(0)) else m.group(0), text)


async def _maybe_await(value: Any) -> Any:
    if inspect.isawaitable(value):
        return await value
    return value


class SentLog(Protocol):
    """What :class:`Notifier` needs from the service's database (``Store`` implements it).

    ``key`` is the server (``user/server_name``) or :data:`DIGEST_KEY`; ``kind`` one of
    :data:`USER_KINDS` or :data:`DIGEST_KIND`; ``event_ref`` names the event (e.g. a
    suspension's id), so one event gets one message of each kind. Methods may be sync or async.
    """

    def notification_sent(self, key: str, kind: str, event_ref: str) -> bool: ...

    def record_notification(self, key: str, kind: str, event_ref: str) -> bool: ...


# ---------------------------------------------------------------------------------------------
# Formatting helpers (Jinja2 filters)
# ---------------------------------------------------------------------------------------------


def format_size(n: Any) -> str:
    """Bytes as a person reads them: ``9556302233`` → ``"8.9 GiB"``."""
    if n is None or isinstance(n, jinja2.Undefined):
        return "unknown"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def format_minutes(minutes: Any) -> str:
    """A duration in minutes as words: ``125`` → ``"2 hours 5 minutes"``."""
    if minutes is None or isinstance(minutes, jinja2.Undefined):
        return "unknown"
    total = max(0, round(float(minutes)))
    days, rest = divmod(total, 24 * 60)
    hours, mins = divmod(rest, 60)
    parts = []
    for value, word in ((days, "day"), (hours, "hour"), (mins, "minute")):
        if value:
            parts.append(f"{value} {word}{'' if value == 1 else 's'}")
    return " ".join(parts) if parts else "0 minutes"


def to_datetime(value: Any) -> datetime | None:
    """Accept a datetime (naive means UTC), epoch seconds or an ISO 8601 string."""
    if value is None or isinstance(value, jinja2.Undefined) or value == "":
        return None
    if isinstance(value, datetime):
        dt = value
    elif isinstance(value, (int, float)):
        dt = datetime.fromtimestamp(value, timezone.utc)
    else:
        dt = datetime.fromisoformat(str(value).replace("Z", "+00:00"))
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=timezone.utc)
    return dt


def format_time(value: Any, zone: ZoneInfo) -> str:
    """A time in ``zone`` with the zone named: ``"2026-11-22 21:30 UTC"``."""
    dt = to_datetime(value)
    if dt is None:
        return "unknown"
    local = dt.astimezone(zone)
    abbrev = local.strftime("%Z")
    name = abbrev if abbrev and abbrev[0] not in "+-" else f"UTC{abbrev} ({zone.key})"
    return f"{local:%Y-%m-%d %H:%M} {name}"


def describe_kernels(kernels: Any) -> str:
    """``3`` → ``"3 kernels"``; ``["python3", "ir"]`` → ``"2 kernels (python3, ir)"``."""
    if kernels is None or isinstance(kernels, jinja2.Undefined):
        return "unknown"
    if isinstance(kernels, (list, tuple)):
        names = ", ".join(str(k) for k in kernels)
        count = len(kernels)
        return f"{count} kernel{'' if count == 1 else 's'}" + (f" ({names})" if names else "")
    count = int(kernels)
    return f"{count} kernel{'' if count == 1 else 's'}"


# ---------------------------------------------------------------------------------------------
# Mailer: one message over SMTP
# ---------------------------------------------------------------------------------------------


class Mailer(LoggingConfigurable):
    """Deliver email over SMTP with bounded retries; never raise into the caller."""

    smtp_host = Unicode(
        "localhost",
        help="""SMTP server to send through, e.g. ``smtp.example.org`` or a local relay.""",
    ).tag(config=True)

    smtp_port = Integer(
        0,
        help="""SMTP port. 0 picks the usual port for `smtp_security`:
        25 for "none", 587 for "starttls", 465 for "tls".""",
    ).tag(config=True)

    smtp_security = CaselessStrEnum(
        ["none", "starttls", "tls"],
        default_value="starttls",
        help="""How the connection is protected.

        - "starttls": connect in plain text, then upgrade with STARTTLS (port 587);
          fails if the server does not offer STARTTLS.
        - "tls": implicit TLS from the first byte (port 465, "SMTPS").
        - "none": no encryption, for a relay on localhost or a trusted network only
          (credentials would travel in clear text).
        """,
    ).tag(config=True)

    smtp_username = Unicode(
        "",
        help="""Login for the SMTP server. Empty: send without logging in.""",
    ).tag(config=True)

    smtp_password = Unicode(
        "",
        help="""Password for `smtp_username`. Prefer `smtp_password_file` so the password
        is not in the config file. Never logged.""",
    ).tag(config=True)

    smtp_password_file = Unicode(
        "",
        help="""File holding the SMTP password (e.g. a mounted Kubernetes secret); read at
        each send, so a rotated password is picked up. Wins over `smtp_password`.""",
    ).tag(config=True)

    from_address = Unicode(
        help="""Sender of every message, e.g. ``"GPU JupyterHub <jupyterhub@example.org>"``.
        Many relays only accept senders of their own domain. Default:
        ``jupyterhub@<this host's fully qualified name>``.""",
    ).tag(config=True)

    @default("from_address")
    def _default_from(self) -> str:
        return f"JupyterHub <jupyterhub@{socket.getfqdn()}>"

    reply_to = Unicode(
        "",
        help="""Reply-To address, e.g. the admins' support address, so replies reach a person.
        Empty: no Reply-To header.""",
    ).tag(config=True)

    timeout = Float(
        30.0,
        help="""Seconds to wait for the SMTP server at each step (connect, TLS, each command)
        of one attempt.""",
    ).tag(config=True)

    retries = Integer(
        3,
        min=0,
        help="""How many times to try again after a failed attempt (so 1 + retries attempts).
        Permanent refusals (5xx answers such as a bad login or an unknown recipient, and
        certificate errors) are not retried.""",
    ).tag(config=True)

    retry_backoff = Float(
        5.0,
        min=0,
        help="""Seconds to wait before the first retry; each further retry waits twice as
        long as the one before (5, 10, 20 … seconds), capped by `retry_backoff_max`.""",
    ).tag(config=True)

    retry_backoff_max = Float(
        300.0,
        min=0,
        help="""Longest wait between two attempts, in seconds.""",
    ).tag(config=True)

    tls_verify = Bool(
        True,
        help="""Verify the SMTP server's TLS certificate and host name. Turn off only for a
        test relay; prefer pointing `tls_ca_file` at the CA that signed its certificate.""",
    ).tag(config=True)

    tls_ca_file = Unicode(
        "",
        help="""PEM file of CA certificates to trust for the SMTP server (e.g. an internal CA
        or a self-signed certificate). Empty: the system's trusted CAs.""",
    ).tag(config=True)

    on_failure = traitlets.Callable(
        None,
        allow_none=True,
        help="""Called as ``on_failure(reason)`` after a message could not be delivered (all
        retries spent); ``reason`` is one of "connect", "tls", "auth", "refused", "timeout",
        "error". The service turns it into a Prometheus counter. May be async.""",
    )

    sent_count = Integer(0, help="Messages delivered since start.")
    failure_count = Integer(0, help="Messages given up on since start.")
    last_error = Unicode("", help="The last delivery error (redacted), for the admin page.")

    def _password(self) -> str:
        if self.smtp_password_file:
            return Path(self.smtp_password_file).read_text().strip("\r\n")
        return self.smtp_password

    def _port(self) -> int:
        if self.smtp_port:
            return self.smtp_port
        return {"none": 25, "starttls": 587, "tls": 465}[self.smtp_security]

    def _tls_context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=self.tls_ca_file or None)
        if not self.tls_verify:
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
        return ctx

    def build_message(
        self,
        to: list[str],
        subject: str,
        text: str,
        html: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> EmailMessage:
        """A multipart/alternative message (text first, HTML preferred by mail clients)."""
        msg = EmailMessage()
        msg["From"] = self.from_address
        msg["To"] = ", ".join(to)
        msg["Subject"] = " ".join(subject.split())  # one line: no header injection
        msg["Date"] = email.utils.formatdate(localtime=False, usegmt=True)
        domain = email.utils.parseaddr(self.from_address)[1].rpartition("@")[2] or None
        msg["Message-ID"] = email.utils.make_msgid(domain=domain)
        # RFC 3834: stops vacation auto-replies from answering a machine.
        msg["Auto-Submitted"] = "auto-generated"
        if self.reply_to:
            msg["Reply-To"] = self.reply_to
        for name, value in (headers or {}).items():
            msg[name] = value
        msg.set_content(text)
        if html is not None:
            msg.add_alternative(html, subtype="html")
        return msg

    @staticmethod
    def _classify(exc: BaseException) -> tuple[str, bool, str]:
        """(reason, permanent, what the admin should check) for a delivery error."""
        if isinstance(exc, ssl.SSLCertVerificationError) or (
            isinstance(exc, aiosmtplib.SMTPException) and isinstance(exc.__cause__, ssl.SSLError)
        ):
            return (
                "tls",
                True,
                "set Mailer.tls_ca_file to the CA of the SMTP server's certificate "
                "(or Mailer.tls_verify=False for a test relay)",
            )
        if isinstance(exc, ssl.SSLError):
            return (
                "tls",
                False,
                "check Mailer.smtp_security matches the port (465: tls, 587: starttls)",
            )
        if isinstance(exc, aiosmtplib.SMTPAuthenticationError):
            return "auth", True, "check Mailer.smtp_username and Mailer.smtp_password(_file)"
        if isinstance(exc, aiosmtplib.SMTPRecipientsRefused):
            permanent = all(r.code >= 500 for r in exc.recipients)
            return "refused", permanent, "check the recipient address"
        if isinstance(exc, aiosmtplib.SMTPResponseException):
            if "STARTTLS" in exc.message or "starttls" in exc.message.lower():
                return "tls", True, "check Mailer.smtp_security (the server wants STARTTLS)"
            return "refused", exc.code >= 500, "see the SMTP server's answer"
        if isinstance(exc, aiosmtplib.SMTPException) and "AUTH extension" in str(exc):
            return (
                "auth",
                True,
                "the server offers no login here: leave Mailer.smtp_username empty, or check "
                "Mailer.smtp_security (many servers offer login only over TLS)",
            )
        if isinstance(exc, aiosmtplib.SMTPException) and "STARTTLS" in str(exc):
            return "tls", True, "set Mailer.smtp_security='none' or 'tls' for this server"
        if isinstance(exc, (aiosmtplib.SMTPTimeoutError, asyncio.TimeoutError, TimeoutError)):
            return "timeout", False, "check Mailer.smtp_host/smtp_port and Mailer.timeout"
        if isinstance(exc, (aiosmtplib.SMTPConnectError, OSError)):
            return "connect", False, "is an SMTP server listening at Mailer.smtp_host:smtp_port?"
        return "error", False, "see the error"

    async def send(
        self,
        to: str | list[str],
        subject: str,
        text: str,
        html: str | None = None,
        *,
        headers: dict[str, str] | None = None,
        label: str = "",
    ) -> bool:
        """Deliver one message; True when the SMTP server accepted it.

        Parameters
        ----------
        to
            Recipient address(es).
        subject, text, html
            The message; ``html`` adds a text/html alternative.
        headers
            Extra headers.
        label
            What the message is about (e.g. ``"warning for alice/"``), for log lines.

        Never raises (except cancellation): a failure after ``1 + retries`` attempts is
        logged, counted in :attr:`failure_count` and passed to :attr:`on_failure`.
        """
        recipients = [to] if isinstance(to, str) else list(to)
        label = label or "message"
        try:
            msg = self.build_message(recipients, subject, text, html, headers)
            password = self._password() if self.smtp_username else None
        except Exception as exc:  # bad header value, unreadable password file
            return await self._give_up(label, exc, "error", "check the Mailer configuration")

        attempts = 1 + self.retries
        for attempt in range(1, attempts + 1):
            try:
                await aiosmtplib.send(
                    msg,
                    sender=email.utils.parseaddr(self.from_address)[1] or self.from_address,
                    recipients=recipients,
                    hostname=self.smtp_host,
                    port=self._port(),
                    username=self.smtp_username or None,
                    password=password,
                    use_tls=self.smtp_security == "tls",
                    start_tls=self.smtp_security == "starttls",
                    tls_context=self._tls_context() if self.smtp_security != "none" else None,
                    timeout=self.timeout,
                )
            except Exception as exc:
                reason, permanent, fix = self._classify(exc)
                if permanent or attempt == attempts:
                    return await self._give_up(label, exc, reason, fix, attempt)
                delay = min(self.retry_backoff * 2 ** (attempt - 1), self.retry_backoff_max)
                self.log.warning(
                    "Email %s: attempt %d/%d failed (%s), retrying in %.1fs",
                    label,
                    attempt,
                    attempts,
                    redact(f"{type(exc).__name__}: {exc}"),
                    delay,
                )
                await asyncio.sleep(delay)
            else:
                self.sent_count += 1
                self.log.info("Email %s sent to %s", label, ", ".join(recipients))
                return True
        raise AssertionError("unreachable")

    async def _give_up(
        self, label: str, exc: BaseException, reason: str, fix: str, attempts: int = 0
    ) -> bool:
        self.failure_count += 1
        self.last_error = redact(f"{type(exc).__name__}: {exc}")
        tried = f" after {attempts} attempt{'s' if attempts != 1 else ''}" if attempts else ""
        self.log.error(
            "Email %s not sent%s: %s (%s) — %s", label, tried, self.last_error, reason, fix
        )
        if self.on_failure is not None:
            try:
                await _maybe_await(self.on_failure(reason))
            except Exception:
                self.log.exception("Mailer.on_failure raised for email %s", label)
        return False


# ---------------------------------------------------------------------------------------------
# Notifier: whom, whether, what
# ---------------------------------------------------------------------------------------------


class Notifier(LoggingConfigurable):
    """Find a user's address, render a message from templates, send it once per event."""

    address_from = CaselessStrEnum(
        ["auth_state", "template", "callable"],
        default_value="auth_state",
        help="""Where a user's email address comes from.

        - "auth_state": from the user's auth_state at `auth_state_key` (e.g. the OAuth
          ``email`` claim). Needs ``c.Authenticator.enable_auth_state = True`` and the
          ``admin:auth_state`` scope for the service.
        - "template": `address_template` filled with the user name.
        - "callable": `address_callable`.
        """,
    ).tag(config=True)

    auth_state_key = Unicode(
        "email",
        help="""Dotted path to the address inside auth_state, e.g. ``"email"`` or
        ``"oauth_user.email"`` (GenericOAuthenticator keeps the userinfo under
        ``oauth_user``). Used when `address_from` is "auth_state".""",
    ).tag(config=True)

    address_template = Unicode(
        "",
        help="""Address built from the user name when `address_from` is "template",
        e.g. ``"{username}@example.org"``.""",
    ).tag(config=True)

    address_callable = traitlets.Callable(
        None,
        allow_none=True,
        help="""``address_callable(username, auth_state) -> str | None`` (may be async), used
        when `address_from` is "callable"; e.g. a lookup in a directory. ``auth_state`` is a
        dict or None. Return None for "no address".""",
    ).tag(config=True)

    allow_opt_out = Bool(
        True,
        help="""Whether users may opt out of these emails (the service passes their choice as
        ``opted_out``). False: everyone gets them, as admins of shared clusters may require.""",
    ).tag(config=True)

    template_paths = List(
        Unicode(),
        help="""Directories searched for email templates before the built-in ones. To change
        a message, copy its file from ``jupyterhub_gpusnap/templates/email`` (e.g.
        ``warning.txt``, ``warning.html``, ``warning.subject.txt``, ``_base.html``) into one
        of these directories and edit it; files you do not copy stay the built-in ones.""",
    ).tag(config=True)

    contact = Unicode(
        "",
        help="""Who users should contact when something went wrong, as shown in emails, e.g.
        ``"hpc-support@example.org"`` or ``"#gpu-help on chat"``.""",
    ).tag(config=True)

    subject_prefix = Unicode(
        "[JupyterHub] ",
        help="""Put in front of every subject, so users can filter these emails.""",
    ).tag(config=True)

    send_restored = Bool(
        False,
        help="""Also email users when their server was restored from its checkpoint (off by
        default: they are usually looking at it).""",
    ).tag(config=True)

    digest_to = List(
        Unicode(),
        help="""Admin addresses for the daily digest (GPU-hours given back, suspensions,
        restores, failures, users who could not be mailed). Empty: no digest.""",
    ).tag(config=True)

    digest_hour = Integer(
        7,
        min=0,
        max=23,
        help="""Hour of the day (in `timezone`) from which the daily digest is sent.""",
    ).tag(config=True)

    timezone = Unicode(
        "UTC",
        help="""IANA time zone for times in emails, e.g. ``"Europe/Berlin"``; times show the
        zone's name (``2026-11-22 22:30 CET``).""",
    ).tag(config=True)

    @validate("timezone")
    def _check_timezone(self, proposal: dict) -> str:
        try:
            ZoneInfo(proposal["value"])
        except (ZoneInfoNotFoundError, ValueError) as exc:
            raise TraitError(
                f"Notifier.timezone={proposal['value']!r} is not an IANA time zone "
                "(e.g. 'UTC', 'Europe/Berlin')"
            ) from exc
        return proposal["value"]

    release_on_failure = Bool(
        True,
        help="""When a message could not be delivered (all retries spent), release its claim in
        the service's database, so a later attempt for the same event may send it. The small
        risk: a duplicate, if the SMTP server took the message but its answer was lost. False:
        strictly at most once; a failed message is never tried again.""",
    ).tag(config=True)

    mailer = Instance(Mailer, help="Sends the messages; configured as ``c.Mailer``.")

    @default("mailer")
    def _default_mailer(self) -> Mailer:
        return Mailer(parent=self)

    sent_log = traitlets.Any(
        help="""Records which messages were sent (``notification_sent`` and
        ``record_notification``; the service's Store)."""
    )

    clock = traitlets.Callable(
        help="""Returns the current time (aware datetime); replaceable in tests."""
    )

    @default("clock")
    def _default_clock(self) -> Callable[[], datetime]:
        return lambda: datetime.now(timezone.utc)

    def __init__(self, sent_log: SentLog, mailer: Mailer | None = None, **kwargs: Any) -> None:
        super().__init__(sent_log=sent_log, **kwargs)
        if mailer is not None:
            self.mailer = mailer
        #: username -> why they could not be mailed (no address, failed send); for the digest.
        self.undeliverable: dict[str, str] = {}
        self._no_address_logged: set[str] = set()
        self._env: jinja2.Environment | None = None
        self._tasks: set[asyncio.Task] = set()

    # -- templates ---------------------------------------------------------------------------

    @observe("template_paths", "timezone")
    def _reset_env(self, change: dict) -> None:
        self._env = None

    @property
    def env(self) -> jinja2.Environment:
        """The Jinja2 environment: admin directories first, then the built-in templates."""
        if self._env is None:
            zone = ZoneInfo(self.timezone)
            env = jinja2.Environment(
                loader=jinja2.FileSystemLoader([*self.template_paths, str(TEMPLATE_DIR)]),
                autoescape=jinja2.select_autoescape(
                    enabled_extensions=("html",), default_for_string=False, default=False
                ),
                trim_blocks=True,
                lstrip_blocks=True,
                keep_trailing_newline=True,
            )
            env.filters.update(
                size=format_size,
                minutes=format_minutes,
                when=lambda v: format_time(v, zone),
                kernels=describe_kernels,
            )
            self._env = env
        return self._env

    def render(self, kind: str, context: dict) -> tuple[str, str, str]:
        """Render ``(subject, text, html)`` for ``kind`` from its three templates.

        Raises ``jinja2.TemplateError`` for a broken (admin) template.
        """
        ctx = self._context(kind, context)
        subject = self.env.get_template(f"{kind}.subject.txt").render(ctx)
        text = self.env.get_template(f"{kind}.txt").render(ctx)
        html = self.env.get_template(f"{kind}.html").render(ctx)
        return self.subject_prefix + " ".join(subject.split()), text, html

    def _context(self, kind: str, context: dict) -> dict:
        ctx = dict(context)
        now = self.clock()
        ctx.setdefault("now", now)
        ctx.setdefault("kind", kind)
        ctx.setdefault("contact", self.contact)
        ctx.setdefault("timezone", self.timezone)
        if ctx.get("error"):
            ctx["error"] = redact(str(ctx["error"]))
        if "minutes_left" not in ctx and ctx.get("suspend_at") is not None:
            at = to_datetime(ctx["suspend_at"])
            ctx["minutes_left"] = max(0, round((at - now).total_seconds() / 60))
        return ctx

    # -- addresses ---------------------------------------------------------------------------

    async def resolve_address(self, username: str, auth_state: dict | None = None) -> str | None:
        """The user's email address from the configured source, or None."""
        if self.address_from == "auth_state":
            value: Any = auth_state
            for part in self.auth_state_key.split("."):
                value = value.get(part) if isinstance(value, dict) else None
        elif self.address_from == "template":
            if not self.address_template:
                self.log.error(
                    "Notifier.address_from='template' but Notifier.address_template is empty; "
                    "set it, e.g. '{username}@example.org'"
                )
                return None
            value = self.address_template.format(username=username)
        else:
            if self.address_callable is None:
                self.log.error(
                    "Notifier.address_from='callable' but Notifier.address_callable is not set"
                )
                return None
            value = await _maybe_await(self.address_callable(username, auth_state))
        if not isinstance(value, str) or not _ADDRESS_RE.fullmatch(value.strip()):
            return None
        return value.strip()

    def _no_address(self, user: str, server: str, kind: str) -> None:
        self.undeliverable[user] = "no email address"
        if user in self._no_address_logged:
            return
        self._no_address_logged.add(user)
        where = {
            "auth_state": f"auth_state key {self.auth_state_key!r} is missing (is "
            "Authenticator.enable_auth_state on, and does the service have admin:auth_state?)",
            "template": "Notifier.address_template gave no valid address",
            "callable": "Notifier.address_callable returned no valid address",
        }[self.address_from]
        self.log.warning(
            "No email address for %s, %s not sent (logged once per user): %s",
            server,
            kind,
            where,
        )

    # -- sending -----------------------------------------------------------------------------

    async def notify(
        self,
        kind: str,
        user: str,
        context: dict,
        event_ref: str,
        auth_state: dict | None = None,
        opted_out: bool = False,
        claimed: asyncio.Future | None = None,
    ) -> bool:
        """Email ``user`` about an event of their server, at most once per ``event_ref``.

        Parameters
        ----------
        kind
            "warning", "suspended", "restore_failed" or "restored".
        user
            The user's name.
        context
            Template fields (see the header of ``templates/email/warning.txt``);
            ``server`` ("user/name") is also the key in ``sent_log``.
        event_ref
            Identifies the event (e.g. the suspension's id): one message per kind and event.
        auth_state
            The user's auth_state from the Hub API, for ``address_from="auth_state"``.
        opted_out
            The user's own choice; honoured when `allow_opt_out` is True.
        claimed
            Set to True once this call has claimed the event in ``sent_log`` (before
            sending), or to False once it knows it will not send: a caller can record what
            follows the email only after the claim, so that a crash in between sends no
            second message.

        Returns True when the message was sent by this call; False when it was not needed
        (duplicate, opted out, ``restored`` turned off), impossible (no address, broken
        template) or failed. Never raises.
        """
        server = context.get("server") or server_key(user)
        try:
            return await self._notify(
                kind, user, server, context, event_ref, auth_state, opted_out, claimed
            )
        except Exception:
            self.log.exception("Email %s for %s (event %s) failed", kind, server, event_ref)
            return False
        finally:
            if claimed is not None and not claimed.done():
                claimed.set_result(False)

    async def _notify(
        self,
        kind: str,
        user: str,
        server: str,
        context: dict,
        event_ref: str,
        auth_state: dict | None,
        opted_out: bool,
        claimed: asyncio.Future | None = None,
    ) -> bool:
        if kind not in USER_KINDS:
            self.log.error("Unknown email kind %r for %s; one of %s", kind, server, USER_KINDS)
            return False
        if kind == "restored" and not self.send_restored:
            return False
        if opted_out and self.allow_opt_out:
            self.log.info("%s opted out of email, %s not sent", server, kind)
            return False
        address = await self.resolve_address(user, auth_state)
        if address is None:
            self._no_address(user, server, kind)
            return False
        self._no_address_logged.discard(user)
        ctx = {"username": user, "server": server, **context}
        return await self._deliver(kind, server, [address], ctx, event_ref, user, claimed)

    async def _deliver(
        self,
        kind: str,
        key: str,
        to: list[str],
        context: dict,
        event_ref: str,
        user: str | None = None,
        claimed: asyncio.Future | None = None,
    ) -> bool:
        """Render, claim the event in ``sent_log``, then send: exactly-once at most."""
        label = f"{kind} for {key} (event {event_ref})"
        try:
            subject, text, html = self.render(kind, context)
        except jinja2.TemplateError as exc:
            self.log.error(
                "Email %s not sent: template error %s: %s — fix the template in %s",
                label,
                type(exc).__name__,
                exc,
                self.template_paths or TEMPLATE_DIR,
            )
            return False
        if await _maybe_await(self.sent_log.notification_sent(key, kind, event_ref)):
            self.log.debug("Email %s already sent", label)
            return False
        if not await _maybe_await(self.sent_log.record_notification(key, kind, event_ref)):
            self.log.debug("Email %s claimed by another sender", label)
            return False
        if claimed is not None and not claimed.done():
            claimed.set_result(True)
        ok = await self.mailer.send(to, subject, text, html, label=label)
        if user is not None:
            if ok:
                self.undeliverable.pop(user, None)
            else:
                self.undeliverable[user] = f"sending failed: {self.mailer.last_error}"
        if not ok:
            release = getattr(self.sent_log, "release_notification", None)
            if self.release_on_failure and release is not None:
                await _maybe_await(release(key, kind, event_ref))
                self.log.error(
                    "Email %s not delivered; a later try for this event may send it", label
                )
            else:
                self.log.error("Email %s lost: recorded as sent but delivery failed", label)
        return ok

    def notify_soon(self, *args: Any, **kwargs: Any) -> asyncio.Task:
        """:meth:`notify` in the background, so a slow or dead SMTP server delays nothing.

        The task is kept until done; :meth:`drain` waits for the pending ones at shutdown.
        """
        return self._spawn(self.notify(*args, **kwargs))

    def _spawn(self, coro: Any) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)  # a reference, or the loop may drop the task unfinished
        task.add_done_callback(self._tasks.discard)
        return task

    async def drain(self, timeout: float = 10.0) -> None:
        """Wait up to ``timeout`` seconds for background notifications to finish."""
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=timeout)

    # -- daily admin digest -----------------------------------------------------------------

    def digest_day(self, now: datetime | None = None) -> date | None:
        """The local day whose digest is due at ``now`` (from `digest_hour` on), or None."""
        if not self.digest_to:
            return None
        local = (now or self.clock()).astimezone(ZoneInfo(self.timezone))
        if local.hour < self.digest_hour:
            return None
        return local.date()

    async def send_digest(self, context: dict, day: date) -> bool:
        """Send the admin digest for ``day`` to `digest_to`, once per day.

        ``context``: ``gpu_hours``, ``suspensions``, ``restores``, ``failures`` (numbers),
        optional ``failed_servers`` (list of ``{"server", "error"}``), ``unmailed`` (user
        names; default: those this Notifier could not mail since start), ``hub_url``.
        Never raises.
        """
        if not self.digest_to:
            return False
        ctx = {"day": day, **context}
        ctx.setdefault("unmailed", sorted(self.undeliverable))
        # failure messages are redacted as in the users' emails: a digest is forwarded too
        ctx["failed_servers"] = [
            {**f, "error": redact(str(f.get("error") or ""))}
            for f in ctx.get("failed_servers") or []
        ]
        try:
            return await self._deliver(
                DIGEST_KIND, DIGEST_KEY, list(self.digest_to), ctx, day.isoformat()
            )
        except Exception:
            self.log.exception("Admin digest for %s failed", day)
            return False


# ---------------------------------------------------------------------------------------------
# ServiceNotifier: the Notifier wired to the service's state
# ---------------------------------------------------------------------------------------------


class ServiceNotifier(Notifier):
    """The :class:`Notifier` as the service uses it: one call per state change.

    :meth:`notify_event` builds the template context from the server's status row and the
    event's detail, fetches the user's auth_state from the Hub when the address needs it,
    and sends in the background, so a slow or dead SMTP server never holds up a tick or a
    suspension.
    """

    # What the service hands over (not settings: the service's own settings, passed on).
    public_url = Unicode(
        "", help="""The Hub's public URL (``GpuSnap.public_url``): the base of every link."""
    )
    service_prefix = Unicode(
        "/services/gpusnap/",
        help="""The service's URL prefix (``GpuSnap.service_prefix``), for its pages' links.""",
    )
    max_keep_running = Float(
        None,
        allow_none=True,
        help="""``GpuSnap.max_keep_running``: the longest "keep running" a warning offers.""",
    )
    hub = traitlets.Any(
        None,
        help="""The service's Hub API client (a :class:`~jupyterhub_gpusnap.hub.HubClient`), to
        read a user's auth_state for the address; None: no auth_state.""",
    )
    backend = traitlets.Any(
        None,
        help="""The service's checkpoint backend (a
        :class:`~jupyterhub_gpusnap.checkpoint.base.CheckpointBackend`), whose
        ``retention_days`` the emails quote; None: no number.""",
    )

    keep_path = Unicode(
        "keep/{server}",
        help="""Path of the "keep running" page under the service's prefix; ``{server}`` is
        ``user/server_name``. The link in warning emails.""",
    ).tag(config=True)

    status_path = Unicode(
        "status/{server}",
        help="""Path of the server status page under the service's prefix; ``{server}`` is
        ``user/server_name``.""",
    ).tag(config=True)

    retention_days = Float(
        None,
        allow_none=True,
        min=0,
        help="""How many days a checkpoint is kept, as the emails tell users. None (the
        default): the checkpoint backend's own retention, read from it
        (LocalBackend.max_age_days), so the emails quote what retention really does; with
        a backend that deletes nothing by age (KubernetesBackend) the emails quote no number.
        Set it only where something outside the service deletes checkpoints, e.g. a
        registry's own cleanup after 30 days.""",
    ).tag(config=True)

    def retention(self) -> float | None:
        """Days a snapshot is kept, as emails quote it: `retention_days`, else the backend's
        own figure (``CheckpointBackend.retention_days``: LocalBackend's ``max_age_days``);
        None: no number to quote."""
        if self.retention_days is not None:
            return self.retention_days
        days = self.backend.retention_days if self.backend is not None else None
        return days if days else None

    @default("mailer")
    def _default_mailer(self) -> Mailer:
        return Mailer(parent=self, on_failure=_count_failure)

    def _urls(self, user: str, name: str) -> dict:
        public = self.public_url.rstrip("/")
        prefix = self.service_prefix or "/services/gpusnap/"
        service = public + "/" + prefix.strip("/") + "/"
        u, n = quote(user, safe=""), quote(name, safe="")
        fields = {"server": f"{u}/{n}", "user": u, "name": n}
        return {
            "server": server_key(user, name),
            "server_url": f"{public}/user/{u}/" + (f"{n}/" if name else ""),
            "keep_url": service + self.keep_path.format(**fields),
            "status_url": service + self.status_path.format(**fields),
            "hub_url": public + "/hub/",
        }

    @staticmethod
    def _reasons(sample: dict) -> list[str]:
        """Why a server counts as idle, from its last sample, in words."""
        reasons = []
        if sample.get("gpu_percent") is not None:
            reasons.append(f"GPU {sample['gpu_percent']:.0f} % busy")
        if sample.get("cpu_percent") is not None:
            reasons.append(f"CPU {sample['cpu_percent']:.0f} % of one core")
        if sample.get("kernels") is not None:
            n = sample["kernels"]
            reasons.append(f"{n} kernel{'' if n == 1 else 's'}, none busy")
        if sample.get("terminals"):
            reasons.append(f"{sample['terminals']} terminal(s), no input")
        return reasons

    def context_for(self, kind: str, status: Any, detail: dict) -> dict:
        """Template context for ``kind`` from a ``ServerStatus`` and the event's ``detail``.

        ``detail`` may carry any context field directly (it wins), and the event fields the
        service records: ``suspend_at`` / ``idle_seconds`` (warning), a checkpoint's
        ``as_dict()`` (``created``, ``image_bytes``, ``gpu_bytes``, ``gpu_model``,
        ``extra["kernels"]``, ``error``).
        """
        now = self.clock().timestamp()
        sample = status.last_sample or {}
        extra = detail.get("extra") or {}
        idle_seconds = detail.get("idle_seconds")
        if idle_seconds is None and status.last_active:
            idle_seconds = max(0.0, (detail.get("created") or now) - status.last_active)
        max_keep = self.max_keep_running
        ctx = {
            **self._urls(status.user, status.name),
            "username": status.user,
            "idle_minutes": None if idle_seconds is None else round(idle_seconds / 60),
            "reasons": self._reasons(sample),
            "suspend_at": detail.get("suspend_at"),
            "keep_max_hours": round(max_keep / 3600, 1) if max_keep else None,
            "suspended_at": detail.get("created") or status.state_since or None,
            "image_bytes": detail.get("image_bytes"),
            "gpu_bytes": detail.get("gpu_bytes"),
            "gpu_model": detail.get("gpu_model") or "",
            "kernels": extra.get("kernels", sample.get("kernels")),
            "retention_days": _days(extra.get("retention_days", self.retention())),
            "error": detail.get("error") or status.failure or "",
            "restored_at": status.restored_at,
        }
        if kind in ("restored", "restore_failed") and status.restored_at:
            # the checkpoint's own time, not the restore's
            ctx["suspended_at"] = detail.get("created") or None
        ctx.update({k: v for k, v in detail.items() if k in _CONTEXT_FIELDS})
        ctx["retention_days"] = _days(ctx.get("retention_days"))
        if isinstance(ctx.get("keep_max_hours"), float) and ctx["keep_max_hours"].is_integer():
            ctx["keep_max_hours"] = int(ctx["keep_max_hours"])
        return ctx

    async def _auth_state(self, user: str) -> dict | None:
        if self.hub is None:
            return None
        try:
            model = await self.hub.get_user(user)
        except Exception as exc:
            self.log.warning(
                "Cannot read auth_state of %s for email (%s); give the service the "
                "admin:auth_state scope",
                user,
                redact(str(exc)),
            )
            return None
        return model.get("auth_state") if isinstance(model, dict) else None

    async def notify_event(
        self,
        kind: str,
        status: Any,
        event_ref: str,
        detail: dict | None = None,
        claimed: asyncio.Future | None = None,
    ) -> asyncio.Task:
        """Schedule the ``kind`` email for a server's event; returns the background task.

        ``detail["opted_out"]`` carries the user's opt-out choice where the service keeps one.
        The task's result is :meth:`notify`'s; :meth:`drain` waits for pending ones.
        ``claimed``: see :meth:`notify`.
        """
        detail = dict(detail or {})
        context = self.context_for(kind, status, detail)
        opted_out = bool(detail.get("opted_out", False))

        async def run() -> bool:
            auth_state = None
            if self.address_from != "template":
                auth_state = await self._auth_state(status.user)
            return await self.notify(
                kind, status.user, context, event_ref, auth_state, opted_out, claimed
            )

        return self._spawn(run())


def _days(days: Any) -> int | float | None:
    """30.0 -> 30 (how a template shows it); None stays None."""
    if isinstance(days, float) and days.is_integer():
        return int(days)
    return days


def _count_failure(reason: str) -> None:
    """Count an undelivered email in the service's Prometheus metrics (when installed)."""
    try:
        from . import metrics
    except ImportError:  # prometheus_client missing: the Mailer's own counter still counts
        return
    metrics.FAILURES.labels(kind="email").inc()


_CONTEXT_FIELDS = frozenset(
    "username server server_url keep_url status_url idle_minutes suspend_at reasons image_bytes "
    "gpu_bytes gpu_model kernels retention_days suspended_at error hub_url keep_max_hours "
    "minutes_left restored_at".split()
)


__all__ = [
    "ServiceNotifier",
    "DIGEST_KEY",
    "DIGEST_KIND",
    "USER_KINDS",
    "Mailer",
    "Notifier",
    "SentLog",
    "format_minutes",
    "format_size",
    "format_time",
    "redact",
]
