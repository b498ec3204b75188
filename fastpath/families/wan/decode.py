"""The Wan VAE decode loop without its quadratic copying, and the decoder's precision.

Stock ``WanVAE.decode`` (ComfyUI) and ``AutoencoderKLWan._decode`` (diffusers) run the decoder
one latent frame at a time and grow the output with ``torch.cat([out, chunk], 2)`` after every
frame: O(frames^2) bytes copied, and two whole outputs alive at once. ``assemble_chunk_lists``
writes each chunk into one preallocated output instead. It stores the very same values (a copy
is a copy) in the layout ``torch.cat`` gives contiguous chunks, so the result is ``torch.equal`` to
stock (the tests prove it on every supported class) and it runs whether the gate is open or
closed: lossless decodes get faster too.

The loop replaced must be one we know: ComfyUI's ``WanVAE.decode`` by its fingerprint in the
ComfyUI room (``comfyui/wan_code.py``: the per-frame ``cat`` loop of 0.8, the chunked list loop
of 0.33+), diffusers' by its referenced names (``KNOWN_LOOPS``); any other keeps its own loop.
ComfyUI 0.33+ already concatenates once at the end, so there the gain is the second whole
output that concatenation holds and the frames handed on as they are final.

The same top-level mixins carry the decode precision set by ``precision.py``: latents are cast
to the decoder's dtype on the way in, images to the encoder's, and an fp16 decode whose output
is not finite is done again in bf16 (said once in the log) rather than returning NaN/Inf.
"""
from __future__ import annotations

import contextlib
import logging
import sys
from typing import Callable

import torch

from ...comfyui.wan_code import method_code
from ...log import log_once_for
from ...module_clone import clone_module, tensor_copier
from ...pixels.frames import FrameSink, FramesLost, frames_sink
from ...progress import advance
from ...recognize import class_names, stock_class_name
from ...swap import stock_class, swap_in
from .first_call import first_decoder_call, settle_first_call
from .join_first import join_reason, joined

COMFY_WAN21 = "comfy.ldm.wan.vae.WanVAE"
COMFY_WAN22 = "comfy.ldm.wan.vae2_2.WanVAE"
DIFFUSERS_WAN = "diffusers.models.autoencoders.autoencoder_kl_wan.AutoencoderKLWan"

# Names diffusers' supported ``_decode`` references (ComfyUI's loops are known by ``wan_code``).
KNOWN_LOOPS = {
    (DIFFUSERS_WAN, "_decode"): (
        frozenset({"shape", "tile_sample_min_height", "spatial_compression_ratio",
                   "tile_sample_min_width", "use_tiling", "tiled_decode", "clear_cache",
                   "post_quant_conv", "range", "_conv_idx", "decoder", "_feat_map", "torch",
                   "cat", "config", "patch_size", "unpatchify", "clamp", "DecoderOutput"}),
    ),
}

_NOT_FINITE_FP16 = ("fp16 overflowed in the Wan decoder (non-finite output); this latent was "
                    "decoded again in bf16 -- choose bf16 for this VAE to skip the double work")


def _reporting(step: Callable[[int], object], steps: int) -> Callable[[int], object]:
    """``step`` that reports each finished call as one of ``steps`` chunks (``progress``); a
    caller stopping the decode there does so between chunks."""
    def run(i: int):
        out = step(i)
        advance(i + 1, steps)
        return out
    return run


