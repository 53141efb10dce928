"""Tensor parallelism: one worker process per rank, driven by the caller's process.

The caller's process keeps the scheduler and the block manager and never joins the
process group: it pickles each step's :class:`~chunklocal.engine.tp_runner.DeviceStep`
once and sends the same bytes to every rank.  Each rank builds its own attention
metadata, runs its slice of the model (collectives over torch.distributed: NCCL
on GPUs, gloo on the CPU) and rank 0 sends back the sampled tokens.

Failures: the caller waits on every worker's pipe *and* process sentinel, so a rank
that raises (its traceback is sent) or dies (killed, out of memory) ends the wait at
once; then every worker is stopped (ranks blocked in a collective with a dead peer
are killed) and the call raises :class:`WorkerError`.  Because the caller holds no
process group and no CUDA context, nothing in it can hang on a dead rank, and
shutdown (:meth:`Workers.close`, also run by ``del llm`` and at interpreter exit)
bounds how long it waits for a rank to tear its process group down before killing it.
"""

from __future__ import annotations

import os
import pickle
import shutil
import tempfile
import threading
import time
import traceback
import weakref
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import wait

import torch

from chunklocal.engine.memory import MemoryFactory
from chunklocal.engine.tp_runner import RemoteRunner, execute

_STOP = b"stop"
#: How often a worker checks that its caller is alive.
PARENT_POLL_S = 0.5
#: Seconds a stopping worker gets to tear down its process group before it is killed.
STOP_GRACE_S = 10.0


class WorkerError(RuntimeError):
    """A tensor-parallel worker failed or died; every worker has been stopped."""


@dataclass(frozen=True)
class WorkerArgs:
    model_dir: str
    device_type: str    # "cpu" or "cuda" (rank r uses cuda:r)
    dtype: torch.dtype
    moe_parallel: str
    load_format: str
    seed: int           # of load_format="dummy" weights (the same on every rank)
    num_threads: int    # torch CPU threads per worker
    init_file: str      # torch.distributed FileStore rendezvous
    # gpu_memory_utilization's device queries (LLM.device_memory; None: torch.cuda's on a
    # GPU, nothing on the CPU) and whether the caller will ask for a profile
    memory_factory: MemoryFactory | None = None
    profile_memory: bool = False


def _exit_with_parent(parent_pid: int) -> None:
    """A worker whose caller died without stopping it (SIGKILL, out of memory) exits
    within a poll: it would otherwise wait for ever, holding its memory, its GPU and any
    socket it inherited (a forked server's listening port)."""
    while True:
        time.sleep(PARENT_POLL_S)
        if os.getppid() != parent_pid:  # re-parented: the caller is gone
            os._exit(1)


def _worker_main(rank: int, size: int, args: WorkerArgs, conn, parent_pid: int) -> None:
    code = 1
    threading.Thread(target=_exit_with_parent, args=(parent_pid,), daemon=True,
                     name="chunklocal-parent-watch").start()
    try:
        _serve(rank, size, args, conn)
        code = 0
    except (EOFError, BrokenPipeError, KeyboardInterrupt):
        pass  # the caller went away or stopped us: nothing to report to
    except BaseException:
        try:
            conn.send(("error", rank, traceback.format_exc()))
        except OSError:
            pass
    # No interpreter teardown: atexit hooks of a process group with a dead peer can hang.
    os._exit(code)


def _serve(rank: int, size: int, args: WorkerArgs, conn) -> None:
    import torch.distributed as dist

    from chunklocal.engine.memory import Baseline, MemoryBudget, device_memory_for
    from chunklocal.engine.runner_setup import build_runner, profile_run
    from chunklocal.models.llama4_config import read_config
    from chunklocal.models.loader import load_model, plan_load
    from chunklocal.models.parallel import TPGroup

    torch.set_num_threads(args.num_threads)
    cuda = args.device_type == "cuda"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{args.init_file}",
                            rank=rank, world_size=size, timeout=timedelta(minutes=10),
                            **({"device_id": device} if cuda else {}))
    # Free memory before any weight loads (and, for gpu_memory_utilization, this rank's
    # baseline): the caller plans the KV pools from the least of the ranks.
    memory = device_memory_for(args.memory_factory, device) if args.profile_memory else None
    baseline = Baseline.take(memory) if memory is not None else None
    conn.send(("started", torch.cuda.mem_get_info(device)[0] if cuda else None, baseline))
    setup = conn.recv()
    plan = plan_load(args.model_dir, read_config(args.model_dir), args.load_format,
                     TPGroup(rank, size, None, args.moe_parallel))
    model = load_model(plan, device, args.dtype, args.seed)
    if setup[0] == "profile":  # every rank runs the same largest step: its collectives meet
        _, setup, utilization = setup
        if memory is None or baseline is None:
            raise RuntimeError("a memory profile was asked of a rank that measures no memory")
        weights = memory.allocated() - baseline.allocated
        measured = profile_run(setup, model, device, memory, plan.ckpt.text.vocab_size)
        conn.send(("budget", MemoryBudget.profiled(utilization, baseline, memory, weights,
                                                   *measured)))
        setup = conn.recv()
    runner = build_runner(setup[1], model, device)
    conn.send(("ready", runner.graphs is not None))
    while True:
        payload = conn.recv_bytes()
        if payload == _STOP:
            break
        step_id, step = pickle.loads(payload)
        out = execute(runner, step, sample=rank == 0)
        if rank == 0:
            conn.send(("step", step_id, out))
    if cuda:
        torch.cuda.synchronize(device)
    dist.destroy_process_group()


