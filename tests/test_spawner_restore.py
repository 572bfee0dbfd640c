"""The restore flow both spawners share (RestoreMixin), with a spawner of in-memory hooks and
a real HTTP server standing in for the restored notebook server."""

from __future__ import annotations

import asyncio
import inspect
from types import SimpleNamespace

import pytest
from jupyterhub.spawner import LocalProcessSpawner, Spawner
from tornado import web
from tornado.httpserver import HTTPServer

from jupyterhub_gpusnap import kubespawner, spawner
from jupyterhub_gpusnap.checkpoint.base import CheckpointError, CheckpointRefused
from jupyterhub_gpusnap.spawner_restore import RestoreMixin, human_bytes
from tests.helpers.ports import free_port

CHECKPOINT = {"id": "ckpt-1", "created": 1795000000.0, "image_bytes": 3 * 1024**3}


class Answering:
    """An HTTP server answering ``/user/alice/api`` (the restored server)."""

    def __init__(self, first_answer_after: float = 0.0):
        self.port = free_port()
        slow = [first_answer_after]

        class Api(web.RequestHandler):
            async def get(self):
                delay, slow[0] = slow[0], 0.0
                await asyncio.sleep(delay)
                self.write({"version": "2"})

        self.server = HTTPServer(web.Application([(r"/user/alice/api", Api)]))
        self.server.listen(self.port, "127.0.0.1")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self):
        self.server.stop()


class HookSpawner(RestoreMixin, Spawner):
    """A spawner whose hooks record what the flow asked of them."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.calls: list[str] = []
        self.restore_to = ""  # URL restore_checkpoint returns
        self.restore_error: BaseException | None = None
        self.token = "old-token"
        self.revoked: list[str] = []

    async def start(self):
        return await self.restore_or_start_fresh()

    async def stop(self, now=False):
        pass

    async def poll(self):
        return None

    async def checkpoint_to_restore(self):
        return self.gpusnap_state.get("checkpoint")

    async def resume_token(self, checkpoint):
        return self.token

    async def restore_checkpoint(self, checkpoint):
        self.calls.append("restore")
        if self.restore_error is not None:
            raise self.restore_error
        return self.restore_to

    def restored(self, checkpoint, url):
        self.calls.append("restored")
        self.gpusnap_state = {}
        return url

    async def discard_restore(self, checkpoint, error, reason):
        self.calls.append(f"discard: {reason}")
        self.gpusnap_state = {}

    async def start_fresh(self):
        self.calls.append("fresh")
        return "http://127.0.0.1:1"

    def revoke_token(self, token):
        if token and token != self.api_token:
            self.revoked.append(token)


def make(**traits) -> HookSpawner:
    s = HookSpawner(
        user=SimpleNamespace(name="alice", url="/user/alice/"),
        hub=SimpleNamespace(api_url="http://hub/hub/api", base_url="/hub/"),
        _mock=True,
        restore_timeout=traits.pop("restore_timeout", 5.0),
        server_poll_interval=0.01,
        **traits,
    )
    s.api_token = "fresh-token"
    s.gpusnap_state = {"checkpoint": dict(CHECKPOINT)}
    return s


async def start_with_progress(s: HookSpawner):
    events: list[dict] = []

    async def collect():
        async for e in s.progress():
            events.append(e)

    collector = asyncio.ensure_future(collect())
    result = await s.start()
    await asyncio.wait_for(collector, 5)
    return result, [e["message"] for e in events]


async def test_restore_waits_for_the_server_then_takes_its_token_back():
    server = Answering()
    try:
        s = make()
        s.restore_to = server.url
        url, messages = await start_with_progress(s)
    finally:
        server.stop()
    assert url == server.url
    assert s.calls == ["restore", "restored"]
    assert s.api_token == "old-token" and s.revoked == []
    assert messages == [
        "Restoring your server from a 3.0 GiB snapshot taken 2026-11-18 11:06 UTC…",
        "Memory restored; waiting for the server to answer…",
        "Server restored from its snapshot.",
    ]


async def test_a_restored_server_slow_to_give_its_first_answer_is_still_handed_out():
    """A lazily restored server may take longer than one poll's 5 s request timeout to
    answer its first request (its memory still coming back): that is another poll, not a
    failed restore."""
    server = Answering(first_answer_after=6.0)
    try:
        s = make(restore_timeout=30.0)
        s.restore_to = server.url
        url, messages = await start_with_progress(s)
    finally:
        server.stop()
    assert url == server.url and s.calls == ["restore", "restored"], s.calls
    assert messages[-1] == "Server restored from its snapshot."


async def test_a_failed_restore_falls_back_keeps_the_fresh_token_revokes_the_old():
    s = make()
    s.restore_error = CheckpointError("criu restore failed\nsecond line")
    url, messages = await start_with_progress(s)
    assert url == "http://127.0.0.1:1"
    assert s.calls == ["restore", "discard: criu restore failed\nsecond line", "fresh"]
    assert s.api_token == "fresh-token" and s.revoked == ["old-token"]
    assert "Could not restore your snapshot (criu restore failed" in messages[-1]


async def test_a_server_that_never_answers_is_cut_off_at_restore_timeout():
    s = make(restore_timeout=0.5)
    s.restore_to = f"http://127.0.0.1:{free_port()}"  # nothing listens
    url, messages = await start_with_progress(s)
    assert s.calls[-1] == "fresh"
    assert s.calls[1] == "discard: the restore did not finish within 0.5s"
    assert s.api_token == "fresh-token"


async def test_a_refused_restore_fails_the_start_and_keeps_the_checkpoint():
    s = make()
    s.restore_error = CheckpointRefused("its port is still taken")
    with pytest.raises(CheckpointRefused):
        await s.start()
    assert s.calls == ["restore"]
    assert s.gpusnap_state["checkpoint"]["id"] == "ckpt-1"
    assert s.revoked == []


async def test_no_checkpoint_starts_fresh_without_restore_messages():
    s = make()
    s.gpusnap_state = {}
    url, messages = await start_with_progress(s)
    assert s.calls == ["fresh"] and messages == []


def test_both_spawners_are_the_one_mixin_with_hooks_only():
    local = spawner.SnapLocalProcessSpawner
    kube = kubespawner.SnapKubeSpawner
    for cls in (local, spawner.SnapSimpleLocalProcessSpawner, kube):
        assert issubclass(cls, RestoreMixin)
    # the local hooks are a mixin, not a spawner of their own
    assert not issubclass(spawner.SnapSpawnerMixin, LocalProcessSpawner)
    # progress, the wait for the server and the fall-back are the mixin's alone
    for cls in (spawner.SnapSpawnerMixin, kube):
        for name in ("progress", "emit", "_wait_answering", "_fall_back", "_restore"):
            assert name not in vars(cls), f"{cls.__name__} defines {name} again"
    assert kubespawner.human_bytes is human_bytes and spawner.human_bytes is human_bytes
    # the backend's abilities are its methods, never probed for
    for module in (spawner, kubespawner):
        assert "getattr(self.backend" not in inspect.getsource(module)


def test_human_bytes():
    assert human_bytes(512) == "512 B"
    assert human_bytes(12 * 1024**3) == "12.0 GiB"
