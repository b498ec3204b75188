"""The pack's logger and say-it-once helpers: a fallback reason is logged once per session.

Never key "once" on ``id(obj)``: a later object at a freed object's address would go silent.
Once per object is ``log_once_for`` (a weak per-object record), or plain ``say`` where the event
happens once per object by nature.
"""
from __future__ import annotations

import logging
import threading
import weakref

logger = logging.getLogger("fast_vae_decode")

_SAID: set[str] = set()
_SAID_FOR: "weakref.WeakKeyDictionary[object, set[str]]" = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def log_once(key: str, message: str, level: int = logging.INFO) -> bool:
    """Log ``message`` the first time ``key`` is seen; returns whether it was logged."""
    with _LOCK:
        if key in _SAID:
            return False
        _SAID.add(key)
    say(message, level)
    return True


def log_once_for(obj: object, key: str, message: str, level: int = logging.INFO) -> bool:
    """Log ``message`` the first time ``key`` is seen for the live object ``obj`` (which must
    be weak-referenceable and hash by identity, as ``nn.Module``s do); the record goes with
    the object, so a new object never inherits it."""
    with _LOCK:
        said = _SAID_FOR.setdefault(obj, set())
        if key in said:
            return False
        said.add(key)
    say(message, level)
    return True


def say(message: str, level: int = logging.INFO) -> None:
    """Log ``message`` now, for events that by their nature happen once (no key to remember)."""
    logger.log(level, "[Fast VAE Decode] %s", message)
