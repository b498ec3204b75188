"""How a fused module gets its weights for one call: the way ComfyUI's own ops get them.

ComfyUI's ``comfy.ops`` modules compute with something other than their raw Parameters when
``comfy_cast_weights`` is set or weight patches are attached:
- dynamic VRAM (``ModelPatcherDynamic``, the default on NVIDIA in newer trees) leaves the
  Parameters in host memory and faults them into a VRAM slot per call (``_v``); while the slot
  stays resident ``cast_bias_weight`` hands back the same ``_v_weight`` tensor every call;
- low-VRAM modes cast or stream the weights to the input's device per call;
- LoRA-style patches (``weight_function`` / ``bias_function``) transform them per call.

A fused call opens ``weights_for_call()``; each module whose weights it reads is fetched once
with ``fetch_reason(module, x)`` through ComfyUI's own ``cast_bias_weight`` (never a copy of its
logic); a pinned VRAM slot is given back with ``uncast_bias_weight`` when the call ends, as the
stock op does around its one kernel. ``weight_of`` / ``bias_of`` then return what the stock op would have
computed with. Folded buffers may be kept only for weights that outlive the call
(``is_stable``): the module's own Parameters, a resident VRAM slot, or ComfyUI's cast of
on-device Parameters, kept while they are unchanged (``_cast_copy``); a fold of a per-call
copy is rebuilt per call and never kept.

Outside such a scope (or for a module that is not a ComfyUI op) the raw Parameters are used.
Attributes are read without ``nn.Module.__getattr__``, whose AttributeError for a missing name
is slow on a per-call path.
"""
from __future__ import annotations

import contextlib
import sys
import threading
from typing import Iterator, NamedTuple

import torch

from ..cache import cached

_MISSING = object()
# The kept result of ComfyUI's cast of a module's own on-device Parameters (see _cast_copy).
_CAST_COPY = "comfy_cast_copy"
# A kept copy is memory ComfyUI's estimates do not count: only modules as small as those dynamic
# VRAM force-loads (at most 16 KiB in the model's dtype) get one; a larger module cast per call
# (fp8-stored weights, say) keeps its per-call copy and stays out of CUDA graphs.
MAX_CAST_COPY_BYTES = 64 * 1024

LOW_VRAM = "weights cast per call (ComfyUI low-VRAM mode)"
DYNAMIC_VRAM = "weights streamed per call (ComfyUI dynamic VRAM)"
STREAMED = "weights streamed per call (ComfyUI dynamic VRAM: the model does not fit in VRAM)"
PATCHES = "ComfyUI weight patches"

# The module ComfyUI's own op classes are defined in; ops classes of other extensions (GGUF,
# quantised formats) cast their own way, and are left to their stock forward.
COMFY_OPS = "comfy.ops"


def module_attr(module: torch.nn.Module, name: str, default=None):
    """Instance attribute (set by ComfyUI's patcher) or class attribute (ComfyUI's ops classes)."""
    value = module.__dict__.get(name, _MISSING)
    return getattr(type(module), name, default) if value is _MISSING else value


def comfy_cast_reason(module: torch.nn.Module) -> str | None:
    """Why ComfyUI's ops would compute ``module`` differently from its raw weights."""
    if module_attr(module, "comfy_cast_weights", False):
        state = module.__dict__
        return DYNAMIC_VRAM if ("_v" in state or "_v_signature" in state) else LOW_VRAM
    if module_attr(module, "weight_function") or module_attr(module, "bias_function"):
        return PATCHES
    return None


def _comfy_cast_functions(module: torch.nn.Module):
    """ComfyUI's (cast_bias_weight, uncast_bias_weight) for a module of its own ops, else None."""
    forward = getattr(type(module), "forward_comfy_cast_weights", None)
    if getattr(forward, "__module__", None) != COMFY_OPS:
        return None
    ops = sys.modules.get(COMFY_OPS)
    cast = getattr(ops, "cast_bias_weight", None)
    uncast = getattr(ops, "uncast_bias_weight", None)
    # uncast_bias_weight came with the offloadable cast protocol: one tells the other.
    if cast is None or uncast is None:
        return None
    return cast, uncast


