"""How much memory the KV cache may take: ``gpu_memory_utilization`` on a GPU (vLLM's
meaning), a RAM budget of its own on the CPU.

**GPU** (vLLM's ``Worker.determine_available_memory``).  ``gpu_memory_utilization`` u is
the fraction of the device's *total* memory this engine may use for weights, peak
activations, CUDA graphs and KV (default 0.9).  At start-up, before any weight loads, the
device must have u x total free (vLLM's check), and the weights alone must fit.  After the
weights load, one step of the largest shape (``max_num_batched_tokens`` tokens over up to
``max_num_seqs`` requests, with logits and sampling) runs on a runner with pools just
large enough for it (engine/runner_setup.py profile_run); its peak above the weights (torch's
``max_memory_allocated`` after ``reset_peak_memory_stats``: activations and the backends'
own buffers) is the activation reserve.  vLLM's procedure leaves CUDA graphs to the
1 - u headroom; here the profile runner captures the engine's graphs (same sizes, same
recorder), their peak is reserved too, and they are dropped.  (An eager step of the largest
graph shape, tried first, reserved 1 MiB on an H200 and the engine went 32 MiB past the
fraction.)  Memory outside torch's allocator that grew since start-up (CUDA context,
library workspaces: ``mem_get_info`` less torch's reserved bytes) is reserved too, and so
is what torch's cache still holds after ``empty_cache`` (reserved less allocated: pieces
of segments partly in use, which it cannot return; reported apart, since it is a defect
to fix where it grows, as MoE.stack_shared's 26 GiB was).  The KV pools then take
``u x total - weights - activations - graphs - non-torch - cached`` (bounds/kv_pools.py,
capped at ``max_num_seqs`` requests of ``max_model_len``).  With tensor parallelism every
rank does this on its own device (engine/workers.py: its baseline before its slices load,
its profile step run with its peers, whose collectives meet), and the pools, the same on
every rank, are planned from the rank with the least room.

**CPU**: torch has no allocator statistics there, so nothing is profiled; the KV pools
take at most ``CPU_KV_FRACTION`` (40%) of the RAM Linux reports available
(``MemAvailable``) after the weights, the host being shared with the OS and other
processes.  ``gpu_memory_utilization`` is checked but does not size CPU pools.

Every device query goes through a :class:`DeviceMemory` (:class:`CudaMemory` on a GPU), so
CPU tests run the whole GPU procedure against a fake one (``LLM.device_memory``).
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from chunklocal.bounds.kv_pools import GIB, KV_MEMORY_FRACTION

DEFAULT_GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default
CPU_KV_FRACTION = KV_MEMORY_FRACTION  # of MemAvailable after the weights
#: Kept free beyond the profiled peaks, as a share of the device's total memory (141 MiB
#: of an H200): with CUDA graphs the H200 engine's first real steps went 46 KiB past the
#: fraction (allocator rounding, small per-step tensors the profile's one shape does not
#: allocate at the same moment); vLLM leaves such slack to 1 - u.
PROFILE_HEADROOM = 1 / 1024
#: Stranded cache (MemoryBudget.cached) past this share of the device is warned about at
#: start-up: full-size Scout FP8 strands 0.16 GiB (0.1%) once its stacks are made in order.
STRANDED_WARN = 0.01


class DeviceMemory(Protocol):
    """The device queries the sizing reads (bytes); torch.cuda's in :class:`CudaMemory`."""

    def total(self) -> int: ...
    def free(self) -> int: ...
    def allocated(self) -> int: ...
    def reserved(self) -> int: ...       # held by torch's cache, allocated or not
    def peak(self) -> int: ...           # most allocated since reset_peak()
    def reset_peak(self) -> None: ...
    def empty_cache(self) -> None: ...


