"""``chunklocal serve MODEL``: the OpenAI-compatible server on uvicorn.

Every ``LLM`` argument has a flag (``LLM_FLAGS``; a test checks the list against
``LLM.__init__``).  The main thread loads and checks the model first, as vLLM does (a bad
checkpoint or flag fails before the port opens), then uvicorn listens in a thread and one
start-up summary line is logged.  SIGTERM / SIGINT abort every running and waiting request
(streams end with finish_reason "abort", waiting non-streamed requests get 503
``shutting_down``), let the responses finish, and exit with status 0 (a signal during
loading stops the load); a second SIGINT forces the exit.

This module imports only argparse at load time, so other subcommands stay fast.
"""

from __future__ import annotations

import argparse
import inspect
import logging
import os
import signal
import threading

API_KEY_ENV = "CHUNKLOCAL_API_KEY"
_GRACE_S = 30  # after SIGTERM, responses still open this long are cut

# LLM keyword argument -> argparse dest of its flag.
LLM_FLAGS = {
    "device": "device", "dtype": "dtype", "max_num_seqs": "max_num_seqs",
    "max_num_batched_tokens": "max_num_batched_tokens", "max_model_len": "max_model_len",
    "block_size": "block_size", "num_kv_blocks": "num_kv_blocks",
    "attention_backend": "attention_backend", "cuda_graphs": "cuda_graphs",
    "hybrid_kv_cache": "hybrid_kv_cache", "num_speculative_tokens": "num_speculative_tokens",
    "seed": "seed", "generation_config": "generation_config",
    "max_waiting_requests": "max_waiting_requests", "load_format": "load_format",
    "async_scheduling": "async_scheduling", "enable_prefix_caching": "enable_prefix_caching",
    "tensor_parallel_size": "tensor_parallel_size", "moe_parallel": "moe_parallel",
    "kv_cache_dtype": "kv_cache_dtype", "gpu_memory_utilization": "gpu_memory_utilization",
    "prefix_caching_hash_algo": "prefix_caching_hash_algo", "tokenizer": "tokenizer",
    "calculate_kv_scales": "calculate_kv_scales",
    "long_prefill_token_threshold": "long_prefill_token_threshold",
    "prefill_pacing_steps": "prefill_pacing_steps",
}

log = logging.getLogger("chunklocal.server")


