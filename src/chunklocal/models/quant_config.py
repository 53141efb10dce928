"""``quantization_config`` of a checkpoint: the FP8 layouts served, everything else refused.

Served (the published Llama-4 FP8 checkpoints):

- ``quant_method: fbgemm_fp8`` (meta-llama's Maverick FP8): e4m3 weights with one float32
  scale per output channel, activations quantized per token at run time with the amax
  capped at ``activation_scale_ub``; ``modules_to_not_convert`` stay 16-bit.
- ``quant_method: compressed-tensors`` with FP8 weights, ``strategy: channel`` (one scale
  per output channel), and ``input_activations`` dynamic per token (the FP8-dynamic Scout
  checkpoints made by llm-compressor); ``ignore`` names modules left 16-bit.

Any other method (gptq, awq, bitsandbytes, fp8 block-wise, ...) or compressed-tensors
scheme (W4A16, block-wise, static activations, ...) raises ValueError naming it, before
any weight is read.  Which modules hold FP8 weights is read from the checkpoint's tensors
(dtype float8_e4m3fn); :meth:`Fp8Scheme.quantizes` tells it from the config alone, for
``load_format="dummy"``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

SERVED = ("fbgemm_fp8", "compressed-tensors (FP8, channel-wise weights, dynamic per-token "
          "activations)")


@dataclass(frozen=True)
class Fp8Scheme:
    method: str                       # "fbgemm_fp8" or "compressed-tensors"
    act_scale_ub: float | None        # cap on a token's activation amax (fbgemm only)
    skip: tuple[str, ...]             # modules_to_not_convert / compressed-tensors ignore
    targets: tuple[str, ...] = ()     # compressed-tensors targets ("Linear", "re:...", names)

    def quantizes(self, names: list[str], classes: tuple[str, ...]) -> bool:
        """Whether a Linear module known by any of ``names`` (its checkpoint spellings) with
        class hierarchy ``classes`` (transformers' class names) holds FP8 weights."""
        if self.method == "fbgemm_fp8":
            # transformers' should_convert_module: a pattern matches from the start up to a
            # module boundary (also as a regex) or as a suffix; releases before v5 matched
            # "pattern." anywhere in the name.  A module is kept 16-bit if any rule skips it.
            return not any(_fbgemm_skips(name, key) for name in names for key in self.skip)
        hit = any(_ct_match(name, classes, t) for name in names for t in self.targets)
        return hit and not any(_ct_match(name, classes, i) for name in names for i in self.skip)


def _fbgemm_skips(name: str, key: str) -> bool:
    if name == key or name.endswith(key) or f"{key}." in name:
        return True
    try:
        return re.match(rf"(?:{key})(?:(?<=\.)|(?=\.|$))", name) is not None
    except re.error:
        return False


def _ct_match(name: str, classes: tuple[str, ...], target: str) -> bool:
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return target == name or target in classes


def _describe(args) -> str:
    if not args:
        return "none"
    kind = f"{args.get('type', '?')}{args.get('num_bits', '?')}"
    strategy = args.get("strategy")
    if strategy == "group":
        strategy = f"group({args.get('group_size')})"
    elif strategy == "block":
        strategy = f"block{args.get('block_structure')}"
    dynamic = "dynamic" if args.get("dynamic") else "static"
    return f"{kind} {strategy} {dynamic}"


def _check_ct_group(name: str, group: dict) -> tuple[str, ...]:
    weights = group.get("weights") or {}
    acts = group.get("input_activations")
    scheme = (f"group {name!r}: weights {_describe(weights)}, input_activations "
              f"{_describe(acts)}")
    ok_weights = (weights.get("type") == "float" and weights.get("num_bits") == 8
                  and weights.get("strategy") == "channel" and not weights.get("dynamic")
                  and weights.get("symmetric", True))
    ok_acts = (isinstance(acts, dict) and acts.get("type") == "float"
               and acts.get("num_bits") == 8 and acts.get("strategy") == "token"
               and acts.get("dynamic") is True and acts.get("symmetric", True))
    if not (ok_weights and ok_acts) or group.get("output_activations"):
        raise ValueError(f"compressed-tensors scheme not served ({scheme}); served: FP8 "
                         "weights with channel-wise scales and dynamic per-token FP8 "
                         "activations (FP8_DYNAMIC)")
    targets = group.get("targets") or []
    if isinstance(targets, str):
        targets = [targets]
    return tuple(targets)


def parse_quantization_config(qc) -> Fp8Scheme | None:
    """The served FP8 scheme of a ``quantization_config`` (None: not quantized)."""
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise ValueError(f"quantization_config must be an object, got {qc!r}")
    method = qc.get("quant_method")
    if method == "fbgemm_fp8":
        ub = qc.get("activation_scale_ub")
        if ub is not None and (isinstance(ub, bool) or not isinstance(ub, (int, float))
                               or not ub > 0):
            raise ValueError(f"fbgemm_fp8 activation_scale_ub must be a positive number, "
                             f"got {ub!r}")
        skip = qc.get("modules_to_not_convert")
        # transformers' default when the list is absent: keep the output embeddings 16-bit
        skip = ["lm_head"] if skip is None else skip
        if not isinstance(skip, list) or not all(isinstance(s, str) for s in skip):
            raise ValueError(f"fbgemm_fp8 modules_to_not_convert must be a list of module "
                             f"names, got {skip!r}")
        return Fp8Scheme(method, None if ub is None else float(ub), tuple(skip))
    if method == "compressed-tensors":
        fmt = qc.get("format")
        if fmt not in (None, "float-quantized", "naive-quantized"):
            raise ValueError(f"compressed-tensors format {fmt!r} is not served (FP8 "
                             "checkpoints are 'float-quantized')")
        status = qc.get("quantization_status", "compressed")
        if status != "compressed":
            raise ValueError(f"compressed-tensors quantization_status {status!r} is not "
                             "served (expected 'compressed': FP8 weights with their scales)")
        for key in ("kv_cache_scheme", "sparsity_config", "transform_config"):
            if qc.get(key):
                raise ValueError(f"compressed-tensors {key} is not served: {qc[key]!r}")
        groups = qc.get("config_groups")
        if not isinstance(groups, dict) or not groups:
            raise ValueError("compressed-tensors quantization_config has no config_groups")
        targets = tuple(t for name, group in groups.items()
                        for t in _check_ct_group(name, group or {}))
        ignore = qc.get("ignore") or []
        if not isinstance(ignore, list) or not all(isinstance(s, str) for s in ignore):
            raise ValueError(f"compressed-tensors ignore must be a list of names, got {ignore!r}")
        return Fp8Scheme(method, None, tuple(ignore), targets)
    raise ValueError(f"quantization method {method!r} is not supported; served: "
                     f"{', '.join(SERVED)}")
