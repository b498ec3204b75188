"""``FastVAEDecode``: ComfyUI's VAE decode with a quality switch (high = fused, lossless = exact)."""
from __future__ import annotations

from comfy_api.latest import io

from ..fastpath.pixels.decode import decode_pixels
from ..fastpath.progress import progress_to
from ..fastpath.quality import DEFAULT_QUALITY, QUALITIES, decode_at_quality
from .latent import latent_samples
from .progress import comfy_progress
from .unload_hook import ensure_unload_hook

CATEGORY = "latent/fast vae"

QUALITY_TOOLTIP = (
    "high: fused Triton kernels, folded weights and a channels-last decoder; not bit-exact but "
    "visually identical (as close to a full-precision decode as ComfyUI's own is). "
    "lossless: exactly ComfyUI's own VAE Decode, bit for bit. "
    "Where the fast path cannot run (no Triton, CPU, low-VRAM offload, unsupported VAE) high "
    "decodes like lossless and the node says why.")


def images_like_vae_decode(images):
    """Video VAEs return (B, T, H, W, C); ComfyUI's VAEDecode flattens that to frames."""
    if images.ndim == 5:
        images = images.reshape(-1, images.shape[-3], images.shape[-2], images.shape[-1])
    return images


class FastVAEDecode(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="FastVAEDecode",
            display_name="Fast VAE Decode (quality)",
            category=CATEGORY,
            description=(
                "Decodes latents to images like VAE Decode, faster. quality=high runs fused "
                "kernels (visually identical); quality=lossless is bit-exact with VAE Decode."),
            inputs=[
                io.Latent.Input("samples", tooltip="The latent to decode."),
                io.Vae.Input("vae", tooltip="The VAE that matches the model that made the latent."),
                io.Combo.Input("quality", options=list(QUALITIES), default=DEFAULT_QUALITY,
                               tooltip=QUALITY_TOOLTIP),
            ],
            outputs=[io.Image.Output(tooltip="The decoded image(s); video latents become frames.")],
        )

    @classmethod
    def execute(cls, samples, vae, quality=DEFAULT_QUALITY) -> io.NodeOutput:
        latent = latent_samples(samples, vae)
        return decode_node_output(vae, quality, lambda: decode_pixels(vae, latent))


def decode_node_output(vae, quality: str, decode, progress_bar: bool = True) -> io.NodeOutput:
    """Run ``decode()`` at ``quality``; the IMAGE shaped like VAEDecode's, and the UI status.

    The decode advances ComfyUI's progress bar per finished chunk (``progress_bar=False``: the
    caller's decode drives its own, as ComfyUI's tiled decode does per tile) and stops between
    chunks when the user cancels, with ComfyUI's interrupt exception.
    """
    if quality == "high":
        ensure_unload_hook(vae)
    with progress_to(comfy_progress(progress_bar)):
        images, outcome = decode_at_quality(vae, quality, decode)
    return io.NodeOutput(images_like_vae_decode(images),
                         ui={"text": [outcome.text()], "fast_vae_decode": [outcome.as_ui()]})
