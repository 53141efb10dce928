"""``chunklocal.LLM``'s arguments, checked before anything is read or loaded.

Every check raises ValueError naming the argument and the value it got, so a wrong
type (``LLM(None)``, ``seed=2**64``, ``generation_config=5``) fails at once with a
message, not deep inside the weights' loading or the sampler's first step.  Checks that
need config.json (``max_model_len`` against max_position_embeddings, whether the heads
split over ``tensor_parallel_size``) come after it is read, still before any weight.
"""

from __future__ import annotations

import os
from pathlib import Path

from chunklocal._validate import as_bool, as_int, as_optional_bool
from chunklocal.backends.factory import BACKENDS
from chunklocal.engine.memory import check_utilization
from chunklocal.engine.prefix_cache import HASH_ALGOS
from chunklocal.engine.requests import check_device, torch_dtype
from chunklocal.engine.sampling import generation_config_defaults
from chunklocal.kv_quant import check_kv_cache_dtype
from chunklocal.models.loader import LOAD_FORMATS
from chunklocal.models.sharding import MOE_PARALLEL

SEED_LIMIT = 2**64  # torch.Generator.manual_seed takes [0, 2**64)
_GENERATION_CONFIGS = ("auto", "none", "vllm")


def check_model(model) -> Path:
    """The checkpoint directory (a str or os.PathLike holding config.json)."""
    if isinstance(model, bool) or not isinstance(model, (str, os.PathLike)):
        raise ValueError(f"model must be a checkpoint directory (a str or os.PathLike path) "
                         f"with config.json and *.safetensors, got {model!r}")
    model_dir = Path(model)
    if not (model_dir / "config.json").is_file():
        raise ValueError(f"model must be a checkpoint directory with config.json and "
                         f"*.safetensors; {str(model)!r} has no config.json")
    return model_dir


def _positive(value, name: str, allow_none: bool = False) -> int | None:
    if value is None and allow_none:
        return None
    if as_int(value, name) <= 0:
        raise ValueError(f"{name} must be positive, got {value!r}")
    return int(value)


def _choice(value, name: str, choices) -> str:
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name} must be one of {tuple(choices)}, got {value!r}")
    return value


def check_arguments(*, device, dtype, max_num_seqs, max_num_batched_tokens, max_model_len,
                    block_size, num_kv_blocks, attention_backend, cuda_graphs,
                    hybrid_kv_cache, num_speculative_tokens, seed, load_format,
                    generation_config, max_waiting_requests, async_scheduling,
                    tensor_parallel_size, moe_parallel, enable_prefix_caching=True,
                    kv_cache_dtype="auto", gpu_memory_utilization=0.9,
                    prefix_caching_hash_algo="builtin", tokenizer=None,
                    calculate_kv_scales=False, long_prefill_token_threshold=0,
                    prefill_pacing_steps=0) -> dict:
    """Every argument but ``model``, checked by itself; returns them normalised (ints as
    int, the device as a torch.device, the dtype as a torch.dtype or None)."""
    out = dict(
        dtype=torch_dtype(dtype), device=check_device(device),
        max_num_seqs=_positive(max_num_seqs, "max_num_seqs"),
        max_num_batched_tokens=_positive(max_num_batched_tokens, "max_num_batched_tokens"),
        max_model_len=_positive(max_model_len, "max_model_len", allow_none=True),
        block_size=_positive(block_size, "block_size"),
        num_kv_blocks=_positive(num_kv_blocks, "num_kv_blocks", allow_none=True),
        max_waiting_requests=_positive(max_waiting_requests, "max_waiting_requests",
                                       allow_none=True),
        tensor_parallel_size=as_int(tensor_parallel_size, "tensor_parallel_size"),
        attention_backend=_choice(attention_backend, "attention_backend",
                                  ("auto",) + BACKENDS),
        load_format=_choice(load_format, "load_format", LOAD_FORMATS),
        kv_cache_dtype=check_kv_cache_dtype(kv_cache_dtype),
        gpu_memory_utilization=check_utilization(gpu_memory_utilization),
        prefix_caching_hash_algo=_choice(prefix_caching_hash_algo, "prefix_caching_hash_algo",
                                         HASH_ALGOS),
    )
    if not isinstance(moe_parallel, str) or moe_parallel not in MOE_PARALLEL:
        raise ValueError(f"moe_parallel must be 'tp' or 'ep', got {moe_parallel!r}")
    out["async_scheduling"] = as_optional_bool(async_scheduling, "async_scheduling",
                                               "on where supported")
    for name, value in (("cuda_graphs", cuda_graphs), ("hybrid_kv_cache", hybrid_kv_cache),
                        ("enable_prefix_caching", enable_prefix_caching),
                        ("calculate_kv_scales", calculate_kv_scales)):
        out[name] = as_bool(value, name)
    if out["calculate_kv_scales"] and out["kv_cache_dtype"] == "auto":
        raise ValueError("calculate_kv_scales=True calibrates FP8 KV pages: it needs "
                         "kv_cache_dtype='fp8', got kv_cache_dtype='auto'")
    if as_int(long_prefill_token_threshold, "long_prefill_token_threshold") < 0:
        raise ValueError(f"long_prefill_token_threshold must be >= 0 (0: no cap), got "
                         f"{long_prefill_token_threshold}")
    out["long_prefill_token_threshold"] = int(long_prefill_token_threshold)
    if as_int(prefill_pacing_steps, "prefill_pacing_steps") < 0:
        raise ValueError(f"prefill_pacing_steps must be >= 0 (0: no pacing), got "
                         f"{prefill_pacing_steps}")
    out["prefill_pacing_steps"] = int(prefill_pacing_steps)
    if as_int(num_speculative_tokens, "num_speculative_tokens") < 0:
        raise ValueError(f"num_speculative_tokens must be >= 0, got {num_speculative_tokens}")
    out["num_speculative_tokens"] = int(num_speculative_tokens)
    if out["tensor_parallel_size"] < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {tensor_parallel_size!r}")
    if not 0 <= as_int(seed, "seed") < SEED_LIMIT:
        raise ValueError(f"seed must be an integer in [0, 2**64), got {seed!r}")
    out["seed"] = int(seed)
    if tokenizer is not None and not (isinstance(tokenizer, (str, os.PathLike))
                                      and Path(tokenizer).is_dir()):
        raise ValueError(f"tokenizer must be a tokenizer directory (None: the model's), got "
                         f"{tokenizer!r}")
    out["tokenizer"] = tokenizer
    gc = generation_config
    if not (gc is None or (isinstance(gc, str) and gc in _GENERATION_CONFIGS)
            or (isinstance(gc, (str, os.PathLike)) and Path(gc).is_dir())):
        raise ValueError(f"generation_config must be 'auto', 'none' or a directory, got "
                         f"{generation_config!r}")
    return out


def default_sampling(generation_config, model_dir: Path, load_format: str) -> dict:
    """The sampling fields a SamplingParams leaves unset, from ``generation_config``
    (checked by :func:`check_arguments`)."""
    if generation_config == "auto":
        # dummy weights read nothing but config.json
        return {} if load_format == "dummy" else generation_config_defaults(model_dir)
    if generation_config in ("none", "vllm", None):
        return {}
    return generation_config_defaults(generation_config)
