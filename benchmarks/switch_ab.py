"""Kernel switches A/B'd inside one engine, in alternated rounds (GPU).

A module switch read when a kernel runs (not when the weights load) can be flipped on a
loaded engine.  Its CUDA graphs hold the kernels of the old setting, so every flip captures
them again (``ModelRunner.recapture_graphs``).  One engine of ``--model`` (dummy weights,
benchmarks.decode_floor's), ``--batch`` requests at ``--context`` tokens on spread routing
(floors.BalancedRouting), then ``--repeats`` rounds.  In each round the defaults and every
switch of ``--switches`` flipped alone, in turn, time ``--steps`` decode steps with CUDA
graphs (the step through ``ModelRunner.run``, and its graph replayed alone).  One engine,
one set of weights and pages, and rounds alternated, so drift between engines (the
fifteenth session's single runs of one tree moved by up to 9%) does not decide: a difference
inside the spread of the repeats is reported as such.  A first round (``--warmup-rounds``)
is timed and dropped, and each variant is also read against the defaults of its own round
(``paired``: "faster" or "slower" in every round, or "mixed").

    python -m benchmarks.switch_ab --model scout-fp8 --batch 1 --repeats 5 \\
        --switches reduce slots gather silu kv16 shared gemv16+gemv_partial
    python -m benchmarks.switch_ab --smoke          # CPU: eager steps, checks the logic
    python -m benchmarks.switch_ab --reread results/h100/switch_ab_....json   # a saved run
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

from benchmarks import decode_floor, floors
from benchmarks.common import base_parser, format_table, write_json

#: name: (module, attribute) of switches read when a kernel runs.  Projections' fusion
#: (``fused.FUSE_PROJECTIONS``) is read when the weights load, so it is not here.
SWITCHES = {
    "reduce": ("chunklocal.models.moe_triton", "SPLITK_REDUCE_IN_KERNEL"),
    "slots": ("chunklocal.models.moe_triton", "ROUTED_SLOTS_ENABLED"),
    "tiles": ("chunklocal.models.moe_triton", "TUNED_TILES_ENABLED"),
    "sum": ("chunklocal.models.moe_triton", "SPLITK_SUM_TRITON"),
    "fp8_gemm": ("chunklocal.models.moe_triton", "FP8_ENABLED"),
    "quant": ("chunklocal.models.quant_triton", "QUANT_ENABLED"),
    "quant1": ("chunklocal.models.quant_triton", "ONE_PASS_ENABLED"),
    "pdl": ("chunklocal.models.quant_triton", "PDL_ENABLED"),
    "gather": ("chunklocal.models.moe", "GATHER_QUANT"),
    "silu": ("chunklocal.models.moe", "SILU_QUANT"),
    "kv_write": ("chunklocal.models.kv_write_triton", "KV_WRITE_ENABLED"),
    "kv16": ("chunklocal.models.kv_write_triton", "KV_WRITE_16BIT_ENABLED"),
    "norm": ("chunklocal.models.norm_triton", "NORM_ENABLED"),
    "route": ("chunklocal.models.route_triton", "ROUTE_ENABLED"),
    "route_fused": ("chunklocal.models.route_triton", "FUSED_ENABLED"),
    "route_wide": ("chunklocal.models.route_triton", "WIDE_ENABLED"),
    "router": ("chunklocal.models.route_triton", "ROUTER_IN_KERNEL"),
    "gemv": ("chunklocal.models.gemv_triton", "GEMV_ENABLED"),
    "gemv16": ("chunklocal.models.gemv_triton", "LINEAR_ENABLED"),
    "gemv_partial": ("chunklocal.models.gemv_triton", "PARTIAL_ENABLED"),
    "gemv_mma": ("chunklocal.models.gemv_triton", "MMA_ENABLED"),
    "graph_replan": ("chunklocal.backends.flashinfer.backend", "GRAPH_REPLAN"),
    "rope_tiled": ("chunklocal.models.norm_triton", "ROPE_TILED"),
    "rope_vec": ("chunklocal.models.norm_triton", "ROPE_VEC"),
    "combine_ranked": ("chunklocal.models.routing", "COMBINE_RANKED"),
    "shared_silu": ("chunklocal.models.moe", "SHARED_SILU_QUANT"),
}
#: name: (attribute of every MoE layer, its value when on) of switches each layer holds,
#: flipped between that value and 0.  "shared": the shared expert as group E of the routed
#: GEMMs on steps of up to 16 tokens (``moe.SHARED_GROUP_TOKENS``, on by default for FP8
#: layers).  With it named the engine loads with the shared expert stacked into the experts
#: (``moe.STACK_SHARED``, float weights too), so its "off" runs the shared expert as dense
#: GEMMs on the stacked slot: the kernels of a shared expert of its own.
LAYER_SWITCHES = {"shared": ("fuse_max_tokens", 16)}
FLIPPED: dict[str, str] = {}  # name -> the setting its flipped rounds ran with
WARMUP = 2  # steps after each capture before the timed ones


def flipped(name: str):
    """(module, attribute, default value) of module switch ``name``."""
    module_name, attr = SWITCHES[name]
    module = importlib.import_module(module_name)
    return module, attr, getattr(module, attr)


def moe_layers(llm) -> list:
    from chunklocal.models.moe import MoE

    return [m for m in llm.model.modules() if isinstance(m, MoE)]


def switch_names(value: str) -> str:
    """argparse type of ``--switches``: a switch, or switches joined by ``+`` flipped
    together in one variant (``gemv16+gemv_partial``)."""
    known = SWITCHES | LAYER_SWITCHES
    parts = value.split("+")
    unknown = [p for p in parts if p not in known]
    if unknown or len(set(parts)) != len(parts):
        raise argparse.ArgumentTypeError(
            f"{value!r}: each of {unknown or parts} must be one of {', '.join(sorted(known))}, "
            "once")
    return value


def flip(llm, name: str):
    """Flip switch ``name`` on the loaded engine (each of ``a+b``'s, together); returns
    what puts it back."""
    if "+" in name:
        restores = [flip(llm, part) for part in name.split("+")]
        FLIPPED[name] = " ".join(FLIPPED[part] for part in name.split("+"))
        return lambda: [restore() for restore in reversed(restores)]
    if name in LAYER_SWITCHES:
        attr, on = LAYER_SWITCHES[name]
        layers = moe_layers(llm)
        before = [getattr(m, attr) for m in layers]
        value = 0 if any(before) else on
        for layer in layers:
            setattr(layer, attr, value)
        FLIPPED[name] = f"MoE.{attr}={value}"
        return lambda: [setattr(m, attr, v) for m, v in zip(layers, before, strict=True)]
    module, attr, default = flipped(name)
    setattr(module, attr, not default)
    FLIPPED[name] = f"{module.__name__.rsplit('.', 1)[-1]}.{attr}={not default}"
    return lambda: setattr(module, attr, default)


@contextlib.contextmanager
def stacked_shared(on: bool):
    """Engines loaded inside stack the shared expert into the experts when ``on``."""
    from chunklocal.models import moe

    before = moe.STACK_SHARED
    moe.STACK_SHARED = before or on
    try:
        yield
    finally:
        moe.STACK_SHARED = before


def timed(llm, steps: int, device) -> dict:
    """Median step through ``ModelRunner.run`` and, with graphs, the graph alone (ms)."""
    graphs = llm.runner.graphs
    decode_floor.timed_steps(llm, WARMUP, True, device)
    before = graphs.replays.copy() if graphs is not None else None
    step = statistics.median(decode_floor.timed_steps(llm, steps, True, device))
    replay = decode_floor.replay_only_ms(graphs, before, steps, device)
    return {"step_ms": step, "replay_ms": replay}


def rounds(llm, names: list[str], repeats: int, steps: int, device,
           warmup: int = 1, on_round=None) -> dict[str, list[dict]]:
    """``warmup`` rounds, not kept, then ``repeats`` rounds of the defaults and each switch
    flipped alone; the graphs are captured again after every flip and after it is put back.

    Why the warm-up round: on the H100 (twenty-fourth session, 12 layers, batch 1) the
    first round's defaults took 2.248 ms and every later round's 2.319-2.328; the variant
    timed right after them was fast in its first round too (2.220 against 2.265-2.277),
    the ones timed later were not: the GPU settling as it warms, most likely.  The one
    fast round widened the defaults' spread enough to put four switches "inside" it
    although each was faster in every later round."""
    runs: dict[str, list[dict]] = {"defaults": []}
    runs |= {name: [] for name in names}
    for r in range(warmup + repeats):
        kept = runs if r >= warmup else {key: [] for key in runs}
        kept["defaults"].append(timed(llm, steps, device))
        for name in names:
            restore = flip(llm, name)
            try:
                llm.runner.recapture_graphs()
                kept[name].append(timed(llm, steps, device))
            finally:
                restore()
                llm.runner.recapture_graphs()
        if on_round is not None and r >= warmup:
            on_round(runs)  # a time limit that stops the run keeps the rounds done
    return runs


def paired(values: list[float | None], ref: list[float | None]) -> list[float]:
    """A variant's time over the defaults' of the same round, for rounds with both: slow
    drift of the machine between rounds cancels in each ratio."""
    return [v / r for v, r in zip(values, ref, strict=True) if v is not None and r is not None]


def summary(runs: dict[str, list[dict]], switches: dict[str, str], base: dict
            ) -> list[dict]:
    """A row per variant (``switches``: each variant's flipped setting, its "switch"):
    median, min and max over the rounds of the step and the replay, and the ratio of the
    medians to the defaults'; ``inside_spread`` when the variant's
    range of round medians overlaps the defaults'; the range of its :func:`paired` ratios
    and ``every_round``: "faster" (every ratio below 1), "slower" (every one above) or
    "mixed"."""
    rows = []
    ref = runs["defaults"]
    for label, measured in runs.items():
        row = dict(base, variant=label)
        if label != "defaults":
            row["switch"] = switches[label]
        for key in ("step_ms", "replay_ms"):
            values = [m[key] for m in measured if m[key] is not None]
            if not values:
                continue
            row |= {f"{key}_median": statistics.median(values), f"{key}_min": min(values),
                    f"{key}_max": max(values)}
            ref_values = [m[key] for m in ref if m[key] is not None]
            row[f"{key}_over_defaults"] = statistics.median(values) / statistics.median(
                ref_values)
            if label != "defaults":
                row[f"{key}_inside_spread"] = (min(values) <= max(ref_values)
                                               and min(ref_values) <= max(values))
                ratios = paired([m[key] for m in measured], [m[key] for m in ref])
                if ratios:
                    row |= {f"{key}_paired_min": min(ratios), f"{key}_paired_max": max(ratios),
                            f"{key}_every_round": ("faster" if max(ratios) < 1 else
                                                   "slower" if min(ratios) > 1 else "mixed")}
        rows.append(row)
    return rows


def reread(path: Path, drop: int) -> int:
    """Print :func:`summary`'s rows for a saved run, each variant's first ``drop`` rounds
    dropped."""
    import json

    saved = json.loads(path.read_text())
    runs = {label: measured[drop:] for label, measured in saved["rounds"].items()}
    if not runs["defaults"]:
        raise SystemExit(f"{path}: {drop} rounds dropped leave none")
    switches = {row["variant"]: row.get("switch", row["variant"]) for row in saved["rows"]
                if row["variant"] != "defaults"}
    first = saved["rows"][0]
    base = {key: first[key] for key in ("model", "batch", "floor_ms") if key in first}
    print_rows(summary(runs, switches, base | {"rounds_kept": len(runs["defaults"])}))
    return 0


def print_rows(rows: list[dict]) -> None:
    """The rows as one table, every key any row has a column."""
    columns = list(dict.fromkeys(key for row in rows for key in row))
    print(format_table(rows, columns), flush=True)


def main(argv=None) -> int:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(decode_floor.MODELS), default="scout-fp8")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="the engine's max_model_len (default: the context and the new "
                             "tokens); a server's long limit plans decode graphs for it "
                             "(switch graph_replan)")
    parser.add_argument("--switches", nargs="+", type=switch_names, default=["reduce", "slots"],
                        help="variants, each one switch or several joined by '+' flipped "
                             f"together; switches: {', '.join(sorted(SWITCHES | LAYER_SWITCHES))}")
    parser.add_argument("--warmup-rounds", type=int, default=1,
                        help="rounds timed and dropped before the kept ones (rounds())")
    parser.add_argument("--reread", type=Path, default=None, metavar="JSON",
                        help="no run: the rows again from a saved run's rounds, its first "
                             "--warmup-rounds rounds dropped (runs before the warm-up round "
                             "kept every round)")
    args = parser.parse_args(argv)
    if args.reread is not None:
        return reread(args.reread, args.warmup_rounds)
    args.repeats = 5 if args.repeats is None else args.repeats  # rounds (base_parser's flag)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.smoke:
        args.model, args.batch, args.context, args.steps, args.repeats = "smoke", 2, 40, 2, 2
    elif device.type != "cuda":
        parser.error("the engine run needs CUDA; on the CPU only --smoke works")
    names = list(dict.fromkeys(args.switches))
    # each round times the defaults and each flip once (a restore is not timed)
    rounds_steps = ((args.warmup_rounds + args.repeats) * (1 + len(names))
                    * (args.steps + WARMUP))
    new = rounds_steps + 32  # and the floor's eager step
    max_model_len = max(args.context + new + 96, args.max_model_len or 0)
    payload = {"args": vars(args), "rows": [], "errors": []}
    name = "switch_ab_smoke" if args.smoke else "switch_ab"
    with tempfile.TemporaryDirectory() as tmp, floors.BalancedRouting():
        path = decode_floor.write_config(Path(tmp) / args.model, args.model)
        with stacked_shared(any("shared" in n.split("+") for n in names)):
            llm = decode_floor.make_llm_with_kv(path, device, args.batch, max_model_len)
        try:
            fitted = decode_floor.fill(llm, args.batch, args.context, new)
            if fitted != args.batch:
                parser.error(f"{args.batch} requests of {max_model_len} tokens do not fit "
                             f"the KV pool ({fitted} do)")
            # the floor: the bytes a step must read (decode_floor.step_floor: the experts
            # its tokens chose, counted in one eager step) at the copy rate of this run
            rates = decode_floor.measure_rates(device)
            with floors.RoutingCounter() as routing:
                decode_floor.timed_steps(llm, 1, False, device)
            positions = np.fromiter((q.num_computed for q in llm.scheduler.running), np.int64)
            _, floor_ms = decode_floor.step_floor(llm, positions, routing.distinct or None,
                                                  rates)
            base = {"model": args.model, "batch": args.batch, "context": args.context,
                    "steps": args.steps, "repeats": args.repeats, "floor_ms": floor_ms}

            def save(runs: dict[str, list[dict]]) -> None:
                payload["rows"] = summary(runs, {n: FLIPPED[n] for n in names}, base)
                payload["rounds"], payload["rates"] = runs, rates
                write_json(name, payload, args.out)

            runs = rounds(llm, names, args.repeats, args.steps, device, args.warmup_rounds,
                          on_round=save)
        finally:
            llm.shutdown()
    save(runs)
    print_rows(payload["rows"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