def _stop(procs, conns, tmpdir, grace: float) -> None:
    """Ask every worker to stop, wait up to ``grace`` seconds in all, kill the rest."""
    for conn in conns:
        try:
            conn.send_bytes(_STOP)
        except OSError:
            pass
    deadline = time.monotonic() + grace
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join()
    for conn in conns:
        conn.close()
    shutil.rmtree(tmpdir, ignore_errors=True)


class Workers:
    """Ranks 0..size-1 as processes; construction returns once every rank has joined
    the process group (``free_bytes``: the least free device memory, before loading);
    :meth:`start_runners` then has them load their slices and build their runners."""

    def __init__(self, size: int, args: dict):
        # CUDA ranks are spawned: a fork of a process that touched CUDA cannot use it.  CPU
        # ranks are forked: they start in a fraction of the time and work from scripts
        # without a __main__ guard; they run one thread (start_workers), because an OpenMP
        # thread team of the parent does not survive the fork (a forked parallel region waits
        # forever on its missing threads).
        mp = torch.multiprocessing
        ctx = mp.get_context("spawn") if args["device_type"] == "cuda" else mp.get_context("fork")
        self._tmpdir = tempfile.mkdtemp(prefix="chunklocal-tp-")
        self.args = WorkerArgs(init_file=os.path.join(self._tmpdir, "store"), **args)
        self.procs, self.conns = [], []
        self.failure: str | None = None
        self._errors: dict[int, str] = {}  # rank -> traceback it sent
        self._next_step = 0
        for rank in range(size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker_main,
                               args=(rank, size, self.args, child, os.getpid()),
                               name=f"chunklocal-tp-rank{rank}", daemon=True)
            self.procs.append(proc)
            self.conns.append(parent)
            proc.start()
            child.close()
        self._finalizer = weakref.finalize(self, _stop, self.procs, self.conns, self._tmpdir,
                                           STOP_GRACE_S)
        started = self._receive(range(size), "started")
        frees = [msg[1] for msg in started.values() if msg[1] is not None]
        self.free_bytes = min(frees) if frees else None
        baselines = [msg[2] for msg in started.values() if msg[2] is not None]
        #: The baseline of the rank with the least free memory (gpu_memory_utilization's
        #: start-up check and pools are planned from it), or None without a profile.
        self.baseline = min(baselines, key=lambda b: b.free) if baselines else None

    @property
    def pids(self) -> list[int]:
        return [proc.pid for proc in self.procs]

    def profile(self, runner_setup, utilization: float):
        """Every rank loads its weights and runs the largest step (engine/memory.py); the
        budget of the rank with the least room left for KV (every rank holds the same
        pages)."""
        for conn in self.conns:
            self._send(conn, ("profile", runner_setup, utilization))
        budgets = [msg[1] for msg in self._receive(range(len(self.procs)), "budget").values()]
        return min(budgets, key=lambda b: b.requested - b.weights - b.reserved)

    def start_runners(self, runner_setup, block_manager) -> RemoteRunner:
        """Send every rank the engine's KV groups; once all have loaded their weights and
        built their runner, the caller's runner that drives them."""
        for conn in self.conns:
            self._send(conn, ("setup", runner_setup))
        self._receive(range(len(self.procs)), "ready")
        return RemoteRunner(self, block_manager, runner_setup.chunk_size)

    def step(self, device_step):
        """Run one step on every rank: rank 0's StepResult (engine/tp_runner.py)."""
        if self.failure is not None:
            raise WorkerError(f"the tensor-parallel workers were stopped earlier: {self.failure}")
        step_id, self._next_step = self._next_step, self._next_step + 1
        payload = pickle.dumps((step_id, device_step), protocol=pickle.HIGHEST_PROTOCOL)
        for conn in self.conns:
            self._send(conn, payload, raw=True)
        while True:  # results of an interrupted earlier step may still be queued
            msg = self._receive([0], "step")[0]
            if msg[1] == step_id:
                return msg[2]

    def close(self, grace: float = STOP_GRACE_S) -> None:
        """Stop every worker (idempotent); those not gone after ``grace`` s are killed."""
        if self._finalizer.alive:
            self._finalizer.detach()
            _stop(self.procs, self.conns, self._tmpdir, grace)
        if self.failure is None:
            self.failure = ("the LLM was shut down (its tensor-parallel workers cannot "
                            "start again): create a new LLM")

    # -- failure detection ------------------------------------------------------------------
    def _send(self, conn, obj, raw=False):
        try:
            conn.send_bytes(obj) if raw else conn.send(obj)
        except OSError:
            self._fail(self._diagnose())

    def _receive(self, ranks, tag: str) -> dict:
        """The next ``tag`` message of each rank in ``ranks``; any error or death first fails."""
        pending, got = set(ranks), {}
        sentinels = [proc.sentinel for proc in self.procs]
        while pending:
            ready = wait([*self.conns, *sentinels])
            problem = any(s in ready for s in sentinels)
            for rank, conn in enumerate(self.conns):
                if conn not in ready:
                    continue
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    problem = True
                    continue
                if msg[0] == "error":
                    self._errors[msg[1]] = msg[2]
                    problem = True
                elif msg[0] == tag and rank in pending:
                    got[rank] = msg
                    pending.discard(rank)
            if problem:
                self._fail(self._diagnose())
        return got

    def _diagnose(self) -> str:
        """Why the ranks failed: deaths by signal first (a peer's collective then raises a
        connection error, which is a symptom), then tracebacks, then other exits."""
        deadline = time.monotonic() + 1.0  # let a failing rank's exit status settle
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        for conn in self.conns:
            try:
                while conn.poll():
                    msg = conn.recv()
                    if msg[0] == "error":
                        self._errors[msg[1]] = msg[2]
            except (EOFError, OSError):
                pass
        codes = [proc.exitcode for proc in self.procs]
        killed = [r for r, code in enumerate(codes) if code is not None and code < 0]
        exited = [r for r, code in enumerate(codes)
                  if code is not None and code >= 0 and r not in self._errors]
        reasons = [f"rank {r} (pid {self.procs[r].pid}) was killed by signal {-codes[r]}"
                   for r in killed]
        reasons += [f"rank {r} raised:\n{tb}" for r, tb in sorted(self._errors.items())]
        reasons += [f"rank {r} (pid {self.procs[r].pid}) exited with code {codes[r]}"
                    for r in exited]
        return "; ".join(reasons) or "a rank closed its pipe"

    def _fail(self, reason: str):
        self.failure = reason
        # Ranks blocked in a collective with a dead peer never read "stop": short grace.
        self.close(grace=2.0)
        raise WorkerError(f"tensor-parallel worker failure: {reason}; every worker is "
                          "stopped, this LLM can not run again")


