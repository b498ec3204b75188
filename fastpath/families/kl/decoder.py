"""Fused KL image-VAE decoders (ComfyUI's ``Decoder`` and diffusers' ``Decoder``).

With the gate open the decoder runs channels-last from end to end: the latent is converted
once, every block works on channels-last tensors, the final GroupNorm and the SiLU after it
(ComfyUI: ``norm_out`` then the module-level ``nonlinearity``; diffusers: ``conv_norm_out`` then
``conv_act``) are applied by the head conv as it reads its input (``ops.norm_silu_head``; one
norm kernel before it where that cannot run), and the output goes back to the stock
(contiguous) layout, so code after the decoder sees what it always saw. With the gate closed
it is the stock forward.

The loop mirrors the stock decoder's order of blocks (a fact about the architecture, checked
at install by ``families.kl``): conv_in, mid block, up levels from the deepest (res blocks, the
attention after each when the level has any, then the upsample), norm + SiLU, conv_out.
"""
from __future__ import annotations

import torch

from ....kernels.group_norm_silu import GROUP_NORM_SILU
from ...comfyui.weights import bias_of, weights_for_call
from ...cuda_graph import graphed_call, settings_key
from ...fused import FusedModule
from ...log import log_once
from ...prewarm import tiny_input
from ...reasons import input_reason
from .exp_scores_guard import exp_scores_guard
from .ops import (
    CHANNELS_LAST,
    StockLayoutGuard,
    add_bias_residual_,
    channels_last_decode,
    conv2d,
    norm_silu_head,
    to_channels_last,
    weights_reason,
)
from .settings import cudnn_benchmark_for, settings


def run_child(module: torch.nn.Module, h: torch.Tensor, *args) -> torch.Tensor:
    """One block of the channels-last decode.

    A fused block takes channels-last input either way (``StockLayoutGuard`` gives its stock
    path a contiguous copy). A block left stock at install gets a contiguous input, as in a
    stock decode, and its output goes back to channels-last for the next block.
    """
    if isinstance(module, StockLayoutGuard) and module._fvd_gate is not None:
        return module(h, *args)
    return to_channels_last(module(h.contiguous(), *args))


def _conv_in_layout(z: torch.Tensor) -> torch.Tensor:
    """The latent in the layout conv_in is fast on.

    cuDNN's channels-last kernels want the channel count a multiple of 8; a 4-channel latent
    (SD 1.x, SDXL) is convolved in the stock layout and only its 512-channel output is turned
    channels-last (one cheap copy).
    """
    return to_channels_last(z) if z.shape[1] % 8 == 0 else z.contiguous()


