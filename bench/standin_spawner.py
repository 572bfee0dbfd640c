"""Cheap stand-in notebook servers, so a real JupyterHub can hold thousands of running servers.

:class:`StandinSpawner` is a JupyterHub spawner whose ``start()`` launches nothing: it
returns the URL of one shared HTTP server (:func:`make_app`, run with
``python bench/standin_spawner.py --port N``) that answers every path with ``200 {}``.
The Hub's only check at spawn, and again at a Hub restart, is that the server's URL
answers an HTTP request with a status below 500 (``jupyterhub.utils.wait_for_http_server``);
the shared server does that for every ``/user/<name>/`` prefix at once. ``poll()`` says
"running" until the Hub stops the server, also across Hub restarts (the flag travels in
the spawner state). Used by ``bench/scale.py`` and ``tests/test_scale_smoke.py``; the
servers do nothing a signal source could read, so those pair it with a simulated source.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

import jupyterhub
from jupyterhub.spawner import Spawner
from tornado import web
from traitlets import Unicode


class StandinSpawner(Spawner):
    """A spawner whose servers are all the one shared stand-in HTTP server."""

    target_url = Unicode(
        "http://127.0.0.1:8999",
        help="URL of the shared stand-in HTTP server every 'server' points at "
        "(start it with `python bench/standin_spawner.py --port N`).",
    ).tag(config=True)

    running = False

    def load_state(self, state: dict) -> None:
        super().load_state(state)
        self.running = bool(state.get("standin_running"))

    def get_state(self) -> dict:
        state = super().get_state()
        if self.running:
            state["standin_running"] = True
        return state

    def clear_state(self) -> None:
        super().clear_state()
        self.running = False

    async def start(self) -> str:
        """Launch nothing; the shared server answers for this user's prefix."""
        self.running = True
        return self.target_url

    async def stop(self, now: bool = False) -> None:
        self.running = False

    async def poll(self) -> int | None:
        return None if self.running else 0


class AnyPathHandler(web.RequestHandler):
    """``200 {}`` for any method on any path: enough for the Hub's readiness check."""

    def get(self, *args) -> None:
        self.set_header("Content-Type", "application/json")
        self.set_header("X-JupyterHub-Version", jupyterhub.__version__)  # as a real server does
        self.finish(b"{}")

    post = put = delete = head = get


def make_app() -> web.Application:
    return web.Application([(r"/.*", AnyPathHandler)], log_function=lambda *a: None)


async def serve(port: int, ip: str = "127.0.0.1") -> None:
    make_app().listen(port, ip)
    print(f"stand-in server listening on http://{ip}:{port}", flush=True)
    await asyncio.Event().wait()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        description="The shared HTTP server behind every StandinSpawner server."
    )
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--ip", default="127.0.0.1")
    args = p.parse_args(argv)
    asyncio.run(serve(args.port, args.ip))


if __name__ == "__main__":
    main(sys.argv[1:])