def assemble_chunk_lists(step: Callable[[int], list], sizes: list[int],
                         sink: FrameSink | None = None) -> torch.Tensor:
    """``torch.cat(step(0) + step(1) + ..., 2)`` (each ``step(i)`` a list of frame chunks, for
    ``sizes[i]`` latent frames) written into one output as the chunks come, or handed to
    ``sink`` (``pixels.frames``) without any whole output on the device.

    ``step(i)`` must be called in order. The output's shape is known once the second step shows
    how many frames a latent frame gives after the first step (which differs: Wan upsamples
    time 4x except for the first latent frame); chunks that do not fit that plan are
    concatenated instead, so any chunk sizes give the stock result (a sink that took frames
    cannot go back: then ``FramesLost``).
    """
    step = _reporting(step, len(sizes))
    first = step(0)
    if len(sizes) == 1:
        return torch.cat(first, 2)  # what stock returns: a new tensor even for one chunk
    second = step(1)
    n0, n1 = sum(c.shape[2] for c in first), sum(c.shape[2] for c in second)
    per = n1 // sizes[1] if n1 % sizes[1] == 0 else 0
    total = n0 + per * sum(sizes[1:])
    ref = first[0]
    shape = ref.shape[:2] + (total,) + ref.shape[3:]
    taking = per > 0 and sink is not None and sink.begin(shape, ref.dtype, ref.device)
    out = None if taking else torch.empty(shape, dtype=ref.dtype, device=ref.device)
    pos, extra = 0, []
    for i in range(len(sizes)):
        chunks = first if i == 0 else second if i == 1 else step(i)
        if i == 0:
            first = None  # the output holds them now; drop the references before the next step
        elif i == 1:
            second = None
        for chunk in chunks:
            n = chunk.shape[2]
            fits = (not extra and pos + n <= total and chunk.dtype == ref.dtype
                    and chunk.device == ref.device and chunk.shape[:2] == shape[:2]
                    and chunk.shape[3:] == shape[3:])
            if taking and not fits:
                raise FramesLost(f"a chunk of {tuple(chunk.shape)} after {pos} frames does not "
                                 f"fit the planned output {tuple(shape)}")
            if taking:
                sink.take(chunk, pos)
            elif fits:
                out[:, :, pos:pos + n].copy_(chunk)
            else:
                extra.append(chunk)
                continue
            pos += n
        del chunks
    if taking:
        if pos != total:
            raise FramesLost(f"{pos} of {total} planned frames came")
        return sink.result()
    if extra or pos != total:
        return torch.cat([out[:, :, :pos]] + extra, 2)
    return out


def stock_loop_reason(model: torch.nn.Module) -> str | None:
    """None when ``model``'s stock decode loop is one this pack knows (ComfyUI's: ``wan_code``)."""
    stock = stock_class(model)
    name = stock_class_name(model)
    if name in (COMFY_WAN21, COMFY_WAN22):
        code = method_code(model, "decode")
        if isinstance(code, str):
            return code
        if code.loop not in ("per_frame", "chunked"):
            return f"no known decode loop for {name}"
        model.__dict__["_fvd_loop_code"] = code
        return None
    for (cls_name, method), accepted in KNOWN_LOOPS.items():
        if cls_name != name:
            continue
        code = getattr(getattr(stock, method, None), "__code__", None)
        if code is None or frozenset(code.co_names) not in accepted:
            return f"unrecognised {name}.{method} (a newer version?)"
        return None
    return f"no known decode loop for {name}"


def _stock_module(model) -> object:
    return sys.modules[stock_class(model).__module__]


# --- precision -----------------------------------------------------------------------------


def _cast(x, dtype):
    return x.to(dtype) if dtype is not None and isinstance(x, torch.Tensor) and x.dtype != dtype else x


def decoder_side(model) -> tuple[str, ...]:
    return ("decoder", "post_quant_conv") if DIFFUSERS_WAN in class_names(model) else ("decoder", "conv2")


