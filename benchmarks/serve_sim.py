"""Closed-loop serving on the engine's own scheduler, with step times from a cost model.

What a full-size serve run (issue 24: Scout FP8 on one H200, 1k-token prompts, 1k new
tokens, 256 clients) can reach at a given decode speed, before spending device time on it.
The real ``Scheduler`` and ``BlockManager`` decide every step (admission, chunked prefill,
preemption when the KV pool runs short); only the model is replaced by a step time:

- ``add``: the decode step at the batch's decode rows (interpolated from ``--decode-ms``,
  measured points) plus ``--prefill-ms-per-token`` for every prompt token;
- ``roofline``: the larger of a memory-bound part (the decode table at the decode rows
  plus up to 512 prompt rows) and a compute-bound part (``--prefill-ms-per-token`` for
  every row): small prompt pieces ride along decodes, as a memory-bound step allows.

The default table is the twentieth session's full-size figures (BENCHMARKS.md: 8.5 ms at
1, 29.5 at 16, 35 at 64, 40.3 at 128, 51 at 256; 0.6 s for an 8,192-token prefill), the
pool the 313k tokens a KV group held there.  ``--scale`` multiplies the decode table (what
a faster decode step buys).  A model, not a measurement: against the twentieth session's
run (384 requests, 256 clients, 3,133 output tok/s measured) ``add`` gives 2,916.

    python -m benchmarks.serve_sim [--max-num-seqs 152 200 256] [--mnbt 8192 2048]
        [--scale 1 0.75] [--cost add roofline] [--requests 768] [--out OUT]
"""

from __future__ import annotations

import itertools
import sys

import numpy as np
import torch

from benchmarks.common import base_parser, format_table, write_json
from benchmarks.host_step import sampled_without_model
from chunklocal.engine.block_manager import BlockManager, KVGroup
from chunklocal.engine.sampling import SamplingParams
from chunklocal.engine.scheduler import Scheduler
from chunklocal.engine.sequence import Sequence
from chunklocal.kv_spec import FullAttentionSpec

BLOCK_SIZE = 16
#: Prompt rows a memory-bound step takes at the decode table's price (``roofline``).
RIDE_ALONG_ROWS = 512


def step_ms(cost: str, table: np.ndarray, decodes: int, prompt_rows: int,
            ms_per_token: float) -> float:
    if cost == "add":
        return float(np.interp(decodes, table[:, 0], table[:, 1])) + ms_per_token * prompt_rows
    memory = np.interp(decodes + min(prompt_rows, RIDE_ALONG_ROWS), table[:, 0], table[:, 1])
    return float(max(memory, ms_per_token * (decodes + prompt_rows)))


def simulate(*, max_num_seqs: int, mnbt: int, cost: str, table: np.ndarray,
             ms_per_token: float, clients: int, requests: int, prompt_tokens: int,
             max_tokens: int, pool_tokens: int, seed: int = 0) -> dict:
    """Run ``requests`` requests from ``clients`` closed-loop clients to the end."""
    spec = FullAttentionSpec(BLOCK_SIZE, 1, 8, torch.float32)  # one global group: the pool
    groups = [KVGroup(spec, pool_tokens // BLOCK_SIZE)]
    max_model_len = prompt_tokens + max_tokens
    pages = -(-max_model_len // BLOCK_SIZE)
    scheduler = Scheduler(BlockManager(groups, max_num_seqs, pages), max_num_seqs, mnbt,
                          max_model_len, 0)
    rng = np.random.default_rng(seed)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    sent = 0

    def send():
        nonlocal sent
        prompt = rng.integers(0, 1000, prompt_tokens).tolist()
        scheduler.add(Sequence(sent, prompt, params, 1))
        sent += 1

    for _ in range(min(clients, requests)):
        send()
    total_ms, steps, output = 0.0, 0, 0
    while scheduler.has_work():
        batch = scheduler.schedule()
        decodes = sum(1 for seq, n in zip(batch.seqs, batch.num_new, strict=True)
                      if n == 1 and seq.num_computed >= seq.num_prompt_tokens)
        total_ms += step_ms(cost, table, decodes, batch.num_tokens - decodes, ms_per_token)
        sampled = sampled_without_model(batch)
        output += sum(len(s) for s in sampled)
        for _ in scheduler.postprocess(batch, sampled, frozenset()):
            if sent < requests:
                send()
        steps += 1
    return {"max_num_seqs": max_num_seqs, "max_num_batched_tokens": mnbt, "cost": cost,
            "output_tokens": output, "seconds": total_ms / 1e3,
            "output_tok_s": round(output / total_ms * 1e3), "steps": steps,
            "preemptions": scheduler.num_preemptions}


def main(argv=None) -> int:
    parser = base_parser(__doc__)
    parser.add_argument("--max-num-seqs", type=int, nargs="+", default=[152, 200, 256])
    parser.add_argument("--mnbt", type=int, nargs="+", default=[8192, 2048],
                        help="max_num_batched_tokens")
    parser.add_argument("--cost", nargs="+", choices=["add", "roofline"],
                        default=["add", "roofline"])
    parser.add_argument("--scale", type=float, nargs="+", default=[1.0],
                        help="multiplies the decode table")
    parser.add_argument("--decode-ms", type=float, nargs="+",
                        default=[1, 8.5, 16, 29.5, 64, 35.0, 128, 40.3, 256, 51.0],
                        help="pairs: decode rows, step ms")
    parser.add_argument("--prefill-ms-per-token", type=float, default=0.6e3 / 8192)
    parser.add_argument("--clients", type=int, default=256)
    parser.add_argument("--requests", type=int, default=768)
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--max-tokens", type=int, default=1024)
    parser.add_argument("--pool-tokens", type=int, default=313_000)
    args = parser.parse_args(argv)
    if len(args.decode_ms) % 2:
        parser.error("--decode-ms takes pairs: decode rows, step ms")
    if args.smoke:
        args.clients, args.requests, args.prompt_tokens, args.max_tokens = 8, 12, 32, 16
        args.pool_tokens, args.max_num_seqs, args.mnbt = 320, [4, 8], [64]
    base = np.array([[0.0, 0.0], *np.reshape(args.decode_ms, (-1, 2))])
    rows = []
    for scale, cost, seqs, mnbt in itertools.product(args.scale, args.cost, args.max_num_seqs,
                                                     args.mnbt):
        table = base * [1.0, scale]
        row = simulate(max_num_seqs=seqs, mnbt=mnbt, cost=cost, table=table,
                       ms_per_token=args.prefill_ms_per_token, clients=args.clients,
                       requests=args.requests, prompt_tokens=args.prompt_tokens,
                       max_tokens=args.max_tokens, pool_tokens=args.pool_tokens)
        row["scale"] = scale
        rows.append(row)
        print(row, flush=True)
    print(format_table(rows, ["scale", "cost", "max_num_seqs", "max_num_batched_tokens",
                              "output_tok_s", "seconds", "steps", "preemptions"]))
    path = write_json("serve_sim", {"args": vars(args), "rows": rows, "errors": []}, args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