def _int_at_least(lowest: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < lowest:
            raise argparse.ArgumentTypeError(f"expected an integer >= {lowest}, got {text!r}")
        return value

    parse.__name__ = "positive int" if lowest == 1 else "int >= 0"
    return parse


_positive, _non_negative = _int_at_least(1), _int_at_least(0)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from chunklocal.server.limits import ServeLimits

    lim = ServeLimits()
    p.add_argument("model", help="checkpoint directory (config.json + *.safetensors, "
                   "tokenizer files for text prompts and chat)")
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1; 0.0.0.0 serves beyond "
                   "this machine: an explicit choice)")
    g.add_argument("--port", type=int, default=8000, help="TCP port (default 8000)")
    g.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="model names the API accepts (default: MODEL as given); responses "
                   "use the first")
    g.add_argument("--api-key", default=os.environ.get(API_KEY_ENV),
                   help=f"require 'Authorization: Bearer KEY' on /v1 (default: ${API_KEY_ENV})")
    g.add_argument("--max-request-bytes", type=_positive, default=lim.max_request_bytes,
                   help="largest request body (default: 16 bytes per token of max_model_len, "
                   "at least 4 MiB)")
    g.add_argument("--max-n", type=_positive, default=lim.max_n,
                   help=f"largest n per request (default {lim.max_n})")
    g.add_argument("--max-logprobs", type=_non_negative, default=lim.max_logprobs,
                   help=f"largest logprobs / top_logprobs (default {lim.max_logprobs})")
    g.add_argument("--max-stop", type=_non_negative, default=lim.max_stop,
                   help=f"most stop strings, and most stop_token_ids (default {lim.max_stop})")
    g.add_argument("--max-prompts", type=_positive, default=lim.max_prompts,
                   help=f"most prompts in one /v1/completions request (default "
                   f"{lim.max_prompts})")
    g.add_argument("--chat-template", default=None, metavar="FILE|TEMPLATE",
                   help="chat template for /v1/chat/completions instead of the tokenizer's: "
                   "a file, or the Jinja template itself (as vLLM's flag)")
    g.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="tokenizer directory, if not MODEL's (as vLLM's flag)")
    g.add_argument("--trust-request-chat-template", action="store_true",
                   help="let requests bring their own chat_template (it renders on the "
                   "server, unbounded; default: refused with 400)")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="tool_choice \"auto\" (the default with tools): the model's tool calls "
                   "are parsed into tool_calls (needs --tool-call-parser), as vLLM's flag")
    g.add_argument("--tool-call-parser", default=None, choices=sorted(_tool_parser_names()),
                   help="format of the model's tool calls (llama4_pythonic for Llama-4)")
    g.add_argument("--disable-uvicorn-access-log", action="store_true",
                   help="no access-log line per request")
    g.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                   help="run the engine core in a process of its own, so HTTP and engine "
                   "share no GIL (default; --no-engine-process keeps it in a thread of "
                   "the server; docs/engine-process.md)")
    g.add_argument("--log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"],
                   help="default info")
    e = p.add_argument_group("engine (LLM arguments)")
    e.add_argument("--device", default="auto",
                   help="'cuda', 'cpu', ... (default auto: cuda when available)")
    e.add_argument("--dtype", default="auto",
                   help="auto, float32, bfloat16 or float16 (default auto)")
    e.add_argument("--max-num-seqs", type=_positive, default=256,
                   help="requests per step (default 256)")
    e.add_argument("--max-num-batched-tokens", type=_positive, default=8192,
                   help="query tokens per step, drafts included (default 8192)")
    e.add_argument("--long-prefill-token-threshold", type=_int_at_least(0), default=0,
                   help="prompt tokens one request may prefill per step (0, the default: "
                   "no cap); lower trades its time to first token for the decodes' ITL")
    e.add_argument("--prefill-pacing-steps", type=_int_at_least(0), default=0,
                   help="while decodes run, a step takes at most 1/N of the prompt tokens "
                   "waiting (at least 256), so prompts that arrive together spread over "
                   "steps and the decodes' ITL stays even (0, the default: no pacing)")
    e.add_argument("--max-model-len", type=_positive, default=None,
                   help="prompt + new tokens per request (default: max_position_embeddings)")
    e.add_argument("--block-size", type=_positive, default=16,
                   help="tokens per KV page (default 16)")
    e.add_argument("--num-kv-blocks", "--num-gpu-blocks-override", dest="num_kv_blocks",
                   type=_positive, default=None,
                   help="KV pages in the global group (default: sized from memory)")
    e.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="fraction (0, 1] of the GPU's total memory for weights, activations, "
                   "CUDA graphs and KV, as vLLM's flag (default 0.9; the CPU keeps a RAM "
                   "budget of its own)")
    e.add_argument("--attention-backend", default="auto",
                   choices=["auto", "torch", "flashinfer"],
                   help="auto: flashinfer on cuda, torch on the cpu (default auto)")
    e.add_argument("--enforce-eager", dest="cuda_graphs", action="store_false",
                   help="no CUDA graphs")
    e.add_argument("--disable-hybrid-kv-cache-manager", dest="hybrid_kv_cache",
                   action="store_false",
                   help="one merged KV group that keeps every page (default: separate "
                   "global and chunked groups)")
    e.add_argument("--num-speculative-tokens", type=_non_negative, default=0,
                   help="prompt-lookup draft length k (default 0)")
    e.add_argument("--load-format", default="auto", help="checkpoint format (default auto)")
    e.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3"],
                   help="KV pages: the model's dtype (auto) or FP8 e4m3 (default auto)")
    e.add_argument("--calculate-kv-scales", action="store_true",
                   help="with --kv-cache-dtype fp8: each layer's K and V scales from the first "
                   "step's keys and values instead of the checkpoint's (or 1.0)")
    e.add_argument("--seed", type=int, default=0, help="engine seed (default 0)")
    e.add_argument("--tensor-parallel-size", "-tp", type=_positive, default=1,
                   help="ranks (one worker process each; NCCL on GPUs, gloo on the CPU) "
                   "(default 1)")
    e.add_argument("--moe-parallel", default="tp", choices=["tp", "ep"],
                   help="MoE experts split inside each expert (tp) or by expert (ep) "
                   "(default tp)")
    e.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV of cached prompt prefixes (vLLM's flag; default on)")
    e.add_argument("--prefix-caching-hash-algo", default="builtin", choices=["builtin", "sha256"],
                   help="block hashes: Python's (builtin) or sha256, which a crafted prompt "
                   "cannot collide with (vLLM's flag; default builtin)")
    e.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="prepare step n+1 on the host while the device runs step n (vLLM's "
                   "flag; steps with speculative decoding or penalties run in order; default: "
                   "on with one rank, off with tensor parallelism)")
    e.add_argument("--generation-config", default="auto", metavar="auto|none|DIR",
                   help="auto: sampling fields a request leaves unset take the checkpoint's "
                   "generation_config.json; none (or vllm): vLLM's defaults; a directory: "
                   "its generation_config.json (default auto)")
    e.add_argument("--max-waiting-requests", type=_positive, default=None,
                   help="sequences (prompts x n) allowed to wait for a slot; past it the "
                   "server answers 503 (default: no limit)")


