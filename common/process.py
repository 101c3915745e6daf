"""What every SpecPipe process does on its way out (the stage, the coordinator, the CLI)."""
from __future__ import annotations

import gc


def before_exit() -> None:
    """Move every live object into the collector's permanent generation (`gc.freeze`), so the collections
    the interpreter runs at shutdown do not walk the millions of objects torch, transformers and a model
    leave behind. Atexit handlers still run, and so do the finalizers of objects freed by reference
    counting; objects held only by reference cycles at that moment are never collected (their `__del__`
    does not run): call it last, once the process's own resources are closed. A stage process holding a
    SmolLM2 shard exits in ~0.2 s instead of ~1.3 s (2-core dev machine); `specpipe run` stops four at once."""
    gc.freeze()
