"""The import graph runs one way (docs/architecture.md, "Layers").

Every module and package directly under ``jupyterhub_gpusnap`` sits on one floor; it may
import from its own floor and the floors below, never from a floor above, and no two of them
import each other (directly or round a longer loop). The imports are read with ``ast``, not
run, so an import inside a function or under ``TYPE_CHECKING`` counts as much as one at
the top of a file: a lazy import still makes the lower part depend on the upper one.

A new module must be given a floor here; an edge that cannot be removed yet goes into
:data:`KNOWN_UPWARD_EDGES`, named, with the reason (empty is the goal).
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

PACKAGE = "jupyterhub_gpusnap"
ROOT = Path(__file__).resolve().parent.parent / PACKAGE

#: Bottom first. A part may import only from its own floor or a lower one.
FLOORS: list[tuple[str, set[str]]] = [
    (
        "foundations: data types, errors, small helpers",
        {"__init__", "model", "errors", "retry", "procs", "metrics", "hubconfig", "sandbox"},
    ),
    ("hardware and cluster: the GPU layer and the Kubernetes clients", {"gpu", "kube"}),
    (
        "parts: checkpoint backends, signal sources, the policy, persistence, the Hub API, email",
        {"checkpoint", "signals", "policy", "store", "hub", "notify"},
    ),
    (
        "the loop: the watcher, the effects it runs, the service facade",
        {"watcher", "room", "service"},
    ),
    (
        "entry points: the service app and its pages, the spawners, the node agent, the "
        "server extension, the admin commands",
        {
            "app",
            "handlers",
            "spawner",
            "spawner_restore",
            "kubespawner",
            "agent",
            "serverext",
            "culler_hook",
            "doctor",
            "service_main",
            "keys_cli",
            "unpack_cli",
            "demo",
        },
    ),
]

#: (importer, imported) -> why it is still there. Each entry is an edge that breaks the rule
#: and is being removed; the test fails on any edge not listed here.
KNOWN_UPWARD_EDGES: dict[tuple[str, str], str] = {}


def part_of(module: str, root: Path) -> str | None:
    """``jupyterhub_gpusnap.x.y`` -> ``x`` (``__init__`` for the package itself); None outside."""
    parts = module.split(".")
    if parts[0] != PACKAGE:
        return None
    if len(parts) == 1:
        return "__init__"
    head = parts[1]
    if (root / f"{head}.py").exists() or (root / head / "__init__.py").exists():
        return head
    return "__init__"  # a name the package's __init__ defines (__version__)


def imports(root: Path) -> dict[tuple[str, str], list[str]]:
    """Every import between two parts of the package under ``root``: (importer, imported)
    -> the places (``module:line``)."""
    edges: dict[tuple[str, str], list[str]] = defaultdict(list)
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts = parts[:-1]
        here = part_of(".".join(parts), root)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:  # relative: from the module's package, up level - 1
                    base = parts if is_package else parts[:-1]
                    base = base[: len(base) - (node.level - 1)]
                else:
                    base = []
                module = ".".join(base + ([node.module] if node.module else []))
                if module == PACKAGE or not node.module:
                    # `from . import x`, `from jupyterhub_gpusnap import x`: x may be a module
                    targets = [f"{module}.{a.name}" for a in node.names]
                else:
                    targets = [module]
            else:
                continue
            for target in targets:
                there = part_of(target, root)
                if there and there != here:
                    edges[(here, there)].append(f"{'.'.join(parts)}:{node.lineno}")
    return edges


def floor_of() -> dict[str, int]:
    return {part: i for i, (_, parts) in enumerate(FLOORS) for part in parts}


def parts_on_disk(root: Path) -> set[str]:
    found = {p.stem for p in root.glob("*.py") if p.stem != "__init__"}
    found |= {p.parent.name for p in root.glob("*/__init__.py")}
    return found | {"__init__"}


def upward(edges: dict[tuple[str, str], list[str]]) -> list[str]:
    """The edges from a floor to a floor above it, as lines a reader can act on."""
    floor = floor_of()
    out = []
    for (a, b), where in sorted(edges.items()):
        if floor[b] > floor[a] and (a, b) not in KNOWN_UPWARD_EDGES:
            out.append(
                f"{a} (floor {floor[a]}) imports {b} (floor {floor[b]}) at {', '.join(where)}"
            )
    return out


def loops(edges: dict[tuple[str, str], list[str]]) -> list[list[str]]:
    """The groups of parts that import each other, directly or round a loop (Tarjan)."""
    graph: dict[str, set[str]] = defaultdict(set)
    for a, b in edges:
        if (a, b) not in KNOWN_UPWARD_EDGES:
            graph[a].add(b)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(set(graph) | {b for bs in graph.values() for b in bs}):
        if v not in index:
            visit(v)
    return groups


def test_every_part_has_a_floor():
    placed = floor_of()
    missing = sorted(parts_on_disk(ROOT) - set(placed))
    assert not missing, f"give these a floor in FLOORS (tests/test_import_layers.py): {missing}"
    gone = sorted(set(placed) - parts_on_disk(ROOT))
    assert not gone, f"FLOORS names parts that no longer exist: {gone}"


def test_no_part_imports_a_floor_above_it():
    edges = imports(ROOT)
    assert ("app", "watcher") in edges  # the walk sees the imports at all
    bad = upward(edges)
    assert not bad, "imports that point up:\n" + "\n".join(bad)


def test_no_two_parts_import_each_other():
    groups = loops(imports(ROOT))
    assert not groups, f"parts that import each other (directly or round a loop): {groups}"


def test_known_upward_edges_are_still_there():
    """An allowlisted edge that is gone must leave the list, so the list only shrinks."""
    edges = imports(ROOT)
    stale = sorted(e for e in KNOWN_UPWARD_EDGES if e not in edges)
    assert not stale, f"remove from KNOWN_UPWARD_EDGES, these imports are gone: {stale}"


@pytest.mark.parametrize(
    "importer, source, problem",
    [
        ("model.py", "from .watcher import Watcher\n", "upward"),
        ("gpu/cuda.py", "def f():\n    from ..checkpoint import local\n", "upward"),
        ("kube/api.py", "import jupyterhub_gpusnap.signals.agent\n", "upward"),
        ("policy.py", "from .store import Store\n", "loop"),
    ],
)
def test_the_check_finds_a_bad_edge(tmp_path, importer, source, problem):
    """The walk, on a small copy of the package with one bad import added: an import from a
    bottom floor up (at the top of a file, inside a function, absolute) and a loop."""
    pkg = tmp_path / PACKAGE
    for part in ("model", "policy", "store", "watcher"):
        (pkg / f"{part}.py").parent.mkdir(parents=True, exist_ok=True)
        (pkg / f"{part}.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "store.py").write_text("from .policy import Rule\nfrom .model import State\n")
    (pkg / "watcher.py").write_text("from . import model, store\n")
    for sub in ("gpu", "kube", "checkpoint", "signals"):
        (pkg / sub).mkdir(exist_ok=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "checkpoint" / "local.py").write_text("from ..gpu import cuda\n")
    (pkg / "signals" / "agent.py").write_text("from ..kube import api\n")
    (pkg / "gpu" / "cuda.py").write_text("from ..model import Server\n")
    (pkg / "kube" / "api.py").write_text("from jupyterhub_gpusnap.model import Server\n")

    clean = imports(pkg)
    assert not upward(clean) and not loops(clean)
    assert ("store", "policy") in clean and ("checkpoint", "gpu") in clean

    path = pkg / importer
    path.write_text(path.read_text() + source)
    edges = imports(pkg)
    if problem == "upward":
        assert len(upward(edges)) == 1, edges
        assert importer.split("/")[0].removesuffix(".py") in upward(edges)[0]
    else:
        assert loops(edges) == [["policy", "store"]]


# ---------------------------------------------------------------- the tests' own imports

TESTS = Path(__file__).resolve().parent


def imported_test_modules(path: Path) -> list[str]:
    """The test modules (``test_*``, ``conftest``) the file at ``path`` imports, as
    ``name:line``; what tests share lives in ``tests/helpers/`` instead."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""] + [a.name for a in node.names if not node.module]
        else:
            continue
        for name in names:
            last = name.split(".")[-1]
            if last.startswith("test_") or last == "conftest":
                found.append(f"{name}:{node.lineno}")
    return found


def test_no_test_module_imports_another():
    """A test module imports shared fakes and helpers from ``tests/helpers/``, never from
    another test module or conftest (nor does a bench)."""
    files = sorted(TESTS.rglob("*.py")) + sorted((TESTS.parent / "bench").rglob("*.py"))
    bad = {
        str(p.relative_to(TESTS.parent)): found
        for p in files
        if (found := imported_test_modules(p))
    }
    assert bad == {}


@pytest.mark.parametrize(
    "source",
    [
        "from test_policy import T0\n",
        "from tests.test_restore_e2e import suspend\n",
        "import tests.test_gpu_park\n",
        "from conftest import TREE_PROGRAM\n",
        "from . import test_policy\n",
        "def f():\n    from test_chunk_scrub import suspend_two\n",
    ],
)
def test_the_check_finds_a_test_module_imported(tmp_path, source):
    path = tmp_path / "test_x.py"
    path.write_text("from tests.helpers.policy_samples import T0\nimport pytest\n")
    assert imported_test_modules(path) == []
    path.write_text(source)
    assert len(imported_test_modules(path)) == 1
