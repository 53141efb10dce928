"""Full-size Llama-4 Scout FP8 geometry on one GPU, without a checkpoint.

Writes Scout's published config.json (Llama-4-Scout-17B-16E-Instruct's text_config, nested
as published) with the compressed-tensors FP8-dynamic ``quantization_config`` of the
community Scout FP8 checkpoints (channel-wise e4m3 weights, dynamic per-token activations;
attention, router and lm_head 16-bit), then ``chunklocal.LLM(load_format="dummy")`` makes
random weights of those shapes and dtypes on the device.  Reports the load time, the
weights' bytes, the KV pool (pages per group) and how many more KV pages the memory left
would hold, then generates and checks that a second load with the same seed gives the
same tokens.

    python -m benchmarks.fp8_dummy                  # H200: full Scout geometry
    python -m benchmarks.fp8_dummy --smoke --device cpu   # tiny geometry, checks it runs
"""

from __future__ import annotations

import gc
import json
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import base_parser, write_json

SCOUT_TEXT = dict(  # meta-llama/Llama-4-Scout-17B-16E-Instruct, text_config as published
    attention_bias=False, attention_chunk_size=8192, attention_dropout=0.0, attn_scale=0.1,
    attn_temperature_tuning=4, bos_token_id=200000, cache_implementation="hybrid",
    eos_token_id=[200001, 200007, 200008], floor_scale=8192, for_llm_compressor=False,
    head_dim=128, hidden_act="silu", hidden_size=5120, initializer_range=0.02,
    interleave_moe_layer_step=1, intermediate_size=8192, intermediate_size_mlp=16384,
    max_position_embeddings=10485760, model_type="llama4_text", moe_layers=list(range(48)),
    no_rope_layers=[int((i + 1) % 4 != 0) for i in range(48)], num_attention_heads=40,
    num_experts_per_tok=1, num_hidden_layers=48, num_key_value_heads=8, num_local_experts=16,
    output_router_logits=False, pad_token_id=200018, rms_norm_eps=1e-05,
    rope_scaling={"factor": 16.0, "high_freq_factor": 1.0, "low_freq_factor": 1.0,
                  "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    rope_theta=500000.0, router_aux_loss_coef=0.001, router_jitter_noise=0.0,
    torch_dtype="bfloat16", use_cache=True, use_qk_norm=True, vocab_size=202048)
SMOKE = dict(hidden_size=128, head_dim=32, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=64, intermediate_size_mlp=128, num_hidden_layers=4,
             moe_layers=[0, 1, 2, 3], no_rope_layers=[1, 1, 1, 0], vocab_size=512,
             attention_chunk_size=64, max_position_embeddings=4096)
FP8_DYNAMIC = {  # compressed-tensors FP8_DYNAMIC, as the community Scout FP8 checkpoints
    "quant_method": "compressed-tensors", "format": "float-quantized",
    "quantization_status": "compressed",
    "ignore": ["re:.*lm_head", "re:.*self_attn", "re:.*router", "re:.*vision_model.*",
               "re:.*multi_modal_projector.*"],
    "config_groups": {"group_0": {
        "targets": ["Linear"],
        "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True,
                    "dynamic": False},
        "input_activations": {"num_bits": 8, "type": "float", "strategy": "token",
                              "symmetric": True, "dynamic": True}}}}


def write_llama4_config(path: Path, text: dict, quant: dict | None = None,
                        **top_level) -> Path:
    """config.json of a multimodal Llama-4 repository (``text`` nested as published)."""
    config = {"architectures": ["Llama4ForConditionalGeneration"], "model_type": "llama4",
              **top_level, "text_config": text, "vision_config": {},
              "tie_word_embeddings": False}
    if quant:
        config["quantization_config"] = quant
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def write_config(path: Path, smoke: bool) -> Path:
    return write_llama4_config(path, {**SCOUT_TEXT, **(SMOKE if smoke else {})}, FP8_DYNAMIC,
                               image_token_index=200092)


