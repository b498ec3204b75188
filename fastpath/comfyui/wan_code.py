"""Which Wan VAE code a ComfyUI tree carries (``comfy.ldm.wan.vae`` / ``vae2_2``), as facts the
Wan family asks for: the causal-conv padding shape, what a block caches for the next chunk,
which arguments a forward takes but ignores, and which decode loop ``WanVAE.decode`` runs.

Nothing here compares version strings. A stock method is known by its fingerprint: the names
its code references (``co_names``) and its parameters. Code with another fingerprint is not
known, and the family keeps it stock. The kinds of code met so far:

- 0.3.64 .. 0.8: ``CausalConv3d._padding`` is ``F.pad``'s 6-tuple and the conv pads nothing;
  a block caches the last two frames of its conv's input, joining the previous chunk's last
  frame to a one-frame chunk (clones); ``WanVAE.decode`` runs the decoder per latent frame and
  grows the output with ``torch.cat``.
- 0.33 .. 0.38 (Wan 2.1 ``vae``): ``_padding`` is the time padding (an int) and the conv pads
  space itself; a one-frame input without cache convolves with the last temporal tap only
  (``autopad="causal_zero"``, the same sums as zero padding); a block caches the last two
  frames of its own input, nothing joined (views); forwards take a ``final`` they ignore
  outside ``downsample3d``; ``decode`` runs a first latent frame, then two at a time, the
  decoder returning a list of chunks (``run_up``), concatenated once; the cache is sized by
  ``count_cache_layers``. 0.38 adds a 4-D (single image) branch in front.
- newest ``vae2_2``: the 0.33 conv (imported from ``vae``), its own blocks with the older cache
  rule, ``temporal_kernel`` (1 or 3), ``patch_size`` read from the model, a 4-D branch.

diffusers' ``WanCausalConv3d`` has the 6-tuple shape and the older cache rule; its classes are
not fingerprinted here (they are not ComfyUI's), the family takes them as it always has.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..swap import stock_class  # noqa: F401  (re-exported: families ask this room)

V21 = "comfy.ldm.wan.vae"
V22 = "comfy.ldm.wan.vae2_2"

# What a block stores for a causal conv's next chunk (the conv itself reads it only when it pads
# time): the last CACHE_T frames of the previous cache joined with the new input (JOINED), or of
# the new input alone (OWN).
JOINED = "joined"
OWN = "own"


@dataclass(frozen=True)
class Code:
    """Facts about one stock method."""

    cache: str | None = None  # JOINED / OWN for a cache-keeping forward
    ignored: tuple[str, ...] = ()  # parameters the method takes and never reads (fusable calls)
    padding: str | None = None  # causal conv: "tuple" (F.pad 6-tuple) or "time" (int, conv pads space)
    loop: str | None = None  # WanVAE.decode: "per_frame" or "chunked"
    counter: str | None = None  # WanVAE.decode: the module function sizing the frame cache
    model_cache: bool = False  # WanVAE.decode keeps its cache on the model (clear_cache)
    unpatchify: int | str | None = None  # Wan 2.2 decode: patch size, or the model attribute holding it
    images: bool = False  # WanVAE.decode takes 4-D latents (single images) itself


def _key(names: set[str], params: tuple[str, ...]) -> tuple[frozenset, tuple]:
    return frozenset(names), ("self",) + params


_CACHE = {"feat_cache", "feat_idx"}
_JOIN = {"CACHE_T", "cat", "clone", "device", "shape", "to", "torch", "unsqueeze"}
_RESAMPLE = {"mode", "rearrange", "resample", "reshape", "shape", "size", "stack", "time_conv", "torch",
             "CACHE_T", "cat"}
_ATTENTION = {"chunk", "norm", "optimized_attention", "proj", "rearrange", "size", "to_qkv"}
_DECODE = {"cat", "conv2", "decoder", "range", "shape", "torch"}
_X_CACHE = ("x", "feat_cache", "feat_idx")

# (stock class, method) -> {fingerprint: facts}
KNOWN: dict[tuple[str, str], dict[tuple[frozenset, tuple], Code]] = {
    (f"{V21}.CausalConv3d", "forward"): {
        _key({"F", "_padding", "cat", "device", "forward", "list", "pad", "shape", "super", "to", "torch"},
             ("x", "cache_x", "cache_list", "cache_idx")): Code(padding="tuple"),
        _key({"_padding", "device", "dtype", "forward", "list", "max", "shape", "super", "to", "torch",
              "torch_cat_if_needed", "zeros"},
             ("x", "cache_x", "cache_list", "cache_idx")): Code(padding="time"),
    },
    (f"{V21}.ResidualBlock", "forward"): {
        _key(_JOIN | {"CausalConv3d", "isinstance", "residual", "shortcut"}, _X_CACHE): Code(cache=JOINED),
        _key({"CACHE_T", "CausalConv3d", "isinstance", "residual", "shortcut"}, _X_CACHE + ("final",)):
            Code(cache=OWN, ignored=("final",)),
    },
    (f"{V22}.ResidualBlock", "forward"): {
        _key(_JOIN | {"CausalConv3d", "isinstance", "residual", "shortcut"}, _X_CACHE): Code(cache=JOINED),
    },
    (f"{V21}.Resample", "forward"): {
        _key(_RESAMPLE | _JOIN | {"zeros_like"}, _X_CACHE): Code(cache=JOINED),
        # ``final`` is read only by the downsample3d branch, which the decoder never has.
        _key(_RESAMPLE, _X_CACHE + ("final",)): Code(cache=OWN, ignored=("final",)),
    },
    (f"{V22}.Resample", "forward"): {
        _key(_RESAMPLE | _JOIN | {"zeros_like"}, _X_CACHE): Code(cache=JOINED),
    },
    (f"{V22}.DupUp3D", "forward"): {
        _key({"contiguous", "factor_s", "factor_t", "out_channels", "permute", "repeat_interleave",
              "repeats", "size", "view"}, ("x", "first_chunk")): Code(),
    },
    (f"{V21}.AttentionBlock", "forward"): {
        _key(_ATTENTION, ("x",)): Code(),
        _key(_ATTENTION, _X_CACHE + ("final",)): Code(ignored=("feat_cache", "feat_idx", "final")),
    },
    # 0.33+: after a temporal upsample the frames go on in pieces of two (``join_first`` puts
    # the first frame in front of the first piece in a joined first call).
    (f"{V21}.Decoder3d", "run_up"): {
        _key({"CACHE_T", "CausalConv3d", "Resample", "append", "copy", "head", "isinstance", "len",
              "mode", "range", "run_up", "shape", "upsamples"},
             ("layer_idx", "x_ref", "feat_cache", "feat_idx", "out_chunks")): Code(),
    },
    (f"{V21}.WanVAE", "decode"): {
        _key(_DECODE | {"count_conv3d"}, ("z",)): Code(loop="per_frame", counter="count_conv3d"),
        _key(_DECODE | {"count_cache_layers"}, ("z",)): Code(loop="chunked", counter="count_cache_layers"),
        _key(_DECODE | {"count_cache_layers", "ndim", "decode", "unsqueeze", "squeeze"}, ("z",)):
            Code(loop="chunked", counter="count_cache_layers", images=True),
    },
    (f"{V22}.WanVAE", "decode"): {
        _key(_DECODE | {"count_conv3d", "unpatchify"}, ("z",)):
            Code(loop="per_frame", counter="count_conv3d", unpatchify=2),
        _key(_DECODE | {"clear_cache", "_feat_map", "_conv_idx", "unpatchify"}, ("z",)):
            Code(loop="per_frame", model_cache=True, unpatchify=2),
        _key(_DECODE | {"count_conv3d", "unpatchify", "ndim", "unsqueeze", "squeeze", "patch_size"}, ("z",)):
            Code(loop="per_frame", counter="count_conv3d", unpatchify="patch_size", images=True),
    },
}


def qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


@functools.lru_cache(maxsize=None)
def fingerprinted(cls: type) -> bool:
    """Whether this room knows code of ``cls`` at all (ComfyUI's Wan classes)."""
    name = qualified(cls)
    return any(c == name for c, _ in KNOWN)


def method_code(obj: object, method: str) -> Code | str:
    """The facts about ``obj``'s stock ``method``, or why it is not known code."""
    return _class_method_code(stock_class(obj), method)


@functools.lru_cache(maxsize=None)
def _class_method_code(cls: type, method: str) -> Code | str:
    name = qualified(cls)
    table = KNOWN.get((name, method))
    if table is None:
        return f"no known {name}.{method}"
    func = getattr(cls, method, None)
    code = getattr(func, "__code__", None)
    if code is None:
        return f"{name}.{method} is not plain Python"
    params = code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]
    facts = table.get((frozenset(code.co_names), params))
    return facts if facts is not None else f"unrecognised {name}.{method} (a newer version?)"


