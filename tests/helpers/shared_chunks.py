"""Two users' servers running the same program, suspended to chunks they share."""

from __future__ import annotations

from jupyterhub_gpusnap.checkpoint.manifest import Manifest
from jupyterhub_gpusnap.model import Server
from tests.helpers.process_tree import SHARED_TREE


def chunk_ids(backend, info) -> dict[str, int]:
    m = Manifest.load(backend.folder(info.id))
    return {cid: n for refs in m.chunks.values() for cid, n in refs}


async def suspend_two(backend, process_tree):
    """alice's and bob's servers, the same program, suspended: (trees, infos, shared ids)."""
    trees, infos, before = [], [], []
    for user in ("alice", "bob"):
        tree = process_tree(pidns=True, program=SHARED_TREE)
        await tree.wait_ready()
        before.append(await tree.ask("inc"))
        infos.append(await backend.checkpoint(Server(user=user, name="", state={"pid": tree.pid})))
        trees.append(tree)
    a, b = (chunk_ids(backend, i) for i in infos)
    shared = sorted(set(a) & set(b), key=lambda c: -a[c])
    assert sum(a[c] for c in shared) >= 3 << 20, "the weights are not stored once for both"
    return trees, infos, before, shared
