"""Tile arguments for ``vae.decode_tiled``, derived from the tiled node's pixel/frame inputs the
way ComfyUI's "VAE Decode (Tiled)" derives them, so lossless output matches that node exactly."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TileArgs:
    tile_x: int
    tile_y: int
    overlap: int
    tile_t: int | None
    overlap_t: int | None

    def as_kwargs(self) -> dict:
        return {"tile_x": self.tile_x, "tile_y": self.tile_y, "overlap": self.overlap,
                "tile_t": self.tile_t, "overlap_t": self.overlap_t}


def tile_args(vae, tile_size: int, overlap: int, temporal_size: int, temporal_overlap: int) -> TileArgs:
    # The overlap may be at most a quarter of the tile (and the temporal overlap half the
    # temporal window); larger values are clamped rather than refused.
    if tile_size < 4 * overlap:
        overlap = tile_size // 4
    if temporal_size < 2 * temporal_overlap:
        temporal_overlap //= 2
    frames_per_latent = vae.temporal_compression_decode()
    if frames_per_latent is None:  # image VAE: no time axis
        tile_t = overlap_t = None
    else:
        tile_t = max(2, temporal_size // frames_per_latent)
        overlap_t = max(1, min(tile_t // 2, temporal_overlap // frames_per_latent))
    pixels_per_latent = vae.spacial_compression_decode()
    return TileArgs(tile_size // pixels_per_latent, tile_size // pixels_per_latent,
                    overlap // pixels_per_latent, tile_t, overlap_t)
