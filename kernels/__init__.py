"""Pure PyTorch + Triton math for the fast VAE decode.

Every fast kernel here has a plain-torch reference beside it (``*_reference``), which is both
the fallback and the test oracle. Nothing in this package imports ComfyUI or diffusers.
"""
