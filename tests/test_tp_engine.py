"""chunklocal.LLM with tensor_parallel_size=2 (worker processes, gloo) against TP=1, float32.

Oracle: the same engine with one rank, whose greedy tokens and prompt logits are
checked against transformers in test_engine.py.  Two ranks must give every greedy
token and the prompt logits within max|difference| / max|logit| <= 1e-4.
On the CPU the ranks are forked processes talking over gloo.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch
from llama4_tiny import rel_err, write_tiny_llama4

import chunklocal
from chunklocal.engine.workers import WorkerError

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
# The acceptance geometry: steps of at most 32 tokens (MoE's dense path).
ACCEPTANCE = dict(device="cpu", dtype=torch.float32, max_model_len=128,
                  max_num_batched_tokens=32, block_size=4)
PROMPTS = [[(7 * i + 3 * j) % 512 for i in range(n)] for j, n in enumerate((5, 33, 70, 100))]


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def worker_pids_alive(pids) -> list[int]:
    """Pids still running (a zombie counts as gone: it no longer runs)."""
    alive = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            continue
        if state != "Z":
            alive.append(pid)
    return alive


def child_pids() -> list[int]:
    """Running children of this process (workers are forked on the CPU)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read()
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        if ppid == os.getpid() and b"resource_tracker" not in cmd:
            found.append(int(entry))
    return worker_pids_alive(found)


def compare(tp_llm, ref_llm, prompts, max_new_tokens=12):
    assert tp_llm.generate(prompts, max_new_tokens) == ref_llm.generate(prompts, max_new_tokens)
    for i, (got, want) in enumerate(zip(tp_llm.prompt_logits(prompts),
                                        ref_llm.prompt_logits(prompts), strict=True)):
        assert got.shape == want.shape
        assert rel_err(got, want) <= 1e-4, f"prompt {i}"


@pytest.fixture(scope="module")
def ckpt_a(tmp_path_factory):
    """4 layers (dense 0, 2; top-1 MoE 1, 3), GQA 4/2: each rank holds 2 q and 1 KV heads."""
    path = tmp_path_factory.mktemp("tp_a")
    write_tiny_llama4(path, seed=0)
    return path


@pytest.fixture(scope="module")
def ckpt_b(tmp_path_factory):
    """bf16 checkpoint; 6 layers, c=16, top-2 MoE on 0/2/5, one KV head (replicated on both
    ranks), llama3 RoPE, attention biases, tied embeddings."""
    path = tmp_path_factory.mktemp("tp_b")
    model = write_tiny_llama4(
        path, seed=1, num_hidden_layers=6, attention_chunk_size=16, num_key_value_heads=1,
        no_rope_layers=[1, 1, 0, 1, 1, 0], moe_layers=[0, 2, 5], num_experts_per_tok=2,
        rope_parameters=LLAMA3_ROPE, intermediate_size=48, attention_bias=True,
        tie_word_embeddings=True)
    model.to(torch.bfloat16).save_pretrained(str(path))
    return path


@pytest.mark.parametrize("moe, hybrid, batched", [("tp", True, 96), ("ep", False, 32)],
                         ids=["moe-tp-hybrid-sparse", "moe-ep-merged"])
def test_two_ranks_match_one(ckpt_a, moe, hybrid, batched):
    """96-token steps run MoE's sparse path (> 64 tokens), 32-token steps its dense path."""
    kw = dict(ACCEPTANCE, max_num_batched_tokens=batched, hybrid_kv_cache=hybrid)
    ref = chunklocal.LLM(ckpt_a, **kw)
    with chunklocal.LLM(ckpt_a, tensor_parallel_size=2, moe_parallel=moe, **kw) as llm:
        pids = llm.workers.pids
        assert llm.model is None and len(worker_pids_alive(pids)) == 2
        assert llm.groups[0].spec.num_kv_heads == 1  # 2 KV heads over 2 ranks
        compare(llm, ref, PROMPTS)
        if batched > 64:
            assert max(llm.runner.tokens_per_step) > 64
    assert worker_pids_alive(pids) == []
    with pytest.raises(WorkerError, match="was shut down"):
        llm.generate(PROMPTS[:1], max_new_tokens=2)


@pytest.mark.parametrize("moe, hybrid", [("ep", True), ("tp", False)])
def test_bf16_checkpoint_replicated_kv_head_bias_and_tied_embeddings(ckpt_b, moe, hybrid):
    ref = chunklocal.LLM(ckpt_b, **ACCEPTANCE, hybrid_kv_cache=hybrid)
    llm = chunklocal.LLM(ckpt_b, tensor_parallel_size=2, moe_parallel=moe,
                         hybrid_kv_cache=hybrid, **ACCEPTANCE)
    pids = llm.workers.pids
    assert llm.groups[0].spec.num_kv_heads == 1  # the one KV head, on both ranks
    compare(llm, ref, PROMPTS)
    del llm  # ends the workers
    assert worker_pids_alive(pids) == []


