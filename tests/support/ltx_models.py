"""Tiny LTX VAEs of other configurations than the bench's, for the tier-2 tests: ComfyUI's own
``VideoVAE`` built by ``comfy.sd.VAE`` from a seeded state dict and the config as checkpoint
metadata (``bench.models.ltx_state_dict``)."""
from __future__ import annotations

# LTX-Video 0.9.1 / 0.9 pieces: blocks that inject spatial noise (timestep-conditioned), a
# channel-changing block (``res_x_y``: layer norm + 1x1x1 conv shortcut), plain upsamplers.
# Listed in encoder order (the decoder runs them reversed); the 32x / 8x ratios are kept.
NOISE_AND_SHORTCUT = {
    "dims": 3, "in_channels": 3, "out_channels": 3, "latent_channels": 128,
    "decoder_blocks": [["res_x", {"num_layers": 1}],
                       ["res_x_y", {"multiplier": 2}],
                       ["compress_all", {"residual": True, "multiplier": 1}],
                       ["compress_all", {"multiplier": 1}],
                       ["compress_all", {"multiplier": 1}],
                       ["res_x", {"num_layers": 1, "inject_noise": True}]],
    "encoder_blocks": [["res_x", {"num_layers": 1}]],
    "norm_layer": "pixel_norm", "patch_size": 4, "latent_log_var": "uniform",
    "causal_decoder": False, "timestep_conditioning": True,
}

# The other branches of the config keys: no timestep conditioning (no noise drawn per decode),
# a causal decoder (time padding in front only) and zero spatial padding (the conv's own).
UNCONDITIONED_CAUSAL_ZEROS = {
    "dims": 3, "in_channels": 3, "out_channels": 3, "latent_channels": 128,
    "decoder_blocks": [["res_x", {"num_layers": 1}],
                       ["compress_all", {"residual": True, "multiplier": 2}],
                       ["compress_all", {"residual": True, "multiplier": 1}],
                       ["compress_all", {"multiplier": 1}],
                       ["res_x", {"num_layers": 1}]],
    "encoder_blocks": [["res_x", {"num_layers": 1}]],
    "norm_layer": "pixel_norm", "patch_size": 4, "latent_log_var": "uniform",
    "causal_decoder": True, "timestep_conditioning": False, "spatial_padding_mode": "zeros",
}


def ltx_vae(config: dict, seed: int = 0):
    import comfy.sd

    from fast_vae_decode.bench.models import ltx_metadata, ltx_state_dict

    return comfy.sd.VAE(sd=ltx_state_dict(config, seed), metadata=ltx_metadata(config))
