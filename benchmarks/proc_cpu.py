"""CPU use of a process tree, per process and per thread, from /proc (Linux only).

What it is for: a load test whose server runs below the engine's speed says which thread is
the bottleneck.  A thread near 1.0 core for the whole level is saturated: in the server
process that is the event loop (streaming, JSON, HTTP) or the reader of the engine
process's pipe; in the engine process, the step loop (scheduling, input preparation,
detokenization) or its forwarder.

    before = sample(pid); ...; report = usage(before, sample(pid), seconds, pid)
"""

from __future__ import annotations

import os
from pathlib import Path

PROC = Path("/proc")


def _ticks(stat_text: str) -> int:
    # utime and stime are fields 14 and 15; the name (field 2) may hold spaces, so split
    # after its closing parenthesis.
    fields = stat_text[stat_text.rindex(")") + 2:].split()
    return int(fields[11]) + int(fields[12])


def _children(pid: int) -> list[int]:
    kids = []
    for task in (PROC / str(pid) / "task").glob("*"):
        try:
            kids += [int(k) for k in (task / "children").read_text().split()]
        except OSError:
            continue
    return kids


def tree(pid: int) -> list[int]:
    """``pid`` and its descendants (processes, not threads), parents first."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop(0)
        out.append(p)
        todo += _children(p)
    return out


def sample(pid: int) -> dict[tuple[int, int], tuple[str, int]]:
    """{(process, thread): (thread name, CPU ticks so far)} over ``pid``'s tree; empty where
    /proc is missing (not Linux)."""
    out = {}
    for p in tree(pid) if (PROC / str(pid)).exists() else []:
        for task in (PROC / str(p) / "task").glob("*"):
            try:
                name = (task / "comm").read_text().strip()
                out[(p, int(task.name))] = (name, _ticks((task / "stat").read_text()))
            except (OSError, ValueError):
                continue  # the thread ended between the listing and the read
    return out


def usage(before: dict, after: dict, seconds: float, root: int, top: int = 3) -> list[dict]:
    """Per process of the tree: cores used over ``seconds`` (CPU seconds / wall seconds),
    and its ``top`` busiest threads ``(name, tid, cores)``.  ``root`` is called "server",
    the others "child <pid>"."""
    hz = os.sysconf("SC_CLK_TCK")
    per: dict[int, list[tuple[float, str, int]]] = {}
    for (p, t), (name, ticks) in after.items():
        used = (ticks - before.get((p, t), (name, 0))[1]) / hz / seconds
        per.setdefault(p, []).append((used, name, t))
    rows = []
    for p, threads in per.items():
        threads.sort(reverse=True)
        rows.append({"process": "server" if p == root else f"child {p}",
                     "cores": round(sum(u for u, _, _ in threads), 3),
                     "threads": [(name, t, round(u, 3)) for u, name, t in threads[:top]]})
    return rows


def summary(rows: list[dict]) -> str:
    return "; ".join(f"{r['process']} {r['cores']:.2f} cores (busiest thread "
                     f"{r['threads'][0][2]:.2f})" for r in rows if r["threads"])
