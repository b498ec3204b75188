"""One latent decoded by a stock copy and by the installed VAE with its gate set (tier 2)."""
from __future__ import annotations

import torch

from fast_vae_decode.fastpath.gate import gates_opened


def stock_and_gated(decode, stock, vae, z, is_open: bool):
    """(stock's output, the installed VAE's output, the gate's stats) for ``decode(vae, z)``."""
    with torch.inference_mode():
        expected = decode(stock, z)
        with gates_opened(vae, is_open) as stats:
            got = decode(vae, z)
    return expected, got, stats[0]
