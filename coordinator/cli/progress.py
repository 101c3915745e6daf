"""Progress of the one-time conversion of the embedded default model, on stderr.

The loader (services/model/loader.py) announces what it converts and where, and how long it took; on a
terminal the seconds in between tick on one line. A model that is ready already says nothing.
"""
from __future__ import annotations

import contextlib
import io
import sys
import threading
import time
from typing import TextIO


class ConversionProgress:
    """The `log` of resolve_model: prints the loader's messages; on a terminal, from the first message until
    the next one (or the end of the `with` block), ticks the seconds passing on one line."""

    def __init__(self, stream: TextIO | None = None, interval_s: float = 1.0) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.interval_s = interval_s
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._ticked = False

    def __call__(self, message: str) -> None:
        first = self._thread is None
        if not first:
            self._halt()
        with self._lock:
            self._clear()
            print(message, file=self.stream, flush=True)
        if first and _isatty(self.stream):
            self._thread = threading.Thread(target=self._tick, args=(time.monotonic(),), daemon=True)
            self._thread.start()

    def _tick(self, started: float) -> None:
        while not self._stop.wait(self.interval_s):
            with self._lock:
                self.stream.write(f"\r  ... {time.monotonic() - started:.0f} s")
                self.stream.flush()
                self._ticked = True

    def _clear(self) -> None:
        if self._ticked:
            self.stream.write("\r\x1b[K")
            self._ticked = False

    def _halt(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        with self._lock:
            self._clear()
            self.stream.flush()

    def __enter__(self) -> "ConversionProgress":
        return self

    def __exit__(self, *exc: object) -> None:
        self._halt()


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def resolve_with_progress(spec: str) -> str:
    """resolve_model, showing the one-time conversion of the default model on stderr. What the libraries
    print meanwhile (transformers' progress bars: three, one of them not switchable) is dropped."""
    from services.model.loader import resolve_model

    with ConversionProgress(sys.stderr) as log, contextlib.redirect_stderr(io.StringIO()):
        return resolve_model(spec, log)
