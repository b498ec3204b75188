"""What the bench decodes with: a VAE, a latent, and the stock / lossless / high decode calls.

With ComfyUI loaded, stock is ComfyUI's own ``VAEDecode`` node and lossless/high go through
this pack's ``FastVAEDecode`` node, exactly as a workflow runs them (outputs on ComfyUI's
intermediate device, in [0, 1]). Without ComfyUI, stock is a diffusers model's ``decode`` and
lossless/high wrap that same call in ``decode_at_quality`` (outputs in [-1, 1]).
"""
from __future__ import annotations

import copy
import types
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..fastpath.gate import decoder_models
from ..fastpath.quality import decode_at_quality
from . import models
from .cases import Case


@dataclass
class Subject:
    backend: str  # "comfyui" | "diffusers"
    vae: Any  # what the fast path and the precision node take: comfy.sd.VAE or the nn.Module
    latent: torch.Tensor
    device: torch.device
    signed: bool  # outputs in [-1, 1] (diffusers) rather than [0, 1] (ComfyUI)
    stock: Callable[[], torch.Tensor]
    decode: Callable[[str], tuple[torch.Tensor, dict]]  # quality -> (images, path info)
    nodes: types.ModuleType | None = None  # ComfyUI's ``nodes`` module for the comfyui back end
    fp32: Callable[[], torch.Tensor] | None = None  # the same decode with an fp32 copy of the model

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the decoder computes in: a precision variant's decoder dtype (its
        ``vae_dtype`` is its encoder's), else ComfyUI's ``vae_dtype`` (under dynamic VRAM the
        stored weights keep the file's dtype and are cast per call), else the weights'."""
        model = decoder_models(self.vae)[0]
        chosen = model.__dict__.get("_fvd_decoder_dtype")
        if chosen is None and self.backend == "comfyui":
            chosen = getattr(self.vae, "vae_dtype", None)
        return chosen or _decoder_dtype(model)

    def with_vae(self, vae: Any) -> "Subject":
        """The same latent and calls on another VAE (a decode-precision variant)."""
        if self.backend == "comfyui":
            return _comfy_subject(vae, self.latent, self.nodes)
        return _diffusers_subject(vae, self.latent)


def _decoder_dtype(model: torch.nn.Module) -> torch.dtype:
    inner = getattr(model, "decoder", model)
    return next(inner.parameters()).dtype


# Every decode starts from the same random state: some decoders draw noise per decode (LTX's
# timestep-conditioned ``VideoVAE.decode``), and stock, lossless and high must see the same.
DECODE_SEED = 0


def _seed() -> None:
    """``torch.manual_seed(DECODE_SEED)`` for the generators a decode can draw from (CPU, CUDA).

    Inside the timed call, so not torch.manual_seed itself: it also seeds XPU, which on a
    machine without one queues a lazy call with a formatted stack trace every time (~1 ms of
    host per decode under cProfile, and a queue that grows per decode).
    """
    torch.random.default_generator.manual_seed(DECODE_SEED)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(DECODE_SEED)


def _comfy_subject(vae, latent: torch.Tensor, nodes: types.ModuleType) -> Subject:
    from ..nodes.fast_vae_decode import FastVAEDecode
    from .progress_cost import timed_progress

    def stock() -> torch.Tensor:
        _seed()
        return nodes.VAEDecode().decode(vae, {"samples": latent})[0]

    def decode(quality: str) -> tuple[torch.Tensor, dict]:
        _seed()
        with timed_progress() as progress:
            out = FastVAEDecode.execute({"samples": latent}, vae, quality)
        return out[0], dict(out.ui["fast_vae_decode"][0], **progress.as_info())

    def fp32() -> torch.Tensor:
        # A private fp32 copy (stock classes, none of ComfyUI's loader state: under dynamic
        # VRAM a deep copy would drag the source's VRAM area and pinned buffers along), decoded
        # as comfy.sd.VAE.decode does it.
        from ..fastpath.module_clone import clone_module, tensor_copier

        model = clone_module(vae.first_stage_model,
                             tensor_copier(vae.device, lambda path: torch.float32))
        z = latent.to(device=vae.device, dtype=torch.float32)
        _seed()
        images = vae.process_output(model.decode(z).float()).to(vae.output_device).movedim(1, -1)
        return images.reshape(-1, *images.shape[-3:]) if images.ndim == 5 else images

    return Subject("comfyui", vae, latent, torch.device(vae.device), False, stock, decode,
                   nodes, fp32)


def _diffusers_subject(model, latent: torch.Tensor) -> Subject:
    device = next(model.parameters()).device

    def call() -> torch.Tensor:
        # The latent follows the decoder's dtype, so a decode-precision variant gets its own.
        return model.decode(latent.to(device=device, dtype=_decoder_dtype(model))).sample

    def decode(quality: str) -> tuple[torch.Tensor, dict]:
        images, outcome = decode_at_quality(model, quality, call)
        return images, outcome.as_ui()

    def fp32() -> torch.Tensor:
        return copy.deepcopy(model).float().decode(latent.float()).sample

    return Subject("diffusers", model, latent, device, True, call, decode, fp32=fp32)


def build_subject(case: Case, *, nodes: types.ModuleType | None, device: torch.device | None,
                  dtype: torch.dtype | None, seed: int = 0) -> Subject:
    """Build the case's VAE (ComfyUI's when ``nodes`` is given, else diffusers') and latent.

    ComfyUI gets the latent as its samplers leave it (fp32, on the CPU) and chooses the VAE's
    device and dtype itself unless they are given; diffusers gets it on ``device``.
    """
    if nodes is not None:
        vae = models.comfy_vae(case.arch, seed=seed, dtype=dtype, device=device)
        return _comfy_subject(vae, models.seeded_latent(case.latent_shape, seed + 1), nodes)
    model = models.diffusers_vae(case.arch, seed=seed, dtype=dtype, device=device)
    latent = models.seeded_latent(case.latent_shape, seed + 1, device, _decoder_dtype(model))
    return _diffusers_subject(model, latent)


def unsupported_reason(subject: Subject) -> str | None:
    """Why the fast path has no family for this VAE yet (None when one is registered)."""
    from ..fastpath.install import find_family

    for model in decoder_models(subject.vae):
        if find_family(model) is None:
            return f"no fast-path family for {type(model).__name__} yet"
    return None


def release(subject: Subject | None) -> None:
    """Let ComfyUI unload the subject's model so the next case starts with free memory."""
    if subject is not None and subject.backend == "comfyui":
        import comfy.model_management as mm

        mm.unload_all_models()
        mm.soft_empty_cache()