class CudaMemory:
    """torch.cuda's queries for one device."""

    def __init__(self, device):
        self.device = torch.device(device)

    def total(self) -> int:
        return int(torch.cuda.mem_get_info(self.device)[1])

    def free(self) -> int:
        return int(torch.cuda.mem_get_info(self.device)[0])

    def allocated(self) -> int:
        return int(torch.cuda.memory_allocated(self.device))

    def reserved(self) -> int:
        return int(torch.cuda.memory_reserved(self.device))

    def peak(self) -> int:
        return int(torch.cuda.max_memory_allocated(self.device))

    def reset_peak(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)

    def empty_cache(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()


#: Makes the DeviceMemory of a device (LLM.device_memory; None: CudaMemory on a GPU).
MemoryFactory = Callable[[torch.device], DeviceMemory]


def device_memory_for(factory: MemoryFactory | None, device: torch.device
                      ) -> DeviceMemory | None:
    """The queries gpu_memory_utilization sizes the pools by: ``factory``'s, else torch.cuda's
    on a GPU; None on the CPU, which keeps its RAM budget."""
    if factory is not None:
        return factory(device)
    return CudaMemory(device) if device.type == "cuda" else None


def check_utilization(value) -> float:
    """``gpu_memory_utilization`` in (0, 1], as a float."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not 0 < float(value) <= 1:
        raise ValueError(f"gpu_memory_utilization must be a fraction in (0, 1] of the "
                         f"device's total memory, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class Baseline:
    """The device before the engine takes anything: its total, free, torch-allocated and
    torch-reserved bytes (what grows outside torch's allocator, and what its cache cannot
    give back, are measured from here)."""

    total: int
    free: int
    allocated: int
    reserved: int = 0

    @classmethod
    def take(cls, memory: DeviceMemory) -> Baseline:
        settle(memory)
        return cls(memory.total(), memory.free(), memory.allocated(), memory.reserved())

    def growth(self, memory: DeviceMemory) -> tuple[int, int]:
        """``(outside_torch, cached)`` grown since the baseline (each never < 0), from one
        settled reading: bytes outside torch's allocator, and bytes torch's cache holds
        unallocated after ``empty_cache`` (free pieces of segments partly in use, which
        only freeing the rest of the segment returns)."""
        settle(memory)
        reserved, allocated = memory.reserved(), memory.allocated()
        outside = memory.total() - memory.free() - reserved
        return (max(0, outside - (self.total - self.free - self.reserved)),
                max(0, reserved - allocated - (self.reserved - self.allocated)))


@dataclass(frozen=True)
class MemoryBudget:
    """What ``gpu_memory_utilization`` leaves the KV pools, and where it went."""

    utilization: float
    total: int
    weights: int
    activations: int = 0  # peak of the largest step above the weights
    graphs: int = 0       # estimate of the CUDA graphs' pool
    outside_torch: int = 0
    headroom: int = 0     # PROFILE_HEADROOM x total once profiled
    cached: int = 0       # torch's cache, unallocated and not returnable (Baseline.growth)

    @classmethod
    def profiled(cls, utilization: float, baseline: Baseline, memory: DeviceMemory,
                 weights: int, activations: int, graphs: int) -> MemoryBudget:
        """Once the weights loaded and the largest step ran: with what grew outside torch
        since the baseline, and PROFILE_HEADROOM of the device kept free."""
        outside_torch, cached = baseline.growth(memory)
        return cls(utilization, baseline.total, weights, activations, graphs, outside_torch,
                   int(PROFILE_HEADROOM * baseline.total), cached)

    @property
    def requested(self) -> int:
        return int(self.utilization * self.total)

    @property
    def reserved(self) -> int:
        """Activations, graphs, non-torch memory, torch's stranded cache and the
        headroom: what the KV pools cannot take."""
        return (self.activations + self.graphs + self.outside_torch + self.cached
                + self.headroom)

    def stranded_warning(self) -> str | None:
        """A warning when torch's cache holds more than ``STRANDED_WARN`` of the device that
        it cannot return: memory some load-time re-layout left in pieces (a defect to fix
        there; the KV pools lose it)."""
        if self.cached <= STRANDED_WARN * self.total:
            return None
        return (f"{self.cached / GIB:.2f} GiB of device memory sits in torch's cache in "
                f"pieces of segments still in use and is lost to the KV cache: a load-time "
                f"re-layout freed a tensor that a smaller one then split (MoE.stack_shared "
                f"once stranded 26 GiB this way)")

    def note(self) -> str:
        """Where the KV budget comes from, for messages."""
        return (f"gpu_memory_utilization={self.utilization} of {self.total / GIB:.1f} GiB, "
                f"less {self.weights / GIB:.2f} GiB of weights, {self.activations / GIB:.2f} "
                f"GiB of activations, {self.graphs / GIB:.2f} GiB of CUDA graphs, "
                f"{self.outside_torch / GIB:.2f} GiB outside torch, "
                f"{self.cached / GIB:.2f} GiB that torch's cache holds and cannot return "
                f"and {self.headroom / GIB:.2f} GiB of headroom")


def check_start(baseline: Baseline, utilization: float, weight_bytes: int,
                device: str) -> None:
    """Before any weight loads: u x total must be free (vLLM's start-up check) and hold
    the weights."""
    requested = int(utilization * baseline.total)
    if baseline.free < requested:
        raise ValueError(
            f"gpu_memory_utilization={utilization} asks {requested / GIB:.1f} GiB of "
            f"{device}'s {baseline.total / GIB:.1f} GiB, but only {baseline.free / GIB:.1f} "
            f"GiB is free: pass gpu_memory_utilization <= "
            f"{int(baseline.free / baseline.total * 1000) / 1000} or free the device")
    if weight_bytes > requested:
        raise ValueError(
            f"gpu_memory_utilization={utilization} gives {requested / GIB:.1f} GiB of "
            f"{device}'s {baseline.total / GIB:.1f} GiB, less than the "
            f"{weight_bytes / GIB:.1f} GiB of weights: pass a larger gpu_memory_utilization")


def settle(memory: DeviceMemory) -> None:
    """Collect Python's garbage, then return torch's cached blocks: every reading starts
    from memory that is really in use.  An engine dropped earlier in the process can sit in
    a reference cycle holding GiBs; collected in the middle of a profiled step, it lowered
    ``allocated`` below the reading taken before the step, and the H200 profiled 0 bytes of
    activations for a step that allocated its KV pages and buffers (vLLM collects first too)."""
    gc.collect()
    memory.empty_cache()


def peak_of(memory: DeviceMemory, run: Callable[[], object]) -> int:
    """Bytes ``run()`` allocated at its peak above what was allocated before it."""
    settle(memory)
    memory.reset_peak()
    before = memory.allocated()
    run()
    return max(0, memory.peak() - before)


def startup_line(weights: int, kv_bytes: int, group_pages: dict[str, int],
                 requests_fit: int, max_model_len: int, budget: MemoryBudget | None,
                 num_kv_blocks: int | None = None) -> str:
    """The one line ``LLM`` logs once its pools are sized."""
    pages = ", ".join(f"{name} {n}" for name, n in group_pages.items())
    where = budget.note() if budget is not None else f"num_kv_blocks={num_kv_blocks}" \
        if num_kv_blocks else (f"at most {CPU_KV_FRACTION:.0%} of the memory available "
                               f"after the weights")
    return (f"weights {weights / GIB:.2f} GiB, KV cache {kv_bytes / GIB:.2f} GiB (pages per "
            f"KV group: {pages}); {requests_fit} requests of max_model_len {max_model_len} "
            f"fit at once [{where}]")
