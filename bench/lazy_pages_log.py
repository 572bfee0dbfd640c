"""Where a lazy restore's time went, from the daemon's log (``lazy-pages.log``, ``-v4``).

Per restored process: its page faults (how many, how long each waited from the fault to
the copy of its pages: median, 90th percentile, most, and the sum; ``fault_events``: also
those on pages already asked for), the requests around them (``around``, CRIU patch
0005), its background requests, and when its first fault, last fault and last copy came (seconds from the
daemon's start). ``bench/gpu_notebook.py --logs DIR`` keeps the log of each lazy restore.

The daemon's own pace, from its background answers of 4 MiB (the largest it asks for):
``copy_ms``, the median time from its copy of one into the process (``uffd_copy``) to its next
background request, which it makes once the copy is done; ``receive_ms`` (median) and
``receive_p90_ms``, from a background request to its next copy of 4 MiB, the time it spent
receiving the answer or waiting for it (docs/lazy-restore.md, "What holds the transfer back").
With copier threads (CRIU patch 0011) the daemon hands each background answer over
(``uffd_copy: … by a copier``) and ``copy_ms`` is that hand-over; ``copier_ms`` and
``copier_p90_ms`` are a copier's own time for 4 MiB, ``copier_copies`` how many it copied, and
``last_copy_s`` counts the copiers' last copy.

Both sides of each round trip, when the page server's log of the same restore lies beside
the daemon's (``page-server.log`` for ``lazy-pages.log``, ``X_page-server.log`` for
``X_lazy-pages.log``; the service keeps both in the checkpoint's folder): for the background
answers of 4 MiB, ``joined`` of them found in both, ``to_server_ms`` from the daemon's request
until the page server read it, ``server_ms`` until the page server had written the answer,
``to_daemon_ms`` from then until the daemon copied it (which includes the daemon's copy of
the answer before it), medians and ``_p90_ms``. The daemon's log counts from its start and
the page server's is the wall clock: the two are set so that the quickest request reached the
page server at once, and ``to_server_ms`` is what a request took on top of that quickest one.

Usage: ``python bench/lazy_pages_log.py LOG [LOG ...] [--until SECONDS]`` (``--until``:
count only the faults before then, e.g. the kernel's first answer).
"""

from __future__ import annotations

import argparse
import lzma
import re
import statistics
from collections import defaultdict
from pathlib import Path

from common import print_table

LINE = re.compile(r"^\((\d+\.\d+)\) uffd: (\d+)-\d+: (.*)$")
FAULT = re.compile(r"#PF at 0x([0-9a-f]+): asking for (\d+) bytes")
COPY = re.compile(r"uffd_copy: 0x([0-9a-f]+)/(\d+)")
BACKGROUND = re.compile(r"background: (\d+) pages at 0x([0-9a-f]+)")
QUEUED = re.compile(r"#PF at 0x([0-9a-f]+)$")
AROUND = re.compile(r"fault-around: (\d+) pages at 0x([0-9a-f]+)")
COPIER = re.compile(r"copier: (\d+) of (\d+) pages at 0x([0-9a-f]+) in (\d+) us")
FULL = 4 << 20  # the background transfer's largest answer (CRIU patch 0002: MAX_XFER_LEN)


def _ms(seconds: list[float], q: float = 0.5) -> float | None:
    """The ``q`` quantile of ``seconds``, in ms (None when empty)."""
    if not seconds:
        return None
    s = sorted(seconds)
    return round(s[int(q * (len(s) - 1))] * 1e3, 2)


def _lines(path: Path):
    opener = lzma.open if path.suffix == ".xz" else open
    with opener(path, "rt", errors="replace") as f:
        yield from f


def _server_log(path: Path) -> Path | None:
    """The page server's log beside the daemon's ``path``, if there is one."""
    name = path.name.removesuffix(".xz").replace("lazy-pages.log", "page-server.log")
    for suffix in ("", ".xz"):
        other = path.with_name(name + suffix)
        if other != path and other.is_file():
            return other
    return None


def _served(path: Path) -> dict[tuple[int, int], list[tuple[float, float]]]:
    """The page server's answers of 4 MiB in the background, by (process, vaddr): (read,
    written), in order."""
    out: dict[tuple[int, int], list[tuple[float, float]]] = defaultdict(list)
    for line in _lines(path):
        f = line.split()
        if len(f) != 6 or f[0].startswith("#") or f[2] != "background" or f[1] == "-":
            continue
        if int(f[5]) * 4096 == FULL:
            out[int(f[3]), int(f[4], 16)].append((float(f[0]), float(f[1])))
    return out


