"""Q3: host cost of one step's attention metadata, shared once vs rebuilt per group / layer.

Build = virtual batches (chunked group) + paged-KV arrays + (on the GPU) the
FlashInfer plan's host work and the copies to the device.  A Llama-4-Scout-sized
model has 48 layers: 36 chunked, 12 global; vLLM's hybrid KV manager makes 4 KV
groups (3 chunked + 1 global).  Three ways to pay for it, measured in one run:

* ``once per step``: one chunked build + one global build (chunklocal);
* ``per KV group``: 3 chunked + 1 global builds (engines that rebuild per group);
* ``per layer``: 36 chunked + 12 global builds.

With ``--device cuda`` each step's attention time (36 chunked + 12 global layer
forwards, CUDA events) is measured too, and the build as a fraction of it.
Target (issue 6): < 100 us on the CPU for 256 decodes; < 5 % of attention time.
"""

from __future__ import annotations

import sys

from benchmarks import workloads as wl
from benchmarks.common import (
    base_parser,
    cpu_time_us,
    cuda_time_ms,
    format_table,
    guarded,
    write_json,
)
from benchmarks.steps import make_step_builders

NUM_LAYERS = 48
CHUNKED_LAYERS = 36
KV_GROUPS_CHUNKED = 3


def cases(smoke: bool) -> list[wl.Batch]:
    if smoke:
        return [
            wl.decode_ragged_contexts(16, 1024, 32768),
            wl.single_prefill(3000),
            wl.mixed(prefills=4, prefill_len=64, decodes=12, hi=32768),
        ]
    return [wl.decode_ragged_contexts(256), wl.single_prefill(36000), wl.mixed()]


def count_builds(strategy, *builders) -> int:
    """How many metadata builds one call of ``strategy`` makes (so a row's label is checked,
    not trusted)."""
    calls = 0
    originals = [b.build for b in builders]

    def counted(build):
        def wrapper(*args, **kwargs):
            nonlocal calls
            calls += 1
            return build(*args, **kwargs)
        return wrapper

    for b, build in zip(builders, originals, strict=True):
        b.build = counted(build)
    try:
        strategy()
    finally:
        for b, build in zip(builders, originals, strict=True):
            b.build = build
    return calls


def run_case(batch: wl.Batch, args, errors: list) -> list[dict]:
    rows = []
    builders = make_step_builders(batch, args.device, args.implementation)
    chunked, global_ = builders.chunked, builders.global_
    repeats = args.repeats or (5 if args.smoke else 100)
    layer_repeats = max(3, repeats // 10)

    def once():
        chunked.build()
        global_.build()

    def per_group():
        for _ in range(KV_GROUPS_CHUNKED):
            chunked.build()
        global_.build()

    def per_layer():
        for _ in range(CHUNKED_LAYERS):
            chunked.build()
        for _ in range(NUM_LAYERS - CHUNKED_LAYERS):
            global_.build()

    builds_per_step = {}
    for how, strategy in (("once per step", once), ("per KV group (3+1)", per_group),
                          ("per layer (36+12)", per_layer)):
        builds_per_step[how] = count_builds(strategy, chunked, global_)

    t_chunked = cpu_time_us(chunked.build, repeats, warmup=3)
    t_global = cpu_time_us(global_.build, repeats, warmup=3)
    t_once = cpu_time_us(once, repeats, warmup=2)
    t_group = cpu_time_us(per_group, max(3, repeats // 4), warmup=1)
    t_layer = cpu_time_us(per_layer, layer_repeats, warmup=1)

    attention_us = None
    if args.device == "cuda":
        # Build once (already done above), then time the layers' kernels alone.
        fwd_c = cuda_time_ms(chunked.forward, repeats=20)["median"] * 1e3
        fwd_g = cuda_time_ms(global_.forward, repeats=20)["median"] * 1e3
        attention_us = CHUNKED_LAYERS * fwd_c + (NUM_LAYERS - CHUNKED_LAYERS) * fwd_g

    for how, t in (("once per step", t_once), ("per KV group (3+1)", t_group),
                   ("per layer (36+12)", t_layer)):
        row = {
            "case": batch.name, "implementation": builders.implementation, "build": how,
            "build_us": t["median"], "p10_us": t["p10"], "p90_us": t["p90"],
            "chunked_build_us": t_chunked["median"], "global_build_us": t_global["median"],
            "virtual_batches": builders.num_virtual_batches,
            "builds_per_step": builds_per_step[how],
        }
        if attention_us is not None:
            row["attention_us_48_layers"] = attention_us
            row["fraction_of_attention"] = t["median"] / attention_us
        rows.append(row)
    return rows


def main(argv=None) -> int:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cpu: host work only; cuda: plan + copies + attention time")
    parser.add_argument("--implementation", choices=("auto", "chunklocal", "direct"),
                        default="auto",
                        help="chunklocal's builder, or make_virtual_batches + numpy paged KV "
                             "(+ FlashInfer plan) straight; auto prefers chunklocal")
    args = parser.parse_args(argv)
    errors: list = []
    rows: list = []
    name = "metadata_smoke" if args.smoke else f"metadata_{args.device}"

    def save():  # after every case, so a timeout keeps what was measured
        return write_json(name, {"rows": rows, "errors": errors, "args": vars(args)}, args.out)

    for batch in cases(args.smoke):
        got = guarded(batch.name, lambda b=batch: run_case(b, args, errors), errors)
        rows.extend(got or [])
        save()
    columns = ["case", "implementation", "build", "build_us", "p10_us", "p90_us",
               "chunked_build_us", "global_build_us", "virtual_batches"]
    if args.device == "cuda":
        columns += ["attention_us_48_layers", "fraction_of_attention"]
    print(format_table(rows, columns))
    print(f"wrote {save()}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
