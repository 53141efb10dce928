"""Batched sampling with per-request ``SamplingParams`` (vLLM v1's order and semantics).

One call handles every logit row of a step.  The per-request parameters arrive as one
float64 row per request (``sampling_row``, made once when the request is added), so a
step gathers them with one ``np.stack`` and every operation after that is a tensor op
over the batch.  Python loops run only over rows that need them: one
``exponential_`` per *seeded* sampled row (a generator of its own is what makes a
seed reproducible beside other requests) and the token-history gather of requests with
penalties.

Order (vLLM v1): raw logprobs (if asked) -> penalties -> greedy rows take the argmax ->
temperature -> min_p -> top_k -> top_p on the top-k renormalised distribution -> draw.

Draws: on CUDA with FlashInfer, unseeded rows use
``flashinfer.sampling.top_k_top_p_sampling_from_logits`` (one batch generator).  Seeded
rows, and every row on the CPU, use the exponential race ``argmax(p / E)`` with
``E ~ Exp(1)`` drawn from the row's generator: a row's token depends only on its own
logits and its own generator, whatever else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from chunklocal.engine.sampling import SAMPLING_EPS, SamplingParams

# Columns of a sampling row.
TEMP, TOP_K, TOP_P, MIN_P, REP, PRES, FREQ, LOGPROBS, SEEDED = range(9)


_TINY32, _MAX32 = float(np.finfo(np.float32).tiny), float(np.finfo(np.float32).max)


def sampling_row(params: SamplingParams) -> np.ndarray:
    """The request's parameters as the float64 row the sampler gathers each step.  top_p
    and repetition_penalty are kept inside float32's positive range: the device math is
    float32, and a top_p of 1e-300 must stay "the top token", not become 0."""
    return np.array([params.temperature, max(params.top_k, 0), max(params.top_p, _TINY32),
                     params.min_p, min(max(params.repetition_penalty, _TINY32), _MAX32),
                     params.presence_penalty, params.frequency_penalty,
                     -1 if params.logprobs is None else params.logprobs,
                     params.seed is not None], dtype=np.float64)


def to_device(array, device, dtype=None) -> torch.Tensor:
    """A numpy array on ``device`` without waiting for queued device work: staged in
    pinned memory and copied asynchronously (a plain ``.to(cuda)`` synchronises the
    stream, which would serialise an overlapped loop, see engine/overlap.py)."""
    tensor = torch.from_numpy(np.ascontiguousarray(array))
    if dtype is not None:
        tensor = tensor.to(dtype)
    if torch.device(device).type != "cuda":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)


@dataclass
class SampleResult:
    tokens: np.ndarray                  # [R] int64
    #: Rows that asked for logprobs get their values here (others hold junk).
    topk_ids: np.ndarray | None = None  # [R, K] int64, K = max logprobs asked this step
    topk_logprobs: np.ndarray | None = None  # [R, K] float32
    token_logprobs: np.ndarray | None = None  # [R] float32, the chosen token's


def apply_penalties(logits, token_ids, num_prompt, rep, pres, freq):
    """Penalised copy of ``logits`` [P, V] (vLLM semantics, see engine/sampling.py).

    ``token_ids``: per row, the prompt then the output tokens; ``num_prompt``: prompt
    length per row.  One scatter over the flattened histories, no loop over rows.
    """
    num_rows, vocab = logits.shape
    lengths = np.fromiter((len(t) for t in token_ids), np.int64, num_rows)
    flat = np.fromiter(chain.from_iterable(token_ids), np.int64, int(lengths.sum()))
    row = np.repeat(np.arange(num_rows), lengths)
    starts = np.cumsum(lengths) - lengths
    is_output = (np.arange(flat.shape[0]) - starts[row]) >= np.repeat(num_prompt, lengths)
    dev = logits.device
    row_t, tok_t = to_device(row, dev), to_device(flat, dev)
    seen = torch.zeros(num_rows, vocab, dtype=torch.bool, device=dev)
    seen[row_t, tok_t] = True
    counts = torch.zeros(num_rows, vocab, dtype=logits.dtype, device=dev)
    out_t = to_device(is_output, dev)
    counts.index_put_((row_t[out_t], tok_t[out_t]),
                      torch.ones((), dtype=logits.dtype, device=dev), accumulate=True)
    rep_t = to_device(np.asarray(rep, np.float64), dev, logits.dtype)[:, None]
    penalised = torch.where(logits > 0, logits / rep_t, logits * rep_t)
    # An extreme penalty may overflow: keep logits finite (an inf would make softmax NaN).
    logits = torch.where(seen, penalised, logits).clamp(-_MAX32, _MAX32)
    freq_t = to_device(np.asarray(freq, np.float64), dev, logits.dtype)[:, None]
    pres_t = to_device(np.asarray(pres, np.float64), dev, logits.dtype)[:, None]
    return logits - freq_t * counts - pres_t * (counts > 0)


def top_k_top_p_min_p(logits, top_k, top_p, min_p):
    """``logits`` [S, V] with filtered-out tokens at -inf.  ``top_k`` 0 = off."""
    vocab = logits.shape[1]
    if (min_p > 0).any():
        probs = logits.softmax(dim=-1)
        scale = to_device(min_p, probs.device, probs.dtype)[:, None]
        floor = probs.amax(dim=-1, keepdim=True) * scale
        logits = logits.masked_fill(probs < floor, float("-inf"))
    k = np.where(top_k > 0, np.minimum(top_k, vocab), vocab)
    if not ((k < vocab).any() or (top_p < 1).any()):
        return logits
    ordered, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=logits.device)
    drop = ranks[None, :] >= to_device(k, logits.device)[:, None]
    ordered = ordered.masked_fill(drop, float("-inf"))
    probs = ordered.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    # Keep the fewest leading tokens whose mass reaches top_p (the first always stays).
    drop |= mass_before >= to_device(top_p, probs.device, probs.dtype)[:, None]
    drop[:, 0] = False
    ordered = ordered.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(1, order, ordered)


class Sampler:
    """Chooses one token per logit row.  ``generator`` drives unseeded rows."""

    def __init__(self, device, seed: int = 0, use_flashinfer: bool | None = None):
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        if use_flashinfer is None:
            use_flashinfer = self.device.type == "cuda" and _flashinfer_sampling() is not None
        self.use_flashinfer = use_flashinfer

    def __call__(self, logits: torch.Tensor, seqs, owner: np.ndarray) -> SampleResult:
        """``logits`` [R, V] float32; ``owner[r]``: index into ``seqs`` of row r.

        Speculative verify windows belong to plain-greedy requests only (the scheduler
        drafts for no other), so their rows are argmax rows like any greedy row.
        """
        return self.launch(logits, seqs, owner).result()

    def launch(self, logits: torch.Tensor, seqs, owner: np.ndarray) -> DeviceSample:
        """Queue the sampling of every row; the host copies start without waiting."""
        num_rows = logits.shape[0]
        if num_rows == 0:
            return DeviceSample(torch.zeros(0, dtype=torch.long, device=logits.device))
        table = np.stack([s.sampling_row for s in seqs])[owner]
        want_logprobs = table[:, LOGPROBS] >= 0
        raw = logits
        penalised = (table[:, REP] != 1) | (table[:, PRES] != 0) | (table[:, FREQ] != 0)
        if penalised.any():
            rows = np.flatnonzero(penalised)
            hist = [seqs[i] for i in owner[rows]]
            logits = logits.clone()
            rows_t = to_device(rows, logits.device)
            logits[rows_t] = apply_penalties(
                logits[rows_t], [s.token_ids for s in hist],
                np.fromiter((s.num_prompt_tokens for s in hist), np.int64, len(hist)),
                table[rows, REP], table[rows, PRES], table[rows, FREQ])
        greedy = table[:, TEMP] < SAMPLING_EPS
        tokens = logits.argmax(dim=-1)
        if not greedy.all():
            rows = np.flatnonzero(~greedy)
            tokens[to_device(rows, tokens.device)] = self._draw(
                logits, rows, table, seqs, owner)
        if not want_logprobs.any():
            return DeviceSample(tokens)
        # Raw log-probabilities (before penalties and temperature) of the rows asking.
        rows = np.flatnonzero(want_logprobs)
        rows_t = to_device(rows, raw.device)
        logprobs = torch.log_softmax(raw[rows_t].float(), dim=-1)
        picked = logprobs.gather(1, tokens[rows_t][:, None])[:, 0]
        k = min(int(table[want_logprobs, LOGPROBS].max()), logprobs.shape[1])
        values, ids = logprobs.topk(k, dim=-1) if k > 0 else (None, None)
        return DeviceSample(tokens, rows, picked, values, ids)

    def _draw(self, logits, rows, table, seqs, owner):
        dev = logits.device
        rows_t = to_device(rows, dev)
        temp = to_device(table[rows, TEMP], dev, logits.dtype)
        scaled = logits[rows_t] / temp[:, None]
        top_k, top_p, min_p = table[rows, TOP_K], table[rows, TOP_P], table[rows, MIN_P]
        seeded = table[rows, SEEDED] > 0
        chosen = torch.empty(rows.shape[0], dtype=torch.long, device=dev)
        race = np.flatnonzero(seeded) if self.use_flashinfer else np.arange(rows.shape[0])
        if self.use_flashinfer and not seeded.all():
            free = np.flatnonzero(~seeded)
            free_t = to_device(free, dev)
            part = scaled[free_t]
            if (min_p[free] > 0).any():
                part = top_k_top_p_min_p(part, np.zeros(free.shape[0]),
                                         np.ones(free.shape[0]), min_p[free])
            vocab = part.shape[1]
            k = np.where(top_k[free] > 0, np.minimum(top_k[free], vocab), vocab)
            chosen[free_t] = _flashinfer_sampling().top_k_top_p_sampling_from_logits(
                part.float().contiguous(), to_device(k.astype(np.int32), dev),
                to_device(top_p[free].astype(np.float32), dev),
                deterministic=True, generator=self.generator).long()
        if race.shape[0]:
            race_t = to_device(race, dev)
            probs = top_k_top_p_min_p(scaled[race_t], top_k[race], top_p[race],
                                      min_p[race]).softmax(dim=-1)
            noise = torch.empty_like(probs)
            unseeded = np.flatnonzero(~seeded[race])
            if unseeded.shape[0]:
                noise[to_device(unseeded, dev)] = torch.empty(
                    unseeded.shape[0], probs.shape[1], dtype=probs.dtype,
                    device=dev).exponential_(generator=self.generator)
            for i in np.flatnonzero(seeded[race]):  # one generator per seeded request
                seq = seqs[owner[rows[race[i]]]]
                noise[i].exponential_(generator=request_generator(seq, dev))
            chosen[race_t] = (probs / noise).argmax(dim=-1)
        return chosen


class DeviceSample:
    """A step's sampled tokens (and logprobs) on the device, with their copies to the host
    already queued: ``result()`` waits for those copies only, not for later work."""

    def __init__(self, tokens, rows=None, picked=None, values=None, ids=None):
        self.tokens_dev = tokens  # read on the device by the next step's input patch
        self.num_rows, self.rows = tokens.shape[0], rows
        parts = [tokens, picked, values, ids]
        self.event = None
        if tokens.is_cuda:
            copies = []
            for part in parts:
                if part is None:
                    copies.append(None)
                    continue
                host = torch.empty(part.shape, dtype=part.dtype, pin_memory=True)
                copies.append(host.copy_(part, non_blocking=True))
            parts = copies
            self.event = torch.cuda.Event()
            self.event.record()
        self.host = parts

    def result(self) -> SampleResult:
        if self.event is not None:
            self.event.synchronize()
        tokens, picked, values, ids = self.host
        result = SampleResult(tokens.numpy())
        if picked is not None:
            result.token_logprobs = np.zeros(self.num_rows, dtype=np.float32)
            result.token_logprobs[self.rows] = picked.numpy()
        if values is not None:
            result.topk_logprobs = np.zeros((self.num_rows, values.shape[1]), dtype=np.float32)
            result.topk_ids = np.zeros((self.num_rows, values.shape[1]), dtype=np.int64)
            result.topk_logprobs[self.rows] = values.numpy()
            result.topk_ids[self.rows] = ids.numpy()
        return result


def request_generator(seq, device) -> torch.Generator:
    """The seeded request's own generator (made on first use, on the logits' device)."""
    if seq.generator is None:
        seq.generator = torch.Generator(device=device).manual_seed(seq.params.seed)
    return seq.generator


def _flashinfer_sampling():
    try:
        import flashinfer.sampling as sampling
    except ImportError:
        return None
    return sampling