def _kept_norm_dtype(module: torch.nn.Module, x: torch.Tensor) -> torch.dtype | None:
    """The dtype ComfyUI keeps a GroupNorm's weights in on ``x``'s device, where that is not
    the input's.

    Dynamic VRAM keeps a norm's weights in the model's dtype (fp32 in the SDXL VAE's bf16
    decode): in a VRAM slot, or, for a module of at most 16 KiB (a 512-channel norm's 4 KiB),
    force-loaded onto the device as its own Parameters, with ``comfy_cast_weights`` still set.
    Cast to the input's dtype they are a new copy every call, which no fold or CUDA graph can
    keep. The fused norms compute in fp32 from weights of any float dtype, so they fetch the
    kept tensors themselves (``cast_bias_weight(dtype=)``). Weights on another device (low-VRAM
    modes) are copied either way and keep the input's dtype.
    """
    if not isinstance(module, torch.nn.GroupNorm):
        return None
    param = module._parameters.get("weight")
    kept = getattr(param, "_model_dtype", None)
    if kept is None:
        slot = module.__dict__.get("_v_weight")
        if isinstance(slot, torch.Tensor):
            kept = slot.dtype
        elif "_v" not in module.__dict__ and isinstance(param, torch.Tensor) \
                and param.device == x.device:
            kept = param.dtype
    if kept is None or kept == x.dtype or not kept.is_floating_point:
        return None
    return kept


def _cast_copy(module: torch.nn.Module, x: torch.Tensor, cast) -> tuple | None:
    """ComfyUI's cast of a module whose own Parameters sit on ``x``'s device in another dtype
    and carry no weight patches, kept while those Parameters stay the same tensors; None for
    any other module.

    Dynamic VRAM force-loads every module of at most 16 KiB onto the device in the model's
    dtype (the SDXL decoder's 3-channel conv_out: fp32 in a bf16 decode) and casts it per call.
    For such a module the cast depends on nothing but the Parameters and the dtype, so its
    result is kept as a fold (dropped on unload, rebuilt when ComfyUI replaces or rewrites the
    Parameters): the same tensors every call, which a CUDA graph may keep, where a fresh copy
    per call kept the whole decoder out of its graph ('conv_out: weights copied per call').
    """
    params = module._parameters
    weight, bias = params.get("weight"), params.get("bias")
    if not isinstance(weight, torch.Tensor) or weight.device != x.device:
        return None
    if bias is not None and bias.device != x.device:
        return None
    if weight.dtype == x.dtype and (bias is None or bias.dtype == x.dtype):
        return None  # the cast hands the Parameters themselves back
    if module_attr(module, "weight_function") or module_attr(module, "bias_function"):
        return None  # patches (LoRA) are applied per call, by ComfyUI
    size = sum(t.numel() * x.element_size() for t in (weight, bias) if t is not None)
    if size > MAX_CAST_COPY_BYTES:
        return None
    # No fold generation bump (``cache``): the copy is what this call fetches, so whoever reads
    # it (a CUDA graph's fingerprint, or its weight copies) sees a rebuilt one through the fetch.
    return cached(module, _CAST_COPY, (weight, bias),
                  lambda: tuple(cast(module, x, offloadable=False)[:2]),
                  extra_key=(x.dtype, x.device), bump=False)


# Where a module remembers that ComfyUI's cast handed back its own Parameters (see _as_cast).
_CAST_IS_PARAMS = "_fvd_cast_is_params"


def _params_key(module: torch.nn.Module, x: torch.Tensor, dtype) -> tuple | None:
    """What decides ComfyUI's cast of a module without a VRAM slot: its Parameters (as objects,
    with their dtype and device), the dtypes asked for and the device; None with weight patches."""
    if module_attr(module, "weight_function") or module_attr(module, "bias_function"):
        return None  # patches (LoRA) are applied per call, by ComfyUI
    params = module._parameters
    weight, bias = params.get("weight"), params.get("bias")
    if not isinstance(weight, torch.Tensor):
        return None
    return (id(weight), weight.dtype, weight.device, id(bias),
            None if bias is None else (bias.dtype, bias.device), x.dtype, x.device, dtype)


