"""The benchmark cases: a VAE architecture and the latent it decodes.

Full-size cases are the ones TARGETS.md measures; ``tiny-*`` cases are the same structures at
small widths and sizes, for CPU tests of the command line (never in the default selection).
"""
from __future__ import annotations

from dataclasses import dataclass

from .models import split_arch


@dataclass(frozen=True)
class Case:
    name: str
    arch: str  # bench.models architecture, "tiny_" prefixed for the small variants
    latent_shape: tuple[int, ...]
    note: str = ""
    default: bool = True  # in the default selection (full-size cases only)

    @property
    def video(self) -> bool:
        return len(self.latent_shape) == 5

    @property
    def tiny(self) -> bool:
        return split_arch(self.arch)[1]


CASES: dict[str, Case] = {c.name: c for c in (
    Case("sdxl-1024", "sdxl", (1, 4, 128, 128), "SDXL VAE, 1024x1024"),
    Case("flux-1024", "flux", (1, 16, 128, 128), "Flux VAE, 1024x1024"),
    Case("sdxl-2048", "sdxl", (1, 4, 256, 256), "SDXL VAE, 2048x2048"),
    Case("sd15-512", "sd15", (1, 4, 64, 64), "SD1.5 VAE, 512x512"),
    Case("sd15-768x512-b4", "sd15", (4, 4, 96, 64), "SD1.5 VAE, 768x512, batch 4"),
    Case("wan21-480p-33", "wan21", (1, 16, 9, 60, 104), "Wan 2.1 VAE, 480x832, 33 frames"),
    Case("wan21-480p-81", "wan21", (1, 16, 21, 60, 104), "Wan 2.1 VAE, 480x832, 81 frames"),
    Case("wan22-704p-33", "wan22", (1, 48, 9, 44, 80), "Wan 2.2 VAE, 704x1280, 33 frames"),
    # Qwen-Image decodes its images with the Wan 2.1 VAE, one latent frame each.
    Case("qwen-1024", "wan21", (1, 16, 1, 128, 128), "Qwen-Image (Wan 2.1 VAE), 1024x1024, one frame"),
    # The Wan 2.1 x33 decode's structure (chunks, pieces, routes: none depends on H x W) at
    # 64x112, where each kernel runs for microseconds: its wall time is the host's launch cost.
    Case("wan21-host-33", "wan21", (1, 16, 9, 8, 14),
         "Wan 2.1 VAE, 64x112, 33 frames: host-bound (wall time = host time)", default=False),
    # LTX-2: 32x spatial, 8x temporal (121 frames = 1 + 8 * 15).
    Case("ltx2-768x512-121", "ltx2", (1, 128, 16, 16, 24), "LTX-2 VAE, 768x512, 121 frames"),
    Case("ltx2-1280x704-121", "ltx2", (1, 128, 16, 22, 40), "LTX-2 VAE, 1280x704, 121 frames"),
    # Small structures for CPU tests: two latent frames exercise the Wan feature cache.
    Case("tiny-sdxl", "tiny_sdxl", (1, 4, 8, 8)),
    Case("tiny-flux", "tiny_flux", (1, 16, 8, 8)),
    Case("tiny-wan21", "tiny_wan21", (1, 16, 2, 4, 4)),
    Case("tiny-wan22", "tiny_wan22", (1, 48, 2, 4, 4)),
    Case("tiny-ltx2", "tiny_ltx2", (1, 128, 2, 2, 3)),
)}

DEFAULT_CASES = tuple(name for name, case in CASES.items() if case.default and not case.tiny)
TINY_CASES = tuple(name for name, case in CASES.items() if case.tiny)  # the CPU default


def select_cases(spec: str | None) -> list[Case]:
    """Cases named in a comma-separated ``spec``; ``None``/"all" = every full-size case."""
    if not spec or spec == "all":
        return [CASES[name] for name in DEFAULT_CASES]
    names = [n.strip() for n in spec.split(",") if n.strip()]
    unknown = [n for n in names if n not in CASES]
    if unknown:
        raise ValueError(f"unknown case(s) {', '.join(unknown)}; known: {', '.join(CASES)}")
    return [CASES[n] for n in names]
