"""Switches of the Wan video-VAE fast path that are chosen by measurement on the GPU.

As the KL wing's (``families/kl/settings.py``): they change only how the open gate computes,
never the closed gate, and are module-level so a benchmark can flip them in one process
(``bench --wan-setting NAME=VALUE``); tests and benchmarks restore what they change.
"""
from __future__ import annotations

from dataclasses import dataclass

from ....kernels.silu import FAST_SILU


@dataclass
class WanSettings:
    # The mid-block's per-frame attention: "chunked" (cuBLAS score and value GEMMs by chunks of
    # query rows, the in-place ``softmax_rows`` between them), "sdpa" (torch SDPA: its
    # memory-efficient kernel, as stock, at head dims past the flash kernel's 256) or "auto"
    # (chunked for frames of fewer than ``chunked_max_tokens`` latent pixels). Interleaved on
    # the H200 at 18a0697, 10 rounds, SDPA against chunked, 0.33 / 0.8: Wan 2.1 480p (6240
    # tokens) +1.1 / +1.5%, Wan 2.2 704p (3520) +0.3 / +0.3%, Qwen-Image 1024² (16384)
    # -5.9 / 0.0% (docs/benchmark/18a0697).
    attention: str = "auto"
    chunked_max_tokens: int = 8192
    # Score bytes one chunk may hold (``attention_chunk_size``, which counts scores and
    # probabilities): a 1024² Qwen-Image frame chunked (``attention="chunked"``) would hold
    # 16384 x 16384 scores, 1 GiB with torch's softmax, in one chunk under the KL wing's 1 GiB;
    # a quarter keeps the mid-block's transient memory well below the full-resolution peak.
    attention_budget_bytes: int = 1 << 28
    # A residual block's norms also write the frames its conv caches for the next chunk
    # (``rms_norm_silu``'s frame tail) instead of a clone pass reading them back: the same
    # bytes, one read of them fewer. Off: ``next_cache`` clones, as before.
    cache_from_norm: bool = True
    # A residual block's 2-D-taps convs (Wan 2.1's 96 channels at full resolution) read their
    # cached frames where they lie in ComfyUI 0.33's two-frame pieces (``split_tap_parts``):
    # no copy of the cached frames into an assembled input, and the new frames are the next
    # cache. Off: every conv assembles its input (``causal_input``), as before.
    split_cached_frames: bool = True
    # The same in chunks of more than two new frames (ComfyUI 0.8's four-frame chunks): taps 0
    # and 1 each read a run of cached and new frames, two convs written into one part by
    # cuDNN's out= form (``split_tap_parts``), instead of a copy of the two cached frames into
    # each conv's assembled input (~0.1 ms per conv at 480x832 on an H100, six convs a chunk).
    # Interleaved against the assembled input (0.8, H100, 10 rounds, docs/benchmark/s37/b): Wan
    # 2.1 x33 -1.6%, x81 -1.2%, quartiles apart on both; peak 3632 / 3638 MiB against 3756 /
    # 3765 before (stock 3936 / 4052), PSNR against fp32 unchanged (48.7 dB). 0.33 does not
    # meet such chunks at full resolution. Off: the assembled input, as before.
    split_long_chunks: bool = True
    # ComfyUI 0.33's pieces of two new frames hand three parts as well (the middle tap's two
    # 1-frame convs written into a part of its own by cuDNN's out= form) instead of adding that
    # tap into tap 0's output with two torch adds (13.3 ms, 184 launches of an H100 Wan 2.1
    # x33 decode on 0.33, docs/benchmark/s36/c). One more two-frame part alive at the conv, which
    # no longer sets the decode's peak (the joined call's pieces below full size do). Interleaved
    # against the two parts (0.33, H100, 10 rounds, docs/benchmark/s37/c): Wan 2.1 x33 -1.9%,
    # x81 -2.9%, quartiles apart on both; peak 3001 / 3006 MiB against 3000 / 3006 (stock 3095
    # / 3208), PSNR against fp32 47.7 dB either way (stock 46.1 / 46.2). (At f037ac7, before
    # the join, the same parts measured +0.6% inside the spread and raised the peak.)
    # Off: the two torch adds, as before.
    three_parts_in_pieces: bool = True
    # A 2-D-taps conv (``ops.tap_parts``: Wan 2.1's 96 channels at full resolution, on an
    # assembled input) hands all three tap outputs to the pass that reads it next (the norm or
    # the residual add takes up to two addends), instead of summing taps 0 and 1 with a torch
    # add: two passes over a conv output fewer, one more of them alive at once. This measured
    # ComfyUI 0.8's four-frame chunks on assembled inputs (which now read their cached frames
    # in place, ``split_long_chunks``, with the same parts); 0.33's two-frame pieces have a
    # switch of their own (``three_parts_in_pieces``). The tap adds of both routes were 14.3 ms
    # (195 launches) of an H100 Wan 2.1 x33 decode on 0.33 (docs/benchmark/34207ac). The sums
    # change by one rounding fewer (the three taps meet in fp32). Interleaved against two parts
    # (H100, 8 rounds, docs/benchmark/s34 section 2): Wan 2.1 x33 / x81 -1.5 / -2.9% on 0.8,
    # -0.5 / +0.1% on 0.33; peak still under stock's on both (0.8 x33: 3760 against 3936 MiB;
    # 0.33 x33: 2949 against 3095), PSNR against fp32 48.7 / 47.7 dB (stock 46.8 / 46.1).
    # Off: the torch add, as before.
    three_tap_parts: bool = True
    # A first chunk's 3x3x3 convs of 192-384 channels (one uncached frame of at least 128²:
    # only the last temporal tap applies) as ``conv2d`` over the frame instead of a (1, 3, 3)
    # ``conv3d`` (``ops.last_tap_part``; per-conv numbers at ``ops.SINGLE_TAP_2D_MAX_CHANNELS``).
    # Off: ``conv3d`` with the last tap's weight, as before. Interleaved on the H200 against
    # off, 10 rounds, 0.33 / 0.8 (docs/benchmark/7c40816): Qwen-Image 1024² -1.4 / -6.2%; Wan
    # 2.1 x33 +0.7 / +0.3% and Wan 2.2 +0.5 / +0.1%, inside their spreads (their first chunk
    # is host-bound: the GPU waits for its launches either way).
    single_frame_2d: bool = True
    # The RMS norms' SiLU in its MUFU form (``kernels.silu``), as the KL wing's ``fast_silu``
    # (sm_90a SASS of the 96-channel norm: 832 -> 664 instructions). Off: on an H100 the norm
    # alone moved -5.2% at Wan 2.2's 160 x 704x1280 and -0.2 to +4.5% at Wan 2.1's sizes; Wan
    # 2.1 x33 interleaved 8 rounds -0.3 / -0.5% (0.33 / 0.8), inside the quartiles
    # (docs/benchmark/s38/b). Not measured on the H200 yet.
    fast_silu: bool = FAST_SILU
    # A residual block's 3x3x3 convs at the measured shapes (``ops.STACKED_TAPS_MIN_PIXELS``:
    # Wan 2.1's 384-channel convs from 120x208) as one 2-D conv over a channel-stacked input
    # that the norm before it writes (``kernels.stacked_taps``), instead of cuDNN's conv3d.
    # Off by default: each conv measured 0.03-0.25 ms faster alone, but interleaved against
    # conv3d (H200, 6 rounds, docs/benchmark/b28b6be, inter-stacked384-*.log) Wan 2.1 x33 /
    # x81 moved -0.3 / -0.3% on 0.8 and +2.1 / -0.1% on 0.33, inside their spreads: no gain
    # measured end to end, so the simpler route stays.
    stacked_taps: bool = False
    # A residual block's 3x3x3 convs with a measured tiling (``kernels.padded_grid_conv``:
    # Wan 2.1's 96, 192 and 384 channels) as one CUTLASS-DSL WGMMA GEMM over a zero-padded
    # input that the norm before it writes, where the optional ``nvidia-cutlass-dsl`` is
    # installed and the GPU is an sm_90 (Hopper); elsewhere the routes below, unchanged.
    # Alone at Wan 2.1 x33's shapes (H100, s49, docs/benchmark/s49/h100/own.log) the kernel
    # ran 192 / 192->384 / 384 channels 1.31 / 1.24 / 1.21x faster than cuDNN's conv3d and 96
    # channels 1.28x faster than the three tap convs and their sum. Interleaved against off
    # (H100, s49, with ``padded_grid_fill``): 0.8 Wan 2.1 x33 -7.4 / -7.3%, x81 -8.7%; 0.33
    # x33 -4.6% (5 rounds) and +1.3% (7 rounds, quartiles 269.6-293.6 ms), x81 -5.2%.
    padded_grid_conv: bool = True
    # The route's narrowest input: convs of fewer channels keep the routes below. From 192
    # (the 96-channel convs keep their tap convs, which read the cached frames in place) it
    # measured -6.6 / -5.2% on 0.8's x33 and -5.8% on x81, behind every width's -7.4 / -7.3 /
    # -8.7%, and -6.7 / +0.6% on 0.33's x33, -5.5% on x81 (H100, s49).
    padded_grid_min_channels: int = 96
    # On that route, a residual block's second conv (identity shortcut) adds its bias and the
    # block's input in its epilogue, writing the block's output: no residual-add pass reading
    # the conv's output back. Off: from 192 channels it measured -6.0% against the route's
    # -6.6% without it on 0.8's x33, and -0.5% against -6.7% on 0.33's (H100, s49).
    padded_grid_residual: bool = False
    # On that route, the grid's border, zero frames and cached frames written by one Triton
    # pass (``kernels.padded_grid_fill``) instead of four torch fills and torch's strided copy
    # of the cached frames into the grid's interior (37 ms over 542 launches of a routed Wan
    # 2.1 x33 decode on 0.8, H200, s48 profile). Alone 1.84-2.09x faster than those (H100, s49);
    # in the decode, the route with torch's fills and copy measured -3.9% on 0.8's x33 and
    # +5.6% on 0.33's, against -7.4 / -4.6% with the pass. Off: the torch fills and copy.
    padded_grid_fill: bool = True
    # On that route, each conv launched through TVM FFI (the DSL's optional calling convention,
    # where the optional ``apache-tvm-ffi`` is installed; else the DSL's own call): nine plain
    # ints instead of the DSL converting each argument in Python. Same output bits (H100, s51,
    # ``docs/benchmark/s51/h100/tvmffi.log``), host time per conv 99-108 -> 23-26 us; decodes
    # interleaved against the DSL's call (4-5 rounds): 0.33 x33 -0.2%, x81 -1.0%; 0.8 x33
    # -0.8%, x81 -0.7%. A failed compile or a refused call falls back to the DSL's call.
    padded_grid_tvm_ffi: bool = True
    # On that route, each conv at its ``padded_grid_conv.SWEEP_TILINGS`` candidate of this
    # index (two CTAs per SM, s52) where its shape has one, instead of its measured tiling.
    # Not measured yet: the per-conv benchmark's sweep and an interleave against -1 decide.
    # -1: the measured tilings.
    padded_grid_candidate: int = -1
    # The decode loop's first decoder call (the first latent frame, a single-frame latent's
    # whole decode) replayed from a CUDA graph once captured (``first_call``): one frame gives
    # the GPU less work per launch than Python needs to issue it. Off by default: on the H200
    # (0.33, default flags, pack cc84da3, docs/benchmark/cc84da3) it took Qwen-Image 1024² from
    # 22.5 to 19.7 ms and Wan 2.1 480p x33 from 309 to 294 ms (x81 and Wan 2.2 within 1%), but
    # its pool, kept between decodes, put every case's peak over stock's (Wan 2.1 x33 5193 MiB
    # against 3095, Wan 2.2 10116 against 8548, Qwen 1722 against 1261): issue 13's "peak
    # memory <= stock" rules it out until the pool is smaller than the eager decode's peak.
    cuda_graphs: bool = False
    # The decode loop's first latent frame decoded in the same decoder call as the next chunk
    # (``join_first``): the same sums, one decoder call's host time fewer, where the first call
    # left the GPU waiting for the host (H100: through all 23 module calls of the first call and
    # 10 of the second on 0.8, docs/benchmark/s35/h; 0.33 waited 33 ms at 33 module calls,
    # docs/benchmark/s36). Open gate and a device Triton runs on only. A latent of up to three
    # frames is then one call in 0.33's Wan 2.1 loop (two in a per-frame loop with
    # ``join_per_frame``), whose frames are not streamed to the host.
    # Interleaved against off (H100, 8 rounds, docs/benchmark/s36/d, with ``join_pieces`` below):
    # 0.33 Wan 2.1 x33 -3.9% (quartiles apart), x81 -0.9%. Peaks stay under stock's: 0.33 3000
    # / 3005 MiB against 3095 / 3208 (s36/c). Per-frame loops join only with ``join_per_frame``.
    join_first_chunk: bool = True
    # The join in a per-frame loop too (0.8's Wan 2.1, every Wan 2.2, diffusers: the first two
    # latent frames in one call). Off: there it measured no gain, interleaved against the
    # unjoined decode (H100): 0.8 Wan 2.1 x33 / x81 +0.4 / -0.2% (s35/f), +0.5 / +0.7% and
    # +0.9 / -0.9% (s37/first, s37/a: inside the spread); Wan 2.2 704p x33 +1.2% on 0.33 and
    # +1.1% on 0.8, quartiles apart (s37/a): its one-frame calls already give the GPU more
    # work than the host needs to issue them.
    join_per_frame: bool = False
    # How a joined call on 0.33+ cuts its frames after a temporal upsample (``JoinedRunUp``):
    # "stock", the first frame alone and then pairs (stock's pieces); "ride", the first frame in
    # front of the first pair (a three-frame piece down to full size); "ride_below_last", in
    # front of the first pair except after the last temporal upsample (three frames only at the
    # smaller sizes, stock's pieces at full size). Interleaved against the unjoined decode (0.33,
    # Wan 2.1 x33, H100, docs/benchmark/s36/d): "stock" -1.8% (inside the spread), "ride"
    # -3.5%, "ride_below_last" -3.9%. "ride" put x33's peak over stock's (3145 MiB against
    # 3095, docs/benchmark/s35/t); "ride_below_last" left it at 3000 (docs/benchmark/s36/c).
    join_pieces: str = "ride_below_last"


settings = WanSettings()

ATTENTION_MODES = ("auto", "chunked", "sdpa")
JOIN_PIECES = ("stock", "ride", "ride_below_last")
CHOICES: dict[str, tuple[str, ...]] = {"attention": ATTENTION_MODES, "join_pieces": JOIN_PIECES}
