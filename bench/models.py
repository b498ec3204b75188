"""Seeded random-weight VAEs with the real architectures, for the demo, the bench and tests.

No checkpoint is downloaded: every weight comes from a seeded ``torch.Generator``. Convs and
linears get a fan-in scaled normal (std = 1/sqrt(fan_in)) so activations keep a sane scale
through the decoder, biases a small normal (0.01) so bias handling is exercised, norms 1 / 0.

Two back ends, one architecture list (``ARCHS``):
- ``diffusers_vae(arch)``: a diffusers ``AutoencoderKL`` / ``AutoencoderKLWan``; no ComfyUI.
- ``comfy_vae(arch)``: a ``comfy.sd.VAE`` built from a state dict that ComfyUI's own classes
  produced, so ComfyUI detects the architecture from the keys as it does for a checkpoint.
  Needs ComfyUI imported first (``bench.comfyui.setup_comfyui``).

``tiny=True`` (or an arch spelled ``tiny_<arch>``) gives the same structure at small widths for
CPU tests.
"""
from __future__ import annotations

import contextlib
import functools
import math
from typing import Iterator

import torch

ARCHS = ("sdxl", "sd15", "flux", "wan21", "wan22", "ltx2")
VIDEO_ARCHS = ("wan21", "wan22", "ltx2")
COMFY_ONLY_ARCHS = ("ltx2",)  # no diffusers builder: ComfyUI's classes are what users run
BIAS_STD = 0.01


def split_arch(arch: str, tiny: bool = False) -> tuple[str, bool]:
    """("sdxl", True) for "tiny_sdxl"; validates the name."""
    if arch.startswith("tiny_"):
        arch, tiny = arch[len("tiny_"):], True
    if arch not in ARCHS:
        raise ValueError(f"unknown VAE architecture {arch!r}; known: {', '.join(ARCHS)} "
                         "(prefix tiny_ for the small test variants)")
    return arch, tiny


def latent_channels(arch: str) -> int:
    arch, _ = split_arch(arch)
    return {"sdxl": 4, "sd15": 4, "flux": 16, "wan21": 16, "wan22": 48, "ltx2": 128}[arch]


# ---------------------------------------------------------------------------------------------
# Weights


def _is_norm(module: torch.nn.Module) -> bool:
    # GroupNorm, LayerNorm, BatchNorm, ComfyUI's RMS_norm, diffusers' WanRMS_norm: scale 1, shift 0.
    return "norm" in type(module).__name__.lower()


