"""OS names for the library's threads (Linux), so that ``top -H``, ``/proc`` and py-spy
tell the engine's step loop from the server's event loop (Python before 3.14 leaves every
thread named after the interpreter)."""

from __future__ import annotations

import ctypes
import sys
import threading

_PR_SET_NAME = 15  # prctl option: the calling thread's name, 15 bytes and a NUL


def name_os_thread() -> None:
    """Give the calling thread's OS thread its Python name less the ``chunklocal-`` prefix
    (``engine-core``, ``http``, ``forwarder``); a no-op where prctl is missing."""
    if not sys.platform.startswith("linux"):
        return
    name = threading.current_thread().name.removeprefix("chunklocal-")[:15]
    try:
        ctypes.CDLL(None).prctl(_PR_SET_NAME, name.encode(), 0, 0, 0)
    except (OSError, AttributeError):
        pass
