"""Pure PyTorch + Triton math for the fast VAE decode.

Every fast kernel here has a plain-torch reference beside it (``*_reference``): its test oracle,
not a fallback. Where a kernel declines an input, the caller in ``fastpath`` runs the stock
module (bit-exact with ComfyUI), never the reference. Each Triton kernel declares what it takes
once (``accepts.Accepts``: ``GROUP_NORM_SILU``, ``RMS_NORM_SILU``, ``RMS_NORM_EXACT``,
``BIAS_RESIDUAL_ADD``); its ``*_unsupported`` check and ``fastpath``'s checks ask that
declaration. Nothing in this package imports ComfyUI or diffusers.
"""
