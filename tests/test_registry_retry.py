"""Registry pushes through a gateway that fails: the real registry (Debian's docker-registry)
behind tests/helpers/fault_proxy.py, which answers 502 to the requests a test names.

A chunked upload that meets a 502 resumes where the registry is (``GET`` on the upload URL,
``Range``) instead of starting over; one the registry dropped starts again; idempotent
requests are simply tried again; a push failing every time gives up after
``1 + Backoff.retries`` tries with the registry's error, and the archive stays where it was;
a 4xx is never tried again.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from traitlets.config import Config

from jupyterhub_gpusnap.agent.ship import RegistryStore, Shipper
from jupyterhub_gpusnap.checkpoint import oci
from jupyterhub_gpusnap.kube.errors import AgentError
from tests.helpers.fault_proxy import Fault, FaultProxy
from tests.helpers.registry import Registry

pytestmark = pytest.mark.k8s

CHUNK = 1 << 20
UPLOADS = r"^/v2/gpusnap/alice/blobs/uploads/."  # one upload's URL (not the POST that opens it)


@pytest.fixture
async def registry(tmp_path):
    r = await Registry(tmp_path / "registry").start()
    yield r
    r.stop()


@pytest.fixture
async def proxy(registry):
    p = await FaultProxy(f"http://{registry.host}").start()
    yield p
    await p.stop()


def quick(**backoff) -> Config:
    """Retries without the production waits (the number of tries is what is tested)."""
    c = Config()
    c.Backoff.retry_backoff = 0.01
    c.Backoff.retry_backoff_max = 0.05
    for k, v in backoff.items():
        setattr(c.Backoff, k, v)
    return c


def archive_file(tmp_path: Path, size: int = 5 * CHUNK + 12345) -> Path:
    path = tmp_path / "checkpoint.tar"
    path.write_bytes(os.urandom(size))
    return path


async def push(
    proxy: FaultProxy, archive: Path, config: Config
) -> tuple[oci.RegistryClient, oci.PushedImage]:
    client = oci.RegistryClient(proxy.host, scheme="http", chunk_size=CHUNK, config=config)
    pushed = await oci.push_archive(
        client, f"{proxy.host}/gpusnap/alice", archive, {}, "t1", time.time()
    )
    return client, pushed


async def pulled_back(registry: Registry, pushed: oci.PushedImage, dest: Path) -> bytes:
    """The layer as the registry itself serves it (not through the proxy), digest-checked."""
    client = oci.RegistryClient(registry.host, scheme="http")
    await oci.pull_layer(client, f"{registry.host}/gpusnap/alice@{pushed.digest}", dest)
    return dest.read_bytes()


async def test_a_chunk_the_gateway_refused_is_resent_and_the_upload_goes_on(
    tmp_path, registry, proxy
):
    archive = archive_file(tmp_path)
    size = archive.stat().st_size
    proxy.faults = [Fault("PATCH", UPLOADS, nth=3)]  # the third chunk never reaches the registry

    client, pushed = await push(proxy, archive, quick())

    assert proxy.faults[0].hits == 1
    # the registry was asked how far the upload got, once, and the same upload went on
    assert proxy.count("GET", UPLOADS) == 1
    assert proxy.count("POST", r"/blobs/uploads/$") == 2  # the layer's upload and the config's
    # every byte reached the registry once; only the refused chunk was sent twice
    assert proxy.sent("PATCH", UPLOADS) == size
    assert client.uploaded_bytes == size + CHUNK
    assert await pulled_back(registry, pushed, tmp_path / "pulled") == archive.read_bytes()


async def test_an_upload_the_registry_dropped_starts_again_and_completes(tmp_path, registry, proxy):
    """The third chunk reaches the registry but its answer is lost. The upload URL the
    client holds now names an older state; distribution 2.8 cancels an upload asked about
    with it, so the client opens a new one and sends the layer from its first byte."""
    archive = archive_file(tmp_path)
    size = archive.stat().st_size
    proxy.faults = [Fault("PATCH", UPLOADS, nth=3, when="after")]

    client, pushed = await push(proxy, archive, quick())

    assert proxy.faults[0].hits == 1
    assert proxy.count("GET", UPLOADS) == 1
    assert proxy.count("POST", r"/blobs/uploads/$") == 3  # the layer twice, the config
    assert proxy.sent("PATCH", UPLOADS) == size + 3 * CHUNK
    assert await pulled_back(registry, pushed, tmp_path / "pulled") == archive.read_bytes()


async def test_idempotent_requests_are_tried_again(tmp_path, registry, proxy):
    """502s on opening the upload, on closing it, on the manifest and on the verification's
    reads: each is tried again, and the image is verified."""
    archive = archive_file(tmp_path, size=2 * CHUNK)
    proxy.faults = [
        Fault("POST", r"/blobs/uploads/$", nth=1),
        Fault("PUT", UPLOADS, nth=1, when="after"),  # the layer is stored, the answer lost
        Fault("PUT", r"/manifests/", nth=1, status=503),
        Fault("GET", r"/manifests/sha256:", nth=1, status=504),
        Fault("HEAD", r"/blobs/sha256:", nth=2),
    ]

    client, pushed = await push(proxy, archive, quick())

    assert [f.hits for f in proxy.faults] == [1, 1, 1, 1, 1]
    assert await pulled_back(registry, pushed, tmp_path / "pulled") == archive.read_bytes()
    assert proxy.sent("PATCH", UPLOADS) == 2 * CHUNK  # the lost PUT answer cost no upload

    # a pull whose first answer is a gateway's error page: the page is not kept, the layer is
    proxy.faults = [Fault("GET", r"/blobs/sha256:", nth=1)]
    dest = tmp_path / "via-proxy"
    await oci.pull_layer(client, f"{proxy.host}/gpusnap/alice@{pushed.digest}", dest)
    assert proxy.faults[0].hits == 1
    assert dest.read_bytes() == archive.read_bytes()


async def test_a_push_failing_every_time_gives_up_and_leaves_the_archive(tmp_path, registry, proxy):
    archive = archive_file(tmp_path)
    before = archive.read_bytes()
    proxy.faults = [Fault("PATCH", UPLOADS, nth=2, times=0)]  # from the second chunk on
    shipper = Shipper(registry_scheme="http", chunk_size=CHUNK, config=quick(retries=3))
    store = RegistryStore(shipper, f"{proxy.host}/gpusnap/alice")

    with pytest.raises(AgentError) as raised:
        await store.ship(
            archive, server="alice/", container="notebook", gpu_bytes=0, created=time.time()
        )

    err = raised.value
    assert err.code == 502
    assert "pushing the checkpoint failed" in err.message and "502" in err.message
    assert "gave up after 4 tries in a row" in err.message
    assert err.fix == "check the registry's log"
    assert proxy.faults[0].hits == 4  # bounded
    # between tries the registry was asked where the upload stood
    assert proxy.count("GET", UPLOADS) == 3
    # nothing half-pushed looks like an image; the archive is as it was
    client = oci.RegistryClient(registry.host, scheme="http")
    assert await client.list_tags("gpusnap/alice") == []
    assert archive.read_bytes() == before

    # a 4xx is the registry's answer, not a moment's failure: not tried again
    proxy.faults = [Fault("PATCH", UPLOADS, nth=1, times=0, status=403)]
    with pytest.raises(AgentError, match="403") as raised:
        await store.ship(
            archive, server="alice/", container="notebook", gpu_bytes=0, created=time.time()
        )
    assert "tries" not in raised.value.message
    assert proxy.faults[0].hits == 1 and proxy.count("GET", UPLOADS) == 3
