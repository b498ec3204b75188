"""The pack's command line run in-process: ``bench.cli.main(argv)`` with its stdout kept."""
from __future__ import annotations

import contextlib
import io

from fast_vae_decode.bench.cli import main


def run_cli(argv: list[str]) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(argv)
    return code, out.getvalue()
