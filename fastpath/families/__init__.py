"""Built-in VAE families; each module registers itself with ``install.register_family``.

A family module that fails to import (a newer ComfyUI renamed something) is skipped: its VAEs
simply take the stock path.
"""
from __future__ import annotations

import importlib

from ..log import log_once

for _name in ("kl", "wan", "ltx"):
    try:
        importlib.import_module(f"{__name__}.{_name}")
    except Exception as _exc:  # pragma: no cover - depends on the ComfyUI tree
        log_once(f"family-import:{_name}", f"family {_name} unavailable: {_exc}")