def _fan_in(module: torch.nn.Module, weight: torch.Tensor) -> int:
    if isinstance(module, torch.nn.modules.conv._ConvTransposeNd):
        # Transposed-conv weights are [Cin, Cout/groups, *k]: each output sums over dim 0.
        return weight.shape[0] * math.prod(weight.shape[2:])
    return max(1, weight.numel() // weight.shape[0])


@torch.no_grad()
def init_weights_(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Overwrite every parameter of ``model`` in place from a generator seeded with ``seed``.

    Drawn on the CPU in ``named_modules`` order, so a given architecture and seed give the same
    weights on every machine, whatever device the model is on.
    """
    gen = torch.Generator().manual_seed(seed)
    for module in model.modules():
        norm = _is_norm(module)
        for name, param in module.named_parameters(recurse=False):
            if norm:
                value = torch.zeros(param.shape) if name == "bias" else torch.ones(param.shape)
            elif name == "bias" or param.ndim < 2:
                value = torch.randn(param.shape, generator=gen) * BIAS_STD
            else:
                std = 1.0 / math.sqrt(_fan_in(module, param))
                value = torch.randn(param.shape, generator=gen) * std
            param.copy_(value.to(param.dtype))
    return model


def seeded_latent(shape: tuple[int, ...], seed: int = 0, device: str | torch.device = "cpu",
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A standard-normal latent drawn on the CPU (the same on every machine), then moved."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen).to(device=device, dtype=dtype)


# ---------------------------------------------------------------------------------------------
# diffusers


def _diffusers_config(arch: str, tiny: bool) -> tuple[str, dict]:
    if arch in COMFY_ONLY_ARCHS:
        raise ValueError(f"{arch} is built from ComfyUI's classes only (run the bench with --comfyui)")
    if arch in ("sdxl", "sd15", "flux"):
        blocks = (32, 64) if tiny else (128, 256, 512, 512)
        config = dict(
            in_channels=3, out_channels=3,
            down_block_types=("DownEncoderBlock2D",) * len(blocks),
            up_block_types=("UpDecoderBlock2D",) * len(blocks),
            block_out_channels=blocks,
            layers_per_block=1 if tiny else 2,
            latent_channels=latent_channels(arch),
            # 8 groups at tiny widths keeps several channels per group, as at full size.
            norm_num_groups=8 if tiny else 32,
        )
        if arch == "flux":
            config.update(use_quant_conv=False, use_post_quant_conv=False)
        return "AutoencoderKL", config
    if arch == "wan21":
        return "AutoencoderKLWan", dict(base_dim=16 if tiny else 96, z_dim=16)
    # Wan 2.2: residual up/down blocks, 2x2 patchified pixels (12 channels), wider decoder.
    return "AutoencoderKLWan", dict(
        base_dim=16 if tiny else 160, decoder_base_dim=32 if tiny else 256, z_dim=48,
        is_residual=True, in_channels=12, out_channels=12, patch_size=2,
        scale_factor_temporal=4, scale_factor_spatial=16,
        latents_mean=[0.0] * 48, latents_std=[1.0] * 48)


def image_upscale(arch: str, tiny: bool = False) -> int:
    """Output pixels per latent pixel, per side, of the image VAE ``arch`` (8; 2 for tiny)."""
    arch, tiny = split_arch(arch, tiny)
    if arch in VIDEO_ARCHS:
        raise ValueError(f"{arch} is a video VAE; expected one of the image VAEs")
    _, config = _diffusers_config(arch, tiny)
    return 2 ** (len(config["block_out_channels"]) - 1)


def diffusers_vae(arch: str, seed: int = 0, tiny: bool = False, dtype: torch.dtype | None = None,
                  device: str | torch.device | None = None) -> torch.nn.Module:
    """A diffusers VAE of ``arch`` (see ``ARCHS``) with seeded random weights, in eval mode."""
    import diffusers

    arch, tiny = split_arch(arch, tiny)
    class_name, config = _diffusers_config(arch, tiny)
    model = getattr(diffusers, class_name)(**config)
    init_weights_(model, seed)
    if device is not None or dtype is not None:
        model = model.to(**{k: v for k, v in (("device", device), ("dtype", dtype)) if v is not None})
    return model.eval().requires_grad_(False)


# ---------------------------------------------------------------------------------------------
# ComfyUI


def _kl_ddconfig(arch: str, tiny: bool) -> dict:
    # The configuration comfy.sd.VAE uses for SD1.x/SDXL/Flux KL VAEs; ComfyUI's GroupNorm has
    # 32 groups fixed, so the tiny width is the smallest with a whole channel per group.
    return {"double_z": True, "z_channels": latent_channels(arch), "resolution": 256,
            "in_channels": 3, "out_ch": 3, "ch": 32 if tiny else 128, "ch_mult": [1, 2, 4, 4],
            "num_res_blocks": 1 if tiny else 2, "attn_resolutions": [], "dropout": 0.0}


_TINY_WAN = {"wan21": {"dim": 16}, "wan22": {"dim": 16, "dec_dim": 32}}


def _wan_config(arch: str, tiny: bool) -> dict:
    config = {"z_dim": latent_channels(arch), "dim_mult": [1, 2, 4, 4], "num_res_blocks": 2,
              "attn_scales": [], "temperal_downsample": [False, True, True], "dropout": 0.0}
    config.update({"dim": 96} if arch == "wan21" else {"dim": 160, "dec_dim": 256})
    if tiny:
        config.update(_TINY_WAN[arch])
    return config


# LTX: ComfyUI builds ``VideoVAE`` from the checkpoint's metadata config when it has one (LTX-2
# checkpoints do), else from its default for the version it reads off the keys; the full-size
# case is that default (version 2: 1024 -> 128 channels over three residual depth-to-space
# stages, timestep-conditioned, reflect padding). The tiny one keeps its 32x spatial and 8x
# temporal ratios (ComfyUI's tiling assumes them), narrow (0.8 fixes the decoder's base width
# at 128, so the narrowing is in the stages: 256, then 128), with one block per stage and one
# plain (non-residual) upsampler; given as metadata, the way a checkpoint gives its config.
LTX_VERSION = 2
TINY_LTX_CONFIG = {
    "dims": 3, "in_channels": 3, "out_channels": 3, "latent_channels": 128,
    "decoder_blocks": [["res_x", {"num_layers": 1}],
                       ["compress_all", {"residual": True, "multiplier": 2}],
                       ["res_x", {"num_layers": 1}],
                       ["compress_all", {"residual": True, "multiplier": 1}],
                       ["compress_all", {"multiplier": 1}],
                       ["res_x", {"num_layers": 1}]],
    "encoder_blocks": [["res_x", {"num_layers": 1}]],
    "norm_layer": "pixel_norm", "patch_size": 4, "latent_log_var": "uniform",
    "causal_decoder": False, "timestep_conditioning": True,
}


def _ltx_model(config: dict | None) -> torch.nn.Module:
    from comfy.ldm.lightricks.vae.causal_video_autoencoder import VideoVAE

    with _eager_comfy_ops():
        return VideoVAE(version=LTX_VERSION) if config is None else VideoVAE(config=dict(config))


@contextlib.contextmanager
def _eager_comfy_ops() -> Iterator[None]:
    """ComfyUI's ops create a ``Linear``'s weights only when a state dict is loaded while its
    dynamic VRAM (comfy-aimdo) is on; a model made to produce a state dict needs them created."""
    import sys

    memory = sys.modules.get("comfy.memory_management")
    if not getattr(memory, "aimdo_enabled", False):
        yield
        return
    memory.aimdo_enabled = False
    try:
        yield
    finally:
        memory.aimdo_enabled = True


@torch.no_grad()
def _ltx_constants_(model: torch.nn.Module) -> None:
    """What ``init_weights_`` must not randomise in an LTX VAE: the latent statistics (buffers
    left uninitialised by the constructor) become the identity, and the decoder's timestep
    multiplier keeps the value it is constructed with."""
    for name, buf in model.per_channel_statistics.named_buffers():
        buf.copy_(torch.ones_like(buf) if "std" in name else torch.zeros_like(buf))
    multiplier = getattr(model.decoder, "timestep_scale_multiplier", None)
    if multiplier is not None:
        multiplier.fill_(1000.0)


def ltx_state_dict(config: dict | None = None, seed: int = 0) -> dict[str, torch.Tensor]:
    """A seeded state dict of ComfyUI's ``VideoVAE`` built from ``config`` (None: its default
    for ``LTX_VERSION``, what a checkpoint without metadata gets), fresh tensors each call."""
    if config is None or config is TINY_LTX_CONFIG:
        return {k: v.clone() for k, v in _ltx_state_dict(seed, config is not None).items()}
    return _seeded_ltx(config, seed)


@functools.lru_cache(maxsize=1)
def _ltx_state_dict(seed: int, tiny: bool) -> dict[str, torch.Tensor]:
    """The bench's LTX VAEs, kept for the next case of the same VAE."""
    return _seeded_ltx(TINY_LTX_CONFIG if tiny else None, seed)


def _seeded_ltx(config: dict | None, seed: int) -> dict[str, torch.Tensor]:
    """Seeded decoder weights; the encoder (694M parameters at full size, never used by a
    decode) is zeros, which keeps building it cheap."""
    model = _ltx_model(config)
    with torch.no_grad():
        for p in model.encoder.parameters():
            p.zero_()
    init_weights_(model.decoder, seed)
    _ltx_constants_(model)
    return dict(model.state_dict())


def comfy_metadata(arch: str, tiny: bool = False) -> dict | None:
    """The checkpoint metadata ``comfy.sd.VAE`` gets for ``arch`` (an LTX config, tiny only)."""
    arch, tiny = split_arch(arch, tiny)
    return ltx_metadata(TINY_LTX_CONFIG) if arch == "ltx2" and tiny else None


def ltx_metadata(config: dict) -> dict:
    """Checkpoint metadata carrying an LTX VAE config, as LTX-2 checkpoints do."""
    import json

    return {"config": json.dumps({"vae": config})}


def comfy_state_dict(arch: str, seed: int = 0, tiny: bool = False) -> dict[str, torch.Tensor]:
    """A seeded state dict for ``arch`` made by ComfyUI's own classes (fp32, CPU)."""
    arch, tiny = split_arch(arch, tiny)
    if arch == "ltx2":
        # Copies (ltx_state_dict): under dynamic VRAM ComfyUI loads a state dict by assignment,
        # adopting the tensors.
        return ltx_state_dict(TINY_LTX_CONFIG if tiny else None, seed)
    if arch in ("sdxl", "sd15"):
        from comfy.ldm.models.autoencoder import AutoencoderKL

        model = AutoencoderKL(ddconfig=_kl_ddconfig(arch, tiny), embed_dim=latent_channels(arch))
    elif arch == "flux":
        # Flux's VAE has no quant convs; with no ``post_quant_conv.weight`` key comfy.sd builds an
        # AutoencodingEngine around the same Encoder/Decoder classes.
        from comfy.ldm.modules.diffusionmodules.model import Decoder, Encoder

        model = torch.nn.Module()
        model.encoder = Encoder(**_kl_ddconfig(arch, tiny))
        model.decoder = Decoder(**_kl_ddconfig(arch, tiny))
    elif arch == "wan21":
        import comfy.ldm.wan.vae

        model = comfy.ldm.wan.vae.WanVAE(**_wan_config(arch, tiny))
    else:
        import comfy.ldm.wan.vae2_2

        model = comfy.ldm.wan.vae2_2.WanVAE(**_wan_config(arch, tiny))
    init_weights_(model, seed)
    return dict(model.state_dict())


@contextlib.contextmanager
def _tiny_constructors(arch: str) -> Iterator[None]:
    """While comfy.sd.VAE runs, let the class it picked from the keys take tiny widths.

    comfy.sd.VAE detects the architecture from key names but hard-codes full widths (the KL
    ``ch`` is 128, Wan 2.2's ``dim`` 160, and 0.3.64 also fixes Wan 2.1's ``dim`` at 96). The
    constructor it calls is wrapped for the duration so the detection branch, the class and the
    VAE's other attributes stay ComfyUI's own; only the width follows the tiny state dict.
    """
    import comfy.ldm.wan.vae
    import comfy.ldm.wan.vae2_2
    import comfy.sd

    if arch in ("sdxl", "sd15"):
        owner, name = comfy.sd, "AutoencoderKL"
        stock = getattr(owner, name)

        def build(*args, ddconfig, **kwargs):
            # Newer trees pass the decoder its own config (widths read off its keys) too.
            if kwargs.get("decoder_ddconfig") is not None:
                kwargs["decoder_ddconfig"] = {**kwargs["decoder_ddconfig"], **_tiny_kl(arch)}
            return stock(*args, ddconfig={**ddconfig, **_tiny_kl(arch)}, **kwargs)
    elif arch == "flux":
        owner, name = comfy.sd, "AutoencodingEngine"
        stock = getattr(owner, name)

        def build(*args, encoder_config, decoder_config, **kwargs):
            return stock(*args, encoder_config=_with_params(encoder_config, _tiny_kl(arch)),
                         decoder_config=_with_params(decoder_config, _tiny_kl(arch)), **kwargs)
    else:
        owner = comfy.ldm.wan.vae if arch == "wan21" else comfy.ldm.wan.vae2_2
        name = "WanVAE"
        stock = getattr(owner, name)

        def build(*args, **kwargs):
            return stock(*args, **{**kwargs, **_TINY_WAN[arch]})
    setattr(owner, name, build)
    try:
        yield
    finally:
        setattr(owner, name, stock)


def _tiny_kl(arch: str) -> dict:
    full, tiny = _kl_ddconfig(arch, False), _kl_ddconfig(arch, True)
    return {k: v for k, v in tiny.items() if full[k] != v}


def _with_params(config: dict, overrides: dict) -> dict:
    return {**config, "params": {**config["params"], **overrides}}


def comfy_vae(arch: str, seed: int = 0, tiny: bool = False, dtype: torch.dtype | None = None,
              device: str | torch.device | None = None):
    """A ``comfy.sd.VAE`` of ``arch`` with seeded random weights, detected from its keys.

    ``dtype``/``device`` default to ComfyUI's own choice (``vae_dtype``/``vae_device``), which is
    what a user gets. Requires ComfyUI to be importable (see ``bench.comfyui``). A tiny VAE's
    state dict cannot be loaded back by ComfyUI's own loaders (they build full widths); a
    full-size one can (e.g. saved as safetensors for a server test).
    """
    import comfy.sd

    arch, tiny = split_arch(arch, tiny)
    sd = comfy_state_dict(arch, seed, tiny)
    metadata = comfy_metadata(arch, tiny)
    with _tiny_constructors(arch) if tiny and metadata is None else contextlib.nullcontext():
        # A torch.device, never a string: newer trees' VAE.decode reads ``device.type``.
        device = None if device is None else torch.device(device)
        vae = comfy.sd.VAE(sd=sd, device=device, dtype=dtype, metadata=metadata)
    expected = _COMFY_CLASSES[arch]
    got = f"{type(vae.first_stage_model).__module__}.{type(vae.first_stage_model).__qualname__}"
    if got != expected:
        raise RuntimeError(f"comfy.sd.VAE detected {got} for {arch}, expected {expected}")
    return vae


_COMFY_CLASSES = {
    "sdxl": "comfy.ldm.models.autoencoder.AutoencoderKL",
    "sd15": "comfy.ldm.models.autoencoder.AutoencoderKL",
    "flux": "comfy.ldm.models.autoencoder.AutoencodingEngine",
    "wan21": "comfy.ldm.wan.vae.WanVAE",
    "wan22": "comfy.ldm.wan.vae2_2.WanVAE",
    "ltx2": "comfy.ldm.lightricks.vae.causal_video_autoencoder.VideoVAE",
}