def _as_cast(module: torch.nn.Module, x: torch.Tensor, dtype) -> tuple | None:
    """(weight, bias) where ComfyUI's cast of this module handed back its own Parameters on the
    last call with the same key (``_params_key``): it depends on nothing else, so it would again.

    The force-loaded modules of dynamic VRAM (norms and small convs: 30 of the SDXL decoder's
    68 weighted modules) are cast every fused call; a CUDA-graph replay fetches every weight
    before it launches, with the GPU idle, so each cast skipped is host time off every decode.
    """
    memo = module.__dict__.get(_CAST_IS_PARAMS)
    if memo is None or memo != _params_key(module, x, dtype):
        return None
    params = module._parameters
    return params.get("weight"), params.get("bias")


def _remember_cast(module: torch.nn.Module, x: torch.Tensor, dtype, weight, bias) -> None:
    params = module._parameters
    if weight is params.get("weight") and bias is params.get("bias"):
        key = _params_key(module, x, dtype)
        if key is not None:
            module.__dict__[_CAST_IS_PARAMS] = key
    else:
        module.__dict__.pop(_CAST_IS_PARAMS, None)


class _Fetched(NamedTuple):
    weight: torch.Tensor | None
    bias: torch.Tensor | None
    stable: bool
    release: object  # a callable that gives the weights back, or None


class CallWeights:
    """The weights one fused call has fetched, given back together when the call ends."""

    def __init__(self) -> None:
        self._held: dict[int, tuple[torch.nn.Module, _Fetched]] = {}

    def get(self, module: torch.nn.Module) -> _Fetched | None:
        entry = self._held.get(id(module))
        return entry[1] if entry is not None and entry[0] is module else None

    def fetch(self, module: torch.nn.Module, x: torch.Tensor) -> str | None:
        if self.get(module) is not None:
            return None
        cast_reason = comfy_cast_reason(module)
        if cast_reason is None:
            return None  # raw Parameters: the stock forward computes with exactly these
        functions = _comfy_cast_functions(module)
        if functions is None:
            return cast_reason  # not ComfyUI's own ops, or a tree without the cast pair
        cast, uncast = functions
        state_dict = module.__dict__
        # A VRAM slot (``_v``) is pinned while in use and must be given back (offloadable);
        # any other cast is fetched as private tensors (not offloadable): an offloadable cast
        # of host weights lands in a staging buffer that the next module's cast reuses, and a
        # fused block holds several modules' weights at once.
        offloadable = "_v" in state_dict
        dtype = _kept_norm_dtype(module, x)
        if not offloadable:
            same = _as_cast(module, x, dtype)
            if same is not None:
                self._held[id(module)] = (module, _Fetched(same[0], same[1], True, None))
                return None
        if not offloadable and dtype is None:
            try:
                kept_copy = _cast_copy(module, x, cast)
            except Exception as exc:  # fail closed, as below
                return f"ComfyUI could not fetch the weights ({type(exc).__name__})"
            if kept_copy is not None:
                self._held[id(module)] = (module, _Fetched(kept_copy[0], kept_copy[1], True, None))
                return None
        try:
            fetched_tensors = (cast(module, x, offloadable=offloadable) if dtype is None else
                               cast(module, x, dtype=dtype, offloadable=offloadable))
        except Exception as exc:  # fail closed: the stock forward fetches (or raises) its own way
            return f"ComfyUI could not fetch the weights ({type(exc).__name__})"
        weight, bias = fetched_tensors[0], fetched_tensors[1]
        state = fetched_tensors[2] if offloadable else None
        if not offloadable:
            _remember_cast(module, x, dtype, weight, bias)
        stable = ((weight is state_dict.get("_parameters", {}).get("weight")
                   or weight is state_dict.get("_v_weight"))
                  and (bias is None or bias is state_dict.get("_parameters", {}).get("bias")
                       or bias is state_dict.get("_v_bias")))
        release = (None if not offloadable else
                   lambda m=module, w=weight, b=bias, s=state: uncast(m, w, b, s))
        fetched = _Fetched(weight, bias, bool(stable), release)
        self._held[id(module)] = (module, fetched)
        if "_v" in state_dict and not stable:
            # The VRAM slot could not hold it: ComfyUI streams this module's weights through a
            # staging buffer per call; its stock forward (and its prefetching) stays in charge.
            return STREAMED
        return None

    def substitute(self, module: torch.nn.Module, weight: torch.Tensor | None,
                   bias: torch.Tensor | None) -> None:
        """Compute this call with ``weight`` and ``bias`` in place of the fetched ones: copies
        with the same bits that outlive where ComfyUI put them (``cuda_graph``). The fetch
        itself is still given back when the call ends."""
        release = self.get(module).release
        self._held[id(module)] = (module, _Fetched(weight, bias, True, release))

    def release(self) -> None:
        held, self._held = self._held, {}
        for _, fetched in held.values():
            if fetched.release is not None:
                fetched.release()


