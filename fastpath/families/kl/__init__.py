"""The KL image-VAE family wing (SD1.x, SDXL, SD3, Flux, Flux 2): recognise and install
(``install``), the fused norm (``ops``), blocks (``modules``) and decoder (``decoder``), and the
fast-path settings the benchmark compares (``settings``). Importing it registers the family."""
from __future__ import annotations

from . import install  # noqa: F401  (registers the family)
