"""Decode step time of two source trees in one run (A/B), e.g. before and after a change.

Each round runs one child process per tree (``PYTHONPATH=<tree>/src``), alternating
A, B, A, B, ... so that clock and thermal drift hit both alike.  A child builds
``chunklocal.LLM`` (one GPU, bf16, CUDA graphs) on a random checkpoint with Scout's
layer geometry (hidden 5120, 40/8 heads of 128, 16 experts of inner size 8192 on
every other layer, dense MLP 16384 on the others, vocab 202048; ``--layers`` of them),
generates ``--new-tokens`` tokens for ``--batch`` prompts of ``--context`` tokens and
times every ``llm.runner.run`` call (it returns host tokens, so the step is over);
its figure is the median over pure decode steps.  The checkpoint is written once
with transformers' parameter names, which every version of the loader reads.

    python -m benchmarks.decode_ab --a /tmp/base --b . --out benchmarks/results/h200
    python -m benchmarks.decode_ab --a . --b . --smoke   # CPU: checks the logic
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import base_parser, format_table, machine_info, write_json

SCOUT_LAYER = dict(hidden_size=5120, num_attention_heads=40, num_key_value_heads=8,
                   head_dim=128, intermediate_size=8192, intermediate_size_mlp=16384,
                   num_local_experts=16, num_experts_per_tok=1, interleave_moe_layer_step=2,
                   vocab_size=202048, attention_chunk_size=8192)
SMOKE = dict(SCOUT_LAYER, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, intermediate_size=64, intermediate_size_mlp=128, num_local_experts=4,
             vocab_size=512, attention_chunk_size=32)


def write_checkpoint(path: Path, shape: dict, layers: int, max_len: int, device) -> None:
    from transformers import Llama4ForCausalLM, Llama4TextConfig

    from benchmarks.engine import save_random_weights  # here: a child never needs it

    config = Llama4TextConfig(**shape, num_hidden_layers=layers, max_position_embeddings=max_len,
                              bos_token_id=None, eos_token_id=None, pad_token_id=None)
    save_random_weights(path, config, Llama4ForCausalLM, device)


def child(model_dir: str, batch: int, context: int, new_tokens: int) -> dict:
    """Runs inside one tree: the median decode step of one engine."""
    import inspect

    import chunklocal

    cuda = torch.cuda.is_available()
    # steps one at a time through runner.run (timed below), in trees that schedule ahead too
    sync = {"async_scheduling": False} if "async_scheduling" in inspect.signature(
        chunklocal.LLM).parameters else {}
    llm = chunklocal.LLM(model_dir, device="cuda" if cuda else "cpu",
                         dtype=torch.bfloat16 if cuda else torch.float32, max_num_seqs=batch,
                         max_num_batched_tokens=max(2048, batch),
                         max_model_len=context + new_tokens + 8, **sync)
    run, times = llm.runner.run, []

    def timed(sched_batch, *rest):  # (batch) now, (batch, temperatures) in older trees
        start = time.perf_counter()
        out = run(sched_batch, *rest)
        times.append(((time.perf_counter() - start) * 1e3, sum(sched_batch.num_new)))
        return out

    llm.runner.run = timed
    vocab = llm.config.vocab_size
    prompts = [[(17 * i + 5 * j) % vocab for i in range(context)] for j in range(batch)]
    llm.generate(prompts, max_new_tokens=new_tokens, ignore_eos=True)
    decode = [ms for ms, tokens in times if tokens == batch][3:]  # after warm-up steps
    return {"decode_ms": statistics.median(decode), "decode_steps": len(decode),
            "source": str(Path(chunklocal.__file__).resolve().parent)}


def main(argv=None) -> int:
    parser = base_parser(__doc__.split("\n")[0])
    parser.add_argument("--a", type=Path, required=True, help="tree A (holds src/chunklocal)")
    parser.add_argument("--b", type=Path, required=True, help="tree B")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--child", nargs=4, help=argparse_suppress())
    args = parser.parse_args(argv)
    if args.child:
        model_dir, batch, context, new = args.child
        print("RESULT " + json.dumps(child(model_dir, int(batch), int(context), int(new))))
        return 0
    shape = SMOKE if args.smoke else SCOUT_LAYER
    if args.smoke:
        args.rounds, args.batch, args.context, args.new_tokens = 1, 4, 40, 12
    rows = []
    payload = {"machine": machine_info(), "args": {k: str(v) for k, v in vars(args).items()},
               "rows": rows, "errors": []}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "ckpt"
        write_checkpoint(model_dir, shape, args.layers, args.context + args.new_tokens + 64,
                         "cuda" if torch.cuda.is_available() else "cpu")
        for r in range(args.rounds):
            for label, tree in (("A", args.a), ("B", args.b)):
                env = dict(os.environ, PYTHONPATH=child_path(tree))
                cmd = [sys.executable, "-m", "benchmarks.decode_ab", "--a", ".", "--b", ".",
                       "--child", str(model_dir), str(args.batch), str(args.context),
                       str(args.new_tokens)]
                proc = subprocess.run(cmd, env=env, capture_output=True, text=True,
                                      cwd=Path(__file__).resolve().parents[1])
                lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
                if proc.returncode or not lines:
                    payload["errors"].append(f"{label} round {r}: {proc.stderr[-2000:]}")
                    continue
                rows.append({"tree": label, "round": r, **json.loads(lines[-1][7:])})
                print(format_table(rows[-1:]), flush=True)
    medians = {t: statistics.median(x["decode_ms"] for x in rows if x["tree"] == t)
               for t in ("A", "B") if any(x["tree"] == t for x in rows)}
    if len(medians) == 2:
        payload["b_over_a"] = medians["B"] / medians["A"]
        print(f"decode step: A {medians['A']:.3f} ms, B {medians['B']:.3f} ms, "
              f"B / A = {payload['b_over_a']:.4f}")
    payload["medians_ms"] = medians
    write_json("decode_ab_smoke" if args.smoke else "decode_ab", payload, args.out)
    return 0 if not payload["errors"] else 1


def child_path(tree: Path) -> str:
    """PYTHONPATH for a child that imports chunklocal from ``tree``: its ``src`` first, then
    the parent's entries that do not hold a chunklocal of their own (on the H200 FlashInfer
    lives in one of them, /tmp/site; dropping them all lost it)."""
    keep = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
            if p and not (Path(p) / "chunklocal").is_dir()]
    return os.pathsep.join([str(tree.resolve() / "src"), *keep])


def argparse_suppress():
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    sys.exit(main())
