"""Write a decoded image to disk: PNG through Pillow when it is installed, else binary PPM."""
from __future__ import annotations

import pathlib

import torch


def to_uint8_hwc(images: torch.Tensor, signed: bool) -> torch.Tensor:
    """The first image of a batch as H x W x 3 uint8 (CPU).

    Accepts NCHW / NCTHW model outputs (``signed``: values in [-1, 1]) and ComfyUI's NHWC
    IMAGE tensors in [0, 1]; a video contributes its first frame.
    """
    x = images.detach().float().cpu()
    if signed:
        x = (x + 1.0) / 2.0
        x = x[0]
        if x.ndim == 4:  # C, T, H, W
            x = x[:, 0]
        x = x.permute(1, 2, 0)
    else:
        while x.ndim > 3:
            x = x[0]
    return (x.clamp(0.0, 1.0) * 255.0).round().to(torch.uint8)


def save_image(images: torch.Tensor, path: str | pathlib.Path, signed: bool) -> pathlib.Path:
    """Save the first image; a ``.ppm`` path, or no Pillow, writes PPM (returns the real path)."""
    path = pathlib.Path(path)
    pixels = to_uint8_hwc(images, signed)
    if path.suffix.lower() != ".ppm":
        try:
            from PIL import Image
        except ImportError:
            path = path.with_suffix(".ppm")
        else:
            Image.fromarray(pixels.numpy()).save(path)
            return path
    height, width, _ = pixels.shape
    with open(path, "wb") as f:
        f.write(f"P6\n{width} {height}\n255\n".encode("ascii"))
        f.write(pixels.contiguous().numpy().tobytes())
    return path
