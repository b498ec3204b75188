"""The Wan video-VAE family wing (Wan 2.1, Qwen-Image, Wan 2.2): recognise and install
(``install``), the fused per-call pieces (``ops``, ``modules``), the exact lossless shortcuts
(``exact``), the decode loop (``decode``) and the decoder precision copy (``precision``).
Importing it registers the family."""
from __future__ import annotations

from . import install  # noqa: F401  (registers the family)
