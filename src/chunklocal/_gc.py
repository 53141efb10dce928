"""Garbage collection kept off the step loop's latency (vLLM freezes its heap the same way).

A full (generation 2) collection walks every tracked object.  Once the model is loaded the
process holds about 400k of them (torch, transformers, the engine's own), and one full
collection took 157-204 ms on a CPU of the test machine (measured with ``gc.callbacks``
around 3,072 requests of ``LLM.generate``: one such pause; after freezing, the same run's
full collection took 25 ms): one stalled step, seen by every running request as one long
inter-token gap.  :func:`freeze_startup_heap` moves everything alive at the end of start-up
into the permanent generation, which collections skip, so a full collection walks only
what was made since.

Invariant: objects that die after being frozen are not freed until unfrozen.  So each call
unfreezes first and collects (an engine built and dropped earlier in the process, such as a
test's, is freed then), and the interpreter's exit unfreezes, so objects are finalized as
usual.  ``CHUNKLOCAL_GC_FREEZE=0`` turns it off (read at each call).
"""

from __future__ import annotations

import atexit
import gc
import os

_unfreeze_at_exit = False


def freeze_startup_heap(enabled: bool | None = None) -> bool:
    """Collect, then freeze every live object; False (nothing done) when not ``enabled``
    (None: the switch)."""
    global _unfreeze_at_exit
    if not (os.environ.get("CHUNKLOCAL_GC_FREEZE", "1") != "0" if enabled is None
            else enabled):
        return False
    gc.unfreeze()  # what an earlier call froze and has died since is collected now
    gc.collect()
    gc.freeze()
    if not _unfreeze_at_exit:
        atexit.register(gc.unfreeze)
        _unfreeze_at_exit = True
    return True
