"""The pack's logger and say-it-once helper: a fallback reason is logged once per session."""
from __future__ import annotations

import logging
import threading

logger = logging.getLogger("fast_vae_decode")

_SAID: set[str] = set()
_LOCK = threading.Lock()


def log_once(key: str, message: str, level: int = logging.INFO) -> bool:
    """Log ``message`` the first time ``key`` is seen; returns whether it was logged."""
    with _LOCK:
        if key in _SAID:
            return False
        _SAID.add(key)
    say(message, level)
    return True


def say(message: str, level: int = logging.INFO) -> None:
    """Log ``message`` now, for events that by their nature happen once (no key to remember)."""
    logger.log(level, "[Fast VAE Decode] %s", message)
