"""``VAE.decode`` for the families this pack knows, with the pixel finish done on the GPU.

The same steps as ComfyUI's non-tiled ``VAE.decode`` (model load with the same memory estimate,
skipped where ComfyUI's own state shows it would change nothing (``comfyui.loading``),
the same batch split (``comfyui.decode_batches``), the same ``first_stage_model.decode`` and
``process_output``), except that ``process_output`` runs on the VAE's device and the finished
pixels are copied to host memory once (``fastpath.pixel_finish``); a Wan or LTX decode streams
its frames there while it runs.
The result is ``torch.equal`` to ``vae.decode``'s, laid out as ``VAEDecode`` returns it.
Anything else, and any out-of-memory, goes to ``vae.decode`` itself, which keeps ComfyUI's own
tiled retry.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from ..comfyui.decode_batches import free_memory_for_batches, unknown_batch_split_reason
from ..comfyui.loading import load_for_decode
from ..gate import existing_gate
from ..install import find_family
from ..log import log_once
from ..progress import advance, nested
from .finish import FrameStream, finish_pixels
from .frames import FramesLost, frames_to

# Progress units per batch slice: a video decoder's own chunks subdivide its slice.
SLICE_UNITS = 100


@dataclass
class PixelSettings:
    """How decoded pixels reach host memory; flipped by the benchmark to measure the choice."""

    # The pack finishes pixels on the GPU and copies them once (video frames stream while the
    # decoder runs); False leaves the output handling to ComfyUI's own ``VAE.decode``.
    device_finish: bool = True
    # True: the latent goes to the VAE's device in its own dtype and is cast there, not on the
    # host as ComfyUI's decode does: a host cast of a large latent runs on torch's OpenMP pool,
    # whose threads then spin (``finish``'s note). The same values (IEEE round-to-nearest-even
    # on either device); measured together with ``finish.host_copy``'s memmove.
    cast_latent_on_device: bool = True


pixel_settings = PixelSettings()

_VAE_ATTRS = ("first_stage_model", "patcher", "device", "output_device", "vae_dtype",
              "process_output", "memory_used_decode")


def device_finish_reason(vae: object, latent: torch.Tensor) -> str | None:
    """Why ``decode_pixels`` hands ``latent`` to ``vae.decode`` unchanged (None: it does not)."""
    if not pixel_settings.device_finish:
        return "the pack's pixel finish is turned off (pixel_settings.device_finish)"
    missing = [a for a in _VAE_ATTRS if not hasattr(vae, a)]
    if missing:
        return f"not a comfy.sd.VAE (no {', '.join(missing)})"
    patched = _patched_decode(vae)
    if patched is not None:
        return f"VAE.decode is replaced ({patched}); it runs as given"
    if find_family(vae.first_stage_model) is None:
        return f"unsupported VAE ({type(vae.first_stage_model).__name__})"
    batches = unknown_batch_split_reason(vae)
    if batches is not None:
        return batches
    if getattr(vae.first_stage_model, "comfy_decode_estimate_is_reliable", False):
        # Newer trees then tile without an untiled attempt when the estimate exceeds free memory.
        return "the model's decode estimate decides tiling (ComfyUI's VAE.decode does that)"
    if torch.device(vae.device).type != "cuda" or torch.device(vae.output_device).type != "cpu":
        return "the VAE's outputs stay on its device (nothing to copy)"
    if getattr(vae, "latent_dim", latent.ndim - 2) != latent.ndim - 2:
        return f"a {latent.ndim}-D latent for a {vae.latent_dim}-D VAE (ComfyUI adapts it)"
    if getattr(vae, "extra_1d_channel", None) is not None:
        return "a VAE with an extra 1-D channel"
    return None


def _patched_decode(vae: object) -> str | None:
    """Where ``vae.decode`` comes from, if not ComfyUI's own ``comfy.sd.VAE.decode``.

    Another extension may wrap or replace it (on the class or the object) to change what a
    decode does; this loop would silently skip that, so such a VAE keeps its own decode.
    """
    if "decode" in vars(vae):
        return "on the object"
    method = getattr(type(vae), "decode", None)
    module = getattr(method, "__module__", None)
    if module != "comfy.sd" or getattr(method, "__qualname__", None) != "VAE.decode":
        return f"by {module or type(method).__name__}"
    return None


def decode_pixels(vae, latent: torch.Tensor) -> torch.Tensor:
    """``vae.decode(latent)``'s values: (B, *spatial, C) fp32 pixels in host memory."""
    reason = device_finish_reason(vae, latent)
    if reason is not None:
        log_once(f"pixel_decode:{reason}", f"pixels finished by ComfyUI's VAE.decode: {reason}",
                 logging.DEBUG)
        return vae.decode(latent)
    if (getattr(vae.first_stage_model, "comfy_has_chunked_io", False)
            and _device_output_shape(vae, latent.shape, vae.vae_dtype) is None):
        # The decoder writes its frames to host memory itself; the pack would add nothing.
        log_once("pixel_decode:own_output", "pixels written to host memory by the decoder "
                 "itself (no GPU output buffer for this decode): ComfyUI's VAE.decode", logging.DEBUG)
        return vae.decode(latent)
    try:
        pixels = _decode_with_device_finish(vae, latent)
    except FramesLost as lost:
        # The frames already handed over are not in the decode any more; ComfyUI's own decode
        # runs it again (the decoder is deterministic: same values).
        log_once("pixel_decode:lost", f"frame streaming broke off ({lost}); decoding again "
                 "with ComfyUI's VAE.decode")
        return vae.decode(latent)
    if pixels is None:
        # Out of memory: ComfyUI's own decode retries with its tiled decoder. Outside the except
        # block, so the failed attempt's tensors are already freed.
        log_once("pixel_decode:oom", "out of GPU memory; decoding with ComfyUI's VAE.decode "
                 "(it retries tiled)")
        return vae.decode(latent)
    log_once("pixel_decode:device", "decoded pixels are finished on the GPU and copied to host "
             "memory once")
    return pixels