_LOCAL = threading.local()


def _stack() -> list[CallWeights]:
    stack = getattr(_LOCAL, "stack", None)
    if stack is None:
        stack = _LOCAL.stack = []
    return stack


@contextlib.contextmanager
def weights_for_call() -> Iterator[CallWeights]:
    """One fused call's weight scope; everything fetched in it is given back at its end."""
    scope = CallWeights()
    stack = _stack()
    stack.append(scope)
    try:
        yield scope
    finally:
        stack.pop()
        scope.release()


def _fetched(module: torch.nn.Module) -> _Fetched | None:
    for scope in reversed(_stack()):
        hit = scope.get(module)
        if hit is not None:
            return hit
    return None


def fetch_reason(module: torch.nn.Module, x: torch.Tensor) -> str | None:
    """Make ``module``'s weights for this call available to ``weight_of``; why not, if not.

    Outside a ``weights_for_call`` scope nothing is fetched, and a module ComfyUI would cast
    gets the reason it would have got before weights could be fetched.
    """
    stack = _stack()
    if not stack:
        return comfy_cast_reason(module)
    if _fetched(module) is not None:
        return None
    return stack[-1].fetch(module, x)


def call_tensors(module: torch.nn.Module, x: torch.Tensor) -> tuple[str | None, tuple, bool]:
    """``fetch_reason(module, x)``, then what ``weight_of`` gives for each of the module's
    Parameter names in order and ``is_stable``, from one lookup: ``(reason, tensors, stable)``
    (``()`` and False where there is a reason). For a caller that reads every weight of a
    model per call (a CUDA-graph replay's fingerprint), where three lookups per module were
    most of the host time between the latent's arrival and the replay."""
    stack = _stack()
    params = module._parameters
    if not stack:
        reason = comfy_cast_reason(module)
        return (reason, (), False) if reason is not None else (None, tuple(params.values()), True)
    hit = _fetched(module)
    if hit is None:
        reason = stack[-1].fetch(module, x)
        if reason is not None:
            return reason, (), False
        hit = stack[-1].get(module)
    if hit is None:
        return None, tuple(params.values()), True
    return None, tuple(hit.weight if n == "weight" else hit.bias for n in params), hit.stable


def placed_by_comfyui(module: torch.nn.Module) -> bool:
    """Whether this call's weights of ``module`` came from ComfyUI's cast and outlive the call:
    a VRAM slot of dynamic VRAM, a weight it force-loaded onto the device, or the kept cast of
    one. ComfyUI puts each of them at a new place (new tensors) whenever it prepares the model
    again, which dynamic VRAM does whenever another model was loaded in between."""
    fetched = _fetched(module)
    return fetched is not None and fetched.stable


def read_instead(module: torch.nn.Module, weight: torch.Tensor | None,
                 bias: torch.Tensor | None) -> None:
    """From now on in the scope that fetched ``module`` (the innermost, where nested), read
    ``weight`` and ``bias`` as its weights: copies with the same bits that outlive where
    ComfyUI put them (``cuda_graph``)."""
    for scope in reversed(_stack()):
        if scope.get(module) is not None:
            scope.substitute(module, weight, bias)
            return
    raise LookupError(f"{type(module).__name__}: no weights fetched in an open scope")


def weight_of(module: torch.nn.Module, name: str = "weight") -> torch.Tensor | None:
    """The tensor the stock op would compute with for this call (``name``: weight or bias)."""
    fetched = _fetched(module)
    if fetched is not None:
        return fetched.weight if name == "weight" else fetched.bias
    return module._parameters.get(name) if name in module._parameters else getattr(module, name)


def bias_of(module: torch.nn.Module) -> torch.Tensor | None:
    return weight_of(module, "bias")


def is_stable(module: torch.nn.Module) -> bool:
    """Whether this call's weights of ``module`` outlive the call (a fold of them may be kept)."""
    fetched = _fetched(module)
    return True if fetched is None else fetched.stable
