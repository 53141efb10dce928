"""``chunklocal.LLM``: serve a Llama-4 checkpoint directory with paged chunked-local KV."""

from __future__ import annotations

import contextlib
import logging
import threading
from dataclasses import replace

import torch

from chunklocal._gc import freeze_startup_heap
from chunklocal._validate import cdiv
from chunklocal.backends.base import EngineLimits, Kind
from chunklocal.backends.factory import BACKEND_DEVICES, resolve_backend
from chunklocal.bounds.closed_forms import max_virtual_batches
from chunklocal.bounds.kv_pools import KVPoolPlan, plan_kv_pools
from chunklocal.engine.block_manager import BlockManager, KVGroup, available_memory
from chunklocal.engine.config import EngineConfig
from chunklocal.engine.llm_args import check_model, default_sampling
from chunklocal.engine.memory import (
    CPU_KV_FRACTION,
    Baseline,
    MemoryBudget,
    MemoryFactory,
    check_start,
    device_memory_for,
    startup_line,
)
from chunklocal.engine.model_runner import StepRunner
from chunklocal.engine.requests import check_prompts, load_tokenizer
from chunklocal.engine.runner_setup import RunnerSetup, build_runner, pool_sizes, profile_run
from chunklocal.engine.scheduler import Scheduler
from chunklocal.engine.stats import GenerateStats
from chunklocal.engine.workers import OwnsWorkers, start_workers
from chunklocal.kv_quant import cache_dtype
from chunklocal.kv_spec import ChunkedLocalAttentionSpec, FullAttentionSpec
from chunklocal.models.llama4_config import generation_eos, layer_kind, read_config
from chunklocal.models.loader import load_model, plan_load
from chunklocal.models.parallel import TPGroup
from chunklocal.models.sharding import kv_head_split

log = logging.getLogger(__name__)


