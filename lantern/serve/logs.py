"""One JSON object per log line: the record's time, level, logger and message, plus its `fields` (a request's
id, status, outcome, latencies ...), and the trace of an error."""
from __future__ import annotations

import json
import logging
import sys
from datetime import datetime, timezone


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = {"ts": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
                "level": record.levelname.lower(), "logger": record.name, "message": record.getMessage(),
                **getattr(record, "fields", {})}
        if record.exc_info:
            line["trace"] = self.formatException(record.exc_info)
        return json.dumps(line)


def log_json_to_stderr(logger: logging.Logger, level: int = logging.INFO) -> logging.Handler:
    """Send `logger`'s records to stderr as JSON lines (the serve command calls this; the library configures
    no logging itself). Returns the handler, so a caller can remove it."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False
    return handler
