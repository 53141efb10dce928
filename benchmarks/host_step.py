"""Host microseconds per decode step, stage by stage, with no model: what the engine's own
Python costs before and after the device runs.

A scheduler, block manager and runner host half (``InputBuilder``, as the
tensor-parallel engine's rank 0 uses it) serve ``batch`` requests that have finished a
``context``-token prefill.  Each decode step runs the host stages of the real step path:

* ``schedule``: Scheduler.schedule (pages for every request, its token budget);
* ``prepare``: flat input ids, positions, query starts, sequence lengths, logit rows;
* ``group_inputs``: each KV group's block table and slot mapping (numpy here);
* ``postprocess``: Scheduler.postprocess on one sampled token per request.

Not counted: the attention metadata build (``benchmarks.metadata``: host build per
step, and none under CUDA graphs with ``build_on_device``), sampling, and publishing to
client streams (``benchmarks.engine_core`` times the whole loop) except its costly part,
``detokenize``: one token into each request's incremental detokenizer, with tokenizers'
DecodeStream and with the two-decodes Python path, on a byte-level BPE tokenizer trained
here (``--tokenizer DIR`` for a real one).

Side by side in one run, alternated per step: the scheduler's vectorised decode pass on
and off (``Scheduler._decodes_at_once``), and two KV groups (chunked + global, Llama-4's
hybrid cache) against one (the same model with chunking off).

    python -m benchmarks.host_step                  # batch 64 and 256, 1k contexts
    python -m benchmarks.host_step --smoke
"""

from __future__ import annotations

import sys
import time

import numpy as np
import torch

from benchmarks.common import base_parser, format_table, write_json

STAGES = ("schedule", "prepare", "group_inputs", "postprocess")


