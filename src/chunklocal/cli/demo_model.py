"""`chunklocal demo`, stage 3: the reporter's scenario served end to end by chunklocal.LLM.

A small random Llama-4 text model is written on the fly with transformers (fixed
seed, c = 8192, Llama-4's layer pattern: three chunked RoPE layers then one
global NoPE layer, MoE + shared expert on every other layer, narrow heads), or
``--model DIR`` serves a real checkpoint.  One 36000-token prompt runs twice with
max_num_seqs=1: with max_num_batched_tokens=36000 (the whole prefill in one step:
5 virtual batches) and with 8192 (prefill split over 5 steps).  Both runs must
give the same tokens; the last prompt position's logits are checked against
transformers (its own model and cache, fed the prompt in pieces).
"""

from __future__ import annotations

import inspect
import json
import random
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from chunklocal.bounds import max_virtual_batches
from chunklocal.models.llama4_config import require_hf

LOGITS_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 1e-2}
RANDOM_MODEL_POSITIONS = 65536  # max_position_embeddings of the random demo model
HF_DEFAULT_POSITIONS = 4096 * 32  # Llama4TextConfig's default when config.json has none


def max_positions(model_dir) -> int:
    """The longest sequence the demo's model takes (its max_position_embeddings)."""
    if model_dir is None:
        return RANDOM_MODEL_POSITIONS
    config = json.loads((Path(model_dir) / "config.json").read_text())
    config = config.get("text_config") or config
    return int(config.get("max_position_embeddings") or HF_DEFAULT_POSITIONS)


@contextmanager
def quiet_transformers():
    """transformers' progress bars off (writing and loading shards), restored afterwards."""
    from transformers.utils import logging

    was_on = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            logging.enable_progress_bar()


