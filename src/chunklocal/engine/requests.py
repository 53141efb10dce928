"""What a caller hands ``chunklocal.LLM``, checked before any work starts, and the
engine core's requests built from it (:func:`build_request`).

Every check raises ValueError naming the argument (and, for prompts, the index
and the value), so a bad request never reaches the scheduler and the other
prompts of the call are not disturbed.
"""

from __future__ import annotations

import functools
import json
import math
import os
import time
import uuid
import weakref
from pathlib import Path

import numpy as np
import torch

from chunklocal._validate import as_int
from chunklocal.engine.prefix_cache import salt_key
from chunklocal.engine.sampler import sampling_row
from chunklocal.engine.sampling import SamplingParams
from chunklocal.engine.sequence import Sequence
from chunklocal.engine.stream import Request, Sample

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
_JSON_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
               "config.json")

_DTYPE_NAMES = {"float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
                "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
                "float16": torch.float16, "half": torch.float16, "fp16": torch.float16}


def torch_dtype(dtype):
    """None / "auto" (the default rule), a torch float dtype, or one of its names."""
    if dtype is None or dtype == "auto":
        return None
    if isinstance(dtype, str) and dtype in _DTYPE_NAMES:
        return _DTYPE_NAMES[dtype]
    if isinstance(dtype, torch.dtype) and dtype in _DTYPE_NAMES.values():
        return dtype
    raise ValueError(f"dtype must be None, 'auto', torch.float32/bfloat16/float16 or one of "
                     f"{sorted(_DTYPE_NAMES)}, got {dtype!r}")


def check_device(device) -> torch.device:
    """A cpu or cuda torch device that exists on this machine."""
    try:
        checked = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        checked = None
    if checked is None or checked.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda' (e.g. 'cuda:0'), got {device!r}")
    if checked.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device={device!r} but CUDA is not available on this machine "
                             "(no GPU, or a CPU-only torch build); use device='cpu'")
        if checked.index is not None and checked.index >= torch.cuda.device_count():
            raise ValueError(f"device={device!r} but this machine has "
                             f"{torch.cuda.device_count()} CUDA device(s)")
    return checked


def load_tokenizer(model_dir: str | os.PathLike):
    """transformers' AutoTokenizer of a checkpoint directory that has tokenizer files."""
    from transformers import AutoTokenizer

    if not any((Path(model_dir) / name).is_file() for name in TOKENIZER_FILES):
        raise ValueError(f"{model_dir} has no tokenizer (none of "
                         f"{', '.join(TOKENIZER_FILES)}); pass token ids")
    try:
        return AutoTokenizer.from_pretrained(str(model_dir))
    except Exception as err:  # JSONDecodeError, tokenizers' Exception, OSError, ...
        # Name the file: transformers' message often names none ("Expecting value: ...").
        culprit = next((path for path in (Path(model_dir) / n for n in _JSON_FILES)
                        if path.is_file() and not _is_json(path)), None)
        main = Path(model_dir) / "tokenizer.json"
        where = (f"{culprit} is not valid JSON" if culprit else
                 f"{main} does not load as a tokenizer" if main.is_file() else
                 f"the tokenizer files in {model_dir} do not load")
        raise ValueError(f"{where} ({type(err).__name__}: {err}); fix or remove the file, or "
                         "pass token ids") from err


def _is_json(path: Path) -> bool:
    try:
        json.loads(path.read_bytes())
    except (OSError, ValueError):
        return False
    return True


def check_temperature(temperature) -> None:
    if (isinstance(temperature, (bool, np.bool_))
            or not isinstance(temperature, (int, float, np.integer, np.floating))
            or not math.isfinite(temperature) or temperature < 0):
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")


def check_prompts(prompts, max_new_tokens, get_tokenizer, vocab_size: int, max_model_len: int,
                  room_for_new_tokens: bool = True, image_token_index: int | None = None):
    """(token lists, prompts were strings) of valid prompts, or ValueError naming the
    first bad one.  ``get_tokenizer``: a callable returning the tokenizer, called only for
    string prompts.  ``room_for_new_tokens``: the prompt plus ``max_new_tokens`` must
    fit in max_model_len (generate); otherwise only the prompt must (prompt_logits).
    Images are refused (the text model of a multimodal checkpoint is served): a
    vLLM-style prompt dict with ``multi_modal_data``, or the ``image_token_index``
    placeholder whose embedding an image's features would replace.
    """
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, (list, tuple)):
        raise ValueError("prompts must be a list of token-id lists or of strings")
    if as_int(max_new_tokens, "max_new_tokens") <= 0:
        raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    max_new_tokens = int(max_new_tokens)
    as_text = bool(prompts) and all(isinstance(p, str) for p in prompts)
    if as_text:
        try:
            tokenizer = get_tokenizer()
        except ValueError as err:
            raise ValueError(f"prompt 0 is a string: {err}") from err
        ids = [tokenizer(p)["input_ids"] for p in prompts]
    else:
        ids = prompts
    reserved = max_new_tokens if room_for_new_tokens else 0
    checked = []
    for i, prompt in enumerate(ids):
        if isinstance(prompt, dict) and ("multi_modal_data" in prompt or "image" in prompt):
            raise ValueError(f"prompt {i}: image input is not supported (chunklocal serves "
                             "the text model of Llama-4 checkpoints)")
        if isinstance(prompt, (str, bytes)):
            raise ValueError(f"prompt {i}: mixes strings and token-id lists")
        arr = token_array(prompt, f"prompt {i}", vocab_size,
                          f"prompt {i}: expected a flat list of int token ids",
                          f"prompt {i} is empty")
        if image_token_index is not None and (arr == image_token_index).any():
            at = int(np.flatnonzero(arr == image_token_index)[0])
            raise ValueError(f"prompt {i}: token id {image_token_index} at index {at} is the "
                             "image placeholder (image_token_index); image input is not "
                             "supported (chunklocal serves the text model)")
        if arr.size + reserved > max_model_len:
            raise ValueError(f"prompt {i}: {arr.size} tokens + max_new_tokens {reserved} "
                             f"exceed max_model_len {max_model_len}")
        checked.append(arr.tolist())
    return checked, as_text


