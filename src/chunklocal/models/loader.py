"""Build a Llama-4 text model from a checkpoint directory, or with random weights.

Two steps, so that an engine can check everything (config, tensors, KV room) before
the weights load: :func:`plan_load` reads config.json and the safetensors headers (or,
with ``load_format="dummy"``, config.json only) and checks them (models/checkpoint.py);
:func:`load_model` then makes the parameters on the device and fills them.

``load_format``: "auto" / "safetensors" read the checkpoint; "dummy" makes random
weights of the config's shapes and dtypes (FP8 ones for an FP8 config) on the device
from ``seed``, reading nothing but config.json: the same seed gives the same weights.
On every device FP8 weights stay FP8 (models/quant.py runs them).  Read weights are
checked for NaN / Inf as they load (:class:`FiniteCheck`: one device reduction per
tensor, one host sync at the end); dummy ones are not.

Tensor parallel (``tp``): routes are checked against the full model (the checkpoint's
shapes), and each rank's model holds its slices (models/parallel.py); each route's
piece is cut to the rank's slice as it is read (models/sharding.py, ``local_pieces``),
so no rank holds more than one full tensor (one expert of a fused stack) beside its
slices, and an expert-parallel rank never reads another rank's experts.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from chunklocal.models.checkpoint import (
    Tensor,
    check_routes,
    fp8_plan_from_config,
    fp8_plan_from_tensors,
    open_safetensors,
    read_headers,
)
from chunklocal.models.fused import fuse_projections
from chunklocal.models.kv_scales import apply_kv_scales, split_kv_scales
from chunklocal.models.llama4 import Llama4ForCausalLM
from chunklocal.models.llama4_config import CheckpointConfig, read_config
from chunklocal.models.moe import configure as configure_moe
from chunklocal.models.parallel import SINGLE, FirstRankOnly, TPGroup
from chunklocal.models.quant import FP8, Fp8Plan
from chunklocal.models.sharding import local_pieces, shard_rules

LOAD_FORMATS = ("auto", "safetensors", "dummy")


@dataclass
class LoadPlan:
    """A checked checkpoint, ready to load: the model on the meta device and, unless the
    weights are dummy ones, where each of its tensors comes from."""

    ckpt: CheckpointConfig
    fp8: Fp8Plan
    model: Llama4ForCausalLM          # on the meta device until load_model()
    routes: list | None               # (Tensor, Route) pairs; None: dummy weights
    full_shapes: dict | None = None   # tensor parallel: each weight's unsplit shape
    kv_scales: dict = field(default_factory=dict)  # (layer, "k" | "v") -> Tensor (kv_scales.py)

    def weight_bytes(self, dtype: torch.dtype) -> int:
        """Bytes the weights take on the device: FP8 1, scales 4, the rest ``dtype``."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return sum(p.numel() * (1 if p.dtype == FP8 else 4 if name.endswith("_scale")
                                else itemsize)
                   for name, p in weights(self.model).items())


def weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every weight a checkpoint fills: parameters and the experts' FP8 scale buffers."""
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


def _display(tensors) -> Callable[[str], str]:
    """Spell a text-model name the way this checkpoint's files do (for messages)."""
    for tensor in tensors.values():
        if tensor.name.startswith("language_model."):
            return lambda name: "language_model." + name
        if tensor.name.startswith("model.language_model."):
            return lambda name: ("model.language_model." + name[len("model."):]
                                 if name.startswith("model.") else name)
    return str