def _decode_with_device_finish(vae, latent: torch.Tensor) -> torch.Tensor | None:
    import comfy.model_management as mm

    check = getattr(vae, "throw_exception_if_invalid", None)
    if check is not None:
        check()
    memory_used = vae.memory_used_decode(latent.shape, vae.vae_dtype)
    skipped = load_for_decode(vae, memory_used, getattr(vae, "disable_offload", False))
    if skipped is not None:
        log_once("pixel_decode:resident", f"model load skipped: {skipped} (ComfyUI's "
                 "load_models_gpu would re-prepare every module)", logging.DEBUG)
    per_pass = max(1, int(free_memory_for_batches(vae) / memory_used))
    count = latent.shape[0]
    passes = -(-count // per_pass)
    pixels = None
    try:
        for start in range(0, count, per_pass):
            z = latent[start:start + per_pass]
            z = (z.to(vae.device).to(vae.vae_dtype) if pixel_settings.cast_latent_on_device
                 else z.to(vae.vae_dtype).to(vae.device))

            def dest_for(out: torch.Tensor, start=start, items=z.shape[0]) -> torch.Tensor:
                nonlocal pixels
                shape = (count,) + tuple(out.shape[2:]) + (out.shape[1],)
                if pixels is None or start == 0 and tuple(pixels.shape) != shape:
                    pixels = torch.empty(shape, dtype=torch.float32, device=vae.output_device)
                return pixels[start:start + items]

            # A Wan decode hands over each chunk of frames as it is done, an LTX decode says
            # when it has written them to its output buffer; anything else is finished from
            # the returned output.
            stream = FrameStream(vae.process_output, dest_for)
            try:
                output = _device_output(vae, z)
                if output:
                    stream.watch(output["output_buffer"])
                with frames_to(stream), nested(start // per_pass, SLICE_UNITS, passes):
                    out = vae.first_stage_model.decode(z, **output)
                del output
                streamed = stream.complete(out)
            finally:
                stream.close()
            if not streamed:
                if out.is_meta:
                    raise FramesLost("the decode returned its frames' stand-in, not all of them")
                finish_pixels(out, vae.process_output, dest_for(out))
            del out, z
            advance((start // per_pass + 1) * SLICE_UNITS, passes * SLICE_UNITS)
    except mm.OOM_EXCEPTION:
        return None
    return pixels


# The most GPU memory a decode's own output buffer may take (see ``_device_output``): the
# model's chunked decode keeps its activations bounded, and a long video's output must not
# make the peak grow with its frames; beyond this the model writes to host memory itself.
DEVICE_OUTPUT_MAX_BYTES = 1 << 30


def _device_output(vae, z: torch.Tensor) -> dict:
    """The decode's own output buffer, on the VAE's device, for a model that writes its frames
    into one (``comfy_has_chunked_io``: ComfyUI's LTX ``VideoVAE``); without it such a model
    copies every chunk to ComfyUI's intermediate device (the CPU) itself. In the decoder's dtype,
    which the pixel finish turns to fp32 exactly as ComfyUI's own fp32 buffer would hold it;
    under another output dtype (fp16 intermediates, which rounds) or beyond
    ``DEVICE_OUTPUT_MAX_BYTES`` the model keeps its own.

    Only for a fused decode (an open gate): its activations leave room for the buffer under
    stock's peak; a stock-module decode (lossless) has no such room, so it keeps ComfyUI's."""
    shape = _device_output_shape(vae, z.shape, z.dtype)
    if shape is None:
        return {}
    return {"output_buffer": torch.empty(shape, dtype=z.dtype, device=z.device)}


def _device_output_shape(vae, latent_shape, dtype: torch.dtype) -> tuple[int, ...] | None:
    """The shape of ``_device_output``'s buffer for a latent of ``latent_shape`` decoded in
    ``dtype``; None where the model keeps its own output."""
    model = vae.first_stage_model
    gate = existing_gate(model)
    output_dtype = getattr(vae, "vae_output_dtype", None)
    if (gate is None or not gate.is_open
            or not getattr(model, "comfy_has_chunked_io", False) or not callable(output_dtype)
            or output_dtype() != torch.float32 or not hasattr(model, "decode_output_shape")):
        return None
    shape = tuple(model.decode_output_shape(tuple(latent_shape)))
    if math.prod(shape) * dtype.itemsize > DEVICE_OUTPUT_MAX_BYTES:
        return None
    return shape
