"""ComfyUI adapters: node schemas, execute(), the unload hook and UI text. Imports comfy_api."""