def token_array(ids, who: str, vocab_size: int, not_flat: str, empty: str) -> np.ndarray:
    """``ids`` as a 1-D integer array of in-vocabulary ids, or ValueError: ``not_flat`` /
    ``empty`` as given, else one naming ``who``, the first bad id and its index."""
    try:
        arr = np.asarray(ids)
    except ValueError:  # ragged nesting
        arr = None
    if arr is None or arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)) \
            or (isinstance(ids, list | tuple) and bool in set(map(type, ids))):  # [1, True]
        raise ValueError(not_flat)
    if arr.size == 0:
        raise ValueError(empty)
    bad = np.flatnonzero((arr < 0) | (arr >= vocab_size))
    if bad.size:
        raise ValueError(f"{who}: token id {int(arr[bad[0]])} at index {int(bad[0])} is "
                         f"outside the vocabulary [0, {vocab_size})")
    return arr


def check_prompt_ids(rid, prompt_token_ids, vocab_size: int, max_model_len: int) -> list[int]:
    """One engine-core request's prompt as a list of ints, or ValueError naming ``rid``."""
    arr = token_array(prompt_token_ids, f"request {rid}", vocab_size,
                      f"request {rid}: prompt_token_ids must be a flat list of int token ids",
                      f"request {rid}: the prompt is empty")
    if arr.size > max_model_len:
        raise ValueError(f"request {rid}: prompt of {arr.size} tokens exceeds "
                         f"max_model_len {max_model_len}")
    return arr.tolist()


def build_request(core, prompt_token_ids, params, request_id=None, prompt=None,
                  detokenize: bool = True, *, capture: str | None = None,
                  apply_defaults: bool = True, cache_salt: str | None = None) -> Request:
    """``EngineCore.make_request``: a checked Request for ``core``'s engine, not yet queued
    (``core.submit`` queues it); ValueError names the request and the bad value.
    ``cache_salt``: only requests of the same salt share prefix-cache KV."""
    rid = f"req-{uuid.uuid4().hex}" if request_id is None else str(request_id)
    if not isinstance(params, SamplingParams):
        raise ValueError(f"request {rid}: params must be a SamplingParams, got "
                         f"{type(params).__name__}")
    asked = "max_tokens" in params.fields_set and params.max_tokens is not None
    if apply_defaults:
        params = params.with_defaults(core.llm.default_sampling)
    ids = check_prompt_ids(rid, prompt_token_ids, core.llm.config.vocab_size,
                           core.max_model_len)
    room = core.max_model_len - len(ids)
    if capture is None:
        # A max_tokens the caller did not ask for (None, SamplingParams' 16 or the
        # generation config's) is capped by the room left; one asked for must fit.
        if not asked and (params.max_tokens is None or params.max_tokens > room):
            if room < 1:
                raise ValueError(f"request {rid}: prompt of {len(ids)} tokens leaves no "
                                 f"room in max_model_len {core.max_model_len}")
            params = params.replace(max_tokens=room)
        elif params.max_tokens > room:
            raise ValueError(f"request {rid}: prompt of {len(ids)} tokens + max_tokens "
                             f"{params.max_tokens} exceed max_model_len "
                             f"{core.max_model_len}")
    vocab = core.llm.config.vocab_size
    bad = [t for t in params.stop_token_ids if t >= vocab]
    if bad:
        raise ValueError(f"request {rid}: stop_token_ids holds {bad[0]}, outside the "
                         f"vocabulary [0, {vocab})")
    if params.logprobs is not None and params.logprobs > core.max_logprobs:
        raise ValueError(f"request {rid}: logprobs {params.logprobs} exceeds the "
                         f"maximum {core.max_logprobs}")
    tokenizer = core.loop_tokenizer() if detokenize or params.stop else None
    if params.stop and tokenizer is None:
        raise ValueError(f"request {rid}: stop strings {list(params.stop)} need a "
                         "tokenizer; the checkpoint has none")
    req = Request(rid, ids, params, prompt, time.monotonic())
    req.stream.bind_abort(functools.partial(_abort_weakly, weakref.ref(core), rid))
    groups = len(core.llm.groups)
    if cache_salt is not None and not isinstance(cache_salt, str):
        raise ValueError(f"request {rid}: cache_salt must be a str, got {cache_salt!r}")
    hashes: list[int] = []  # the samples share the prompt's block hashes
    key = salt_key(cache_salt)
    for i in range(params.n):
        child = params if params.seed is None or params.n == 1 else params.replace(
            seed=params.seed + i, n=1)
        seq = Sequence(next(core.seq_ids), ids, child, groups)
        seq.block_hashes, seq.cache_key = hashes, key
        seq.sampling_row, seq.capture = sampling_row(child), capture
        seq.request, seq.index = req, i
        req.samples.append(Sample(i, child, tokenizer))
        req.seqs.append(seq)
    return req



def _abort_weakly(core_ref, request_id, wait=False) -> None:
    core = core_ref()  # a stream kept by a client must not keep the core alive
    if core is not None:
        core.abort(request_id, wait)
