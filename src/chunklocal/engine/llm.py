"""``chunklocal.LLM``: serve a Llama-4 checkpoint directory with paged chunked-local KV."""

from __future__ import annotations

import threading
from pathlib import Path

import torch

from chunklocal import bounds
from chunklocal._validate import as_int, cdiv, check_chunk_geometry
from chunklocal.engine.block_manager import BlockManager, KVGroup
from chunklocal.engine.model_runner import ModelRunner
from chunklocal.engine.requests import check_prompts, load_tokenizer, torch_dtype
from chunklocal.engine.sampling import generation_config_defaults
from chunklocal.engine.scheduler import Scheduler
from chunklocal.engine.stats import GenerateStats
from chunklocal.kv_spec import ChunkedLocalAttentionSpec, FullAttentionSpec, merge
from chunklocal.models.llama4 import CHUNKED, GLOBAL, load_llama4, load_text_config

_CPU_KV_BYTES = 2 << 30  # default KV budget on the CPU when num_kv_blocks is None


class LLM:
    """Serve a Llama-4 checkpoint directory (``config.json`` + ``*.safetensors``).

    ``device``: "cpu" (PyTorch reference attention) or "cuda" (FlashInfer by
    default, bf16 unless the checkpoint is 16-bit).  ``max_num_seqs`` /
    ``max_num_batched_tokens``: requests and query tokens per step (drafts count).
    ``max_model_len``: prompt + new tokens per request (default: the config's
    max_position_embeddings).  ``num_kv_blocks``: pages of ``block_size`` tokens in
    the global (or merged) group's pool; None sizes it from a memory budget.
    ``hybrid_kv_cache``: separate global and chunked KV groups (the chunked one
    frees pages before the current chunk); False merges every layer into one
    group that keeps every page.  ``cuda_graphs``: replay decode and verify steps
    as CUDA graphs (FlashInfer only).  ``num_speculative_tokens``: prompt-lookup
    draft length k, verified in one step; greedy output equals k = 0 (only greedy
    requests without penalties are drafted).
    ``seed``: the generator of sampled requests that have no seed of their own.
    ``generation_config``: "auto" (vLLM's default) fills the sampling fields a
    ``SamplingParams`` leaves unset from the checkpoint's generation_config.json;
    "none" (or "vllm") keeps SamplingParams' own defaults; a directory reads its
    generation_config.json.  ``max_waiting_requests``: how many requests may wait
    for admission in ``llm.core`` before add_request refuses (None: no limit).

    Every call is a client of one ``EngineCore`` (``llm.core``, a loop thread started
    on first use), so several threads may call generate() / prompt_logits() at once;
    each gets exactly what it would get alone (greedy).  ``last_stats`` is the
    calling thread's latest call's ``GenerateStats`` (see engine/stats.py).
    """

    def __init__(self, model, *, device="cpu", dtype=None, max_num_seqs=256,
                 max_num_batched_tokens=8192, max_model_len=None, block_size=16,
                 num_kv_blocks=None, attention_backend="auto", cuda_graphs=True,
                 hybrid_kv_cache=True, num_speculative_tokens=0, seed=0,
                 generation_config="auto", max_waiting_requests=None):
        self.model_dir = Path(model)
        if not (self.model_dir / "config.json").is_file():
            raise ValueError(f"model must be a checkpoint directory with config.json and "
                             f"*.safetensors; {str(model)!r} has no config.json")
        dtype = torch_dtype(dtype)
        config = load_text_config(self.model_dir)
        self.config = config
        if max_model_len is None:
            max_model_len = config.max_position_embeddings
        elif as_int(max_model_len, "max_model_len") > config.max_position_embeddings:
            raise ValueError(f"max_model_len {max_model_len} exceeds the config's "
                             f"max_position_embeddings {config.max_position_embeddings}")
        # Exact integers only: 2.5 requests per step is a mistake, not 2.
        for name, value in (("max_num_seqs", max_num_seqs), ("block_size", block_size),
                            ("max_num_batched_tokens", max_num_batched_tokens),
                            ("max_model_len", max_model_len)):
            if as_int(value, name) <= 0:
                raise ValueError(f"{name} must be positive, got {value!r}")
        if as_int(num_speculative_tokens, "num_speculative_tokens") < 0:
            raise ValueError(f"num_speculative_tokens must be >= 0, got {num_speculative_tokens}")
        if num_kv_blocks is not None and as_int(num_kv_blocks, "num_kv_blocks") <= 0:
            raise ValueError(f"num_kv_blocks must be positive, got {num_kv_blocks!r}")
        seed = as_int(seed, "seed")
        if max_waiting_requests is not None and as_int(max_waiting_requests,
                                                       "max_waiting_requests") <= 0:
            raise ValueError(f"max_waiting_requests must be positive or None, got "
                             f"{max_waiting_requests!r}")
        self.max_waiting_requests = max_waiting_requests
        if generation_config == "auto":
            self.default_sampling = generation_config_defaults(self.model_dir)
        elif generation_config in ("none", "vllm", None):
            self.default_sampling = {}
        elif Path(generation_config).is_dir():
            self.default_sampling = generation_config_defaults(generation_config)
        else:
            raise ValueError(f"generation_config must be 'auto', 'none' or a directory, got "
                             f"{generation_config!r}")
        self.max_model_len = int(max_model_len)
        chunk = config.attention_chunk_size
        if chunk is not None:
            check_chunk_geometry(chunk, block_size)
        self.device = torch.device(device)
        self.max_num_seqs, self.block_size = int(max_num_seqs), int(block_size)
        self.max_num_batched_tokens = int(max_num_batched_tokens)
        self.num_speculative_tokens = int(num_speculative_tokens)
        self.cuda_graphs = bool(cuda_graphs) and self.device.type == "cuda"

        backend_name = attention_backend
        if backend_name == "auto":
            backend_name = "flashinfer" if self.device.type == "cuda" else "torch"
        if backend_name not in ("torch", "flashinfer"):
            raise ValueError(f"unknown attention_backend {attention_backend!r} "
                             "(expected 'auto', 'torch' or 'flashinfer')")
        if backend_name == "flashinfer" and self.device.type != "cuda":
            raise ValueError(f"attention_backend='flashinfer' needs a CUDA device, got {device}")
        if dtype is None and backend_name == "flashinfer":
            # FlashInfer kernels run in 16-bit; keep a 16-bit checkpoint dtype, else bf16.
            config_dtype = getattr(config, "dtype", None)
            config_dtype = getattr(torch, config_dtype, None) if isinstance(
                config_dtype, str) else config_dtype
            dtype = config_dtype if config_dtype in (torch.float16, torch.bfloat16) \
                else torch.bfloat16
        self.cuda_graphs = self.cuda_graphs and backend_name == "flashinfer"
        self.model = load_llama4(self.model_dir, self.device, dtype)
        kv_dtype = next(self.model.parameters()).dtype
        kinds = {layer.self_attn.kind for layer in self.model.layers}
        specs = {kind: self._spec(kind, kv_dtype) for kind in kinds}
        groups, kind_to_group = self._make_groups(specs, hybrid_kv_cache, num_kv_blocks)
        self.groups = groups
        self.max_virtual_batches = (
            bounds.max_virtual_batches(self.max_num_seqs, self.max_num_batched_tokens, chunk,
                                       self.max_model_len) if chunk else self.max_num_seqs)
        backends = [self._backend(backend_name, grp, kv_dtype) for grp in groups]
        self.block_manager = BlockManager(groups, self.max_num_seqs,
                                          cdiv(self.max_model_len, self.block_size))
        self.scheduler = Scheduler(self.block_manager, self.max_num_seqs,
                                   self.max_num_batched_tokens, self.max_model_len,
                                   self.num_speculative_tokens, pad_drafts=self.cuda_graphs)
        self.runner = ModelRunner(self.model, self.block_manager, kind_to_group, backends,
                                  self.device, kv_dtype, seed, chunk_size=chunk)
        if self.cuda_graphs:
            self.runner.enable_cuda_graphs(backends[0].graph_batch_sizes,
                                           backends[0].graph_query_lens)
        eos = config.eos_token_id
        self.eos_ids = frozenset([] if eos is None else [eos] if isinstance(eos, int) else eos)
        self._tokenizer = None
        self._core = None
        self._core_lock = threading.Lock()
        self._local = threading.local()

    # -- construction -------------------------------------------------------------------------
    def _spec(self, kind, kv_dtype):
        c = self.config
        geometry = (self.block_size, c.num_key_value_heads, c.head_dim, kv_dtype)
        if kind == CHUNKED:
            return ChunkedLocalAttentionSpec(*geometry, attention_chunk_size=c.attention_chunk_size)
        return FullAttentionSpec(*geometry)

    def _make_groups(self, specs, hybrid, num_kv_blocks):
        layers_of = {kind: sum(layer.self_attn.kind == kind for layer in self.model.layers)
                     for kind in specs}
        whole_seq = cdiv(self.max_model_len, self.block_size)
        if num_kv_blocks is None:
            per_block = sum(specs[k].page_size_bytes * n for k, n in layers_of.items())
            budget = _CPU_KV_BYTES
            if self.device.type == "cuda":
                budget = int(torch.cuda.mem_get_info(self.device)[0] * 0.4)
            if whole_seq * per_block > budget:
                raise ValueError(
                    f"one request of max_model_len {self.max_model_len} needs "
                    f"{whole_seq * per_block / 2**30:.1f} GiB of KV cache, more than the "
                    f"default budget of {budget / 2**30:.1f} GiB: pass a smaller max_model_len "
                    "or an explicit num_kv_blocks")
            num_kv_blocks = min(self.max_num_seqs * whole_seq, budget // per_block)
        num_kv_blocks = int(num_kv_blocks)
        chunk = self.config.attention_chunk_size
        local_need = min(cdiv(chunk - 1 + self.max_num_batched_tokens, self.block_size),
                         whole_seq) if chunk else whole_seq
        if hybrid or len(specs) == 1:
            names = sorted(specs)
            groups = []
            for kind in names:
                need = local_need if specs[kind].attention_chunk_size else whole_seq
                size = num_kv_blocks
                if specs[kind].attention_chunk_size:
                    size = min(num_kv_blocks, self.max_num_seqs * need)
                groups.append((kind, specs[kind], size, need))
            kind_to_group = {kind: i for i, kind in enumerate(names)}
        else:
            merged = merge([specs[CHUNKED], specs[GLOBAL]])
            groups = [("merged", merged, num_kv_blocks, whole_seq)]
            kind_to_group = {CHUNKED: 0, GLOBAL: 0}
        for name, _, size, need in groups:
            if size < need:
                raise ValueError(
                    f"num_kv_blocks={size} for the {name} KV group cannot hold one request: "
                    f"max_model_len {self.max_model_len} needs {need} blocks of {self.block_size}")
        self.group_names = [name for name, *_ in groups]
        return [KVGroup(spec, size) for _, spec, size, _ in groups], kind_to_group

    def _backend(self, name, group, kv_dtype):
        if name == "torch":
            from chunklocal.backends.torch_ref import TorchRefBackend

            # Plans live where q and the caches do; Hq sizes the memory-bounded groups.
            return TorchRefBackend(group.spec, num_q_heads=self.config.num_attention_heads,
                                   device=self.device)
        from chunklocal.backends.base import EngineLimits
        from chunklocal.backends.flashinfer import FlashInferBackend

        c = self.config
        limits = EngineLimits(self.max_num_seqs, self.max_num_batched_tokens,
                              self.max_model_len, self.block_size)
        verify_len = self.num_speculative_tokens + 1 if self.num_speculative_tokens else None
        return FlashInferBackend(
            group.spec, limits, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
            kv_dtype, self.device, self.cuda_graphs, verify_len=verify_len,
            scratch_page=group.num_blocks, sm_scale=c.head_dim ** -0.5)

    # -- requests -----------------------------------------------------------------------------
    @property
    def tokenizer(self):
        """The checkpoint directory's tokenizer (transformers' AutoTokenizer)."""
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.model_dir)
        return self._tokenizer

    def _check_prompts(self, prompts, max_new_tokens, room_for_new_tokens=True):
        return check_prompts(prompts, max_new_tokens, lambda: self.tokenizer,
                             self.config.vocab_size, self.max_model_len,
                             room_for_new_tokens)

    @property
    def core(self):
        """The engine core every call goes through (made and started on first use)."""
        with self._core_lock:
            if self._core is None or self._core.closed:
                from chunklocal.engine.core import EngineCore

                EngineCore(self)
            return self._core

    @property
    def last_stats(self) -> GenerateStats | None:
        """The calling thread's latest generate() / prompt_logits() call (None before)."""
        return getattr(self._local, "stats", None)

    def generate(self, prompts, sampling_params=None, *, max_new_tokens: int | None = None,
                 temperature: float | None = None, ignore_eos: bool | None = None,
                 use_tqdm: bool | None = None):
        """Two forms.  ``generate(prompts, max_new_tokens=16, temperature=0.0,
        ignore_eos=False)`` returns new token ids per prompt (strings for string
        prompts), greedy unless asked; generation_config.json does not apply.
        ``generate(prompts, sampling_params)`` (one ``SamplingParams`` or one per
        prompt) returns a ``RequestOutput`` per prompt, in order.

        Every prompt is checked before any work starts; a bad one raises
        ValueError naming its index and value.  ``use_tqdm=None`` shows the
        progress bar and the summary line only for calls longer than 2 s.
        """
        from chunklocal.engine import client

        return client.generate(self, prompts, sampling_params, max_new_tokens, temperature,
                               ignore_eos, use_tqdm)

    def prompt_logits(self, prompts, last_only: bool = False) -> list[torch.Tensor]:
        """float32 logits [prompt_len, vocab] (or [1, vocab]) per prompt, from a normal
        engine run (same batching, chunked prefill and KV paging as generate())."""
        from chunklocal.engine import client

        return client.prompt_logits(self, prompts, last_only)