def decoder_twin(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """A temporary model sharing ``model``'s encoder, with a ``dtype`` copy of its decoder side."""
    side = decoder_side(model)
    device = next(getattr(model, side[0]).parameters()).device
    twin = clone_module(model, tensor_copier(device, lambda path: dtype),
                        share=lambda path: "." not in path and path not in side)
    install_decode_loop(twin)
    twin.__dict__["_fvd_decoder_dtype"] = dtype
    return twin


def _images(out) -> torch.Tensor:
    """The image tensor of a decode result (a tensor, diffusers' tuple or ``DecoderOutput``)."""
    if isinstance(out, torch.Tensor):
        return out
    return out[0] if isinstance(out, tuple) else out.sample


def _finite_or_redecode(model, out, redecode: Callable[[torch.nn.Module], object]):
    """``out`` unless an fp16 decoder overflowed; then ``redecode`` on a bf16 twin of it."""
    if model.__dict__.get("_fvd_decoder_dtype") is not torch.float16:
        return out
    if bool(torch.isfinite(_images(out)).all()):
        return out
    log_once_for(model, "fp16-overflow", _NOT_FINITE_FP16, logging.WARNING)
    del out
    again = redecode(decoder_twin(model, torch.bfloat16))
    if not bool(torch.isfinite(_images(again)).all()):
        raise RuntimeError("Wan VAE decode gave non-finite values in fp16 and again in bf16: the "
                           "latent or the VAE weights are broken (try fp32 to check)")
    return again


# --- the mixins ------------------------------------------------------------------------------


class ComfyWanDecodeLoop:
    """ComfyUI ``WanVAE`` (Wan 2.1/Qwen-Image ``vae``, Wan 2.2 ``vae2_2``): decode + precision."""

    _fvd_loop: bool = False

    def decode(self, z, *args, **kwargs):
        z = _cast(z, self.__dict__.get("_fvd_decoder_dtype"))
        # 4-D latents (single images, newest trees) go to the stock code: no loop to save there
        # (Wan 2.1's calls ``self.decode`` again with the frame axis, which comes back here).
        if (args or kwargs or not self._fvd_loop or not isinstance(z, torch.Tensor) or z.dim() != 5
                or z.shape[2] < 1):
            out = super().decode(z, *args, **kwargs)
        else:
            out = _comfy_decode(self, z)
        return _finite_or_redecode(self, out, lambda twin: twin.decode(z.to(torch.bfloat16)))

    def encode(self, x, *args, **kwargs):
        return super().encode(_cast(x, self.__dict__.get("_fvd_encoder_dtype")), *args, **kwargs)


def _comfy_decode(model, z: torch.Tensor) -> torch.Tensor:
    module = _stock_module(model)
    code = model.__dict__["_fvd_loop_code"]
    if code.loop == "chunked":
        return _comfy_chunked_decode(model, module, code, z)
    wan22 = code.unpatchify is not None
    # 0.3.64's Wan 2.2 keeps its cache on the model (clear_cache); the others in locals. Both
    # start every decode from an empty cache, and so does this loop.
    if code.model_cache:
        model.clear_cache()
    feat_map = [None] * getattr(module, code.counter or "count_conv3d")(model.decoder)
    x = model.conv2(z)

    if not wan22:
        out = _per_frame_loop(model, x, feat_map, {}, _sink_for(model))
        settle_first_call(model, model.decoder)
        return out
    # Wan 2.2 rearranges its output afterwards (unpatchify), a rearrangement within each frame:
    # ComfyUI's own unpatchify of a chunk is those frames of the unpatchified whole, so the
    # chunks go to the sink unpatchified one by one and the whole output is never formed.
    patch = code.unpatchify if isinstance(code.unpatchify, int) else getattr(model, code.unpatchify)
    unpatched = _Unpatchified(_sink_for(model), lambda t: module.unpatchify(t, patch_size=patch))
    out = _per_frame_loop(model, x, feat_map, {"first_chunk": True},
                          unpatched if unpatched.sink is not None else None)
    settle_first_call(model, model.decoder)
    return out if unpatched.taking else module.unpatchify(out, patch_size=patch)


def _first_call(model, x: torch.Tensor, first: int, feat_map: list | None, kwargs: dict):
    """The loop's first decoder call over the latent frames ``[0, first)``: more than one
    only where ``join_first`` joined the first frame to the next chunk."""
    with joined() if first > 1 else contextlib.nullcontext():
        return first_decoder_call(model, model.decoder, x[:, :, :first], feat_map, **kwargs)


def _per_frame_loop(model, x: torch.Tensor, feat_map: list, kwargs: dict,
                    sink: FrameSink | None) -> torch.Tensor:
    """A per-frame loop (ComfyUI 0.8's Wan 2.1, every Wan 2.2, diffusers): one decoder call
    per latent frame, the first with ``kwargs``, or the first two frames in that call
    (``join_first``, with ``settings.join_per_frame``)."""
    frames = x.shape[2]
    first = 2 if frames > 1 and join_reason(model, model.decoder, False, x) is None else 1

    def step(i: int) -> list:
        if i == 0:
            return [_first_call(model, x, first, feat_map, kwargs)]
        return [model.decoder(x[:, :, first + i - 1:first + i], feat_cache=feat_map, feat_idx=[0])]

    if frames == 1:
        return _reporting(lambda i: step(i)[0], 1)(0)  # stock returns the decoder's output itself
    return assemble_chunk_lists(step, [first] + [1] * (frames - first), sink)


def _comfy_chunked_decode(model, module, code, z: torch.Tensor) -> torch.Tensor:
    """ComfyUI 0.33+'s Wan 2.1 loop: the first latent frame, then two at a time; the decoder
    returns each call's output as a list of chunks (its ``run_up``), stock concatenates them all
    at the end. Here they go into one output as they come (no second whole output at the end,
    and the frames stream out as they are final). A single latent frame runs without a cache,
    as stock does. ``join_first`` makes the first call the first three latent frames (the
    first one and the first pair)."""
    frames = z.shape[2]
    calls = 1 + frames // 2
    feat_map = [None] * getattr(module, code.counter)(model.decoder) if calls > 1 else None
    x = model.conv2(z)
    first = 1
    if calls > 1 and join_reason(model, model.decoder, True, x) is None:
        first, calls = min(3, frames), calls - 1
    sizes = [first] + [x[:, :, first + 2 * (i - 1):first + 2 * i].shape[2] for i in range(1, calls)]

    def step(i: int) -> list:
        if i == 0:
            return _first_call(model, x, first, feat_map, {})
        return model.decoder(x[:, :, first + 2 * (i - 1):first + 2 * i], feat_cache=feat_map,
                             feat_idx=[0])

    out = assemble_chunk_lists(step, sizes, _sink_for(model))
    settle_first_call(model, model.decoder)
    return out


class _Unpatchified:
    """A ``FrameSink`` in front of ``sink`` that hands it each chunk through ``unpatchify`` (a
    rearrangement within frames, so frame counts and positions stay)."""

    def __init__(self, sink: FrameSink | None, unpatchify: Callable[[torch.Tensor], torch.Tensor]):
        self.sink = sink
        self.unpatchify = unpatchify
        self.taking = False

    def begin(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> bool:
        out = self.unpatchify(torch.empty(shape, dtype=dtype, device="meta"))
        if out.shape[2] != shape[2]:
            return False
        self.taking = self.sink.begin(tuple(out.shape), dtype, device)
        return self.taking

    def take(self, chunk: torch.Tensor, start: int) -> None:
        self.sink.take(self.unpatchify(chunk), start)

    def result(self) -> torch.Tensor:
        return self.sink.result()


def _sink_for(model) -> FrameSink | None:
    """Where the loop may hand its frames: not for an fp16 decoder, whose whole output is
    checked for overflow afterwards (``_finite_or_redecode``)."""
    if model.__dict__.get("_fvd_decoder_dtype") is torch.float16:
        return None
    return frames_sink()


class DiffusersWanDecodeLoop:
    """diffusers ``AutoencoderKLWan``: ``_decode`` + precision (``_encode`` for the encoder)."""

    _fvd_loop: bool = False

    def _decode(self, z, return_dict: bool = True, *args, **kwargs):
        z = _cast(z, self.__dict__.get("_fvd_decoder_dtype"))
        if args or kwargs or not self._fvd_loop or self.use_tiling or z.shape[2] < 1:
            out = super()._decode(z, return_dict, *args, **kwargs)
        else:
            out = _diffusers_decode(self, z, return_dict)
        return _finite_or_redecode(self, out, lambda twin: twin._decode(z.to(torch.bfloat16), return_dict))

    def _encode(self, x, *args, **kwargs):
        return super()._encode(_cast(x, self.__dict__.get("_fvd_encoder_dtype")), *args, **kwargs)


def _diffusers_decode(model, z: torch.Tensor, return_dict: bool):
    module = _stock_module(model)
    model.clear_cache()
    x = model.post_quant_conv(z)
    out = _per_frame_loop(model, x, model._feat_map, {"first_chunk": True}, None)
    settle_first_call(model, model.decoder)
    if model.config.patch_size is not None:
        out = module.unpatchify(out, patch_size=model.config.patch_size)
    out = torch.clamp(out, min=-1.0, max=1.0)
    model.clear_cache()
    if not return_dict:
        return (out,)
    return module.DecoderOutput(sample=out)


def _mixin_for(model) -> type | None:
    names = class_names(model)
    if COMFY_WAN21 in names or COMFY_WAN22 in names:
        return ComfyWanDecodeLoop
    if DIFFUSERS_WAN in names:
        return DiffusersWanDecodeLoop
    return None


def install_decode_loop(model: torch.nn.Module) -> str | None:
    """Give ``model`` the top-level mixin; returns why the preallocated loop is off, if it is.

    The mixin goes in even when the loop is not recognised (``_fvd_loop`` stays False and the
    stock loop runs): the precision casts live in it too. Idempotent.
    """
    mixin = _mixin_for(model)
    if mixin is None:
        return f"not a Wan VAE ({type(model).__name__})"
    if not swap_in(model, mixin) and not isinstance(model, mixin):
        return f"{type(model).__name__} already has another fast-path class"
    reason = stock_loop_reason(model)
    model.__dict__["_fvd_loop"] = reason is None
    return reason
