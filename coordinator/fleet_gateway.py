"""The coordinator's public listener: Flower's Fleet API for devices, and nothing else.

In flwr 1.41/1.42 one SuperLink port serves the Fleet API (devices), the Control API (the
operator's ``flwr`` CLI: register a SuperNode key, start a run with an app bundle whose code the
devices import) and the Runtime API (the ServerApp). Without an OIDC plugin the Control API
authenticates nobody, so anyone who can reach the port and holds ``ca.crt`` (which every device
has) could register their own SuperNode key or push an app bundle. Flower's own answer for
bundles, ``--trusted-entities``, needs bundles signed through Flower Hub, which an offline fleet
cannot use.

So the SuperLink listens on loopback only (the operator's CLI and the ServerApp reach it there),
and this gateway is what the devices connect to: it terminates TLS with the fleet's certificate
and forwards ``POST /v1/fleet/...`` requests (byte for byte, headers included, so SuperNode
authentication is still checked by the SuperLink itself) to the loopback SuperLink over TLS.
Every other path is refused with 403. No maintained reverse proxy installs from the package
registries with a path filter and TLS on both sides (nginx and envoy are system packages), so
this is a small Starlette app on uvicorn and httpx, the libraries Flower itself runs on.
"""

from __future__ import annotations

import contextlib
import ssl
import threading
import time
from pathlib import Path

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

FLEET_PREFIX = "/v1/fleet/"
HOP_HEADERS = frozenset(
    {
        "host",
        "content-length",
        "transfer-encoding",
        "connection",
        "keep-alive",
        "upgrade",
        "te",
        "trailer",
        "proxy-authorization",
        "proxy-authenticate",
    }
)
UPSTREAM_TIMEOUT_S = 600.0  # a pull of a multi-MB state over a slow link
STARTUP_S = 15.0  # longest wait for the listener to come up


def gateway_app(upstream: str, ca_cert: str | Path) -> Starlette:
    """The ASGI app: ``POST /v1/fleet/*`` forwarded to ``upstream`` (``https://127.0.0.1:PORT``,
    verified against ``ca_cert``); any other method or path answers 403."""
    client = httpx.AsyncClient(
        base_url=upstream, verify=ssl.create_default_context(cafile=str(ca_cert)), timeout=UPSTREAM_TIMEOUT_S
    )

    async def forward(request: Request) -> Response:
        path = request.url.path
        if request.method != "POST" or not path.startswith(FLEET_PREFIX) or ".." in path:
            return PlainTextResponse("only the Fleet API is served here\n", status_code=403)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
        try:
            reply = await client.post(path, content=await request.body(), headers=headers)
        except httpx.HTTPError:
            return PlainTextResponse("the SuperLink is not reachable\n", status_code=502)
        return Response(
            reply.content,
            status_code=reply.status_code,
            headers={k: v for k, v in reply.headers.items() if k.lower() not in HOP_HEADERS | {"content-encoding"}},
        )

    @contextlib.asynccontextmanager
    async def lifespan(_app: Starlette):
        yield
        await client.aclose()

    return Starlette(
        routes=[Route("/{path:path}", forward, methods=["GET", "POST", "PUT", "DELETE", "PATCH"])], lifespan=lifespan
    )


def serve_gateway(
    host: str, port: int, upstream: str, *, ca_cert: str | Path, certfile: str | Path, keyfile: str | Path
) -> tuple[uvicorn.Server, threading.Thread]:
    """Start the gateway on ``host:port`` with TLS (``certfile``/``keyfile``) in a daemon
    thread; returns the server (``should_exit = True`` stops it) and its thread once it
    listens. OSError when it cannot start (a certificate or key file missing, the port taken)."""
    for path in (ca_cert, certfile, keyfile):
        if not Path(path).is_file():
            raise OSError(f"the gateway did not start on {host}:{port}: no file {path}")
    config = uvicorn.Config(
        gateway_app(upstream, ca_cert),
        host=host,
        port=port,
        ssl_certfile=str(certfile),
        ssl_keyfile=str(keyfile),
        log_level="warning",
        lifespan="on",
    )
    server = uvicorn.Server(config)
    failed: list[BaseException | None] = []

    def run() -> None:
        try:
            server.run()
        except (OSError, SystemExit) as exc:  # a bad certificate raises; a taken port: uvicorn logs it and exits
            if server.started:
                raise
            failed.append(exc.__context__ if isinstance(exc, SystemExit) else exc)  # said below in one line

    thread = threading.Thread(target=run, name="fleet-gateway", daemon=True)
    thread.start()
    deadline = time.monotonic() + STARTUP_S
    while not server.started and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    if not server.started:
        server.should_exit = True
        cause = failed[0] if failed else None
        why = f": {cause.strerror or cause}" if isinstance(cause, OSError) else ""
        raise OSError(f"the gateway did not start on {host}:{port}{why}")
    return server, thread