def load_and_generate(path, args, device):
    """Load dummy weights, measure, generate.  Returns ``(row, tokens)`` and keeps no
    reference to the engine or its tensors, so :func:`release` can free them."""
    import chunklocal

    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    llm = chunklocal.LLM(path, device=str(device), load_format="dummy", seed=args.seed,
                         max_model_len=args.max_model_len, max_num_seqs=args.num_prompts,
                         max_num_batched_tokens=args.max_num_batched_tokens,
                         cuda_graphs=device.type == "cuda")
    if device.type == "cuda":
        torch.cuda.synchronize()
    row = {"load_s": round(time.perf_counter() - start, 2), **weight_gib(llm.model),
           "kv_groups": {name: g.num_blocks for name, g in
                         zip(llm.group_names, llm.groups, strict=True)}}
    # one page of block_size tokens in every layer (all layers' K and V)
    page_bytes = llm.groups[0].spec.page_size_bytes * llm.config.num_hidden_layers
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        row.update(allocated_gib=torch.cuda.memory_allocated(device) / 2**30,
                   free_gib=free / 2**30, total_gib=total / 2**30,
                   kv_pages_left=free // page_bytes)
    gen = torch.Generator().manual_seed(0)
    vocab = llm.config.vocab_size
    prompts = torch.randint(vocab, (args.num_prompts, args.prompt_len), generator=gen).tolist()
    start = time.perf_counter()
    outs = llm.generate(prompts, max_new_tokens=args.new_tokens, ignore_eos=True,
                        use_tqdm=False)
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    row.update(generate_s=round(seconds, 3), new_tokens=args.num_prompts * args.new_tokens,
               steps=llm.last_stats.steps)
    return row, outs


def weight_gib(model) -> dict:
    """GiB of all weights and of the FP8 ones (the tensors dict dies with this frame: a
    reference left alive would keep every weight on the device after the engine goes)."""
    from chunklocal.models.loader import weights

    tensors = weights(model)
    return {"weight_gib": sum(t.numel() * t.element_size() for t in tensors.values()) / 2**30,
            "fp8_weight_gib": sum(t.numel() for t in tensors.values()
                                  if t.dtype == torch.float8_e4m3fn) / 2**30}


def release(device) -> dict:
    """Free a dropped engine's device memory before the next load: gc breaks its reference
    cycles (runner <-> CUDA graphs), and empty_cache hands the caching allocator's blocks
    back to the driver, whose free memory is what LLM sizes the next KV pool from.
    Returns what is left, so a leak shows in the JSON."""
    gc.collect()
    if device.type != "cuda":
        return {}
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    return {"allocated_gib_after_release": torch.cuda.memory_allocated(device) / 2**30,
            "free_gib_after_release": torch.cuda.mem_get_info(device)[0] / 2**30}


def main(argv=None) -> int:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-model-len", type=int, default=32768)  # KV room: ~10 GiB
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args(argv)
    if args.smoke:
        args.max_model_len, args.max_num_batched_tokens = 512, 256
        args.num_prompts, args.prompt_len, args.new_tokens = 2, 40, 4
    device = torch.device(args.device)
    name = "fp8_dummy_smoke" if args.smoke else "fp8_dummy_scout"
    result = {"geometry": "smoke" if args.smoke else "scout-17b-16e fp8-dynamic",
              "args": vars(args) | {"out": str(args.out)}}
    with tempfile.TemporaryDirectory() as tmp:
        path = write_config(Path(tmp), args.smoke)
        first, outs = load_and_generate(path, args, device)
        first.update(release(device))
        result["first_load"] = first
        write_json(name, result, args.out)  # the first load's numbers outlive a failed second
        second, again = load_and_generate(path, args, device)
        second.update(release(device))
    result.update(second_load=second, same_seed_same_tokens=outs == again)
    print(json.dumps(result, indent=2, default=str))
    write_json(name, result, args.out)
    return 0 if outs == again else 1


if __name__ == "__main__":
    raise SystemExit(main())
