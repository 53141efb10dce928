"""``LLM.generate`` and ``LLM.prompt_logits``: clients of the engine core.

A call checks all its prompts first (nothing is queued if one is bad), submits its
requests together, and waits for all of them.  Any error while waiting (a failed step,
KeyboardInterrupt) aborts the call's remaining requests before it propagates, so none
keeps pages or runs on after the call is gone.  Safe from several threads at once.
"""

from __future__ import annotations

import itertools
import sys
import time

import torch
from tqdm.auto import tqdm

from chunklocal._validate import as_bool
from chunklocal.engine.requests import check_temperature
from chunklocal.engine.sampling import SamplingParams
from chunklocal.engine.stats import call_stats

_call_ids = itertools.count()


def generate(llm, prompts, sampling_params, max_new_tokens, temperature, ignore_eos,
             use_tqdm):
    if use_tqdm is not None:
        use_tqdm = as_bool(use_tqdm, "use_tqdm")
    if isinstance(prompts, (str, dict)):  # one prompt, as vLLM takes it
        prompts = [prompts]
    prompts, dict_texts = _prompt_dicts(llm, prompts)
    if isinstance(sampling_params, int) and not isinstance(sampling_params, bool):
        max_new_tokens, sampling_params = sampling_params, None  # old positional form
    legacy = (max_new_tokens, temperature, ignore_eos) != (None, None, None)
    if sampling_params is None and legacy:
        return _generate_tokens(llm, prompts, 16 if max_new_tokens is None else max_new_tokens,
                                0.0 if temperature is None else temperature,
                                ignore_eos is not None and as_bool(ignore_eos, "ignore_eos"),
                                use_tqdm)
    if legacy:
        raise ValueError("pass max_new_tokens / temperature / ignore_eos inside the "
                         "SamplingParams, not beside it")
    token_lists, as_text = llm._check_prompts(prompts, 1, room_for_new_tokens=False)
    texts = prompts if as_text else dict_texts or [None] * len(token_lists)
    return _request_outputs(llm, token_lists, texts, sampling_params, use_tqdm, "generate")


_PROMPT_KEYS = ("prompt", "prompt_token_ids")


def _prompt_dicts(llm, prompts):
    """vLLM's TextPrompt ``{"prompt": str}`` and TokensPrompt ``{"prompt_token_ids": [...]}``
    as the plain forms: (prompts, texts per prompt or None).  Text dicts beside token ones
    are tokenized here (the plain forms do not mix); a dict of another shape is refused
    naming its index and keys (an image's ``multi_modal_data`` is left to the check that
    refuses images)."""
    if not isinstance(prompts, (list, tuple)) or not any(isinstance(p, dict) for p in prompts):
        return prompts, None
    plain, texts = [], []
    for i, p in enumerate(prompts):
        if not isinstance(p, dict) or "multi_modal_data" in p:
            plain.append(p)
            texts.append(p if isinstance(p, str) else None)
            continue
        keys = [k for k in _PROMPT_KEYS if k in p]
        extra = sorted(set(p) - set(_PROMPT_KEYS))
        if len(keys) != 1 or extra:
            raise ValueError(f"prompt {i}: a prompt dict holds exactly one of 'prompt' (a "
                             f"string) or 'prompt_token_ids' (a list of token ids), got keys "
                             f"{sorted(p)}")
        value = p[keys[0]]
        if keys[0] == "prompt" and not isinstance(value, str):
            raise ValueError(f"prompt {i}: 'prompt' must be a string, got "
                             f"{type(value).__name__}")
        if keys[0] == "prompt_token_ids" and not isinstance(value, (list, tuple)):
            raise ValueError(f"prompt {i}: 'prompt_token_ids' must be a list of token ids, "
                             f"got {type(value).__name__}")
        plain.append(value)
        texts.append(value if keys[0] == "prompt" else None)
    if all(isinstance(p, str) for p in plain) or not any(isinstance(p, str) for p in plain):
        return plain, texts
    try:
        tokenizer = llm.tokenizer
    except ValueError as err:
        raise ValueError(f"text prompts need a tokenizer: {err}") from err
    return [tokenizer(p)["input_ids"] if isinstance(p, str) else p for p in plain], texts


def chat(llm, messages, sampling_params, use_tqdm, chat_template, add_generation_prompt,
         continue_final_message, chat_template_kwargs, tools):
    """``LLM.chat``: each conversation rendered by the tokenizer's chat template (or
    ``chat_template``) to text, tokenized without special tokens (the template holds BOS:
    one BOS, never two), then generated like ``generate(ids, sampling_params)``."""
    if use_tqdm is not None:
        use_tqdm = as_bool(use_tqdm, "use_tqdm")
    conversations = _conversations(messages)
    if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, dict):
        raise ValueError(f"chat_template_kwargs must be a dict or None, got "
                         f"{chat_template_kwargs!r}")
    flags = (as_bool(add_generation_prompt, "add_generation_prompt"),
             as_bool(continue_final_message, "continue_final_message"))
    if chat_template is not None and not isinstance(chat_template, str):
        raise ValueError(f"chat_template must be a Jinja template string or None, got "
                         f"{chat_template!r}")
    try:
        tokenizer = llm.tokenizer
    except ValueError as err:
        raise ValueError(f"chat needs a tokenizer: {err}") from err
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"{llm.model_dir}'s tokenizer has no chat template: pass "
                         "chat_template=, or use generate()")
    texts = []
    for i, conversation in enumerate(conversations):
        try:
            texts.append(tokenizer.apply_chat_template(
                conversation, tokenize=False, add_generation_prompt=flags[0],
                continue_final_message=flags[1], chat_template=chat_template, tools=tools,
                **(chat_template_kwargs or {})))
        except Exception as err:  # jinja2's TemplateError, transformers' ValueError, ...
            raise ValueError(f"conversation {i}: the chat template failed: "
                             f"{type(err).__name__}: {err}") from err
    ids = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
    token_lists, _ = llm._check_prompts(ids, 1, room_for_new_tokens=False)
    return _request_outputs(llm, token_lists, texts, sampling_params, use_tqdm, "chat")