def plan_load(model_dir, ckpt: CheckpointConfig, load_format: str = "auto",
              tp: TPGroup = SINGLE) -> LoadPlan:
    """Check a checkpoint against its config without reading tensor data; ``tp``: plan
    this rank's slices."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {load_format!r}")
    tied = bool(getattr(ckpt.text, "tie_word_embeddings", False))
    if load_format == "dummy":
        fp8 = fp8_plan_from_config(ckpt)
        with torch.device("meta"):
            return LoadPlan(ckpt, fp8, Llama4ForCausalLM(ckpt.text, fp8, tp), None)
    tensors, kv_scales = split_kv_scales(read_headers(model_dir), ckpt.text.num_hidden_layers)
    fp8 = fp8_plan_from_tensors(tensors, ckpt)
    with torch.device("meta"):
        model = Llama4ForCausalLM(ckpt.text, fp8)
    routes, full_shapes = check_routes(tensors, model, tied, _display(tensors)), None
    if tp.size > 1:
        full_shapes = {name: tuple(w.shape) for name, w in weights(model).items()}
        with torch.device("meta"):
            model = Llama4ForCausalLM(ckpt.text, fp8, tp)
    return LoadPlan(ckpt, fp8, model, routes, full_shapes, kv_scales)


class FiniteCheck:
    """NaN / Inf in a checkpoint, found as its tensors load: one reduction per loaded
    piece, left on the device (no host sync per tensor); :meth:`check` syncs once and
    names the first tensor holding one."""

    def __init__(self) -> None:
        self.tensors: list[Tensor] = []
        self.flags: list[torch.Tensor] = []

    def add(self, tensor: Tensor, loaded: torch.Tensor) -> None:
        if loaded.numel():
            self.tensors.append(tensor)
            self.flags.append(all_finite(loaded))

    def check(self) -> None:
        if not self.flags:
            return
        ok = torch.stack(self.flags)
        if bool(ok.all()):
            return
        bad = self.tensors[int((~ok).nonzero()[0, 0])]
        raise ValueError(f"tensor {bad.name} in {bad.file.name} holds NaN or Inf values: the "
                         "checkpoint is corrupt (a model with them generates garbage)")


def all_finite(t: torch.Tensor) -> torch.Tensor:
    """A 0-dim bool on ``t``'s device: no NaN or Inf in ``t`` (min and max in one pass;
    NaN propagates to both, no temporary the size of ``t``).  float8_e4m3fn has no Inf,
    and its NaNs are the bytes 0x7F (the int8 maximum) and 0xFF (the uint8 maximum)."""
    if t.dtype == FP8:
        return (t.view(torch.int8).amax() != 127) & (t.view(torch.uint8).amax() != 255)
    lo, hi = torch.aminmax(t)
    return torch.isfinite(lo) & torch.isfinite(hi)


def _materialize(model: nn.Module, device, dtype) -> None:
    """Empty parameters on ``device``: FP8 weights stay FP8, scales float32, the rest
    ``dtype``."""
    for module in model.modules():
        for store in (module._parameters, module._buffers):
            for name, p in list(store.items()):
                if p is None:
                    continue
                dt = FP8 if p.dtype == FP8 else torch.float32 if name.endswith("_scale") \
                    else dtype
                t = torch.empty(p.shape, dtype=dt, device=device)
                store[name] = nn.Parameter(t, requires_grad=False) if store is \
                    module._parameters else t


def _fill_slices(model: nn.Module, routes, full_shapes: dict, finite: FiniteCheck) -> None:
    """Tensor parallel: copy each route's piece into this rank's slice of its weight."""
    params, rules = weights(model), shard_rules(model)
    for name, rule in rules.items():  # biases summed over ranks: rank 0's alone
        if isinstance(rule, FirstRankOnly) and rule.index and name in params:
            params[name].zero_()
    for path, items in _by_file(routes).items():
        with open_safetensors(path) as f:
            for tensor, r in items:
                rule, full = rules.get(r.param), full_shapes[r.param]
                if isinstance(rule, FirstRankOnly):
                    if rule.index:
                        continue
                    rule = None
                dst = params[r.param]
                if r.transpose:  # fused experts, one at a time; other ranks' never read
                    rows = f.get_slice(tensor.name)
                    for e in range(full[0]):
                        pieces = local_pieces(rule, full, (e,))
                        src = rows[e].transpose(-2, -1) if pieces else None
                        for sel, at in pieces:
                            dst[at].copy_(src[sel])
                            finite.add(tensor, dst[at])
                    continue
                pieces = local_pieces(rule, full, r.index)
                if pieces:
                    region = torch.empty(full, device="meta")[r.index].shape
                    src = f.get_tensor(tensor.name).reshape(region)
                    for sel, at in pieces:
                        dst[at].copy_(src[sel])
                        finite.add(tensor, dst[at])


def _by_file(routes) -> dict:
    by_file: dict[Path, list] = {}
    for tensor, r in routes:
        by_file.setdefault(tensor.file, []).append((tensor, r))
    return by_file


def _fill_from_files(model: nn.Module, routes, finite: FiniteCheck) -> None:
    params = weights(model)
    by_file: dict[Path, list] = {}
    for tensor, r in routes:
        by_file.setdefault(tensor.file, []).append((tensor, r))
    for path, items in by_file.items():
        with open_safetensors(path) as f:
            for tensor, r in items:
                dst = params[r.param][r.index] if r.index else params[r.param]
                if r.transpose:  # fused experts, one at a time: bounded host memory
                    rows = f.get_slice(tensor.name)
                    for e in range(dst.shape[0]):
                        dst[e].copy_(rows[e].transpose(-2, -1))
                else:
                    dst.copy_(f.get_tensor(tensor.name).reshape(dst.shape))
                finite.add(tensor, dst)


def _fill_dummy(model: nn.Module, seed: int, device) -> None:
    """Random weights made on ``device`` from ``seed``: norms 1, matrices uniform in
    +-1/sqrt(fan_in) (FP8: e4m3 values in +-448 with scales giving the same range),
    embeddings uniform in +-1."""
    gen = torch.Generator(device=device).manual_seed(int(seed))
    for name, p in weights(model).items():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        elif name.endswith("_scale"):  # X.weight_scale / X.w13_scale scale X.weight / X.w13
            fan_in = model.get_parameter(name.removesuffix("_scale")).shape[-1]
            p.fill_(1.0 / (448.0 * math.sqrt(fan_in)))
        else:
            bound = 1.0 if name.endswith("embed_tokens.weight") else p.shape[-1] ** -0.5
            scale = 448.0 if p.dtype == FP8 else bound
            work = torch.bfloat16 if p.dtype == FP8 else p.dtype
            # one expert at a time: the temporary never exceeds one expert's matrix
            for part in (p.unbind(0) if p.dim() == 3 else (p,)):
                tmp = torch.empty(part.shape, dtype=work, device=device)
                part.copy_((tmp.uniform_(-1, 1, generator=gen) * scale).to(p.dtype))


@torch.no_grad()
def load_model(plan: LoadPlan, device="cpu", dtype=torch.float32, seed: int = 0):
    """Make the planned model's parameters on ``device`` and fill them (eval mode)."""
    model, device = plan.model, torch.device(device)
    _materialize(model, device, dtype)
    finite = FiniteCheck()
    if plan.routes is None:  # random weights: finite by construction, not checked
        _fill_dummy(model, seed, device)
    elif plan.full_shapes is not None:
        _fill_slices(model, plan.routes, plan.full_shapes, finite)
    else:
        _fill_from_files(model, plan.routes, finite)
    finite.check()
    apply_kv_scales(model, plan.kv_scales)
    if getattr(plan.ckpt.text, "tie_word_embeddings", False):
        stored = next((t for t, r in plan.routes or () if r.param == "lm_head.weight"), None)
        if stored is None:
            model.lm_head.weight = model.model.embed_tokens.weight
        elif not torch.equal(model.lm_head.weight, model.model.embed_tokens.weight):
            # transformers 4.x would tie (drop the stored head), 5.x use it: no right answer
            raise ValueError(f"config.json sets tie_word_embeddings, but {stored.file.name} holds "
                             f"an {stored.name} that differs from the embedding; set "
                             "tie_word_embeddings to false to use it, or remove it to tie")
    model.eval()
    model.init_rope(device)
    configure_moe(model)
    fuse_projections(model)
    return model


def load_llama4(model_dir, device="cpu", dtype=None, load_format: str = "auto",
                seed: int = 0, tp: TPGroup = SINGLE) -> Llama4ForCausalLM:
    """Read, check and load a checkpoint directory in one call (``dtype`` None: the
    checkpoint's torch_dtype, else float32; ``tp``: this rank's slices)."""
    ckpt = read_config(model_dir)
    plan = plan_load(model_dir, ckpt, load_format, tp)
    return load_model(plan, device, dtype or ckpt.dtype or torch.float32, seed)
