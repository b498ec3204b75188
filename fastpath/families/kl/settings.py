"""Switches of the KL image-VAE fast path that are chosen by measurement on the GPU.

They change only how the open gate computes (speed, and rounding within the high-quality
bar), never the closed gate. They are module-level so a benchmark can flip them and compare
in one process; tests and benchmarks restore what they change.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator

import torch

from ....kernels.group_norm_silu import PREFETCH as GROUP_NORM_PREFETCH
from ....kernels.group_norm_silu import PREFETCH_MODES as GROUP_NORM_PREFETCH_MODES
from ....kernels.silu import FAST_SILU


@dataclass
class KLSettings:
    """Defaults chosen on one H200 (torch 2.11, bf16, SDXL-layout diffusers decoder, random
    seeded weights; fast decode in ms at 1024² / 2048² output, same run, 2026-11-29, before the
    bias-add kernel: chunked attention 24.6 / 114.6, SDPA 26.9 / 159.8; transposed upsample
    24.6 / 109.1, sub-pixel 30.2 / 147.7, stock 28.8 / 130.2; cuDNN benchmark on 24.7 / 112.1
    against 24.6 / 109.1 off; fp32 scores 25.1 / 128.9 for the same 56 / 57 dB PSNR)."""

    # "chunked" (matmul + softmax by query chunks), "sdpa" (torch SDPA: the stock kernel at
    # d=512), "exp_scores" (the score GEMM writes unnormalised probabilities, no softmax pass:
    # ``kernels.exp_scores``; bf16 only, else chunked) or "auto" (chunked from
    # ``chunked_min_tokens`` tokens in the batch up, where SDPA's memory-efficient kernel is
    # slower; below that size neither matters).
    attention: str = "auto"
    chunked_min_tokens: int = 8192
    # "auto" takes exp_scores from ``exp_scores_min_tokens`` tokens in the batch. Measured at
    # SDXL 2048² (65536 tokens) only, on an H100 under 0.33 (docs/benchmark/s31/h100): the
    # attention alone 16.5 against 21.6 ms for the chunked softmax, whole decodes interleaved
    # 94.7 against 101.6 ms (-6.8%), PSNR vs fp32 48.2 dB either way. Smaller batches keep the
    # chunked softmax until measured.
    auto_exp_scores: bool = True
    exp_scores_min_tokens: int = 65536
    # A resnet block's 3x3 convs with a tiling (``kernels.padded_grid_conv`` with one temporal
    # tap: the batch's images are the grid's frames) as one CUTLASS-DSL WGMMA GEMM over a
    # zero-bordered input its norm writes, where the optional ``nvidia-cutlass-dsl`` is
    # installed and the GPU is an sm_90 (Hopper). Off: it makes decodes slower. Interleaved
    # against cuDNN (H100, s49, 9 rounds, docs/benchmark/s49/h100/inter-kl-*.log): SDXL 1024²
    # +14.8 / +9.7% (0.33 / 0.8), SD1.5 768x512 b4 +18.6 / +14.0%, SDXL 2048² +19.1 / +14.3%.
    # Alone the kernel had looked 1.16-1.61x faster (kl.log), but against conv2d + bias on
    # cuDNN's heuristic choice, not the bias-free convs the decode runs: in the decode's
    # profile the 18 routed convs took 8.85 ms (prof-kl-grid.log) where cuDNN's took 7.78 on
    # an H200 (docs/benchmark/7c40816), and the norm writing the grid (two-byte stores then)
    # and the border fills cost more besides. s47's lab had the DSL GEMM at 0.89-0.99x cuDNN on
    # these shapes.
    padded_grid_conv: bool = False
    # The route's smallest conv, in pixels over the batch: 512 channels at 128² (16384) were
    # 0.85x cuDNN in that lab, larger ones faster there.
    padded_grid_min_pixels: int = 65536
    # On that route, each conv at its ``padded_grid_conv.SWEEP_TILINGS`` candidate of this
    # index (two CTAs per SM, s52) instead of its measured tiling; -1: the measured tilings.
    # Not measured yet (the per-conv benchmark's sweep times them first).
    padded_grid_candidate: int = -1
    # Scores and softmax in fp32 for half inputs (twice the score traffic, smaller logit error).
    attention_fp32_scores: bool = False
    # Chunked attention's softmax as ``softmax_rows`` (Triton, in place: one read and one write
    # of each score chunk, one score-sized tensor less alive) instead of torch's (a second
    # score-sized tensor; ~2.1 TB/s at 2048², 8.1 ms of an 86 ms SDXL decode on the H200).
    # Off: interleaved at 18a0697 it was 2.0% faster on SDXL 2048² on both trees (1024²: within
    # the quartiles), but with it on, two full-size Flux decodes that differ only in
    # ``residual_norm_stats`` were not bit-equal (tier 3, three times in runs 4 and 5; with
    # torch's softmax, equal twice). The kernel's rows are independent and its sums have a fixed order, so the likelier
    # cause is some other op that depends on where the allocator puts tensors, which the freed
    # score tensor moves; not found. Left off until it is (docs/benchmark/32151e6).
    row_softmax: bool = False
    # Nearest-2x + 3x3 conv as "transposed" (one 4x4 stride-2 conv_transpose2d), "subpixel"
    # (2x2 conv to 4*C channels + pixel shuffle) or "stock" (interpolate, then the 3x3 conv).
    upsample: str = "transposed"
    # cuDNN autotuning inside the open gate only (None: leave the global flag as it is).
    # Measured no gain for these channels-last convs, and autotuning costs the first decode.
    cudnn_benchmark: bool | None = None
    # ComfyUI's decoder hands back fp32 (widened on the GPU in the layout pass) instead of the
    # weight dtype that comfy.sd.VAE.decode widens on the CPU after the copy.
    comfy_output_fp32: bool = True
    # conv1's bias folded into norm2 (``group_norm_silu(input_bias=)``: its statistics and shift)
    # instead of a channels-last bias pass of its own: per resnet block one read and one write
    # of the activation and one launch fewer (on paper: SDXL 1024² spent 2.2 ms in 33 bias
    # passes, 15 of them conv1's). SDXL / Flux 1024² ``high`` on the H200, decodes interleaved
    # in one process against the bias pass: -4.7 / -4.7% (0.33, dynamic VRAM), -4.5 / -2.9%
    # (0.33 legacy), -7.1 / -0.6% (0.8); with the split host copies -3.3 / -3.7%, -3.2 / -2.7%,
    # -11.0 / -12.1% against both off.
    norm_input_bias: bool = True
    # Each resnet block's closing add (conv2's bias and the residual) also takes the statistics
    # of its sum for the next block's first norm (``add_bias_residual_group_stats_``), which then
    # skips its statistics pass: per block one read of the activation and one launch fewer, the
    # norm's output bit-identical. high on the H200 (9716de3), decodes interleaved in one
    # process against off, 15 rounds, 0.33 / 0.8: SDXL 1024² -1.0 / -3.5%, Flux 1024² -0.7 /
    # -0.8%, SDXL 2048² -3.7 / -4.3%, SD1.5 768x512 batch 4 -1.4 / -0.9%
    # (docs/benchmark/9716de3/interleave-*.log).
    residual_norm_stats: bool = True
    # 3x3 conv weights kept channels-last for channels-last inputs (``ops.conv2d``; per weight
    # version, dropped on unload) instead of PyTorch converting the weight on every call (34
    # copies per SDXL 1024² decode). Costs one copy of the decoder's 3x3 weights in VRAM.
    # Interleaved against off, 15 rounds (docs/benchmark/6fe596f/interleave.md), 0.33 / 0.8:
    # SDXL 1024² -0.6 / -2.1%, Flux -0.9 / -1.1%, SD1.5 768x512 batch 4 +0.3 / -1.1%.
    channels_last_weights: bool = True
    # The fast decode replayed from a CUDA graph once a shape has been decoded eagerly
    # (``fastpath.cuda_graph``: one launch instead of ~600, so the GPU does not wait on the
    # host between kernels at the small stages).
    cuda_graphs: bool = True
    # Which GroupNorm passes load their next tile before they use the current one, by
    # ``group_norm_silu``'s PREFETCH_MODES name; its default (measured there) unless set. A
    # setting so that decodes can be interleaved against another mode (``interleave --variant
    # NAME='--kl-setting group_norm_prefetch=MODE'``): a CUDA graph is keyed on it.
    group_norm_prefetch: str = GROUP_NORM_PREFETCH
    # The GroupNorm apply pass's SiLU in its MUFU form (``kernels.silu``: ex2 and rcp without
    # the denormal fix-ups, ~15 -> ~8 instructions per element) instead of ``tl.sigmoid``'s.
    # Where the device cannot compile it (interpreter, ROCm) the library form runs either way.
    # Off: on an H100 the whole norm moved -0.7 to -1.1% alone (2.80 -> 2.83 TB/s at 128 x
    # 2048², ``silu_lab``) and decodes interleaved 8 rounds moved -1.4 to +0.2%, inside their
    # quartiles (docs/benchmark/s38/b): the pass is not instruction-bound there. The H200 has
    # 43% more bandwidth per instruction issued; not measured on it yet.
    fast_silu: bool = FAST_SILU
    # Resnet 3x3 convs with at least this many input channels by Winograd F(4x4, 3x3)
    # (``ops.resnet_conv``, ``kernels.winograd_conv``: fp16 products, fp32 M) instead of cuDNN;
    # 0: never. Off: on the H200 it ran the 512-channel convs at 1.15-1.22x cuDNN's speed (the
    # 3x3 convs of an SDXL 2048² decode 36.05 -> 33.86 ms, docs/benchmark/s41), but a CPU study
    # of a whole decode put those convs alone 0.84 dB further from fp32, against ``high``'s
    # 1.0-1.2 dB over stock; and the transformed weights (4x the 3x3 weights' elements) stay in
    # VRAM. A setting so that whole decodes can be interleaved and their PSNR read on the GPU.
    winograd_min_channels: int = 0
    # The last GroupNorm + SiLU as the head conv's prologue (``ops.norm_silu_head``: the head
    # on ``narrow_conv`` with the norm applied as pass 1 reads x) instead of the norm's apply
    # pass writing the activation and the head conv reading it back (cuDNN: ``conv_routes``
    # keeps 2-D heads there). Same rounded activation either way.
    fused_head: bool = True
    # (No two-launch GroupNorm: a statistics pass whose last program per sample combined the
    # groups was measured at 3cdeced, interleaved against these defaults, 15 rounds: +3.2 / +3.5
    # / +3.2% on SDXL / Flux 1024² / SD1.5 768x512 batch 4 under 0.33, +2.7 / +2.9 / +2.8% under
    # 0.8, and its handed-over statistics were not bit-stable at 4x512x96x64 on the GPU; removed.
    # docs/benchmark/3cdeced/interleave.md)


settings = KLSettings()

# The values each text field takes; the bench's ``--kl-setting NAME=VALUE`` rejects others.
ATTENTION_MODES = ("auto", "chunked", "sdpa", "exp_scores")
UPSAMPLE_MODES = ("transposed", "subpixel", "stock")
CHOICES: dict[str, tuple[str, ...]] = {"attention": ATTENTION_MODES, "upsample": UPSAMPLE_MODES,
                                       "group_norm_prefetch": tuple(GROUP_NORM_PREFETCH_MODES)}


@contextlib.contextmanager
def cudnn_benchmark_for(x: torch.Tensor) -> Iterator[None]:
    """Set cuDNN's benchmark flag for the decode of ``x`` (CUDA only) and restore it after.

    The flag is process-wide; it is set only for the duration of one open-gate decode, so a
    stock decode before or after sees the flag it had.
    """
    wanted = settings.cudnn_benchmark
    if wanted is None or x.device.type != "cuda" or torch.backends.cudnn.benchmark == wanted:
        yield
        return
    previous = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = wanted
    try:
        yield
    finally:
        torch.backends.cudnn.benchmark = previous
