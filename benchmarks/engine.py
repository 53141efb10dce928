"""Q5: engine tokens/s on a Llama-4-Scout-shaped model with random weights (GPU).

Model: hidden 5120, 40/8 heads, head dim 128, 4 layers (3 chunked RoPE layers +
1 global NoPE layer, Llama-4's pattern), dense MLP 16384 on every layer, bf16,
c = 8192.  Weights are random (normal, std 0.02; norms 1) and written once as a
safetensors checkpoint.  Each engine runs a long-prompt workload (default 64
prompts of 32k tokens + 256 new tokens each) and a decode-heavy one (the same
number of 1k-token prompts + 256 new tokens), greedy, EOS ignored, for:
chunking on / off (``attention_chunk_size`` removed from the config: all layers
global) x CUDA graphs on / off.  tokens/s counts prompt + new tokens over the
wall time of ``generate()``; new tokens/s counts only generated tokens.
"""

from __future__ import annotations

import gc
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.common import base_parser, format_table, guarded, write_json

SCOUT = dict(hidden_size=5120, num_attention_heads=40, num_key_value_heads=8, head_dim=128,
             num_hidden_layers=4, intermediate_size=8192, intermediate_size_mlp=16384,
             vocab_size=202048, attention_chunk_size=8192)
SMOKE = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             num_hidden_layers=4, intermediate_size=64, intermediate_size_mlp=128,
             vocab_size=512, attention_chunk_size=32)


def write_random_checkpoint(path: Path, shape: dict, max_len: int, device: str,
                            seed: int = 0) -> None:
    """config.json + model.safetensors of a dense-MLP Llama-4 text model with random weights."""
    from transformers import Llama4TextConfig

    from chunklocal.models.llama4 import Llama4ForCausalLM

    config = Llama4TextConfig(**shape, moe_layers=[], max_position_embeddings=max_len,
                              bos_token_id=None, eos_token_id=None, pad_token_id=None)
    save_random_weights(path, config, Llama4ForCausalLM, device, seed)


def save_random_weights(path: Path, config, model_cls, device, seed: int = 0) -> None:
    """``config`` (as bf16) + model.safetensors holding ``model_cls(config)``'s parameter
    names: 1-d ones (norms) 1, the others normal with std 0.02 (activations stay finite
    through the layers), drawn on ``device`` from ``seed``."""
    from safetensors.torch import save_file

    config.dtype = "bfloat16"
    path.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(str(path))
    with torch.device("meta"):
        names = model_cls(config).state_dict()
    gen = torch.Generator(device=device).manual_seed(seed)
    state = {}
    for name, meta in names.items():
        if meta.dim() == 1:
            state[name] = torch.ones(meta.shape, dtype=torch.bfloat16)
        else:
            w = torch.randn(meta.shape, generator=gen, device=device, dtype=torch.bfloat16)
            state[name] = w.mul_(0.02).cpu()
    save_file(state, str(path / "model.safetensors"))


def without_chunking(src: Path, dst: Path) -> None:
    """The same weights with ``attention_chunk_size`` removed: every layer attends globally."""
    dst.mkdir(parents=True, exist_ok=True)
    config = json.loads((src / "config.json").read_text())
    config["attention_chunk_size"] = None
    # Explicit: transformers 4.57 re-derives chunked layer types even without a chunk.
    config["layer_types"] = ["full_attention"] * config["num_hidden_layers"]
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    link = dst / "model.safetensors"
    if not link.exists():
        link.symlink_to((src / "model.safetensors").resolve())


