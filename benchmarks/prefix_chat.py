"""Prefix caching on a chat workload: TTFT and throughput with caching on and off.

Traffic: ``--sessions`` conversations share one system prompt of ``--system-tokens`` tokens
(4096 by default), each opens with its own ``--user-tokens``-token question, and each of
``--turns`` turns resends the whole conversation so far (system prompt, earlier questions and
answers) plus a new question, as a chat client does.  Every turn's requests go in together
(one ``generate()``: concurrent clients), greedy, ``--new-tokens`` per answer, EOS ignored.
A second cell measures one request whose first ``--cached-prefix`` tokens (8192) are in the
cache against the same request cold.  Caching on and off run alternately on one engine
configuration, ``--repeats`` times, so the ratios are side by side in one run.

Model: random weights of Llama-4 Scout's 4-layer geometry (benchmarks/engine.py) on CUDA, a
tiny one on the CPU.  Reports per turn the median TTFT, the cached prompt tokens, and the
wall time; and the cached/uncached TTFT ratio of the second cell (target <= 15%).  An
untimed warm-up pass (its own tokens) runs on each engine first; the summary is the median
over the timed repeats.  Last, the host cost of hashing and looking up a cached
``--system-tokens`` prompt on the caching engine (target <= 100 us on the CPU).
"""

from __future__ import annotations

import random
import shutil
import statistics
import sys
import tempfile
import time
import timeit
from pathlib import Path

import torch

from benchmarks.common import base_parser, format_table, write_json
from benchmarks.engine import SCOUT, write_random_checkpoint

CPU_SHAPE = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                 num_hidden_layers=4, intermediate_size=128, intermediate_size_mlp=256,
                 vocab_size=2048, attention_chunk_size=8192)


def conversations(args, rng: random.Random):
    """Per session, the first prompt; answers are appended as they come back."""
    vocab = args.vocab
    system = [rng.randrange(vocab) for _ in range(args.system_tokens)]
    return [system + [rng.randrange(vocab) for _ in range(args.user_tokens)]
            for _ in range(args.sessions)]


def run_chat(llm, args, seed: int) -> list[dict]:
    from chunklocal import SamplingParams

    rng = random.Random(seed)
    prompts = conversations(args, rng)
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    rows = []
    for turn in range(args.turns):
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - start
        rows.append(dict(turn=turn, prompt_tokens=sum(map(len, prompts)),
                         cached_tokens=sum(o.num_cached_tokens or 0 for o in outs),
                         ttft_p50_ms=1e3 * statistics.median(
                             o.metrics.time_to_first_token for o in outs),
                         wall_s=wall, output_tok_s=len(outs) * args.new_tokens / wall))
        prompts = [p + list(o.outputs[0].token_ids)
                   + [rng.randrange(args.vocab) for _ in range(args.user_tokens)]
                   for p, o in zip(prompts, outs, strict=True)]
    return rows


def run_cached_prefix(llm, args, seed: int) -> dict:
    """TTFT of prefix + question with the prefix cached, against the same request cold."""
    from chunklocal import SamplingParams

    rng = random.Random(seed)
    prefix = [rng.randrange(args.vocab) for _ in range(args.cached_prefix)]
    question = [rng.randrange(args.vocab) for _ in range(args.user_tokens)]
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    cold = llm.generate([prefix + question], params, use_tqdm=False)[0]
    # A different question after the same prefix: the prefix's blocks are cached now
    # (with caching on), the question's are not.
    question2 = [rng.randrange(args.vocab) for _ in range(args.user_tokens)]
    warm = llm.generate([prefix + question2], params, use_tqdm=False)[0]
    return dict(cold_ttft_ms=1e3 * cold.metrics.time_to_first_token,
                warm_ttft_ms=1e3 * warm.metrics.time_to_first_token,
                warm_cached_tokens=warm.num_cached_tokens or 0)


def host_cost(llm, args, seed: int) -> dict:
    """Host time per request of a ``--system-tokens`` prompt whose blocks are all cached:
    hashing its full blocks (once per request) and the lookup (``BlockManager.lookup``)."""
    from chunklocal import SamplingParams
    from chunklocal.engine.prefix_cache import extend_hashes
    from chunklocal.engine.sequence import Sequence

    rng = random.Random(seed)
    prompt = [rng.randrange(args.vocab) for _ in range(args.system_tokens + 1)]
    llm.generate([prompt], SamplingParams(max_tokens=1, ignore_eos=True), use_tqdm=False)
    manager, bs = llm.block_manager, llm.block_size
    seq = Sequence(-1, prompt, SamplingParams(max_tokens=1), len(manager.groups))
    reps = 200 if args.smoke else 2000
    hashing = min(timeit.repeat(lambda: extend_hashes([], prompt, bs, len(prompt) // bs, 0,
                                                      manager.hash_algo),
                                number=reps, repeat=5)) / reps
    with manager.lock:  # the engine loop is idle; the lookup only reads
        hit = manager.lookup(seq)
        lookup = min(timeit.repeat(lambda: manager.lookup(seq), number=reps, repeat=5)) / reps
    return dict(prompt_tokens=len(prompt), blocks=len(prompt) // bs,
                hit_tokens=0 if hit is None else hit.num_tokens, hashing_us=1e6 * hashing,
                lookup_us=1e6 * lookup, total_us=1e6 * (hashing + lookup))