@pytest.mark.parametrize("victim", [1, 0])
def test_a_killed_rank_fails_the_call_and_ends_every_worker(ckpt_a, victim):
    before = set(child_pids())
    llm = chunklocal.LLM(ckpt_a, tensor_parallel_size=2, **ACCEPTANCE)
    pids = llm.workers.pids
    prompts = [[(5 * i + j) % 512 for i in range(8)] for j in range(4)]
    raised = []

    def call():  # far more steps than it takes to kill a rank
        try:
            llm.generate(prompts, max_new_tokens=100)
        except BaseException as err:  # noqa: BLE001 - checked below
            raised.append(err)

    caller = threading.Thread(target=call, daemon=True)
    caller.start()
    while len(llm.runner.tokens_per_step) < 3 and caller.is_alive():
        time.sleep(0.01)
    os.kill(pids[victim], signal.SIGKILL)
    caller.join(30)
    assert not caller.is_alive(), "generate() still running 30 s after a rank was killed"
    assert len(raised) == 1 and isinstance(raised[0], WorkerError), raised
    assert f"rank {victim} (pid {pids[victim]}) was killed by signal 9" in str(raised[0])
    assert worker_pids_alive(pids) == []
    assert set(child_pids()) <= before
    # no request keeps pages; the engine refuses further work with the same reason
    assert all(grp.num_used == 0 for grp in llm.groups)
    with pytest.raises(WorkerError, match="stopped earlier"):
        llm.generate(prompts, max_new_tokens=2)


def test_workers_of_a_killed_caller_exit(ckpt_a):
    """The caller's process dies by SIGKILL (no shutdown, no atexit): its ranks must
    not live on holding memory and inherited sockets."""
    import subprocess
    import sys

    script = ("import sys, time, torch, chunklocal\n"
              f"llm = chunklocal.LLM({str(ckpt_a)!r}, tensor_parallel_size=2, "
              "device='cpu', dtype=torch.float32, max_model_len=128, "
              "max_num_batched_tokens=32, block_size=4)\n"
              "print(*llm.workers.pids, flush=True)\n"
              "time.sleep(600)\n")
    caller = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in caller.stdout.readline().split()]
        assert len(pids) == 2 and worker_pids_alive(pids) == pids
    finally:
        caller.kill()
        caller.wait(30)
    deadline = time.monotonic() + 15
    while worker_pids_alive(pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert worker_pids_alive(pids) == [], "workers outlived their killed caller"


def test_a_rank_that_raises_while_loading(tmp_path, monkeypatch):
    """The checkpoint passes the caller's checks, then vanishes before the ranks read it:
    each rank's traceback reaches the caller, and no worker is left."""
    from chunklocal.engine import llm as llm_module

    write_tiny_llama4(tmp_path, seed=0)
    real_start = llm_module.start_workers

    def start_then_remove(*args, **kwargs):
        started = real_start(*args, **kwargs)
        for f in tmp_path.glob("*.safetensors"):
            f.unlink()
        return started

    monkeypatch.setattr(llm_module, "start_workers", start_then_remove)
    before = set(child_pids())
    with pytest.raises(WorkerError, match=r"rank \d raised:\n.*Traceback"):
        chunklocal.LLM(tmp_path, tensor_parallel_size=2, **ACCEPTANCE)
    assert set(child_pids()) <= before


@pytest.mark.parametrize("kwargs, message", [
    (dict(tensor_parallel_size=3), "tensor_parallel_size 3 does not divide num_attention_heads"),
    (dict(tensor_parallel_size=8, moe_parallel="ep"), "num_attention_heads = 4"),
    (dict(tensor_parallel_size=2, moe_parallel="experts"), "moe_parallel must be 'tp' or 'ep'"),
    (dict(tensor_parallel_size=0), "tensor_parallel_size must be >= 1"),
    (dict(tensor_parallel_size=2.0), "tensor_parallel_size"),
])
def test_bad_parallel_arguments_rejected_before_loading(ckpt_a, monkeypatch, kwargs, message):
    from chunklocal.engine import llm as llm_module
    from chunklocal.engine import workers

    def never(*args, **kw):
        raise AssertionError("workers started")

    monkeypatch.setattr(workers, "Workers", never)
    monkeypatch.setattr(llm_module, "load_model", never)
    with pytest.raises(ValueError, match=message):
        chunklocal.LLM(ckpt_a, **{**ACCEPTANCE, **kwargs})


@pytest.mark.parametrize("device, gpus, message", [
    ("cuda", 1, "at least 2 visible GPUs"), ("cuda:1", 2, "pass device='cuda'")])
def test_ranks_need_one_gpu_each(ckpt_a, monkeypatch, device, gpus, message):
    """Checked before any rank starts (the GPUs are faked: this machine may have none)."""
    from chunklocal.engine import workers

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(workers, "Workers", None)  # calling it would fail the test
    with pytest.raises(ValueError, match=message):
        chunklocal.LLM(ckpt_a, tensor_parallel_size=2, device=device, max_model_len=128)


def test_forked_ranks_after_the_parent_used_a_thread_team(ckpt_a):
    """The parent ran a 2-thread OpenMP region: a forked rank's own 2-thread region would
    wait forever on that team's threads, which the fork did not copy.  Ranks must run one
    thread, whatever the parent's setting (here 4, which once gave each rank 4 / 2)."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        torch.ones(1 << 22).mul_(2)  # an elementwise op: an OpenMP team of 2
        torch.set_num_threads(4)
        out, children = [], set(child_pids())

        def start_and_generate():  # in a thread: a hang fails the test instead of CI
            out.append(chunklocal.LLM(ckpt_a, tensor_parallel_size=2, **ACCEPTANCE))
            out.append(out[0].generate(PROMPTS[:2], 4))

        caller = threading.Thread(target=start_and_generate, daemon=True)
        caller.start()
        caller.join(60)
        if caller.is_alive():  # end the hung ranks before failing
            for pid in set(child_pids()) - children:
                os.kill(pid, signal.SIGKILL)
        assert not caller.is_alive(), "the forked ranks hang"
        assert len(out) == 2 and out[0].workers.args.num_threads == 1
        out[0].shutdown()
    finally:
        torch.set_num_threads(before)
