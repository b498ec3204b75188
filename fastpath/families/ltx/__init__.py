"""The LTX video-VAE family wing (ComfyUI's ``VideoVAE``: LTX-Video and LTX-2): recognise and
install (``install``), the fused per-call pieces (``ops``, ``modules``). ComfyUI's LTX 2.4/2.5
``CausalDiffusionVAE`` is recognised and left stock with its reason. Importing it registers
the family."""
from __future__ import annotations

from . import install  # noqa: F401  (registers the family)
