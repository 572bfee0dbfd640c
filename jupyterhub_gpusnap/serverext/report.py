"""The server reports its own Jupyter signal to the gpusnap service.

The service must know whether a server's kernels are busy, and when its kernels and terminals
were last used; it used to read ``/api/kernels`` through the proxy, which needed a token that
opens every server (``access:servers``). Instead this reporter, inside the single-user server,
sends ``POST api/servers/{user}/{name}/jupyter`` with the server's own Hub token
(``JUPYTERHUB_API_TOKEN``), the way the server already reports its activity to the Hub:

- at once when the picture changes (a kernel starts, stops, goes busy or idle; a terminal
  opens or closes), looked at every ``check_interval`` seconds in this process (no request);
- every ``interval`` seconds besides, so the service knows the server is still there;
- at once after a jump of the wall clock (the server was suspended and has just been restored).

A failed report is retried after 1, 2, 4, 8, then every :data:`RETRY_MAX` seconds (a service
that is restarting hears from every server within that time); the service treats a
server with no report for three of its intervals as giving no signal, never as idle.
The reports carry only what the policy reads: each kernel's ``execution_state`` and
``last_activity``, each terminal's ``last_activity`` (no kernel ids, names or paths).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from traitlets import Float, validate
from traitlets.config import LoggingConfigurable

from .client import GpuSnapClient, ServiceError

#: The longest wait (seconds) before a failed report is sent again.
RETRY_MAX = 10.0


class GpuSnapReporter(LoggingConfigurable):
    """Pushes this server's kernels and terminals to the gpusnap service."""

    interval = Float(
        60.0,
        help="Seconds between two reports of the server's kernels and terminals when nothing "
        "changes (a change is reported at once). Each report says it: the service believes a "
        "report for three intervals, then takes the server's silence as no signal (never idle).",
    ).tag(config=True)

    check_interval = Float(
        1.0,
        help="Seconds between two looks at the kernels' states, inside this server (no request): "
        "a kernel that goes busy reaches the service within this time.",
    ).tag(config=True)

    @validate("interval")
    def _check_interval(self, proposal):
        if not 1 <= proposal.value <= 3600:
            raise ValueError(
                f"GpuSnapReporter.interval must be from 1 to 3600 seconds, got {proposal.value!r}"
            )
        return proposal.value

    def __init__(
        self,
        serverapp,
        client: GpuSnapClient,
        on_answer: Callable[[dict], None] | None = None,
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.serverapp = serverapp
        self.client = client
        self.on_answer = on_answer
        self.reports = 0  # sent and accepted
        self.last_error: str | None = None
        self._task: asyncio.Task | None = None

    def snapshot(self) -> dict:
        """The report body: this server's kernels and terminals, as the service reads them."""
        kernels = [
            {"execution_state": k.get("execution_state"), "last_activity": k.get("last_activity")}
            for k in self.serverapp.kernel_manager.list_kernels()
        ]
        manager = self.serverapp.web_app.settings.get("terminal_manager")
        terminals = (
            [{"last_activity": t.get("last_activity")} for t in manager.list()] if manager else []
        )
        return {"kernels": kernels, "terminals": terminals, "interval": self.interval}

    @staticmethod
    def shape(body: dict) -> tuple:
        """What a change is: the kernels' states and the number of terminals (not the clocks)."""
        return (sorted(str(k["execution_state"]) for k in body["kernels"]), len(body["terminals"]))

    async def send(self, body: dict) -> bool:
        """One report; True when the service took it."""
        try:
            _, answer = await self.client.call("POST", "jupyter", body)
        except ServiceError as e:
            if e.message != self.last_error:  # one line per kind of failure, not one a second
                self.log.warning(
                    "gpusnap: cannot report this server's kernels to the service (%s): %s",
                    e.status,
                    e.message,
                )
            self.last_error = e.message
            return False
        if self.last_error is not None:
            self.log.info("gpusnap: reporting this server's kernels to the service again")
        self.last_error = None
        self.reports += 1
        if self.on_answer is not None and isinstance(answer, dict):
            self.on_answer(answer)
        return True

    async def run(self) -> None:
        sent_shape = None
        sent_at = 0.0  # monotonic
        retry = 0.0
        last_look = time.time()
        while True:
            try:
                body = self.snapshot()
                now_wall, now = time.time(), time.monotonic()
                # a wall-clock jump: the process was frozen (suspended) and is running again
                resumed = now_wall - last_look > 10 * max(self.check_interval, 1.0)
                last_look = now_wall
                due = sent_shape is None or self.shape(body) != sent_shape or resumed
                due = due or now - sent_at >= (retry or self.interval)
                if due:
                    ok = await self.send(body)
                    sent_at = time.monotonic()
                    if ok:
                        sent_shape, retry = self.shape(body), 0.0
                    else:
                        retry = min(max(retry * 2, 1.0), RETRY_MAX, self.interval)
                        sent_shape = self.shape(body)  # a change is retried on the backoff clock
            except asyncio.CancelledError:
                raise
            except Exception as e:  # never take the server down
                self.log.warning("gpusnap: reporting kernels failed: %s", e)
            await asyncio.sleep(self.check_interval)

    def start(self) -> None:
        if self._task is None and self.client.server_key is not None:
            self._task = asyncio.ensure_future(self.run())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None
