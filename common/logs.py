"""structlog, configured once per process: readable on a terminal, JSON otherwise.

SPECPIPE_LOG_FORMAT=json|console overrides the choice; SPECPIPE_LOG_LEVEL sets the level (default info).
Context (stage, request_id, step) is bound with structlog.contextvars.bind_contextvars.
"""
from __future__ import annotations

import logging
import os
import sys

import structlog

_configured = False


def configure(fmt: str | None = None, level: str | None = None) -> None:
    global _configured
    if _configured and fmt is None and level is None:
        return
    fmt = fmt or os.environ.get("SPECPIPE_LOG_FORMAT") or ("console" if sys.stderr.isatty() else "json")
    level_name = (level or os.environ.get("SPECPIPE_LOG_LEVEL") or "info").upper()
    renderer = structlog.processors.JSONRenderer() if fmt == "json" else structlog.dev.ConsoleRenderer(colors=False)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level_name, logging.INFO)),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
    _configured = True


def get_logger(name: str) -> structlog.stdlib.BoundLogger:
    configure()
    return structlog.get_logger(name)
