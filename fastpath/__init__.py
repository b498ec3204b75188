"""VAE surgery on any ``nn.Module`` tree (ComfyUI's or diffusers'): the gate, fused modules,
installers per VAE family, decode precision and cache clearing.

ComfyUI and diffusers classes are imported lazily and only to recognise them.
"""
