"""``FastVAEDecodeTiled``: ComfyUI's tiled VAE decode with the quality switch, per tile."""
from __future__ import annotations

from comfy_api.latest import io

from ..fastpath.quality import DEFAULT_QUALITY, QUALITIES
from .fast_vae_decode import CATEGORY, QUALITY_TOOLTIP, decode_node_output
from .latent import latent_samples
from .tiling import tile_args


class FastVAEDecodeTiled(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="FastVAEDecodeTiled",
            display_name="Fast VAE Decode Tiled (quality)",
            category=CATEGORY,
            description=(
                "Decodes latents tile by tile like VAE Decode (Tiled), for large images and "
                "long videos. quality=high runs the fused kernels on every tile; "
                "quality=lossless is bit-exact with VAE Decode (Tiled)."),
            inputs=[
                io.Latent.Input("samples", tooltip="The latent to decode."),
                io.Vae.Input("vae", tooltip="The VAE that matches the model that made the latent."),
                io.Int.Input("tile_size", default=512, min=64, max=4096, step=32,
                             tooltip="Tile edge in pixels."),
                io.Int.Input("overlap", default=64, min=0, max=4096, step=32,
                             tooltip="Overlap between tiles in pixels (at most a quarter tile)."),
                io.Int.Input("temporal_size", default=64, min=8, max=4096, step=4,
                             tooltip="Only used for video VAEs: frames decoded at a time."),
                io.Int.Input("temporal_overlap", default=8, min=4, max=4096, step=4,
                             tooltip="Only used for video VAEs: frames of overlap."),
                io.Combo.Input("quality", options=list(QUALITIES), default=DEFAULT_QUALITY,
                               tooltip=QUALITY_TOOLTIP),
            ],
            outputs=[io.Image.Output(tooltip="The decoded image(s); video latents become frames.")],
        )

    @classmethod
    def execute(cls, samples, vae, tile_size=512, overlap=64, temporal_size=64,
                temporal_overlap=8, quality=DEFAULT_QUALITY) -> io.NodeOutput:
        latent = latent_samples(samples, vae)
        args = tile_args(vae, tile_size, overlap, temporal_size, temporal_overlap)
        # ComfyUI's tiled decode advances the node's progress bar per tile itself.
        return decode_node_output(vae, quality, lambda: vae.decode_tiled(latent, **args.as_kwargs()),
                                  progress_bar=False)
