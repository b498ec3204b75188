"""``WanVAEDecodePrecision``: a copy of a Wan VAE whose decoder runs at another precision."""
from __future__ import annotations

from comfy_api.latest import io

from ..fastpath.families.wan.precision import PRECISIONS, with_decoder_precision
from .fast_vae_decode import CATEGORY


class WanVAEDecodePrecision(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="WanVAEDecodePrecision",
            display_name="Wan VAE Decode Precision",
            category=CATEGORY,
            description=(
                "Returns a new Wan VAE whose decoder runs at the chosen precision while its "
                "encoder stays fp32. The VAE you give it is not changed."),
            inputs=[
                io.Vae.Input("vae", tooltip="A Wan 2.1, Wan 2.2 or Qwen-Image VAE."),
                io.Combo.Input("precision", options=list(PRECISIONS), default="bf16",
                               tooltip="fp32: exact reference, slowest. bf16: fast, robust range. "
                                       "fp16: fast; refused with a clear error if it overflows."),
            ],
            outputs=[io.Vae.Output(tooltip="The VAE to decode with (use it in Fast VAE Decode).")],
        )

    @classmethod
    def execute(cls, vae, precision="bf16") -> io.NodeOutput:
        return io.NodeOutput(with_decoder_precision(vae, precision))
