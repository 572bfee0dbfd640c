"""CheckpointBackend owns the protocol: the order of its hooks, what a failure in each step
undoes, crash recovery with the same hooks, and retention's rule (no CRIU needed)."""

from __future__ import annotations

import asyncio

import pytest

from jupyterhub_gpusnap.checkpoint.base import (
    INTERRUPTED,
    CheckpointBackend,
    CheckpointError,
    CheckpointInfo,
    CheckpointRefused,
    Kept,
    Restored,
    Suspension,
    expired,
    protected,
)
from jupyterhub_gpusnap.checkpoint.kubernetes import KubernetesBackend
from jupyterhub_gpusnap.checkpoint.local import LocalBackend
from jupyterhub_gpusnap.model import Server

SERVER = Server(user="alice", name="", state={"pid": 4242})


class Scripted(CheckpointBackend):
    """Records its hooks; ``fail`` names the step that raises (and what)."""

    def __init__(self, fail: dict | None = None, unfinished=(), dumped=(), **kw):
        super().__init__(**kw)
        self.fail = fail or {}
        self.calls: list[str] = []
        self.unfinished = list(unfinished)
        self.dumped = set(dumped)
        self.deleted: list[str] = []

    def _step(self, name: str, s: Suspension | None = None) -> None:
        self.calls.append(name if s is None else f"{name}:{s.phase}")
        if name in self.fail:
            raise self.fail[name]

    async def do_preflight(self, server):
        self._step("preflight")
        return Suspension(server, id="cp-1")

    async def do_freeze(self, s):
        self._step("freeze", s)

    async def do_dump(self, s):
        self._step("dump", s)

    async def do_verify(self, s):
        self._step("verify", s)

    async def do_record(self, s):
        self._step("record", s)
        return CheckpointInfo(s.id, s.server.user, s.server.name, 0.0, "verified")

    async def do_end(self, s, info):
        self._step("end", s)

    async def do_resume(self, s, error):
        self.calls.append(f"resume:{s.phase}")
        return CheckpointError(f"undone after {s.phase}: {error}")

    async def do_unfinished(self):
        return [Suspension(SERVER, id=i) for i in self.unfinished]

    async def do_dumped(self, s):
        return s.id in self.dumped

    async def do_expired(self, now):
        return ["old-1", "old-2"]

    async def do_delete(self, cid):
        self.deleted.append(cid)

    async def do_after_retention(self):
        self.calls.append("after_retention")


async def test_checkpoint_runs_every_step_in_order():
    b = Scripted()
    info = await b.checkpoint(SERVER)
    assert info.id == "cp-1" and info.status == "verified"
    assert b.calls == [
        "preflight",
        "freeze:freeze",
        "dump:dump",
        "verify:verify",
        "record:record",
        "end:end",
    ]


@pytest.mark.parametrize("step", ["dump", "verify", "record"])
async def test_a_failure_after_the_freeze_is_undone_and_nothing_ends(step):
    b = Scripted(fail={step: OSError("disk gone")})
    with pytest.raises(CheckpointError, match=f"undone after {step}: disk gone"):
        await b.checkpoint(SERVER)
    assert b.calls[-1] == f"resume:{step}"
    assert not any(c.startswith("end") for c in b.calls)


async def test_a_refusal_is_passed_on_untouched():
    # before anything changed: no resume
    b = Scripted(fail={"preflight": CheckpointRefused("no CRIU")})
    with pytest.raises(CheckpointRefused, match="no CRIU"):
        await b.checkpoint(SERVER)
    assert b.calls == ["preflight"]
    # the driver rolled the freeze back: nothing to resume either
    b = Scripted(fail={"freeze": CheckpointRefused("GPU busy", retry=True)})
    with pytest.raises(CheckpointRefused, match="GPU busy") as e:
        await b.checkpoint(SERVER)
    assert e.value.retry and b.calls == ["preflight", "freeze:freeze"]
    # a refusal once the tree may be frozen is a failure like any other: undone
    b = Scripted(fail={"dump": CheckpointRefused("odd")})
    with pytest.raises(CheckpointError, match="undone after dump"):
        await b.checkpoint(SERVER)
    assert b.calls[-1] == "resume:dump"


async def test_the_error_do_resume_returns_is_raised_as_is():
    class Plain(Scripted):
        async def do_resume(self, s, error):
            self.calls.append("resume")
            return error

    boom = CheckpointError("as the agent said it")
    b = Plain(fail={"dump": boom})
    with pytest.raises(CheckpointError) as e:
        await b.checkpoint(SERVER)
    assert e.value is boom and e.value.__cause__ is None


async def test_what_a_backend_needs_besides_the_server_reaches_its_preflight():
    """The node agent's suspension needs the pod, its container and the store: checkpoint()
    hands them to do_preflight as they are."""

    class Node(Scripted):
        async def do_preflight(self, server, *, pod, store):
            self.calls.append(f"preflight {pod} {store}")
            return Suspension(server, id="cp-1")

    b = Node()
    info = await b.checkpoint(SERVER, pod="jhub/jupyter-alice", store="registry")
    assert info.id == "cp-1"
    assert b.calls[0] == "preflight jhub/jupyter-alice registry" and b.calls[-1] == "end:end"