class _FusedDecoder(FusedModule):
    """Subclasses define ``_ends()`` -> (conv_in, norm_out, conv_out) and ``_blocks(h)``."""

    def _ends(self):
        raise NotImplementedError

    def _blocks(self, h: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _finish(self, h: torch.Tensor) -> torch.Tensor:
        return h

    def fast_unsupported(self, z, *args, **kwargs) -> str | None:
        if any(a is not None for a in args) or any(v is not None for v in kwargs.values()):
            return "extra decoder arguments"
        reason = input_reason(z, GROUP_NORM_SILU)
        if reason is not None:
            return reason
        # Only the weights the decoder reads itself; every block checks its own when it runs
        # and falls back on its own (ComfyUI low-VRAM mode may offload some blocks only).
        return weights_reason(self._ends(), z)

    def prewarm_key(self):
        return type(self)

    def prewarm(self, device, dtype):
        """The decoder's own kernels (the blocks warm up their own): conv_in's bias add,
        the last norm and the head conv (fused, or the norm kernel and the head's routed op)."""
        conv_in, norm_out, conv_out = self._ends()
        with weights_for_call():
            if self.fast_unsupported(tiny_input(conv_in.in_channels, 4, device, dtype)) is not None:
                return
            add_bias_residual_(tiny_input(conv_in.out_channels, 4, device, dtype), bias_of(conv_in))
            norm_silu_head(norm_out, conv_out, tiny_input(norm_out.num_channels, 4, device, dtype))

    def fast_forward(self, z, *args, **kwargs):
        # Everything in the settings may change which kernels the decode launches.
        key = settings_key(settings)
        with exp_scores_guard.watch((tuple(z.shape), z.dtype, z.device) + key, z.device) as tripped:
            out = (graphed_call(self, z, self._decode, key) if settings.cuda_graphs
                   else self._decode(z))
        if tripped[0]:
            log_once("kl:exp_scores_tripped", "attention scores far above their sampled "
                     "reference: this decode ran again with the softmax attention")
            del out
            with exp_scores_guard.suspend():
                out = self._decode(z)
        return out

    def _decode(self, z: torch.Tensor) -> torch.Tensor:
        conv_in, norm_out, conv_out = self._ends()
        with cudnn_benchmark_for(z), channels_last_decode():
            h = to_channels_last(conv2d(conv_in, _conv_in_layout(z), use_bias=False))
            h = add_bias_residual_(h, bias_of(conv_in))
            h = self._blocks(h)
            h = norm_silu_head(norm_out, conv_out, h)
            h = self._finish(h)
        return self._output(h)

    def _output(self, h: torch.Tensor) -> torch.Tensor:
        return h.contiguous()

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        # With the gate open but this decoder on its stock path (a fallback), fused blocks inside
        # may still hand channels-last tensors to the stock tail; keep the stock output layout.
        gate = self._fvd_gate
        if (gate is not None and gate.is_open and isinstance(out, torch.Tensor)
                and out.dim() == 4 and not out.is_contiguous()
                and out.is_contiguous(memory_format=CHANNELS_LAST)):
            out = out.contiguous()
        return out


class FusedComfyDecoder(_FusedDecoder):
    """``comfy.ldm.modules.diffusionmodules.model.Decoder`` (2-D, not ``give_pre_end``)."""

    def _ends(self):
        return self.conv_in, self.norm_out, self.conv_out

    def _blocks(self, h):
        mid = self.mid
        h = run_child(mid.block_1, h, None)
        h = run_child(mid.attn_1, h)
        h = run_child(mid.block_2, h, None)
        for i_level in reversed(range(len(self.up))):
            level = self.up[i_level]
            has_attn = len(level.attn) > 0
            for i_block, block in enumerate(level.block):
                h = run_child(block, h, None)
                if has_attn:
                    h = run_child(level.attn[i_block], h)
            if i_level != 0:
                h = run_child(level.upsample, h)
        return h

    def _finish(self, h):
        return torch.tanh(h) if getattr(self, "tanh_out", False) else h

    def _output(self, h):
        # comfy.sd.VAE.decode copies the decoder output to its output device (the CPU) and then
        # calls .float() there; widening on the GPU, in the same pass that restores the stock
        # layout, takes that conversion off the CPU. Only values change width, not the result.
        if not settings.comfy_output_fp32:
            return h.contiguous()
        return h.to(dtype=torch.float32, memory_format=torch.contiguous_format)


class FusedDiffusersDecoder(_FusedDecoder):
    """``diffusers.models.autoencoders.vae.Decoder`` with GroupNorm (no spatial norm)."""

    def _ends(self):
        return self.conv_in, self.conv_norm_out, self.conv_out

    def _blocks(self, h):
        mid = self.mid_block
        h = run_child(mid.resnets[0], h, None)
        for attn, resnet in zip(mid.attentions, mid.resnets[1:], strict=True):
            if attn is not None:
                h = run_child(attn, h)
            h = run_child(resnet, h, None)
        for up in self.up_blocks:
            for resnet in up.resnets:
                h = run_child(resnet, h, None)
            for upsampler in up.upsamplers or ():
                h = run_child(upsampler, h)
        return h
