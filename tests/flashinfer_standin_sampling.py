"""``flashinfer.sampling`` of the FlashInfer 0.7.2.post1 stand-in (see flashinfer_standin).

Only what ``chunklocal.engine.sampler`` calls: ``top_k_top_p_sampling_from_logits``, with
0.7.2.post1's exact parameter list.  Semantics of its default ``"top_k_first"`` order:
keep the logits >= the row's k-th largest (top_k >= vocab keeps all), softmax, keep the
fewest most likely tokens whose mass reaches top_p (the most likely always stays),
renormalise, draw one token per row from ``generator``.  Returns int32 [batch].
"""

from __future__ import annotations

from numbers import Integral, Real

import torch

_LOGIT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _per_row(name: str, value, rows: int, device, *, integer: bool) -> torch.Tensor:
    """A scalar or a 1-D tensor of one value per row, as 0.7.2 accepts: -> [rows, 1]."""
    if torch.is_tensor(value):
        if value.dim() == 0:
            raise ValueError(f"Expected a 1D tensor of shape (batch_size,) or scalar for "
                             f"{name}, but got a 0-dimensional tensor.")
        if value.dim() > 1:
            raise ValueError(f"Expected a 1D tensor or scalar for {name}, but got a "
                             f"{value.dim()}D tensor.")
        if value.shape[0] != rows:
            raise ValueError(f"{name} tensor batch size mismatch: expected length {rows}, got "
                             f"{value.shape[0]}.")
        if value.device != device:
            raise ValueError(f"{name} is on {value.device}, logits on {device}")
        if integer != (not value.is_floating_point() and value.dtype != torch.bool):
            kind = "an integer" if integer else "a floating-point"
            raise TypeError(f"{name} tensor must have {kind} dtype, got {value.dtype}")
        return value.to(torch.int64 if integer else torch.float32)[:, None]
    kind = Integral if integer else Real
    if isinstance(value, bool) or not isinstance(value, kind):
        raise TypeError(f"{name} must be {'an int' if integer else 'a float'} or a 1-D tensor, "
                        f"got {type(value).__name__}")
    dtype = torch.int64 if integer else torch.float32
    return torch.full((rows, 1), value, dtype=dtype, device=device)


def top_k_top_p_sampling_from_logits(logits, top_k, top_p, indices=None,
                                     filter_apply_order="top_k_first", deterministic=True,
                                     generator=None, check_nan=False, seed=None, offset=None):
    if not torch.is_tensor(logits):
        raise TypeError(f"logits must be a torch.Tensor, got {type(logits).__name__}")
    if logits.dim() != 2:
        raise ValueError(f"logits must be 2-D (batch_size, vocab_size), got shape "
                         f"{tuple(logits.shape)}")
    if logits.dtype not in _LOGIT_DTYPES:
        raise TypeError(f"Unsupported dtype {logits.dtype}, expected float32, float16, or "
                        "bfloat16")
    if filter_apply_order not in ("top_k_first", "joint"):
        raise ValueError(f"Invalid filter_apply_order: {filter_apply_order}")
    for name, value in (("indices", indices), ("seed", seed), ("offset", offset)):
        if value is not None:
            raise NotImplementedError(f"flashinfer stand-in: {name} is not supported")
    if filter_apply_order != "top_k_first":
        raise NotImplementedError("flashinfer stand-in: filter_apply_order='joint' is not "
                                  "supported")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
    rows, vocab = logits.shape
    k = _per_row("top_k", top_k, rows, logits.device, integer=True)
    p = _per_row("top_p", top_p, rows, logits.device, integer=False)
    if rows and (k < 1).any():
        raise ValueError(f"top_k must be >= 1, got {int(k.min())}")
    if rows and ((p <= 0) | (p > 1)).any():
        raise ValueError("top_p must be in (0, 1]")
    x = logits.float()
    if check_nan and torch.isnan(x).any():
        raise ValueError("Input probs contains NaN.")
    if rows == 0:
        return torch.zeros(0, dtype=torch.int32, device=logits.device)
    ordered, order = x.sort(dim=-1, descending=True)
    kth = ordered.gather(1, (k.clamp(max=vocab) - 1))
    x = x.masked_fill(x < kth, float("-inf"))  # top_k_mask_logits: ties with the k-th stay
    probs = x.softmax(dim=-1)
    ordered_p = probs.gather(1, order)
    mass_before = ordered_p.cumsum(dim=-1) - ordered_p
    drop = mass_before >= p
    drop[:, 0] = False
    keep = torch.zeros_like(drop).scatter(1, order, ~drop)
    probs = probs * keep
    return torch.multinomial(probs, 1, generator=generator)[:, 0].to(torch.int32)
