"""What every SpecPipe program does with its heap: freeze it once the model has loaded, and on the way out.

A service's start-up leaves hundreds of thousands of long-lived objects (torch, transformers, the model,
the tokenizer: ~390,000 in a coordinator holding the default model's draft). Python's cyclic collector walks
all of them on each full collection — CPython runs one once the objects that survived since the last reach a
quarter of those that survived it, so rarely but at no moment of our choosing: ~160-180 ms during which the
process does nothing else (2-core dev machine), at GPU stage times a stall of some twenty tokens for every
stream. Frozen (`gc.freeze`), they are left out of every collection.

    as_program()     # the entry point: this process is a SpecPipe program, not a test or an embedding app
    ...load the model...
    after_load()     # collect what loading left, freeze the rest
    ...serve...
    before_exit()    # freeze everything: the interpreter's last collections skip it
"""
from __future__ import annotations

import gc

_program = False


def as_program() -> None:
    """Called first by each program's entry point (the `specpipe` console script, the services' `__main__`):
    the process runs SpecPipe for its lifetime, so `after_load` freezes its heap. Tests and applications that
    import the services in their own process never call it: their heap is theirs. Freezes what the imports
    made so far, so that the full collections loading triggers walk only what loading makes."""
    global _program
    _program = True
    gc.freeze()


def after_load(replaced: bool = False) -> int:
    """Start-up (or a stage's re-configure) has loaded a model: in a program, collect what is not frozen and
    freeze what is alive. `replaced`: a model was dropped (a re-configure), so unfreeze first: what it left in
    reference cycles is freed too (one full collection, ~0.2 s). Returns how many objects are frozen (0
    outside a program)."""
    if not _program:
        return 0
    if replaced:
        gc.unfreeze()
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def before_exit() -> None:
    """Move every live object into the collector's permanent generation (`gc.freeze`), so the collections
    the interpreter runs at shutdown do not walk the millions of objects torch, transformers and a model
    leave behind. Atexit handlers still run, and so do the finalizers of objects freed by reference
    counting; objects held only by reference cycles at that moment are never collected (their `__del__`
    does not run): call it last, once the process's own resources are closed. A stage process holding a
    SmolLM2 shard exits in ~0.2 s instead of ~1.3 s (2-core dev machine); `specpipe run` stops four at once."""
    gc.freeze()
