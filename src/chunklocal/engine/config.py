"""``EngineConfig``: every engine setting, checked once and frozen (nano-vllm's ``Config``).

``LLM(model, **settings)`` builds one from its keyword arguments (``chunklocal serve`` passes
its flags as those arguments, server/cli.py), and ``chunklocal plan`` builds one from its
flags, so the three check the same values with the same messages and size the same pools.
Construction checks each setting by itself (engine/llm_args.py: a ValueError naming the
setting and its value); :meth:`EngineConfig.for_model` then checks what needs the
checkpoint's config.json (``max_model_len`` against ``max_position_embeddings``, the chunk
against the page size, the heads against ``tensor_parallel_size``), still before any
weight loads.  The defaults are ``LLM.__init__``'s (a test holds them equal).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields, replace

import torch

from chunklocal._validate import check_chunk_geometry
from chunklocal.engine.llm_args import check_arguments
from chunklocal.models.sharding import check_tensor_parallel


@dataclass(frozen=True)
class EngineConfig:
    device: torch.device = torch.device("cpu")  # a str is checked and made a torch.device
    dtype: torch.dtype | None = None  # a name ("bfloat16", "auto") is made a torch.dtype
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int | None = None  # None: the checkpoint's max_position_embeddings
    block_size: int = 16
    num_kv_blocks: int | None = None  # None: sized from the memory budget
    attention_backend: str = "auto"
    cuda_graphs: bool = True
    hybrid_kv_cache: bool = True
    num_speculative_tokens: int = 0
    seed: int = 0
    load_format: str = "auto"
    generation_config: str | os.PathLike | None = "auto"
    max_waiting_requests: int | None = None
    async_scheduling: bool | None = None  # None: on where supported (one rank), as vLLM
    tensor_parallel_size: int = 1
    moe_parallel: str = "tp"
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"
    tokenizer: str | os.PathLike | None = None  # None: the model directory's
    gpu_memory_utilization: float = 0.9
    prefix_caching_hash_algo: str = "builtin"  # or "sha256" (engine/prefix_cache.py)
    calculate_kv_scales: bool = False  # FP8 KV scales from the first step (kv_quant.py)
    long_prefill_token_threshold: int = 0  # prompt tokens per request per step (0: no cap)
    prefill_pacing_steps: int = 0  # steps a decode step spreads the prompt backlog over

    def __post_init__(self):
        checked = check_arguments(**{f.name: getattr(self, f.name) for f in fields(self)})
        for name, value in checked.items():  # normalised: ints, torch.device, torch.dtype
            object.__setattr__(self, name, value)

    def for_model(self, text_config) -> EngineConfig:
        """This config for a checkpoint's text config: ``max_model_len`` resolved (its
        default, or refused past ``max_position_embeddings``), the chunk a whole number of
        pages, the heads split over ``tensor_parallel_size``."""
        n = check_tensor_parallel(text_config, self.tensor_parallel_size, self.moe_parallel)
        if self.async_scheduling and n > 1:
            raise ValueError(f"async_scheduling is not supported with tensor_parallel_size "
                             f"{n} > 1 (the ranks run one step at a time): pass "
                             f"async_scheduling=False or leave it unset")
        overlap = n == 1 if self.async_scheduling is None else self.async_scheduling
        limit = text_config.max_position_embeddings
        if self.max_model_len is not None and self.max_model_len > limit:
            raise ValueError(f"max_model_len {self.max_model_len} exceeds the config's "
                             f"max_position_embeddings {limit}")
        if text_config.attention_chunk_size is not None:
            check_chunk_geometry(text_config.attention_chunk_size, self.block_size)
        return replace(self, max_model_len=self.max_model_len or limit,
                       async_scheduling=overlap)
