"""The command-line entry's parts: seeded random-weight VAEs (``models``), the demo, the
benchmark (cases, subjects, timing, results) and ComfyUI in-process set-up.

Nothing here imports ComfyUI or diffusers at import time.
"""
