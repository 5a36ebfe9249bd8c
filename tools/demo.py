"""The demo checkpoint: a tiny random Qwen3.5 made on first use in a cache folder, so the server runs anywhere."""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)


def cache_dir() -> str:
    root = os.environ.get("DELTASERVE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "deltaserve"
    )
    return os.path.join(root, "demo-tiny")


def demo_checkpoint() -> str:
    path = cache_dir()
    if not os.path.isfile(os.path.join(path, "config.json")):
        from .make_checkpoint import write_checkpoint

        log.info("no --model given: making the demo checkpoint (tiny, random weights) in %s", path)
        tmp = path + f".tmp{os.getpid()}"
        write_checkpoint(tmp, "tiny")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        try:
            os.rename(tmp, path)
        except OSError:  # another process made it first
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
    log.info("serving the demo checkpoint at %s (random weights: its text is noise)", path)
    return path
