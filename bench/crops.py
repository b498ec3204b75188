"""Center crops of the bench's lossless and high outputs, for looking at what high changes.

One crop per path per measured row, cut from the outputs the bench already holds (the middle
frame of a video), as 8-bit RGB. They go to PNG files in a folder (``.npy`` without Pillow)
and/or into one ``.npz`` (keys = the file names without extension), which a GPU run can bring
back as a single file; ``bench.report`` reads either.
"""
from __future__ import annotations

import pathlib

import numpy as np
import torch

DEFAULT_CROP_SIZE = 256
PATHS = ("lossless", "high")


def crop_stem(case: str, precision: str | None) -> str:
    return case if precision is None else f"{case}-{precision}"


def center_crop(images: torch.Tensor, *, signed: bool, video: bool,
                size: int = DEFAULT_CROP_SIZE) -> tuple[np.ndarray, dict]:
    """(H x W x 3 uint8 crop, where it was cut) of the first image / the middle video frame.

    ``signed``: a diffusers output (N C H W or N C T H W, values in [-1, 1]); otherwise a
    ComfyUI IMAGE (N H W C in [0, 1]; a video's frames are along N, batch 1 in the bench).
    Sliced before leaving the device, so only the crop is copied.
    """
    if signed:
        x = images[0]
        frames = x.shape[1] if x.ndim == 4 else None
        if frames is not None:  # C T H W
            x = x[:, frames // 2]
        x = x.permute(1, 2, 0)
    else:
        frames = images.shape[0] if video else None
        x = images[frames // 2] if frames is not None else images[0]
    height, width = x.shape[0], x.shape[1]
    h, w = min(size, height), min(size, width)
    top, left = (height - h) // 2, (width - w) // 2
    x = x[top:top + h, left:left + w].detach().float().cpu()
    if signed:
        x = (x + 1.0) / 2.0
    pixels = (x.clamp(0.0, 1.0) * 255.0).round().to(torch.uint8).numpy()
    where = {"frame": None if frames is None else frames // 2, "of_frames": frames,
             "box": [top, left, h, w], "image_size": [height, width]}
    return pixels, where


class CropStore:
    """Collects crops; writes each to ``folder`` at once and all of them to ``npz_path``."""

    def __init__(self, folder: str | None = None, npz_path: str | None = None,
                 size: int = DEFAULT_CROP_SIZE):
        self.folder = None if folder is None else pathlib.Path(folder)
        self.npz_path = npz_path
        self.size = size
        self.arrays: dict[str, np.ndarray] = {}
        if self.folder is not None:
            self.folder.mkdir(parents=True, exist_ok=True)

    def add(self, stem: str, outputs: dict[str, torch.Tensor], *, signed: bool,
            video: bool) -> dict:
        """Crop each path's output; returns the row's ``crops`` record (names, box, files)."""
        record: dict = {}
        for path, images in outputs.items():
            pixels, where = center_crop(images, signed=signed, video=video, size=self.size)
            key = f"{stem}-{path}"
            self.arrays[key] = pixels
            record[path] = key
            record.update(where)
            if self.folder is not None:
                record.setdefault("files", []).append(self._write(key, pixels))
        return record

    def _write(self, key: str, pixels: np.ndarray) -> str:
        try:
            from PIL import Image
        except ImportError:
            name = f"{key}.npy"
            np.save(self.folder / name, pixels)
        else:
            name = f"{key}.png"
            Image.fromarray(pixels).save(self.folder / name)
        return name

    def flush(self) -> None:
        """Rewrite the ``.npz`` with every crop so far (cheap: a few small arrays)."""
        if self.npz_path is not None and self.arrays:
            with open(self.npz_path, "wb") as f:  # a file object: np.savez adds no suffix
                np.savez_compressed(f, **self.arrays)


def load_crops(npz_path: str | None = None, folder: str | None = None) -> dict[str, np.ndarray]:
    """Crops by key from a ``.npz`` and/or a folder of ``<key>.png`` / ``<key>.npy`` files."""
    crops: dict[str, np.ndarray] = {}
    if folder is not None:
        for file in sorted(pathlib.Path(folder).iterdir()):
            if file.suffix == ".npy":
                crops[file.stem] = np.load(file)
            elif file.suffix == ".png":
                from PIL import Image

                with Image.open(file) as image:
                    crops[file.stem] = np.asarray(image.convert("RGB"))
    if npz_path is not None:
        with np.load(npz_path) as data:
            crops.update({key: data[key] for key in data.files})
    return crops