def write_random_llama4(path, seed: int = 0, num_layers: int = 4, full_heads=False) -> None:
    """Narrow heads for the CPU; ``full_heads``: Llama-4's 40/8 heads of dim 128 (GPU)."""
    require_hf()
    from transformers import Llama4ForCausalLM, Llama4TextConfig

    heads = dict(num_attention_heads=40, num_key_value_heads=8, head_dim=128,
                 hidden_size=512) if full_heads else dict(
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, hidden_size=64)
    config = Llama4TextConfig(
        vocab_size=1024, intermediate_size=64, intermediate_size_mlp=128, **heads,
        num_hidden_layers=num_layers, attention_chunk_size=8192, num_local_experts=4,
        num_experts_per_tok=1, interleave_moe_layer_step=2,
        max_position_embeddings=RANDOM_MODEL_POSITIONS, initializer_range=0.1,
        bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(seed)
    Llama4ForCausalLM(config).save_pretrained(str(path))


def describe(config) -> str:
    kinds = ["chunked" if r else "global" for r in config.no_rope_layers]
    moe = list(config.moe_layers)
    return (f"{config.num_hidden_layers} layers {kinds}, MoE on layers {moe} "
            f"({config.num_local_experts} experts, top-{config.num_experts_per_tok}, shared "
            f"expert), {config.num_attention_heads}/{config.num_key_value_heads} heads of dim "
            f"{config.head_dim}, hidden {config.hidden_size}, c={config.attention_chunk_size}")


def summarize_steps(tokens, vbs) -> str:
    """Run-length summary of (tokens, virtual batches) per step."""
    runs = []
    for pair in zip(tokens, vbs, strict=True):
        if runs and runs[-1][0] == pair:
            runs[-1][1] += 1
        else:
            runs.append([pair, 1])
    return ", ".join(f"{n}x({t} tok, {v} vb)" if n > 1 else f"({t} tok, {v} vb)"
                     for (t, v), n in runs)


def transformers_last_logits(model_dir, prompt, device, dtype, piece: int = 2048):
    """transformers' own Llama-4 and cache, prompt fed in pieces (its chunked prefill)."""
    from transformers import DynamicCache, Llama4ForCausalLM

    model = Llama4ForCausalLM.from_pretrained(str(model_dir), dtype=dtype,
                                              attn_implementation="sdpa").to(device).eval()
    cache = DynamicCache(config=model.config)
    # transformers 5.x renamed past_key_values to cache; accept either version.
    cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters \
        else "past_key_values"
    ids = torch.tensor([prompt], device=device)
    with torch.inference_mode():
        for start in range(0, len(prompt), piece):
            out = model(ids[:, start:start + piece], use_cache=True, logits_to_keep=1,
                        **{cache_kw: cache})
    return out.logits[0, -1].float().cpu()


def compare_logits(ours: torch.Tensor, ref: torch.Tensor, dtype) -> tuple[float, bool, bool]:
    """(relative max error, same argmax, within the dtype's tolerance and same argmax)."""
    tol = LOGITS_TOLERANCE.get(dtype, 3e-2)
    err = float((ours - ref).abs().max() / ref.abs().max())
    same_top = int(ours.argmax()) == int(ref.argmax())
    return err, same_top, err < tol and same_top


def run_engine_demo(model_dir=None, device="cpu", prompt_len=36000, new_tokens=32,
                    seed=0, num_layers=4, check_transformers=None) -> bool:
    import chunklocal

    require_hf()
    with tempfile.TemporaryDirectory() as tmp, quiet_transformers():
        if model_dir is None:
            model_dir = Path(tmp) / "random-llama4"
            write_random_llama4(model_dir, seed, num_layers, full_heads=device == "cuda")
            check_transformers = True if check_transformers is None else check_transformers
        dtype = torch.bfloat16 if device == "cuda" else None
        max_model_len = prompt_len + new_tokens
        rng = random.Random(seed)
        results, ok = {}, True
        for budget in (prompt_len, 8192):
            llm = chunklocal.LLM(model_dir, device=device, dtype=dtype, max_num_seqs=1,
                                 max_num_batched_tokens=budget, max_model_len=max_model_len)
            if not results:
                config = llm.config
                print(f"model: {describe(config)}")
                prompt = [rng.randrange(config.vocab_size) for _ in range(prompt_len)]
            bound = max_virtual_batches(1, budget, config.attention_chunk_size,
                                               max_model_len)
            # Keep the last prompt position's logits of the run (no extra pass).
            llm.runner.capture, llm.runner.capture_last_only = {}, True
            start = time.perf_counter()
            out = llm.generate([prompt], max_new_tokens=new_tokens, ignore_eos=True,
                               use_tqdm=False)[0]
            seconds = time.perf_counter() - start
            last = torch.cat(next(iter(llm.runner.capture.values())))[-1]
            llm.runner.capture = None
            stats = llm.last_stats
            print(f"\nmax_num_seqs=1, max_num_batched_tokens={budget}: {stats.steps} steps in "
                  f"{seconds:.1f} s, {(prompt_len + new_tokens) / seconds:.0f} tokens/s, "
                  f"{new_tokens / seconds:.1f} new tokens/s")
            steps = summarize_steps(llm.runner.tokens_per_step,
                                    llm.runner.virtual_batches_per_step)
            print(f"  per step: {steps}")
            print(f"  peak virtual batches per step {stats.peak_virtual_batches} (bound "
                  f"{bound}); peak KV blocks per group {stats.peak_blocks}")
            results[budget] = (out, last)
        (out_a, last_a), (out_b, last_b) = results.values()
        same = out_a == out_b
        print(f"\nsame {new_tokens} new tokens in both runs: {'yes' if same else 'NO'}  "
              f"(first 8: {out_a[:8]})")
        runs_err = float((last_a - last_b).abs().max() / last_b.abs().max())
        print(f"last prompt position's logits, one-step vs 8192-token prefill: relative "
              f"difference {runs_err:.2e}")
        ok &= same
        if check_transformers:
            dtype = next(llm.model.parameters()).dtype
            tol = LOGITS_TOLERANCE.get(dtype, 3e-2)
            start = time.perf_counter()
            ref = transformers_last_logits(model_dir, prompt, device, dtype)
            err, same_top, good = compare_logits(last_b, ref, dtype)
            print(f"last prompt position's logits vs transformers "
                  f"({time.perf_counter() - start:.0f} s): relative error {err:.2e}, same argmax "
                  f"{same_top} ({'OK' if good else 'FAIL'}, tolerance {tol:g})")
            ok &= good
        else:
            print("transformers check skipped (--check-transformers to run it)")
        return ok