def run_engine(model_dir: Path, label: str, cuda_graphs: bool, workloads, args,
               rows: list, save) -> None:
    import chunklocal

    device = "cuda" if torch.cuda.is_available() else "cpu"
    max_len = max(p + n for _, _, p, n in workloads)
    start = time.perf_counter()
    llm = chunklocal.LLM(str(model_dir), device=device, dtype=torch.bfloat16,
                         max_num_seqs=args.max_num_seqs,
                         max_num_batched_tokens=args.max_num_batched_tokens,
                         max_model_len=-(-max_len // 16) * 16, cuda_graphs=cuda_graphs)
    load_s = time.perf_counter() - start
    rng = np.random.default_rng(0)
    vocab = llm.config.vocab_size
    for name, count, prompt_len, new in workloads:
        prompts = rng.integers(0, vocab, size=(count, prompt_len)).tolist()
        if device == "cuda":
            torch.cuda.synchronize()
        graph_steps_before = getattr(llm.runner, "graph_steps", 0)
        start = time.perf_counter()
        outputs = llm.generate(prompts, max_new_tokens=new, ignore_eos=True, use_tqdm=False)
        if device == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        produced = sum(len(o) for o in outputs)
        if produced != count * new:
            raise AssertionError(f"{label}/{name}: {produced} new tokens, expected {count * new}")
        stats = llm.last_stats
        rows.append({
            "engine": label, "workload": name, "requests": count, "prompt_len": prompt_len,
            "new_tokens": new, "seconds": seconds,
            "tokens/s": (count * (prompt_len + new)) / seconds,
            "new_tokens/s": count * new / seconds,
            "steps": getattr(stats, "steps", None),
            "peak_virtual_batches": getattr(stats, "peak_virtual_batches", None),
            "preemptions": getattr(stats, "preemptions", None),
            "graph_steps": getattr(llm.runner, "graph_steps", 0) - graph_steps_before,
            "load_s": load_s,
        })
        print(format_table(rows[-1:]), flush=True)
        save()
    del llm
    # Free the engine's memory now (reference cycles would otherwise hold it), so the
    # next engine sizes its KV pool from the same free memory.
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def main(argv=None) -> int:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=32768)
    parser.add_argument("--short-prompt-len", type=int, default=1024)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=16384)
    parser.add_argument("--vocab-size", type=int, default=SCOUT["vocab_size"])
    parser.add_argument("--configs", nargs="+",
                        default=["chunked+graphs", "chunked+eager", "global+graphs",
                                 "global+eager"],
                        help="which engines to run, in order")
    parser.add_argument("--workdir", type=Path, default=None,
                        help="where to write the random checkpoint (default: a temp dir)")
    args = parser.parse_args(argv)
    shape = dict(SCOUT, vocab_size=args.vocab_size)
    if args.smoke:
        shape = SMOKE
        args.num_prompts, args.prompt_len, args.short_prompt_len = 2, 80, 8
        args.new_tokens, args.max_num_seqs, args.max_num_batched_tokens = 4, 4, 64
    workloads = [(f"{args.num_prompts} x {args.prompt_len} + {args.new_tokens}",
                  args.num_prompts, args.prompt_len, args.new_tokens),
                 (f"{args.num_prompts} x {args.short_prompt_len} + {args.new_tokens}",
                  args.num_prompts, args.short_prompt_len, args.new_tokens)]
    max_len = args.prompt_len + args.new_tokens
    device = "cuda" if torch.cuda.is_available() else "cpu"
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="chunklocal-engine-"))
    errors: list = []
    rows: list = []
    name = "engine_smoke" if args.smoke else "engine"

    def save():  # after every run, so a timeout keeps what was measured
        return write_json(name, {"model": shape, "rows": rows, "errors": errors,
                                 "args": vars(args)}, args.out)

    try:
        chunked_dir, global_dir = workdir / "chunked", workdir / "global"
        start = time.perf_counter()
        # run_engine rounds max_model_len up to whole blocks of 16; positions must cover it
        write_random_checkpoint(chunked_dir, shape, -(-max_len // 16) * 16, device)
        without_chunking(chunked_dir, global_dir)
        print(f"random checkpoint written in {time.perf_counter() - start:.1f} s", flush=True)
        for config in args.configs:
            kind, mode = config.split("+")
            model_dir = chunked_dir if kind == "chunked" else global_dir
            guarded(config, lambda d=model_dir, c=config, m=mode: run_engine(
                d, c, m == "graphs", workloads, args, rows, save), errors)
            save()
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    print(format_table(rows, ["engine", "workload", "seconds", "tokens/s", "new_tokens/s",
                              "steps", "peak_virtual_batches", "preemptions", "graph_steps"]))
    print(f"wrote {save()}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
