"""Serving a registry over HTTP without ever taking the training job down.

Shared by the rank and controller exporters. A metrics endpoint is a side
channel: when its port is taken we warn, try a few documented fallback ports,
and finally run without an endpoint rather than raise into a training loop.

Fallback order for a requested `port`: port, port + stride, port + 2*stride,
... (`tries` ports in all). Ranks pass stride = local world size, so rank r
only ever tries base + r + k*W and never steals a port another local rank
wants.
"""

from __future__ import annotations

import sys
import warnings
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, start_http_server

LOOPBACK = ("127.0.0.1", "localhost", "::1")


class MetricsEndpointWarning(UserWarning):
    """The metrics endpoint could not be served as asked (port taken, public bind).

    Silence with `warnings.filterwarnings("ignore", category=MetricsEndpointWarning)`.
    """


def warn(message: str) -> None:
    """Warn without ever raising, even under `-W error` (training must go on)."""
    try:
        warnings.warn(message, MetricsEndpointWarning, stacklevel=3)
    except Warning:
        print(f"warning: {message}", file=sys.stderr, flush=True)


@dataclass(slots=True)
class Endpoint:
    """A running HTTP endpoint; `close()` stops it and frees the port."""

    addr: str
    port: int
    _server: object
    _thread: object

    @property
    def url(self) -> str:
        host = f"[{self.addr}]" if ":" in self.addr else self.addr
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        self._server.shutdown()  # type: ignore[attr-defined]
        self._server.server_close()  # type: ignore[attr-defined]


def serve_registry(
    registry: CollectorRegistry, *, addr: str, port: int, stride: int = 1, tries: int = 8,
    what: str = "metrics",
) -> Endpoint | None:
    """Serve `registry` on addr:port (or a fallback port); None if every try failed.

    Prints `metrics: http://HOST:PORT/metrics` once serving. Port 0 asks the OS
    for a free port (used by tests).
    """
    if addr not in LOOPBACK:
        warn(f"{what} endpoint binds {addr}: anyone who can reach this host can read "
             "it (and slow the job by scraping); bind 127.0.0.1 unless you need remote scrapes")
    stride = max(1, stride)
    candidates = [port] if port == 0 else [port + k * stride for k in range(max(1, tries))]
    errors = []
    for candidate in candidates:
        try:
            server, thread = start_http_server(candidate, addr=addr, registry=registry)
        except OSError as exc:
            errors.append(f"{candidate}: {exc.strerror or exc}")
            continue
        bound = server.server_address[1]
        if candidate != port:
            warn(f"{what} port {port} on {addr} is in use; serving on {bound} instead "
                 f"(tried {', '.join(errors)})")
        endpoint = Endpoint(addr=addr, port=bound, _server=server, _thread=thread)
        print(f"{what}: {endpoint.url}", flush=True)
        return endpoint
    warn(f"{what} endpoint disabled: no free port on {addr} among "
         f"{', '.join(map(str, candidates))} ({'; '.join(errors)}). Training continues "
         "without live metrics; pick another base port to get them back")
    return None
