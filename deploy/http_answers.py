"""What the HTTP front answers on its own: the error it raises for a request it refuses, status
reasons, and the messages it keys on or sends (a full queue, a stream cut short).

Both `deploy.http_front` (the proxy) and `deploy.generate_front` (/generate over gRPC) answer with
these; `http_front` re-exports them.
"""
from __future__ import annotations

import json

QUEUE_FULL = b"the waiting queue is full"   # the scheduler's QueueFullError message: a 503
RETRY_AFTER_S = 1
STREAM_CUT = ("tritonserver closed the stream before it finished (it died, or was restarted because its model "
              "stub died); the request did not complete: retry")


class HttpError(Exception):
    """A request refused here: status, message (sent as Triton's {"error": ...}, or the front's
    `error_body`), close after. `field`: the request field at fault, when there is one. `sse`:
    sent as one SSE error event, as tritonserver answers on /generate_stream."""

    def __init__(self, status: int, message: str, field: str | None = None, sse: bool = False):
        super().__init__(message)
        self.status = status
        self.field = field
        self.sse = sse


REASONS = {400: "Bad Request", 404: "Not Found", 408: "Request Timeout", 413: "Payload Too Large",
           431: "Request Header Fields Too Large", 501: "Not Implemented", 502: "Bad Gateway",
           503: "Service Unavailable", 505: "HTTP Version Not Supported"}


def cut_event(upstream_name: str) -> bytes:
    """The SSE error event of a stream the server behind cut short."""
    cut = STREAM_CUT if upstream_name == "tritonserver" else \
        f"{upstream_name} closed the stream before it finished; the request did not complete: retry"
    return b"data: " + json.dumps({"error": cut}).encode() + b"\n\n"
