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

import socket
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

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
    what: str = "metrics", version: Callable[[], int] | None = None, min_render_interval: float = 0.0,
) -> Endpoint | None:
    """Serve `registry` on addr:port (or a fallback port); None if every try failed.

    Prints `metrics: http://HOST:PORT/metrics` once serving. Port 0 asks the OS
    for a free port (used by tests). With `version` (a counter that changes
    whenever the registry's content does), see `cached_app`.
    """
    if addr not in LOOPBACK:
        warn(f"{what} endpoint binds {addr}: anyone who can reach this host can read "
             "it (and slow the job by scraping); bind 127.0.0.1 unless you need remote scrapes")
    app = make_wsgi_app(registry)
    if version is not None:
        app = cached_app(app, version, min_render_interval)
    stride = max(1, stride)
    candidates = [port] if port == 0 else [port + k * stride for k in range(max(1, tries))]
    errors = []
    for candidate in candidates:
        try:
            server, thread = _start_server(addr, candidate, app)
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


WsgiApp = Callable[[dict, Callable], Iterable[bytes]]


def cached_app(app: WsgiApp, version: Callable[[], int], min_render_interval: float) -> WsgiApp:
    """Render once per content version, not once per scrape.

    Rendering the exposition costs about 1 ms of Python under the training
    process's GIL; 50 scrapers a second would take that from the training
    thread 50 times. Here a scrape reuses the last rendering while `version()`
    is unchanged (the bytes would be identical), and while the last rendering
    is younger than `min_render_interval` seconds (bounded staleness: at most
    1 / min_render_interval renderings a second, however many scrapers).
    Concurrent scrapes wait for one rendering instead of each making their own.
    Responses are kept per request shape (Accept, Accept-Encoding, query), so
    Prometheus' OpenMetrics negotiation and gzip work as before.
    """
    lock = threading.Lock()
    cache: dict[tuple, tuple[int, float, str, list, bytes]] = {}

    def serve(environ: dict, start_response: Callable) -> Iterable[bytes]:
        if environ.get("REQUEST_METHOD") != "GET":
            return app(environ, start_response)
        key = (environ.get("PATH_INFO"), environ.get("QUERY_STRING", ""),
               environ.get("HTTP_ACCEPT"), environ.get("HTTP_ACCEPT_ENCODING"))
        with lock:
            now, current = time.monotonic(), version()
            hit = cache.get(key)
            if hit is None or (hit[0] != current and now - hit[1] >= min_render_interval):
                got: dict = {}

                def capture(status: str, headers: list, exc_info: object = None) -> None:
                    got["status"], got["headers"] = status, headers

                body = b"".join(app(environ, capture))
                if len(cache) >= 16:  # odd request shapes must not grow memory
                    cache.clear()
                hit = cache[key] = (current, now, got["status"], got["headers"], body)
        start_response(hit[2], list(hit[3]))
        return [hit[4]]

    return serve


SHUTDOWN_POLL_SECONDS = 0.05
"""How often the serving loop checks for `close()` (socketserver's default, 0.5 s, is paid by
every rank at the end of every trial: a warm trial is 4-7 s long)."""


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 (the base's name)
        pass  # one line per scrape would flood the training log


def _start_server(addr: str, port: int, app: WsgiApp) -> tuple[ThreadingWSGIServer, threading.Thread]:
    """prometheus_client's start_http_server, with our WSGI app (daemon thread, quiet)."""
    family, _, _, _, sockaddr = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)[0]

    class Server(ThreadingWSGIServer):
        address_family = family

    server = make_server(sockaddr[0], port, app, Server, handler_class=_QuietHandler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": SHUTDOWN_POLL_SECONDS},
                              daemon=True, name=f"metrics:{port}")
    thread.start()
    return server, thread