def medians(rows: list[dict], keys, fields) -> list[dict]:
    """Per ``keys`` value, the median of each of ``fields`` over the timed repeats."""
    groups: dict = {}
    for row in rows:
        groups.setdefault(tuple(row[k] for k in keys), []).append(row)
    return [dict(zip(keys, key, strict=True), repeats=len(group),
                 **{f: statistics.median(r[f] for r in group) for f in fields})
            for key, group in groups.items()]


def main(argv=None) -> int:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--system-tokens", type=int, default=4096)
    parser.add_argument("--user-tokens", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--cached-prefix", type=int, default=8192)
    parser.add_argument("--host-cost-only", action="store_true",
                        help="only the host cost of hashing + lookup (caching engine)")
    parser.add_argument("--device", choices=("cuda", "cpu"),
                        default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    shape = SCOUT if args.device == "cuda" else CPU_SHAPE
    if args.smoke:
        shape = dict(CPU_SHAPE, hidden_size=64, head_dim=16, attention_chunk_size=64)
        args.sessions, args.turns, args.system_tokens, args.user_tokens = 2, 2, 96, 8
        args.new_tokens, args.cached_prefix = 4, 128
    args.vocab = shape["vocab_size"]
    repeats = args.repeats or (1 if args.smoke else 3)
    max_len = args.system_tokens + args.turns * (args.user_tokens + args.new_tokens) \
        + args.cached_prefix + 64
    max_len = -(-max_len // 16) * 16
    workdir = Path(tempfile.mkdtemp(prefix="chunklocal-prefix-"))
    name = "prefix_chat_smoke" if args.smoke else f"prefix_chat_{args.device}"
    chat_rows: list = []
    prefix_rows: list = []
    host_rows: list = []

    def save():
        ratios = [r["warm_over_cold"] for r in prefix_rows if r["caching"]]
        return write_json(name, {"model": shape, "chat": chat_rows, "cached_prefix": prefix_rows,
                                 "cached_prefix_ratio_median": statistics.median(ratios)
                                 if ratios else None, "host_cost": host_rows, "errors": [],
                                 "args": {k: v for k, v in vars(args).items()
                                          if k != "out"}}, args.out)

    try:
        write_random_checkpoint(workdir, shape, max_len, args.device)
        import chunklocal

        engines = {on: chunklocal.LLM(workdir, device=args.device, max_model_len=max_len,
                                      max_num_seqs=max(args.sessions, 1),
                                      max_num_batched_tokens=max(8192, args.cached_prefix + 64),
                                      enable_prefix_caching=on)
                   for on in ((True,) if args.host_cost_only else (True, False))}
        # Untimed warm-up (first kernels, allocator, caches), with tokens of its own: the
        # timed repeats find none of its blocks.
        for on in () if args.host_cost_only else (True, False):
            run_chat(engines[on], args, seed=-1)
            run_cached_prefix(engines[on], args, seed=-1)
        for rep in range(0 if args.host_cost_only else repeats):
            for on in ((True, False) if rep % 2 == 0 else (False, True)):  # alternate
                llm = engines[on]  # each repeat draws its own tokens: no hits across repeats
                for row in run_chat(llm, args, seed=rep):
                    chat_rows.append(dict(row, caching=on, repeat=rep))
                row = run_cached_prefix(llm, args, seed=1000 + rep)
                prefix_rows.append(dict(row, caching=on, repeat=rep,
                                        warm_over_cold=row["warm_ttft_ms"] / row["cold_ttft_ms"]))
                save()
        host_rows.append(host_cost(engines[True], args, seed=2000))
        save()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    on = [r["warm_over_cold"] for r in prefix_rows if r["caching"]]
    if on:
        print(format_table(chat_rows, ["caching", "repeat", "turn", "prompt_tokens",
                                       "cached_tokens", "ttft_p50_ms", "wall_s",
                                       "output_tok_s"]))
        print(format_table(prefix_rows, ["caching", "repeat", "cold_ttft_ms", "warm_ttft_ms",
                                         "warm_cached_tokens", "warm_over_cold"]))
        print(f"medians over {repeats} timed repeats (after an untimed warm-up pass):")
        print(format_table(medians(chat_rows, ["caching", "turn"],
                                   ["cached_tokens", "ttft_p50_ms", "wall_s", "output_tok_s"]),
                           ["caching", "turn", "repeats", "cached_tokens", "ttft_p50_ms",
                            "wall_s", "output_tok_s"]))
        print(f"cached-prefix TTFT / cold TTFT with caching on: median "
              f"{statistics.median(on):.1%} (repeats {[f'{x:.1%}' for x in on]})")
    print(format_table(host_rows, ["prompt_tokens", "blocks", "hit_tokens", "hashing_us",
                                   "lookup_us", "total_us"]))
    print(f"wrote {save()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
