"""``python -m fast_vae_decode demo``: the pack's main job on an embedded default.

A seeded random-weight SDXL-architecture VAE (diffusers; no ComfyUI, no downloads) decodes one
seeded latent at quality ``lossless`` and ``high``; the demo prints the time and the path each
took, the PSNR of high against lossless, and writes the high image.
"""
from __future__ import annotations

import functools
import math
import statistics
from dataclasses import dataclass

import torch

from ..fastpath.quality import decode_at_quality
from . import models
from .image import save_image
from .timing import measure, psnr_db, to_unit_range

GPU_SIZE = 1024
CPU_SIZE = 256  # a full-width SDXL decoder at 256x256 takes seconds on two CPU cores


@dataclass
class DemoOptions:
    device: torch.device
    dtype: torch.dtype
    size: int | None = None  # output pixels per side; None: GPU_SIZE on CUDA, CPU_SIZE on CPU
    out: str = "fast_vae_decode_demo.png"
    arch: str = "sdxl"
    seed: int = 0
    repeats: int | None = None  # None: 5 on CUDA, 1 on CPU


def say(message: str) -> None:
    print(message, flush=True)


def _upscale(model: torch.nn.Module) -> int:
    return 2 ** (len(model.config.block_out_channels) - 1)


def run_demo(options: DemoOptions) -> dict:
    cuda = options.device.type == "cuda"
    size = options.size or (GPU_SIZE if cuda else CPU_SIZE)
    repeats = options.repeats or (5 if cuda else 1)
    say(f"building a seeded random-weight {options.arch} VAE (diffusers) on {options.device}, "
        f"{str(options.dtype).replace('torch.', '')}")
    model = models.diffusers_vae(options.arch, seed=options.seed, dtype=options.dtype,
                                 device=options.device)
    factor = _upscale(model)
    if size % factor:
        raise ValueError(f"--size must be a multiple of {factor} for {options.arch}; got {size}")
    latent = models.seeded_latent((1, model.config.latent_channels, size // factor, size // factor),
                                  options.seed + 1, options.device, options.dtype)

    def decode(quality: str):
        return decode_at_quality(model, quality, lambda: model.decode(latent).sample)

    summary: dict = {"size": size, "device": str(options.device)}
    outputs = {}
    with torch.inference_mode():
        for quality in ("lossless", "high"):
            # The first call installs and compiles; on CUDA it is timed apart from the others.
            timed = measure(functools.partial(decode, quality), options.device,
                            repeats + (1 if cuda else 0), warmup=0)
            first_ms = timed.times_ms[0]
            steady = statistics.median(timed.times_ms[1:] or timed.times_ms)
            images, outcome = timed.output
            outputs[quality] = images
            summary[quality] = {"ms": steady, "first_ms": first_ms, "path": outcome.text()}
            say(f"{quality:>8}: {steady:8.1f} ms (first call {first_ms:.1f} ms)  "
                f"[{outcome.text()}]")
    psnr = psnr_db(to_unit_range(outputs["high"], True), to_unit_range(outputs["lossless"], True))
    summary["psnr_db"] = psnr
    say("PSNR high vs lossless: " + ("identical" if psnr == math.inf else f"{psnr:.1f} dB"))
    written = save_image(outputs["high"], options.out, signed=True)
    summary["out"] = str(written)
    say(f"wrote {written} ({size}x{size}, quality high)")
    return summary
