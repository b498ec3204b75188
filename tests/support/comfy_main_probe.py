"""Run in a fresh process by the tier-3 main.py test: ComfyUI initialised as its ``main.py``
does (its default memory mode: dynamic VRAM on NVIDIA in newer trees), then one VAE decoded by
``VAEDecode`` and by this pack's node at both qualities, once more after another VAE decoded,
then unloaded. Prints one JSON line.

``python comfy_main_probe.py COMFYUI_PATH ARCH [ComfyUI flags...]``
"""
from __future__ import annotations

import importlib.util
import json
import pathlib
import sys

REPO = pathlib.Path(__file__).resolve().parents[2]


def _import_pack():
    spec = importlib.util.spec_from_file_location(
        "fast_vae_decode", REPO / "__init__.py", submodule_search_locations=[str(REPO)])
    module = importlib.util.module_from_spec(spec)
    sys.modules["fast_vae_decode"] = module
    spec.loader.exec_module(module)


def main() -> None:
    comfyui, arch, flags = sys.argv[1], sys.argv[2], sys.argv[3:]
    _import_pack()
    import torch

    from fast_vae_decode.bench.comfyui import memory_mode, setup_comfyui

    nodes = setup_comfyui(pathlib.Path(comfyui).resolve(), flags)
    import comfy.model_management as mm

    from fast_vae_decode.bench.models import comfy_vae
    from fast_vae_decode.fastpath.cache import cache_bytes
    from fast_vae_decode.fastpath.comfyui.decode_batches import (
        batch_memory_source,
        free_memory_for_batches,
    )
    from fast_vae_decode.fastpath.cuda_graph import graph_bytes, graph_status
    from fast_vae_decode.nodes.fast_vae_decode import FastVAEDecode

    vae = comfy_vae(arch, seed=0)
    shape = {"sdxl": (1, 4, 64, 64), "wan21": (1, 16, 3, 30, 52)}[arch]
    z = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    out = {"memory_mode": memory_mode(),
           "dynamic": bool(getattr(vae.patcher, "is_dynamic", lambda: False)())}
    loads = []
    real_load = mm.load_models_gpu

    def counted_load(*args, **kwargs):
        loads.append(1)
        return real_load(*args, **kwargs)

    with torch.inference_mode():
        stock = nodes.VAEDecode().decode(vae, {"samples": z})[0]
        mm.load_models_gpu = counted_load  # counts the loads of the pack's decodes only
        node = FastVAEDecode.execute(samples={"samples": z}, vae=vae, quality="lossless")
        out["lossless_equal"] = bool(torch.equal(node.args[0], stock))
        node = FastVAEDecode.execute(samples={"samples": z}, vae=vae, quality="high")
        high = node.args[0]
        out["high_text"] = node.ui["text"][0]
        out["high_path"] = node.ui["fast_vae_decode"][0]["path"]
        out["high_finite"] = bool(torch.isfinite(high).all())
        mse = torch.mean((high.float() - stock.float()) ** 2).item()
        out["psnr_vs_stock"] = 99.0 if mse == 0 else 10 * torch.log10(torch.tensor(1.0 / mse)).item()
        out["cache_bytes_loaded"] = cache_bytes(vae.first_stage_model)
        node = FastVAEDecode.execute(samples={"samples": z}, vae=vae, quality="lossless")
        out["lossless_after_high_equal"] = bool(torch.equal(node.args[0], stock))
        out["pack_loads"] = len(loads)  # 3 decodes: dynamic VRAM reloads only for the first
        mm.load_models_gpu = real_load
        nodes.VAEDecode().decode(vae, {"samples": z})  # ComfyUI re-prepares the model
        node = FastVAEDecode.execute(samples={"samples": z}, vae=vae, quality="lossless")
        out["lossless_after_stock_equal"] = bool(torch.equal(node.args[0], stock))
        # The second high decode of a shape captures a CUDA graph, the third replays it
        # (KL image decoders): both must give what the eager first one gave.
        again, out["graph_status"] = [], []
        for _ in range(2):
            again.append(FastVAEDecode.execute(samples={"samples": z}, vae=vae, quality="high").args[0])
            out["graph_status"].append(graph_status(vae.first_stage_model))
        out["high_again_equal"] = [bool(torch.equal(h, high)) for h in again]
        out["graph_bytes_loaded"] = graph_bytes(vae.first_stage_model)
        # Another model decodes in between, as a sampler does in a workflow: dynamic VRAM
        # faults the first VAE's weights into new slots, and its graph must still replay.
        nodes.VAEDecode().decode(comfy_vae(arch, seed=1), {"samples": z})
        after = FastVAEDecode.execute(samples={"samples": z}, vae=vae, quality="high").args[0]
        out["after_other_status"] = graph_status(vae.first_stage_model)
        out["high_after_other_equal"] = bool(torch.equal(after, high))
        # The free memory the pack's decode loop splits batches by, asked where VAE.decode asks
        # (0.33+: the patcher, which adds what dynamic VRAM could evict from the other VAE).
        out["batch_source"] = batch_memory_source(type(vae).decode)
        out["batch_free_gib"] = free_memory_for_batches(vae) / 2**30
    mm.unload_all_models()
    mm.soft_empty_cache()
    out["cache_bytes_unloaded"] = cache_bytes(vae.first_stage_model)
    out["graph_bytes_unloaded"] = graph_bytes(vae.first_stage_model)
    print("PROBE " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