def _round_trips(p: dict, pid: int, served: dict) -> dict:
    """Join the daemon's background requests of 4 MiB and their copies with the page
    server's reads and answers (columns of the module's docstring)."""
    pairs = []  # (asked, read, written, copied): daemon's clock, then the wall clock
    for addr, asked, copied in p["trips"]:
        got = served.get((pid, addr))
        if got:
            read, written = got.pop(0)
            pairs.append((asked, read, written, copied))
    if not pairs:
        return {"joined": 0}
    fix = min(read - asked for asked, read, _, _ in pairs)  # the daemon's clock to the wall
    to_server = [read - fix - asked for asked, read, _, _ in pairs]
    server = [written - read for _, read, written, _ in pairs]
    to_daemon = [copied - (written - fix) for _, _, written, copied in pairs]
    return {
        "joined": len(pairs),
        "to_server_ms": _ms(to_server), "to_server_p90_ms": _ms(to_server, 0.9),
        "server_ms": _ms(server), "server_p90_ms": _ms(server, 0.9),
        "to_daemon_ms": _ms(to_daemon), "to_daemon_p90_ms": _ms(to_daemon, 0.9),
    }  # fmt: skip


def summarize(path: Path, until: float | None = None) -> list[dict]:
    procs: dict[int, dict] = defaultdict(
        lambda: {"faults": [], "pending": {}, "background": 0, "bg_bytes": 0, "copied": 0,
                 "first_fault": None, "last_fault": None, "last_copy": None, "faulted": 0,
                 "around": 0, "around_bytes": 0, "copy": [], "receive": [], "last": None,
                 "copier": [], "asked": {}, "trips": []}
    )  # fmt: skip
    for line in _lines(path):
        m = LINE.match(line.rstrip("\n"))
        if not m:
            continue
        t, pid, what = float(m.group(1)), int(m.group(2)), m.group(3)
        p = procs[pid]
        if f := FAULT.match(what):
            if until is not None and t > until:
                continue
            p["pending"][int(f.group(1), 16)] = t
            p["first_fault"] = p["first_fault"] if p["first_fault"] is not None else t
            p["last_fault"] = t
        elif QUEUED.match(what):
            p["faulted"] += 1  # every fault, also one on pages already asked for
        elif c := COPY.match(what):
            addr, n = int(c.group(1), 16), int(c.group(2))
            p["copied"] += n
            p["last_copy"] = t
            if addr in p["pending"]:
                p["faults"].append(t - p["pending"].pop(addr))
            if n == FULL and addr in p["asked"]:
                p["trips"].append((addr, p["asked"].pop(addr), t))
            if n == FULL:
                if p["last"] is not None and p["last"][0] == "request":
                    p["receive"].append(t - p["last"][1])
                p["last"] = ("copy", t)
        elif k := COPIER.match(what):
            p["last_copy"] = t
            if int(k.group(1)) * 4096 == FULL:
                p["copier"].append(int(k.group(4)) / 1e6)
        elif a := AROUND.match(what):
            if until is None or t <= until:
                p["around"] += 1
                p["around_bytes"] += int(a.group(1)) * 4096
        elif b := BACKGROUND.match(what):
            p["background"] += 1
            p["bg_bytes"] += int(b.group(1)) * 4096
            if int(b.group(1)) * 4096 == FULL:
                p["asked"][int(b.group(2), 16)] = t
            if p["last"] is not None and p["last"][0] == "copy":
                p["copy"].append(t - p["last"][1])
            p["last"] = ("request", t)
    server_log = _server_log(path)
    served = _served(server_log) if server_log is not None else None
    rows = []
    for pid, p in sorted(procs.items()):
        w = sorted(p["faults"])
        if not w and not p["background"]:
            continue
        rows.append({
            "log": path.name, "pid": pid, "faults": len(w), "fault_events": p["faulted"],
            "wait_median_ms": round(statistics.median(w) * 1e3, 2) if w else None,
            "wait_p90_ms": _ms(w, 0.9),
            "wait_max_ms": round(w[-1] * 1e3, 1) if w else None,
            "wait_sum_s": round(sum(w), 3),
            "around": p["around"], "around_mib": round(p["around_bytes"] / 2**20, 1),
            "background": p["background"], "background_mib": round(p["bg_bytes"] / 2**20, 1),
            "copied_mib": round(p["copied"] / 2**20, 1),
            "first_fault_s": p["first_fault"], "last_fault_s": p["last_fault"],
            "last_copy_s": p["last_copy"],
            "copies_4mib": len(p["copy"]),
            "copy_ms": _ms(p["copy"]), "receive_ms": _ms(p["receive"]),
            "receive_p90_ms": _ms(p["receive"], 0.9),
            "copier_copies": len(p["copier"]), "copier_ms": _ms(p["copier"]),
            "copier_p90_ms": _ms(p["copier"], 0.9),
            **(_round_trips(p, pid, served) if served is not None else {}),
        })  # fmt: skip
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("logs", nargs="+", type=Path)
    ap.add_argument("--until", type=float, default=None, help="count faults until this second")
    a = ap.parse_args()
    rows = [r for path in a.logs for r in summarize(path, a.until)]
    # every column any row has (a process without background answers has no round trips)
    print_table(rows, list(dict.fromkeys(k for r in rows for k in r)) or ["log"])


if __name__ == "__main__":
    main()