class LLM(OwnsWorkers):
    """Serve a Llama-4 checkpoint directory (``config.json`` + ``*.safetensors``).

    ``device``: "cpu" (PyTorch reference attention) or "cuda" (FlashInfer by
    default, bf16 unless the checkpoint is 16-bit).  ``max_num_seqs`` /
    ``max_num_batched_tokens``: requests and query tokens per step (drafts count);
    ``long_prefill_token_threshold`` (vLLM's): prompt tokens per request per step (0: no cap).
    ``prefill_pacing_steps`` (ours, 0: off): while decodes run, a step takes at most 1/N of
    the uncomputed prompt tokens (at least 256), which keeps the decodes' steps even.
    ``max_model_len``: prompt + new tokens per request (default: the config's
    max_position_embeddings).  ``num_kv_blocks``: pages of ``block_size`` tokens in
    the global (or merged) group's pool; None sizes it from a memory budget:
    ``gpu_memory_utilization`` (vLLM's, default 0.9) of the GPU's total memory for weights,
    profiled activations, CUDA graphs and KV; on the CPU, 40% of the available RAM after
    the weights (engine/memory.py).  Every setting is checked into ``engine_config``.
    ``hybrid_kv_cache``: separate global and chunked KV groups (the chunked one
    frees pages before the current chunk); False merges every layer into one
    group that keeps every page.  ``cuda_graphs``: replay decode and verify steps
    as CUDA graphs (FlashInfer only).  ``num_speculative_tokens``: prompt-lookup
    draft length k, verified in one step; greedy output equals k = 0 (only greedy
    requests without penalties are drafted).
    ``seed``: the generator of sampled requests that have no seed of their own, and the
    seed of ``load_format="dummy"`` weights.  ``load_format``: "auto"/"safetensors" read
    the checkpoint (index-following, FP8 kept FP8: see models/loader.py); "dummy" makes
    random weights of its config's shapes and dtypes on the device, reading only
    config.json.
    ``generation_config``: "auto" (vLLM's default) fills the sampling fields a
    ``SamplingParams`` leaves unset from the checkpoint's generation_config.json;
    "none" (or "vllm") keeps SamplingParams' own defaults; a directory reads its
    generation_config.json.  ``max_waiting_requests``: how many requests may wait
    for admission in ``llm.core`` before add_request refuses (None: no limit).
    ``async_scheduling``: prepare step n+1 on the host while the device runs step n
    (engine/overlap.py; steps with speculative decoding or penalties run in order), same
    outputs; None (the default, as vLLM's): on with one rank, off with several.
    ``enable_prefix_caching``: reuse the KV of cached full blocks (vLLM's default on;
    engine/prefix_cache.py), same outputs; ``prefix_caching_hash_algo``: "builtin" or
    "sha256" (no crafted collisions).  ``tokenizer``: a directory other than the model's.

    Everything is checked before any weight loads: config.json (and
    generation_config.json, whose EOS ids stop generation too), the tensors' names,
    shapes and dtypes, and whether the KV pool holds one request of max_model_len.
    ``tensor_parallel_size`` N > 1: one worker process per rank (engine/workers.py),
    ranks 0..N-1 on cuda:0..N-1 (or the CPU, over gloo); ``moe_parallel``: "tp"
    splits each expert's inner size, "ep" gives each rank num_local_experts / N
    whole experts.  Call :meth:`shutdown` (or ``del llm``, or use ``with``) to end them.
    The engine core drives the ranks; rank 0 samples (engine/tp_runner.py).  Under
    N > 1 ``async_scheduling=True`` is refused (the ranks run one step at a time).

    Every call is a client of one ``EngineCore`` (``llm.core``, a loop thread started
    on first use), so several threads may call generate() / prompt_logits() at once;
    each gets exactly what it would get alone (greedy).  ``last_stats`` is the
    calling thread's latest call's ``GenerateStats`` (see engine/stats.py)."""

    #: Device types each attention backend may run on (backends/factory.py), and what
    #: records CUDA graphs (None: torch.cuda's, on a GPU).  A subclass may widen both:
    #: the CPU tests run the FlashInfer path against a strict stand-in of the library
    #: (tests/flashinfer_standin.py) with a recorder that replays on the CPU.
    backend_devices = BACKEND_DEVICES
    graph_recorder = None
    #: Makes the device-memory queries gpu_memory_utilization sizes the KV pools by
    #: (engine/memory.py); None: torch.cuda's on a GPU, the RAM budget on the CPU.  CPU
    #: tests inject a fake to run the GPU procedure.
    device_memory: MemoryFactory | None = None

    def __init__(self, model, *, device="cpu", dtype=None, max_num_seqs=256,
                 max_num_batched_tokens=8192, max_model_len=None, block_size=16,
                 num_kv_blocks=None, attention_backend="auto", cuda_graphs=True,
                 hybrid_kv_cache=True, num_speculative_tokens=0, seed=0, load_format="auto",
                 generation_config="auto", max_waiting_requests=None,
                 async_scheduling=None, tensor_parallel_size=1, moe_parallel="tp",
                 enable_prefix_caching=True, kv_cache_dtype="auto", tokenizer=None,
                 gpu_memory_utilization=0.9, prefix_caching_hash_algo="builtin",
                 calculate_kv_scales=False, long_prefill_token_threshold=0,
                 prefill_pacing_steps=0):
        settings = dict(locals())  # every keyword argument: EngineConfig's fields
        del settings["self"], settings["model"]
        self.model_dir = check_model(model)
        cfg = EngineConfig(**settings)  # each setting by itself, before config.json is read
        ckpt = read_config(self.model_dir)
        config = self.config = ckpt.text
        cfg = self.engine_config = cfg.for_model(config)
        dtype, self.device, seed, load_format = cfg.dtype, cfg.device, cfg.seed, cfg.load_format
        n = self.tensor_parallel_size = cfg.tensor_parallel_size
        if self.device.type == "cuda" and self.device.index is None and n == 1:
            # One GPU, named once: the caller's current one.  The weights, graphs, sampler
            # and the engine core's loop thread all use this index, whatever thread runs.
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.max_num_seqs, self.max_num_batched_tokens = cfg.max_num_seqs, \
            cfg.max_num_batched_tokens
        self.max_model_len = int(cfg.max_model_len or config.max_position_embeddings)
        self.block_size, self.num_speculative_tokens = cfg.block_size, cfg.num_speculative_tokens
        self.max_waiting_requests, self.async_scheduling = cfg.max_waiting_requests, \
            cfg.async_scheduling
        self.enable_prefix_caching, self.kv_cache_dtype = cfg.enable_prefix_caching, \
            cfg.kv_cache_dtype
        self.gpu_memory_utilization = cfg.gpu_memory_utilization
        self.default_sampling = default_sampling(cfg.generation_config, self.model_dir,
                                                 load_format)
        chunk = config.attention_chunk_size
        # Graphs are recorded by torch.cuda on a GPU, or by an injected graph_recorder.
        self.cuda_graphs = cfg.cuda_graphs and (self.device.type == "cuda"
                                                or self.graph_recorder is not None)

        backend_name = resolve_backend(cfg.attention_backend, self.device, self.backend_devices)
        if dtype is None and backend_name == "flashinfer":
            # FlashInfer kernels run in 16-bit; keep a 16-bit checkpoint dtype, else bf16.
            dtype = ckpt.dtype if ckpt.dtype in (torch.float16, torch.bfloat16) \
                else torch.bfloat16
        kv_dtype = dtype or ckpt.dtype or torch.float32
        # pages: kv_dtype, or e4m3 (kv_cache_dtype "fp8")
        self.cuda_graphs = self.cuda_graphs and backend_name == "flashinfer"
        eos = set(ckpt.eos_token_ids)
        if load_format != "dummy":  # dummy weights: nothing but config.json is read
            eos.update(generation_eos(self.model_dir))
        self.eos_ids = frozenset(eos)
        self.image_token_index = ckpt.image_token_index
        # headers only, all checked; with N ranks, rank 0's slices (every rank's size)
        plan = plan_load(self.model_dir, ckpt, load_format, TPGroup(0, n, None, cfg.moe_parallel))
        self.layer_kinds = [layer_kind(config, i) for i in range(config.num_hidden_layers)]
        specs = {kind: self._spec(kind, cache_dtype(self.kv_cache_dtype, kv_dtype))
                 for kind in set(self.layer_kinds)}
        if n > 1:  # the ranks start (and report their free memory) before any weight loads
            self.workers = start_workers(n, self.model_dir, self.device, kv_dtype,
                                         cfg.moe_parallel, load_format, seed,
                                         type(self).device_memory, cfg.num_kv_blocks is None)
        # Pools planned before any weight loads: what cannot fit is refused now.  With N
        # ranks, each measures its own device (the least free one is planned from).
        memory = device_memory_for(type(self).device_memory, self.device) \
            if n == 1 and cfg.num_kv_blocks is None else None  # a class attribute, not a method
        baseline = Baseline.take(memory) if memory is not None else \
            getattr(self.workers, "baseline", None)
        pools = self._plan_pools(specs, cfg.hybrid_kv_cache, cfg.num_kv_blocks,
                                 plan.weight_bytes(kv_dtype), baseline)
        on_device = torch.cuda.device(self.device) if self.device.type == "cuda" and n == 1 \
            else contextlib.nullcontext()  # kernels launched while building go to our GPU
        with on_device:
            self.model = load_model(plan, self.device, kv_dtype, seed) if n == 1 else None
        setup = RunnerSetup(
            pool_sizes(pools, specs), pools.kind_to_group, backend_name,
            EngineLimits(self.max_num_seqs, self.max_num_batched_tokens, self.max_model_len,
                         self.block_size),
            config.num_attention_heads // n, kv_dtype, self.num_speculative_tokens,
            self.cuda_graphs, seed, chunk, self.graph_recorder, cfg.calculate_kv_scales)
        self.memory_budget = None
        if baseline is not None:  # gpu_memory_utilization sizes KV
            with on_device:
                self.memory_budget = self._profile(setup, memory, baseline)
            warning = self.memory_budget.stranded_warning()
            if warning:
                log.warning("%s", warning)
            pools = self._plan_pools(specs, cfg.hybrid_kv_cache, None, 0, baseline,
                                     self.memory_budget)
            setup = replace(setup, groups=pool_sizes(pools, specs))
        self.kv_pools, self.group_names = pools, [pool.name for pool in pools.groups]
        self.groups = groups = [KVGroup(spec, pages) for spec, pages in setup.groups]
        self.max_virtual_batches = (
            max_virtual_batches(self.max_num_seqs, self.max_num_batched_tokens, chunk,
                                       self.max_model_len) if chunk else self.max_num_seqs)
        self.block_manager = BlockManager(groups, self.max_num_seqs,
                                          cdiv(self.max_model_len, self.block_size),
                                          self.enable_prefix_caching,
                                          cfg.prefix_caching_hash_algo)
        self.scheduler = Scheduler(self.block_manager, self.max_num_seqs,
                                   self.max_num_batched_tokens, self.max_model_len,
                                   self.num_speculative_tokens, pad_drafts=self.cuda_graphs,
                                   long_prefill_token_threshold=cfg.long_prefill_token_threshold,
                                   prefill_pacing_steps=cfg.prefill_pacing_steps)
        if n == 1:
            with on_device:  # CUDA graphs are captured here
                self.runner: StepRunner = build_runner(setup, self.model, self.device,
                                                       self.block_manager)
        elif self.workers is not None:  # every rank loads its slices, builds its backends
            #                              and captures its graphs
            self.runner = self.workers.start_runners(setup, self.block_manager)
        log.info("%s", startup_line(
            plan.weight_bytes(kv_dtype) if self.memory_budget is None
            else self.memory_budget.weights, pools.total_bytes,
            dict(zip(self.group_names, (g.pages for g in pools.groups), strict=True)),
            pools.requests_fit(), self.max_model_len, self.memory_budget, cfg.num_kv_blocks))
        self._tokenizer = None
        self._tokenizer_error: ValueError | None = None  # no tokenizer there (looked once)
        self._core = None
        self._core_lock = threading.Lock()
        self._local = threading.local()
        freeze_startup_heap()  # a full collection now walks only what serving makes

    # -- construction -------------------------------------------------------------------------
    def _spec(self, kind, kv_dtype):
        c = self.config
        kv_heads = kv_head_split(c.num_key_value_heads, self.tensor_parallel_size)[0]
        geometry = (self.block_size, kv_heads, c.head_dim, kv_dtype)
        if kind is Kind.CHUNKED:
            return ChunkedLocalAttentionSpec(*geometry, attention_chunk_size=c.attention_chunk_size)
        return FullAttentionSpec(*geometry)

    def _plan_pools(self, specs, hybrid, num_kv_blocks, weight_bytes, baseline=None,
                    budget=None) -> KVPoolPlan:
        """The pools of bounds/kv_pools.py (per rank: specs hold a rank's KV heads,
        weight_bytes its slices).  With ``budget`` (profiled): what it leaves.  With a
        ``baseline`` alone, before the weights load: the weights and one request of
        max_model_len must fit in gpu_memory_utilization (activations not yet known).
        Else ``num_kv_blocks``, or the CPU's RAM budget.  With tensor parallelism the
        baseline and budget are the ranks' (engine/workers.py)."""
        kw = dict(hybrid=hybrid, max_num_seqs=self.max_num_seqs,
                  max_num_batched_tokens=self.max_num_batched_tokens,
                  max_model_len=self.max_model_len, block_size=self.block_size,
                  device=str(self.device))
        layers = {kind: self.layer_kinds.count(kind) for kind in specs}
        if baseline is not None:
            if budget is None:
                check_start(baseline, self.gpu_memory_utilization, weight_bytes,
                            str(self.device))
                budget = MemoryBudget(self.gpu_memory_utilization, baseline.total,
                                      weight_bytes)
            return plan_kv_pools(layers, specs, available=budget.requested,
                                 weight_bytes=budget.weights, reserved_bytes=budget.reserved,
                                 fraction=1.0, budget_note=budget.note(), **kw)
        available = self.workers.free_bytes if self.workers is not None else None
        if available is None:  # the CPU's RAM is shared by the ranks of one host
            available = available_memory(self.device) // self.tensor_parallel_size
        return plan_kv_pools(layers, specs, available=available, num_kv_blocks=num_kv_blocks,
                             weight_bytes=weight_bytes, fraction=CPU_KV_FRACTION, **kw)

    def _profile(self, setup, memory, baseline) -> MemoryBudget:
        """The weights as loaded, and one step of the largest shape (and of the largest
        graph) measured: what gpu_memory_utilization leaves for the pools (with N ranks,
        each rank's, the one with the least room)."""
        if memory is None and self.workers is not None:
            return self.workers.profile(setup, self.gpu_memory_utilization)
        weights = memory.allocated() - baseline.allocated
        activations, graphs = profile_run(setup, self.model, self.device, memory,
                                          self.config.vocab_size)
        return MemoryBudget.profiled(self.gpu_memory_utilization, baseline, memory, weights,
                                     activations, graphs)

    def shutdown(self) -> None:
        """Stop the engine core's loop and end the tensor-parallel workers (idempotent)."""
        core = self.__dict__.get("_core")
        if core is not None:
            core.shutdown()
        super().shutdown()

    # -- requests -----------------------------------------------------------------------------
    @property
    def tokenizer(self):
        """The tokenizer (transformers' AutoTokenizer) of ``tokenizer``, else the model's.
        Loaded once: a directory without one raises the same ValueError on every access
        without looking again (the engine's per-request path asks; each look was ~50 us)."""
        if self._tokenizer is None and self._tokenizer_error is None:
            try:
                self._tokenizer = load_tokenizer(self.engine_config.tokenizer or self.model_dir)
            except ValueError as err:
                self._tokenizer_error = err
        if self._tokenizer_error is not None:
            raise ValueError(str(self._tokenizer_error)) from self._tokenizer_error
        return self._tokenizer

    def _check_prompts(self, prompts, max_new_tokens, room_for_new_tokens=True):
        return check_prompts(prompts, max_new_tokens, lambda: self.tokenizer,
                             self.config.vocab_size, self.max_model_len,
                             room_for_new_tokens, self.image_token_index)

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
        """vLLM's form: ``generate(prompts, sampling_params=None)`` (one prompt string, or
        a list of strings or of token-id lists; one ``SamplingParams`` or one per prompt,
        None: ``SamplingParams()``, max_tokens 16, with the generation config's defaults)
        returns a ``RequestOutput`` per prompt, in order.  The legacy form
        ``generate(prompts, max_new_tokens=16, temperature=0.0, ignore_eos=False)`` (any
        of the three given) returns new token ids per prompt (strings for string
        prompts), greedy unless asked; generation_config.json does not apply.

        Every prompt is checked before any work starts; a bad one raises
        ValueError naming its index and value.  ``use_tqdm=None`` shows the
        progress bar and the summary line only for calls longer than 2 s."""
        from chunklocal.engine import client

        return client.generate(self, prompts, sampling_params, max_new_tokens, temperature,
                               ignore_eos, use_tqdm)

    def chat(self, messages, sampling_params=None, use_tqdm: bool | None = None, *,
             chat_template: str | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, chat_template_kwargs: dict | None = None,
             tools: list | None = None):
        """vLLM's ``LLM.chat``: one conversation (a list of {"role", "content"} dicts) or
        a list of them, each rendered by the tokenizer's chat template (or
        ``chat_template``) and generated as ``generate``; a ``RequestOutput`` each, whose
        ``prompt`` is the rendered text."""
        from chunklocal.engine import client

        return client.chat(self, messages, sampling_params, use_tqdm, chat_template,
                           add_generation_prompt, continue_final_message,
                           chat_template_kwargs, tools)

    def get_tokenizer(self):
        """The checkpoint's tokenizer (as vLLM's ``LLM.get_tokenizer()``)."""
        return self.tokenizer

    def reset_prefix_cache(self) -> bool:
        """vLLM's: forget all cached KV blocks; False (none forgotten) while a request holds KV."""
        return self.block_manager.reset_prefix_cache()

    def prompt_logits(self, prompts, last_only: bool = False) -> list[torch.Tensor]:
        """float32 logits [prompt_len, vocab] (or [1, vocab]) per prompt, from a normal
        engine run (same batching, chunked prefill and KV paging as generate())."""
        from chunklocal.engine import client

        return client.prompt_logits(self, prompts, last_only)