def _conversations(messages) -> list[list[dict]]:
    """One conversation (a list of message dicts) or a list of them, as a list of them."""
    shape = ("messages must be a conversation (a list of {'role': ..., 'content': ...} "
             "dicts) or a list of conversations")
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError(f"{shape}, got {messages!r}")
    conversations = [messages] if isinstance(messages[0], dict) else list(messages)
    for i, conversation in enumerate(conversations):
        if not isinstance(conversation, (list, tuple)) or not conversation:
            raise ValueError(f"{shape}; conversation {i} is {conversation!r}")
        for j, message in enumerate(conversation):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise ValueError(f"{shape}; conversation {i}, message {j} is {message!r} "
                                 "(a dict with a 'role' string)")
    return [list(c) for c in conversations]


def _request_outputs(llm, token_lists, texts, sampling_params, use_tqdm, what):
    """A RequestOutput per checked prompt; ``sampling_params`` None: SamplingParams()
    (max_tokens 16), with the generation config's defaults, as vLLM's."""
    if sampling_params is None:
        sampling_params = SamplingParams()
    if isinstance(sampling_params, SamplingParams):
        sampling_params = [sampling_params] * len(token_lists)
    if not isinstance(sampling_params, (list, tuple)) or len(sampling_params) != len(
            token_lists):
        raise ValueError(f"sampling_params must be one SamplingParams or a list of "
                         f"{len(token_lists)} (one per prompt)")
    core, call = llm.core, next(_call_ids)
    requests = []
    for i, (ids, params, text) in enumerate(zip(token_lists, sampling_params, texts,
                                                strict=True)):
        try:
            requests.append(core.make_request(ids, params, f"{what}-{call}-{i}", text))
        except ValueError as err:
            raise ValueError(f"prompt {i}: {err}") from None
    _wait(llm, requests, use_tqdm)
    return [r.stream.result() for r in requests]


def _generate_tokens(llm, prompts, max_new_tokens, temperature, ignore_eos, use_tqdm):
    check_temperature(temperature)
    token_lists, as_text = llm._check_prompts(prompts, max_new_tokens)
    # Every sampling field set: generation_config.json leaves the old call alone.
    params = SamplingParams(max_tokens=int(max_new_tokens), temperature=float(temperature),
                            ignore_eos=ignore_eos, top_p=1.0, top_k=0, min_p=0.0,
                            repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0)
    core, call = llm.core, next(_call_ids)
    requests = [core.make_request(ids, params, f"generate-{call}-{i}", detokenize=False)
                for i, ids in enumerate(token_lists)]
    _wait(llm, requests, use_tqdm)
    _refuse_aborted(requests, "generate")
    outputs = [r.samples[0].token_ids for r in requests]
    if as_text:
        return [llm.tokenizer.decode(out, skip_special_tokens=True) for out in outputs]
    return outputs


@torch.inference_mode()
def prompt_logits(llm, prompts, last_only: bool) -> list[torch.Tensor]:
    last_only = as_bool(last_only, "last_only")
    # The one token sampled after the prompt is never computed: a prompt may fill
    # max_model_len exactly.
    token_lists, _ = llm._check_prompts(prompts, 1, room_for_new_tokens=False)
    core, call = llm.core, next(_call_ids)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    requests = [core.make_request(ids, params, f"logits-{call}-{i}", detokenize=False,
                                  capture="last" if last_only else "all",
                                  apply_defaults=False)
                for i, ids in enumerate(token_lists)]
    _wait(llm, requests, False)
    _refuse_aborted(requests, "prompt_logits")
    # A preempted request recomputes its prompt from position 0: its last pass is whole.
    return [torch.cat(r.seqs[0].captured)[-(1 if last_only else len(ids)):]
            for r, ids in zip(requests, token_lists, strict=True)]


def _refuse_aborted(requests, call: str) -> None:
    """The token-list forms have no finish_reason: an aborted request (the engine shut down
    meanwhile) must raise, not return its tokens cut short."""
    for i, req in enumerate(requests):
        sample = req.samples[0]
        if sample.finish_reason == "abort":
            raise RuntimeError(f"{call}: prompt {i} was aborted after {len(sample.token_ids)} "
                               "new tokens (the engine was shut down during the call)")


def _wait(llm, requests, use_tqdm) -> None:
    """Submit a call's requests and wait for all; on any error abort the rest first."""
    core = llm.core
    start = time.perf_counter()
    bar = tqdm(total=len(requests), desc="generate", unit="req", disable=use_tqdm is False,
               delay=0.0 if use_tqdm else 2.0, file=sys.stderr)
    try:
        core.submit(requests)
        for req in requests:
            req.stream.result()
            bar.update(1)
    except BaseException:
        for req in requests:
            core.abort(req.request_id, wait=True)
        raise
    finally:
        shown = not bar.disable and (use_tqdm or time.perf_counter() - start > 2.0)
        bar.close()
    llm._local.stats = call_stats(core, requests, time.perf_counter() - start)
    if shown:
        print(llm._local.stats.summary(), file=sys.stderr)
