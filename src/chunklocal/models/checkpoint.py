"""What a Llama-4 checkpoint directory holds, read from its headers and checked.

Reading follows ``model.safetensors.index.json`` when there is one: only the files it
names are opened, each tensor is taken from the file the index gives, and a file the
index does not name is never read.  Without an index every ``*.safetensors`` file is
read and a tensor found in two files is an error naming both.  Multimodal checkpoints
serve their text model (``language_model.*``); vision tensors are skipped.

Everything is checked from the files' headers before any tensor data is read: a
truncated or unreadable file, a missing, unexpected or mis-shaped tensor, an FP8
weight without its scales, raise ValueError naming the file or the tensor (and both
shapes).  Which modules are FP8 is read from the tensors' dtypes (float8_e4m3fn).

Expert layouts (both become ``w13 [E, 2*inner, hidden]`` / ``w2 [E, hidden, inner]``):

- fused, as transformers' Llama4TextExperts and fbgemm_fp8 write them:
  ``experts.gate_up_proj [E, hidden, 2*inner]``, ``experts.down_proj [E, inner, hidden]``,
  FP8 scales ``gate_up_proj_scale [E, 1, 2*inner]``, ``down_proj_scale [E, hidden, 1]``;
- one Linear per expert, as llm-compressor writes them (compressed-tensors):
  ``experts.{e}.{gate,up,down}_proj.weight`` ([out, in]) with ``weight_scale [out, 1]``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from chunklocal.models.llama4 import Llama4ForCausalLM
from chunklocal.models.llama4_config import CheckpointConfig
from chunklocal.models.quant import FP8, NO_FP8, Fp8Plan

INDEX = "model.safetensors.index.json"
_SKIP = ("vision_model.", "multi_modal_projector.", "model.vision_model.",
         "model.multi_modal_projector.")
_FLOATS = ("F32", "F16", "BF16")
_EXPERT = re.compile(r"(.*\.experts)\.(\d+)\.(gate|up|down)_proj\.(weight|weight_scale)$")
_FUSED = re.compile(r"(.*\.experts)\.(gate_up_proj|down_proj)(_scale)?$")


def canonical(name: str) -> str | None:
    """Text-model name of a checkpoint tensor (``model.*`` / ``lm_head.*``), None to skip."""
    for prefix in ("language_model.model.", "model.language_model."):
        if name.startswith(prefix):
            return "model." + name[len(prefix):]
    if name.startswith("language_model.lm_head."):
        return name[len("language_model."):]
    if name.startswith(_SKIP) or name.endswith(".rotary_emb.inv_freq"):
        return None
    return name


@dataclass
class Tensor:
    name: str                   # as stored
    file: Path
    dtype: str                  # safetensors dtype: F32, BF16, F8_E4M3, ...
    shape: tuple


def open_safetensors(path: Path):
    from safetensors import safe_open

    try:
        return safe_open(str(path), framework="pt")
    except Exception as err:  # SafetensorError, OSError: truncated, unreadable, not safetensors
        raise ValueError(f"{path}: unreadable safetensors file ({err})") from err


def read_headers(model_dir) -> dict[str, Tensor]:
    """Canonical text-model name -> where and what each tensor is (headers only)."""
    model_dir = Path(model_dir)
    index = model_dir / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            assert isinstance(weight_map, dict)
        except (OSError, ValueError, KeyError, TypeError, AssertionError) as err:
            raise ValueError(f"{index}: unreadable index ({err!r})") from err
        wanted: dict[str, list[str]] = {}
        for name, file in weight_map.items():
            # Lexically inside the folder (its files may be links, as in the hub's cache).
            if not isinstance(file, str) or Path(file).is_absolute() or ".." in Path(file).parts:
                raise ValueError(f"{index}: {name} is in {file!r}, outside {model_dir}; an "
                                 "index names files of its own folder")
            wanted.setdefault(file, []).append(name)
    else:
        files = sorted(p.name for p in model_dir.glob("*.safetensors"))
        if not files:
            raise ValueError(f"{model_dir}: no *.safetensors files and no {INDEX}")
        wanted = {file: None for file in files}
    found: dict[str, Tensor] = {}
    for file, names in sorted(wanted.items()):
        path = model_dir / file
        if not path.is_file():
            raise ValueError(f"{index}: names {file}, which is not in {model_dir}")
        with open_safetensors(path) as f:
            keys = set(f.keys())
            for name in sorted(keys) if names is None else names:
                if name not in keys:
                    raise ValueError(f"{index}: says {name} is in {file}, which has no such "
                                     "tensor")
                canon = canonical(name)
                if canon is None:
                    continue
                if canon in found:
                    raise ValueError(f"tensor {name} is in both {found[canon].file.name} "
                                     f"(as {found[canon].name}) and {file}")
                piece = f.get_slice(name)
                found[canon] = Tensor(name, path, piece.get_dtype(), tuple(piece.get_shape()))
    return found


def _module_of(canon: str) -> str:
    """The module whose weight a tensor name belongs to (experts: the experts module)."""
    for pattern in (_EXPERT, _FUSED):
        match = pattern.match(canon)
        if match:
            return match.group(1)
    return canon.rsplit(".", 1)[0]


def fp8_plan_from_tensors(tensors: dict[str, Tensor], ckpt: CheckpointConfig) -> Fp8Plan:
    fp8 = {_module_of(c) for c, t in tensors.items() if t.dtype == "F8_E4M3"}
    other = sorted(c for c, t in tensors.items() if t.dtype.startswith("F8_")
                   and t.dtype != "F8_E4M3")
    if other:
        raise ValueError(f"tensor {tensors[other[0]].name} has dtype {tensors[other[0]].dtype}; "
                         "only float8_e4m3fn FP8 weights are served")
    if fp8 and ckpt.quant is None:
        first = next(t for t in tensors.values() if t.dtype == "F8_E4M3")
        raise ValueError(f"tensor {first.name} ({first.file.name}) is float8_e4m3fn but "
                         "config.json has no quantization_config")
    if ckpt.quant is not None and not fp8:
        raise ValueError(f"config.json's quantization_config ({ckpt.quant.method}) but no "
                         "tensor of the checkpoint is float8_e4m3fn")
    return Fp8Plan(frozenset(fp8), ckpt.quant.act_scale_ub if ckpt.quant else None)


def fp8_plan_from_config(ckpt: CheckpointConfig) -> Fp8Plan:
    """The modules an FP8 checkpoint of this config holds in FP8 (for dummy weights)."""
    if ckpt.quant is None:
        return NO_FP8
    with torch.device("meta"):
        model = Llama4ForCausalLM(ckpt.text)
    chosen = set()
    for name, module in model.named_modules():
        experts = name.endswith(".experts")
        if not experts and not isinstance(module, nn.Linear):
            continue
        probe = f"{name}.0.gate_proj" if experts and ckpt.quant.method != "fbgemm_fp8" else name
        classes = (("Llama4TextExperts",) if probe == name and experts else
                   ("Llama4Router", "Linear") if name.endswith(".router") else ("Linear",))
        if ckpt.quant.quantizes(_spellings(probe, ckpt.multimodal), classes + ("Module",)):
            chosen.add(name)
    return Fp8Plan(frozenset(chosen), ckpt.quant.act_scale_ub)


def _spellings(canon: str, multimodal: bool) -> list[str]:
    if not multimodal:
        return [canon]
    inner = canon[len("model."):] if canon.startswith("model.") else None
    return [canon, "language_model." + canon] + ([f"model.language_model.{inner}"] if inner
                                                  else [])


@dataclass
class Route:
    """Where one checkpoint tensor goes: ``param[index]`` (after ``transpose``), and which
    stored shapes are right."""

    param: str
    index: tuple = ()
    expect: tuple = ()            # acceptable stored shapes
    transpose: bool = False       # swap the last two dims (fused experts)
    key: tuple = field(default=())


def route(canon: str, params: dict[str, nn.Parameter]) -> Route | None:
    match = _FUSED.match(canon)
    if match:
        experts, which, scale = match.groups()
        param = f"{experts}.{'w13' if which == 'gate_up_proj' else 'w2'}"
        if param not in params:
            return None
        e, n, k = params[param].shape
        if scale:  # gate_up_proj_scale [E, 1, 2I]; down_proj_scale [E, H, 1]
            if param + "_scale" not in params:
                return None
            shape = (e, 1, n) if which == "gate_up_proj" else (e, n, 1)
            return Route(param + "_scale", expect=(shape,), key=(param + "_scale",))
        return Route(param, expect=((e, k, n),), transpose=True, key=(param,))
    match = _EXPERT.match(canon)
    if match:
        experts, e, proj, what = match.groups()
        param = f"{experts}.{'w2' if proj == 'down' else 'w13'}"
        if param not in params or int(e) >= params[param].shape[0]:
            return None
        _, n, k = params[param].shape
        rows = {"gate": slice(0, n // 2), "up": slice(n // 2, n), "down": slice(0, n)}[proj]
        n_out = rows.stop - rows.start
        if what == "weight_scale":
            if param + "_scale" not in params:
                return None
            return Route(param + "_scale", (int(e), rows), ((n_out, 1), (n_out,)),
                         key=(param + "_scale", int(e), proj))
        return Route(param, (int(e), rows), ((n_out, k),), key=(param, int(e), proj))
    if canon.endswith(".weight_scale") and canon in params:
        n = params[canon].shape[0]
        return Route(canon, expect=((n, 1), (n,)), key=(canon,))
    if canon in params:
        return Route(canon, expect=(tuple(params[canon].shape),), key=(canon,))
    return None


def _first_missing(name: str, param: nn.Parameter, seen: dict, per_expert: bool) -> str | None:
    """Checkpoint name (canonical) of the first piece of ``name`` no tensor gave, or None."""
    if not per_expert:
        return None if (name,) in seen else _stored_name(name)
    experts, ours = name.rsplit(".", 1)
    suffix = "weight_scale" if ours.endswith("_scale") else "weight"
    projs = ("down",) if ours.startswith("w2") else ("gate", "up")
    for e in range(param.shape[0]):
        for proj in projs:
            if (name, e, proj) not in seen:
                return f"{experts}.{e}.{proj}_proj.{suffix}"
    return None


def check_routes(tensors: dict[str, Tensor], model: nn.Module, tied: bool, display=str) -> list:
    """(Tensor, Route) for every tensor, or ValueError for the first unexpected, mis-shaped,
    wrongly typed, duplicated or missing one.  Reads no tensor data.  ``display`` spells a
    text-model name as the checkpoint does (for messages)."""
    params = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    routes, seen, per_expert = [], {}, set()
    for canon, tensor in tensors.items():
        r = route(canon, params)
        if r is None:
            raise ValueError(f"unexpected tensor {tensor.name} in {tensor.file.name} (shape "
                             f"{list(tensor.shape)}): the config's model has no such weight")
        if tensor.shape not in r.expect:
            raise ValueError(f"tensor {tensor.name} in {tensor.file.name} has shape "
                             f"{list(tensor.shape)}; the config needs {list(r.expect[0])}")
        fp8 = params[r.param].dtype == FP8
        if (tensor.dtype == "F8_E4M3") != fp8 or (not fp8 and tensor.dtype not in _FLOATS):
            raise ValueError(f"tensor {tensor.name} in {tensor.file.name} has dtype "
                             f"{tensor.dtype}; expected {'F8_E4M3' if fp8 else 'a float'} "
                             "like the other weights of its module")
        if r.key in seen:
            raise ValueError(f"tensors {seen[r.key]} and {tensor.name} both give {r.param}")
        seen[r.key] = tensor.name
        if len(r.key) == 3:
            per_expert.add(r.param.removesuffix("_scale"))
        routes.append((tensor, r))
    for name, param in params.items():
        if name == "lm_head.weight" and tied and (name,) not in seen:
            continue
        missing = _first_missing(name, param, seen, name.removesuffix("_scale") in per_expert)
        if missing is not None:
            needs = " (an FP8 weight needs its scales)" if name.endswith("_scale") else ""
            raise ValueError(f"missing tensor {display(missing)}{needs}; the config's model "
                             f"needs {name} of shape {list(param.shape)}")
    return routes


def _stored_name(name: str) -> str:
    """How a fused-layout checkpoint names the tensor of our parameter ``name``."""
    for ours, theirs in ((".w13_scale", ".gate_up_proj_scale"), (".w2_scale", ".down_proj_scale"),
                         (".w13", ".gate_up_proj"), (".w2", ".down_proj")):
        if name.endswith(ours):
            return name[: -len(ours)] + theirs
    return name
