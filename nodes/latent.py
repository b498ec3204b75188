"""Validation of the LATENT a user wires in: clear errors that name what was expected."""
from __future__ import annotations

import torch


def latent_samples(samples: object, vae: object) -> torch.Tensor:
    """The latent tensor of a LATENT dict, checked against the VAE; raises ValueError."""
    if not isinstance(samples, dict) or "samples" not in samples:
        got = sorted(samples) if isinstance(samples, dict) else type(samples).__name__
        raise ValueError(f"expected a LATENT dict with a 'samples' tensor; got {got}")
    latent = samples["samples"]
    if getattr(latent, "is_nested", False):
        # A nested latent carries several streams (e.g. video + audio); the VAE decodes the first.
        latent = latent.unbind()[0]
    if not isinstance(latent, torch.Tensor):
        raise ValueError(f"expected LATENT 'samples' to be a tensor; got {type(latent).__name__}")
    expected = getattr(vae, "latent_channels", None)
    if isinstance(expected, int) and latent.ndim >= 4 and latent.shape[1] != expected:
        raise ValueError(
            f"this VAE ({type(getattr(vae, 'first_stage_model', vae)).__name__}) expects latents "
            f"with {expected} channels; got {latent.shape[1]} (latent shape {tuple(latent.shape)}). "
            "Is the VAE the one that matches the model that made the latent?")
    return latent