def check_arguments(parser: argparse.ArgumentParser, args) -> None:
    from pathlib import Path

    if not (Path(args.model) / "config.json").is_file():
        parser.error(f"MODEL must be a checkpoint directory with config.json; "
                     f"{args.model!r} has none")
    if not 0 < args.port < 65536:
        parser.error(f"--port must be in 1..65535, got {args.port}")
    if args.api_key == "":
        parser.error(f"--api-key (or ${API_KEY_ENV}) is empty")
    if args.tokenizer is not None and not Path(args.tokenizer).is_dir():
        parser.error(f"--tokenizer must be a tokenizer directory; {args.tokenizer!r} is none")
    if args.chat_template is not None:
        try:
            args.chat_template = chat_template_text(args.chat_template)
        except ValueError as err:
            parser.error(str(err))
    from chunklocal.server.tool_choice import check_tool_flags

    try:
        check_tool_flags(args.enable_auto_tool_choice, args.tool_call_parser)
    except ValueError as err:
        parser.error(str(err))
    from chunklocal.models.loader import LOAD_FORMATS

    if args.load_format not in LOAD_FORMATS:
        parser.error(f"--load-format must be one of {', '.join(LOAD_FORMATS)}, got "
                     f"{args.load_format!r}")


def chat_template_text(value: str) -> str:
    """--chat-template: a file's text, or the template itself, as vLLM reads the flag."""
    from pathlib import Path

    try:
        if Path(value).is_file():
            return Path(value).read_text()
    except OSError:  # a long inline template is no path
        pass
    if not any(c in value for c in "{}\n"):
        raise ValueError(f"--chat-template {value!r} looks like a file path, but there is no "
                         "such file (an inline template holds '{' or a newline)")
    return value


def _tool_parser_names():
    from chunklocal.server.tool_parsers import TOOL_PARSERS

    return TOOL_PARSERS


def _llm_class():
    from chunklocal.engine.llm import LLM

    return LLM


def llm_kwargs(args) -> dict:
    """Keyword arguments for LLM(args.model, ...): every flag the LLM accepts."""
    accepted = inspect.signature(_llm_class().__init__).parameters
    kwargs = {name: getattr(args, dest) for name, dest in LLM_FLAGS.items() if name in accepted}
    if kwargs.get("device") == "auto":
        import torch

        kwargs["device"] = "cuda" if torch.cuda.is_available() else "cpu"
    return kwargs


