"""Pixel output: decoded latents to finished host pixels (the GPU-side finish, host copies
through pinned staging, and frames streamed while a video decoder still runs)."""