class OwnsWorkers:
    """``shutdown()``, ``del`` and ``with`` end an engine's worker processes, if any."""

    workers: Workers | None = None

    def shutdown(self) -> None:
        """End the tensor-parallel worker processes (idempotent; nothing to do for N = 1)."""
        if self.workers is not None:
            self.workers.close()

    def __del__(self):
        self.shutdown()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()


def start_workers(size: int, model_dir, device: torch.device, dtype, moe_parallel,
                  load_format="auto", seed=0, memory_factory=None,
                  profile_memory: bool = False) -> Workers:
    """Spawn the ranks of ``LLM(..., tensor_parallel_size=size)``; rank r uses cuda:r."""
    if device.type == "cuda" and (device.index is not None or torch.cuda.device_count() < size):
        raise ValueError(f"tensor_parallel_size {size} runs rank r on cuda:r: pass "
                         f"device='cuda' with at least {size} visible GPUs (got "
                         f"device={str(device)!r}, {torch.cuda.device_count()} GPUs)")
    threads = max(1, torch.get_num_threads() // size) if device.type == "cuda" else 1
    return Workers(size, dict(model_dir=str(model_dir), device_type=device.type, dtype=dtype,
                              moe_parallel=moe_parallel, load_format=load_format, seed=seed,
                              num_threads=threads, memory_factory=memory_factory,
                              profile_memory=profile_memory))