@pytest.mark.parametrize("undo_on, undone", [((Exception,), False), ((BaseException,), True)])
async def test_a_cancelled_suspension_is_undone_where_the_backend_asks(undo_on, undone):
    """A backend whose suspension must never stay half-done (the node agent: a pod's GPU
    memory frozen) undoes a cancelled one too; the cancellation goes on as it was."""

    class Cancelled(Scripted):
        async def do_resume(self, s, error):
            self.calls.append(f"resume:{s.phase}")
            return error

    b = Cancelled(fail={"dump": asyncio.CancelledError()})
    b.undo_on = undo_on
    with pytest.raises(asyncio.CancelledError):
        await b.checkpoint(SERVER)
    assert (b.calls[-1] == "resume:dump") is undone
    assert not any(c.startswith("end") for c in b.calls)


async def test_recover_completes_a_finished_dump_and_undoes_the_rest():
    b = Scripted(unfinished=["done", "half", "bad"], dumped={"done", "bad"})
    b.fail = {}
    real_verify = b.do_verify

    async def verify(s):
        if s.id == "bad":
            b.calls.append("verify:bad")
            raise CheckpointError("checksum")
        await real_verify(s)

    b.do_verify = verify
    assert await b.recover() == ["done", "half", "bad"]
    assert b.calls == [
        "verify:recover",
        "record:recover",
        "end:recover",
        "resume:recover",  # "half": its dump never finished
        "verify:bad",
        "resume:recover",  # "bad": finished but damaged
    ]


async def test_recover_tells_do_resume_why():
    seen = []

    class Why(Scripted):
        async def do_resume(self, s, error):
            seen.append(str(error))
            return error

    await Why(unfinished=["x"]).recover()
    assert seen == [INTERRUPTED]


async def test_apply_retention_recovers_first_then_deletes_then_tidies():
    b = Scripted(unfinished=["crashed"])
    assert await b.apply_retention() == ["old-1", "old-2"]
    assert b.calls == ["resume:recover", "after_retention"]
    assert b.deleted == ["old-1", "old-2"]


def test_retention_rule():
    day = 86400
    now = 100 * day
    found = [  # newest first
        Kept("a5", "a/", "writing", now - 1),
        Kept("a4", "a/", "verified", now - 2 * day),  # the suspended server's snapshot
        Kept("a3", "a/", "restored", now - 3 * day),
        Kept("a2", "a/", "restored", now - 4 * day),
        Kept("a1", "a/", "failed", now - 50 * day, failed_since=now - 5 * day),
        Kept("b2", "b/", "restored", now - 1 * day),
        Kept("b1", "b/", "verified", now - 40 * day),  # superseded by b2: not protected
    ]
    assert protected(found) == {"a4"}
    # keep_last=2 counts a5 and a4 for a/: a3 and a2 go; a1 is kept 30 days from its failure
    assert expired(found, now, keep_last=2, max_age_days=30) == ["a3", "a2", "b1"]
    assert expired(found, now, keep_last=10, max_age_days=30) == ["b1"]
    assert expired(found, now, keep_last=10, max_age_days=4.5) == ["a1", "b1"]


def test_capabilities_are_declared_not_probed():
    assert CheckpointBackend.supports_park is False
    assert CheckpointBackend.supports_gpu_memory is False
    assert LocalBackend.supports_park is False and LocalBackend.supports_gpu_memory is False
    assert KubernetesBackend.supports_park and KubernetesBackend.supports_gpu_memory


async def test_defaults_are_what_a_backend_without_them_had(tmp_path):
    b = CheckpointBackend()
    assert await b.writing("alice", "") is None
    assert await b.wait_settled("alice", "", timeout=0) is None
    assert await b.resume_token("x") == ""
    assert b.reserved_ports() == set()
    assert b.retention_days is None and b.location("x") == ""
    assert await b.recover() == [] and await b.apply_retention() == []
    await b.kill_tree([1])  # nothing of this host to end
    await b.mark("x", "failed", "why")  # no status kept after the fact
    b.make_private_dirs(tmp_path / "a" / "b")
    assert (tmp_path / "a" / "b").is_dir() and (
        tmp_path / "a" / "b"
    ).stat().st_mode & 0o777 == 0o700
    with pytest.raises(NotImplementedError):
        await b.park(SERVER)
    with pytest.raises(NotImplementedError):
        await b.gpu_memory([SERVER])


async def test_local_restore_is_the_one_result_type(tmp_path):
    b = LocalBackend(checkpoint_dir=str(tmp_path))
    assert b.log_root == str(tmp_path)
    assert b.location("alice/_default/20260101T000000.000000Z") == str(
        tmp_path / "alice" / "_default" / "20260101T000000.000000Z"
    )
    r = Restored(pid=7, ip="127.0.0.1", port=8888)
    assert (r.pid, r.ip, r.port, r.node, r.detail) == (7, "127.0.0.1", 8888, "", {})