# --- the causal conv ---------------------------------------------------------------------------


def causal_padding(conv: torch.nn.Module) -> tuple[int, int, int] | str:
    """``(time, height, width)`` zero padding of a causal conv (time padding all in front), or
    why its shape is not one of the two known ones: ``_padding`` as ``F.pad``'s 6-tuple with a
    conv that pads nothing (0.8, diffusers), or ``_padding`` as the time padding with the
    conv's own ``padding`` ``(0, h, w)`` (0.33+)."""
    pad = getattr(conv, "_padding", None)
    own = tuple(getattr(conv, "padding", ()))
    if getattr(conv, "padding_mode", "zeros") != "zeros" or len(own) != 3:
        return "conv pads by itself"
    if isinstance(pad, tuple) and len(pad) == 6:
        if own != (0, 0, 0):
            return "conv pads by itself"
        if pad[0] != pad[1] or pad[2] != pad[3] or pad[5] != 0:
            return f"causal padding {pad}"
        return pad[4], pad[2], pad[0]
    if isinstance(pad, int) and not isinstance(pad, bool):
        if own[0] != 0:
            return "conv pads time by itself"
        return pad, own[1], own[2]
    return "conv has no causal padding"


def stock_pads_in_two_copies(conv: torch.nn.Module) -> bool:
    """Whether the stock conv builds its input with two copies (``cat`` then ``F.pad``: the
    6-tuple shape), which a one-buffer input beats; the time-padding shape builds it with one
    ``cat`` and lets the convolution pad space (or skips the zeros: ``causal_zero``), which
    leaves nothing to save bit-exactly."""
    if fingerprinted(stock_class(conv)):
        code = method_code(conv, "forward")
        return not isinstance(code, str) and code.padding == "tuple"
    pad = getattr(conv, "_padding", None)
    return isinstance(pad, tuple) and len(pad) == 6