def make_engine(batch: int, context: int, chunk_size: int | None, block_size: int = 16,
                extra_rows: int = 0, max_len: int | None = None):
    """(scheduler, runner) holding ``batch`` requests just past a ``context``-token prefill
    (and room for ``extra_rows`` more requests of up to ``max_len`` tokens)."""
    from chunklocal.engine.block_manager import BlockManager, KVGroup
    from chunklocal.engine.input_builder import InputBuilder
    from chunklocal.engine.sampling import SamplingParams
    from chunklocal.engine.scheduler import Scheduler
    from chunklocal.engine.sequence import Sequence
    from chunklocal.kv_spec import ChunkedLocalAttentionSpec, FullAttentionSpec

    geometry = (block_size, 8, 128, torch.bfloat16)
    max_len = max_len or context + 4096
    rows = batch + extra_rows
    whole = -(-max_len // block_size) * rows
    if chunk_size is None:
        groups = [KVGroup(FullAttentionSpec(*geometry), whole)]
    else:
        local = -(-(chunk_size + max(batch, 8192)) // block_size) * rows
        groups = [KVGroup(FullAttentionSpec(*geometry), whole),
                  KVGroup(ChunkedLocalAttentionSpec(*geometry, attention_chunk_size=chunk_size),
                          local)]
    manager = BlockManager(groups, rows, -(-max_len // block_size))
    scheduler = Scheduler(manager, rows, max(8192, batch * context), max_len)
    runner = InputBuilder(manager, chunk_size)
    rng = np.random.default_rng(0)
    params = SamplingParams(max_tokens=4096, ignore_eos=True)
    for i in range(batch):
        scheduler.add(Sequence(i, rng.integers(0, 1000, context).tolist(), params,
                               len(groups)))
    while scheduler.waiting or any(s.num_uncomputed > 1 for s in scheduler.running):
        step(scheduler, runner, None)
    return scheduler, runner


def sampled_without_model(batch, token: int = 7) -> list[np.ndarray]:
    """What the sampler would hand ``Scheduler.postprocess`` for ``batch`` (no drafts):
    one token for a request whose step reaches its last known token, none for a prefill
    piece short of it."""
    return [np.array([token]) if s.num_computed + n >= len(s.token_ids) else
            np.zeros(0, np.int64) for s, n in zip(batch.seqs, batch.num_new, strict=True)]


def step(scheduler, runner, times: dict | None) -> None:
    """One host step; adds each stage's nanoseconds to ``times`` (when given)."""
    t0 = time.perf_counter_ns()
    batch = scheduler.schedule()
    t1 = time.perf_counter_ns()
    inputs = runner.prepare(batch)
    t2 = time.perf_counter_ns()
    runner.group_inputs(batch, inputs)
    t3 = time.perf_counter_ns()
    sampled = sampled_without_model(batch)
    t4 = time.perf_counter_ns()
    scheduler.postprocess(batch, sampled, frozenset())
    t5 = time.perf_counter_ns()
    if times is not None:
        for name, ns in zip(STAGES, (t1 - t0, t2 - t1, t3 - t2, t5 - t4), strict=True):
            times[name].append(ns / 1e3)


def measure(batches, context, chunk_size, steps) -> list[dict]:
    rows = []
    for batch in batches:
        cases = {}
        for groups, chunk in (("2 (chunked + global)", chunk_size), ("1 (global)", None)):
            for vectorised in (True, False):
                scheduler, runner = make_engine(batch, context, chunk)
                if not vectorised:
                    scheduler._decodes_at_once = lambda *args: False
                cases[(groups, vectorised)] = (scheduler, runner, {s: [] for s in STAGES})
        for _ in range(steps):  # alternated: the machine's drift hits every case alike
            for scheduler, runner, times in cases.values():
                step(scheduler, runner, times)
        for (groups, vectorised), (scheduler, _, times) in cases.items():
            assert scheduler.num_preemptions == 0 and len(scheduler.running) == batch
            medians = {f"{s}_us": float(np.median(times[s])) for s in STAGES}
            rows.append({"batch": batch, "context": context, "kv_groups": groups,
                         "decode_pass": "vectorised" if vectorised else "per request",
                         **medians, "host_us": sum(medians.values())})
    return rows


def mixed_rows(context: int, chunk_size: int, steps: int, decodes: int = 63,
               prompt_len: int = 32768, piece: int = 2048) -> list[dict]:
    """Issue 14's mixed step: ``decodes`` decodes plus one ``piece``-token prefill chunk of a
    ``prompt_len`` prompt (a new prompt replaces a finished one, untimed)."""
    from chunklocal.engine.sampling import SamplingParams
    from chunklocal.engine.sequence import Sequence

    rows = []
    for groups, chunk in (("2 (chunked + global)", chunk_size), ("1 (global)", None)):
        scheduler, runner = make_engine(decodes, context, chunk, extra_rows=1,
                                        max_len=prompt_len + 64)
        scheduler.max_num_batched_tokens = decodes + piece
        params = SamplingParams(max_tokens=1, ignore_eos=True)
        times = {s: [] for s in STAGES}
        prompt = np.random.default_rng(1).integers(0, 1000, prompt_len).tolist()
        while len(times["schedule"]) < steps:
            if len(scheduler.running) == decodes and not scheduler.waiting:
                scheduler.add(Sequence(10**6 + len(times["schedule"]), prompt, params,
                                       len(scheduler.block_manager.groups)))
            step(scheduler, runner, times)
        medians = {f"{s}_us": float(np.median(times[s])) for s in STAGES}
        rows.append({"step": f"{decodes} decodes + {piece}-token prefill chunk",
                     "kv_groups": groups, **medians, "host_us": sum(medians.values())})
    return rows


def byte_level_tokenizer():
    """A byte-level BPE (Llama-4's kind) trained on mixed-script text, 4k tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ["chunked local attention over a paged cache, one chunk at a time",
              "naïve café déjà vu — ünïcödé", "数据 注意力 分块 缓存", "emoji 🙂 🚀 ✨"] * 50
    tok.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=4096, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def detokenize_rows(tokenizer, batches, steps) -> list[dict]:
    """Host us per step to detokenize one new token of each of ``batch`` requests."""
    from chunklocal.engine.detokenize import IncrementalDetokenizer

    class PythonPath:  # the tokenizer without its Rust backend
        decode = tokenizer.decode

    text = "chunked local attention — naïve café 数据 🙂 " * 64
    ids = tokenizer(text, add_special_tokens=False)["input_ids"][:steps]
    rows = []
    for batch in batches:
        for name, tok in (("DecodeStream", tokenizer), ("python", PythonPath())):
            detoks = [IncrementalDetokenizer(tok) for _ in range(batch)]
            times = []
            for token in ids:
                start = time.perf_counter_ns()
                for d in detoks:
                    d.add(token)
                times.append((time.perf_counter_ns() - start) / 1e3)
            rows.append({"batch": batch, "detokenizer": name,
                         "detokenize_us": float(np.median(times)),
                         "us_per_token": float(np.median(times)) / batch})
    return rows


def main(argv=None) -> int:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--chunk-size", type=int, default=8192)
    parser.add_argument("--tokenizer", default=None,
                        help="a tokenizer directory (default: a byte-level BPE trained here)")
    args = parser.parse_args(argv)
    steps = args.repeats or 300
    if args.smoke:
        args.batch, args.context, steps = [4], 40, 5
    rows = measure(args.batch, args.context, args.chunk_size, steps)
    print(format_table(rows))
    mixed = mixed_rows(args.context, args.chunk_size, steps,
                       **(dict(decodes=3, prompt_len=200, piece=32) if args.smoke else {}))
    print(format_table(mixed))
    if args.tokenizer:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    else:
        tokenizer = byte_level_tokenizer()
    detok = detokenize_rows(tokenizer, args.batch, min(steps, 200))
    print(format_table(detok))
    path = write_json("host_step_smoke" if args.smoke else "host_step",
                      {"args": vars(args), "steps": steps, "rows": rows, "mixed": mixed,
                       "detokenize": detok,
                       "errors": []},
                      args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
