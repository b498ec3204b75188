"""``python -m fast_vae_decode demo``: the pack's main job on an embedded default.

A seeded random-weight SDXL-architecture VAE (diffusers; no ComfyUI, no downloads) decodes one
seeded latent at quality ``lossless`` and ``high``; the demo prints the time and the path each
took, the PSNR of high against lossless, what ``high`` did on this machine (the fast path, or
the stock path and why), and writes the high image (outside the source tree by default: the
system's temporary folder).
"""
from __future__ import annotations

import functools
import math
import pathlib
import statistics
import tempfile
from dataclasses import dataclass

import torch

from ..fastpath.quality import decode_at_quality
from . import models
from .image import save_image
from .timing import measure, psnr_db, to_unit_range

GPU_SIZE = 1024
CPU_SIZE = 256  # a full-width SDXL decoder at 256x256 takes seconds on two CPU cores
DEFAULT_OUT = str(pathlib.Path(tempfile.gettempdir()) / "fast_vae_decode_demo.png")
RANDOM_WEIGHTS_NOTE = ("The picture is a decode by random weights (no checkpoint is downloaded), "
                       "so it looks like coloured noise; it shows the decode ran, not what a "
                       "trained VAE draws.")


@dataclass
class DemoOptions:
    device: torch.device
    dtype: torch.dtype
    size: int | None = None  # output pixels per side; None: GPU_SIZE on CUDA, CPU_SIZE on CPU
    out: str = DEFAULT_OUT
    arch: str = "sdxl"
    seed: int = 0
    repeats: int | None = None  # None: 5 on CUDA, 1 on CPU


def say(message: str) -> None:
    print(message, flush=True)


def output_size(arch: str, size: int | None, device: torch.device) -> int:
    """The side in pixels the demo decodes to; ValueError naming what is expected."""
    factor = models.image_upscale(arch)
    if size is None:
        return GPU_SIZE if device.type == "cuda" else CPU_SIZE
    if size <= 0 or size % factor:
        raise ValueError(f"--size expects a positive multiple of {factor} for {arch} (its VAE "
                         f"upsamples {factor}x); got {size}")
    return size


def what_high_did(outcome, high_ms: float, lossless_ms: float, psnr: float) -> str:
    """One sentence: what quality ``high`` ran on this machine, from its ``DecodeOutcome``."""
    if outcome.path != "high":
        return (f"On this machine high fell back to the stock path, so it decoded exactly like "
                f"lossless; the reason the node gives: {outcome.reason}.")
    speed = f"{lossless_ms / high_ms:.2f}x" if high_ms > 0 else "?"
    return (f"On this machine high ran the fast path ({outcome.text()}) at {speed} the speed "
            "of lossless, " + ("identical to it." if psnr == math.inf
                               else f"{psnr:.1f} dB from it."))


def run_demo(options: DemoOptions) -> dict:
    cuda = options.device.type == "cuda"
    size = output_size(options.arch, options.size, options.device)
    factor = models.image_upscale(options.arch)
    repeats = options.repeats or (5 if cuda else 1)
    say(f"building a seeded random-weight {options.arch} VAE (diffusers) on {options.device}, "
        f"{str(options.dtype).replace('torch.', '')}")
    model = models.diffusers_vae(options.arch, seed=options.seed, dtype=options.dtype,
                                 device=options.device)
    latent = models.seeded_latent((1, model.config.latent_channels, size // factor, size // factor),
                                  options.seed + 1, options.device, options.dtype)

    def decode(quality: str):
        return decode_at_quality(model, quality, lambda: model.decode(latent).sample)

    summary: dict = {"size": size, "device": str(options.device)}
    outputs, outcomes = {}, {}
    with torch.inference_mode():
        for quality in ("lossless", "high"):
            # The first call installs and compiles; on CUDA it is timed apart from the others.
            timed = measure(functools.partial(decode, quality), options.device,
                            repeats + (1 if cuda else 0), warmup=0)
            first_ms = timed.times_ms[0]
            steady = statistics.median(timed.times_ms[1:] or timed.times_ms)
            images, outcome = timed.output
            outputs[quality], outcomes[quality] = images, outcome
            summary[quality] = {"ms": steady, "first_ms": first_ms, "path": outcome.text()}
            say(f"{quality:>8}: {steady:8.1f} ms (first call {first_ms:.1f} ms)  "
                f"[{outcome.text()}]")
    psnr = psnr_db(to_unit_range(outputs["high"], True), to_unit_range(outputs["lossless"], True))
    summary["psnr_db"] = psnr
    say("PSNR high vs lossless: " + ("identical" if psnr == math.inf else f"{psnr:.1f} dB"))
    written = save_image(outputs["high"], options.out, signed=True)
    summary["out"] = str(written)
    summary["high_did"] = what_high_did(outcomes["high"], summary["high"]["ms"],
                                        summary["lossless"]["ms"], psnr)
    say(summary["high_did"])
    say(f"wrote {written} ({size}x{size}, quality high)")
    say(RANDOM_WEIGHTS_NOTE)
    return summary
