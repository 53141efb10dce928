"""CPU per streamed chunk: ``StreamState.update`` (server/responses.py), this tree against
another checkout's, alternated in one run.

Traffic: one greedy choice growing by one short token per snapshot (64 snapshots, no
logprobs), chat and completion streams, without usage (the common chunk of a busy server)
and with ``continuous_usage_stats`` (a usage in every chunk, as benchmarks/serve.py asks).  The
figure is microseconds of the event loop's CPU per chunk, the minimum of 3 timings of 50
streams, each of 5 alternated repeats.

    python -m benchmarks.stream_chunks [--before OTHER_CHECKOUT/src] [--out DIR]
"""

from __future__ import annotations

import importlib.util
import sys
import timeit
from pathlib import Path
from types import SimpleNamespace

from benchmarks.common import base_parser, format_table, write_json

MODEL = "meta-llama/Llama-4-Scout-17B-16E-Instruct"


def snapshots(n: int) -> list:
    outs, text = [], ""
    for i in range(n):
        text += " tok"
        choice = SimpleNamespace(index=0, text=text, token_ids=list(range(i + 1)),
                                 finish_reason=None, stop_reason=None, logprobs=None)
        outs.append(SimpleNamespace(outputs=[choice], prompt_token_ids=[1] * 64,
                                    num_cached_tokens=0))
    return outs


def load_responses(src: Path):
    """``server/responses.py`` of another checkout's ``src``, under a name of its own (it
    imports this tree's protocol module, which has not changed shape)."""
    path = src / "chunklocal" / "server" / "responses.py"
    spec = importlib.util.spec_from_file_location("before_responses", path)
    if not path.is_file() or spec is None or spec.loader is None:
        raise SystemExit(f"--before {src}: no chunklocal/server/responses.py there")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def per_chunk_us(module, chat: bool, snaps, number: int, continuous: bool = False) -> float:
    def stream():
        state = module.StreamState(chat, "chatcmpl-0123456789abcdef", MODEL, 1, None, None,
                                   False, continuous)
        for snap in snaps:
            state.update(0, snap)
    return min(timeit.repeat(stream, number=number, repeat=3)) / number / len(snaps) * 1e6


def main(argv=None) -> int:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, default=None,
                        help="another checkout's src directory, timed beside this tree")
    args = parser.parse_args(argv)
    from chunklocal.server import responses

    trees = {"this tree": responses}
    if args.before is not None:
        trees = {"before": load_responses(args.before), **trees}
    snaps = snapshots(4 if args.smoke else 64)
    number, repeats = (2, 1) if args.smoke else (50, args.repeats or 5)
    rows = []
    for chat, continuous in ((True, False), (False, False), (True, True), (False, True)):
        times: dict[str, list[float]] = {name: [] for name in trees}
        for _ in range(repeats):
            for name, module in trees.items():
                times[name].append(per_chunk_us(module, chat, snaps, number, continuous))
        for name, values in times.items():
            rows.append({"stream": "chat" if chat else "completion",
                         "usage": "every chunk" if continuous else "none", "tree": name,
                         "us_per_chunk_min": min(values), "us_per_chunk_max": max(values)})
    print(format_table(rows))
    write_json("stream_chunks_smoke" if args.smoke else "stream_chunks",
               {"rows": rows, "errors": []}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