def make_core(args):
    """Load the checkpoint and start its engine core (the slow part)."""
    if getattr(args, "engine_process", False):
        from chunklocal.engine.core_process import ProcessCore

        return ProcessCore(args.model, llm_kwargs(args), args.max_logprobs)
    llm = _llm_class()(args.model, **llm_kwargs(args))
    core = llm.core
    _ = core.tokenizer  # a bad tokenizer fails here, before the port opens
    core.max_logprobs = args.max_logprobs  # the engine refuses more, the server says 400
    core.owner = llm  # the core holds its LLM weakly; the server keeps it for its lifetime
    return core


class _Interrupted(BaseException):
    """A signal arrived while the model was loading: stop loading."""


def main(args) -> int:
    try:
        import uvicorn

        from chunklocal.server.app import ServerConfig, ServerState, build_app
        from chunklocal.server.limits import ServeLimits
    except ImportError as err:
        raise SystemExit(f"chunklocal serve needs the web packages ({err.name} is missing): "
                         "pip install 'chunklocal[serve]'") from err
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    limits = ServeLimits(args.max_request_bytes, args.max_n, args.max_logprobs, args.max_stop,
                         max_prompts=args.max_prompts,
                         trust_request_chat_template=args.trust_request_chat_template)
    names = args.served_model_name or [args.model]
    state = ServerState(ServerConfig(names, str(args.model), args.api_key, limits,
                                     chat_template=getattr(args, "chat_template", None),
                                     enable_auto_tool_choice=args.enable_auto_tool_choice,
                                     tool_call_parser=args.tool_call_parser))
    server = uvicorn.Server(uvicorn.Config(
        build_app(state), host=args.host, port=args.port, log_level=args.log_level,
        lifespan="off", access_log=not args.disable_uvicorn_access_log,
        timeout_graceful_shutdown=_GRACE_S))

    def on_signal(sig, frame):
        first = not state.shutting_down
        state.shutting_down = True  # /health and new requests: 503
        core = state.core
        if first and core is not None:
            # Running requests end with finish_reason "abort"; their responses complete,
            # then uvicorn stops.  Not in the handler: shutdown joins the loop thread.
            threading.Thread(target=core.shutdown, name="chunklocal-stop", daemon=True).start()
        if server.should_exit and sig == signal.SIGINT:
            server.force_exit = True
        server.should_exit = True
        if loading:
            raise _Interrupted

    loading = True
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    # The model loads in the main thread, before the port opens: loading in a thread that
    # then exits would leave its OpenMP team spinning and slow every CPU step many times.
    try:
        core = make_core(args)
    except _Interrupted:
        return 0
    except ValueError as err:  # a checked refusal (bad checkpoint or flags): no traceback
        log.error("could not load %s: %s", args.model, err)
        return 1
    except Exception:  # noqa: BLE001 - reported; the server stops with status 1
        log.exception("could not load %s", args.model)
        return 1
    finally:
        loading = False
    if state.shutting_down:
        core.shutdown()
        return 0
    state.set_core(core)
    from chunklocal._gc import freeze_startup_heap

    freeze_startup_heap()  # the web stack's heap too (the engine's froze when it was built)
    # uvicorn runs in a thread (it installs no signal handlers there); the main thread
    # handles signals.
    from chunklocal._threads import name_os_thread

    def serve_http():
        name_os_thread()
        server.run()

    web = threading.Thread(target=serve_http, name="chunklocal-http", daemon=True)
    web.start()
    while not server.started and web.is_alive():
        web.join(0.05)
    status = 0
    if not web.is_alive():  # could not bind the port (uvicorn logged why)
        status = 1
    else:
        log.info("chunklocal serving %s as %s on http://%s:%d: max_model_len %d, "
                 "max_num_seqs %d, device %s, API key %s", args.model, ", ".join(names),
                 args.host, args.port, core.max_model_len, args.max_num_seqs,
                 llm_device(core), "required" if args.api_key else "off")
    while web.is_alive():
        web.join(0.2)  # wakes often enough for signal handlers to run
    core.shutdown()
    return status


def llm_device(core) -> str:
    owner = getattr(core, "owner", None)  # an engine process's core knows its device
    return str(getattr(owner, "device", None) or getattr(core, "device", "?"))


run_serve = main


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server",
                              description=__doc__.split("\n\n")[0])
    add_arguments(p)
    return p
