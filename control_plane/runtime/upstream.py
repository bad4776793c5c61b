"""The placeholder upstream: what `meshfn up` runs behind a loopback endpoint of a service that
serves no functions (those get the inference backend; runtime.upstreams chooses).

Answers every request with JSON naming the service, endpoint and locality that served it, the
caller's identity as the sidecar passed it on, and how many requests it has served, with an ORCA
load report like the backend's, so a user (and the e2e tests) can see where Envoy routed a
request. A delay file injects latency into a running upstream (drift and failover demos).
Run as `python -P -m meshfn.control_plane.runtime.upstream --service ns/name --port N`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections import deque
from pathlib import Path

from aiohttp import web

from meshfn.common.unix import listen_private
from meshfn.contracts.qos import ORCA_HEADER, orca_text


def make_app(
    service: str, endpoint: str, locality: str, delay_file: Path | None = None
) -> web.Application:
    served = 0  # lets tests prove that denied requests never reached the application
    inflight = 0
    recent: deque[float] = deque()  # answer times of the last second (the ORCA report's rps)

    async def handle(request: web.Request) -> web.Response:
        nonlocal served, inflight
        served += 1
        inflight += 1
        try:
            delay = _delay_ms(delay_file)
            if delay:
                await asyncio.sleep(delay / 1000)
        finally:
            inflight -= 1
        now = time.monotonic()
        recent.append(now)
        while recent[0] < now - 1.0:
            recent.popleft()
        body = {
            "service": service,
            "endpoint": endpoint,
            "locality": locality,
            "method": request.method,
            "path": request.path_qs,
            "pid": os.getpid(),
            "requests": served,
            # What the sidecar tells the application about the caller (mTLS identity, claims).
            "client_cert": request.headers.get("x-forwarded-client-cert", ""),
            "tenant": request.headers.get("x-tenant", ""),
            "headers": sorted({name.lower() for name in request.headers}),
        }
        return web.Response(
            text=json.dumps(body) + "\n",
            content_type="application/json",
            headers={
                "x-meshfn-service": service,
                "x-meshfn-endpoint": endpoint,
                # Load as the inference backend reports it (one request at a time is "busy").
                ORCA_HEADER: orca_text(inflight + 1, 1, len(recent)),
            },
        )

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    return app


def _delay_ms(path: Path | None) -> float:
    """Injected latency for demos and failover tests: milliseconds read from a file per request,
    so a test can make a running upstream slow (and fast again) without restarting it."""
    if path is None:
        return 0.0
    try:
        return max(0.0, float(path.read_text().strip() or 0))
    except (OSError, ValueError):
        return 0.0


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--service", required=True, help="namespace/name")
    parser.add_argument("--address", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--locality", default="")
    parser.add_argument("--delay-file", type=Path, help="inject latency: ms read per request")
    parser.add_argument(
        "--unix-socket",
        type=Path,
        help="listen on this unix socket (mode 0600) instead of address:port, which then only "
        "names the endpoint",
    )
    args = parser.parse_args(argv)
    endpoint = f"{args.address}:{args.port}"
    app = make_app(args.service, endpoint, args.locality, args.delay_file)
    if args.unix_socket is not None:
        sock = listen_private(args.unix_socket)
        try:
            web.run_app(app, sock=sock, access_log=None, print=None, backlog=1024)
        finally:
            args.unix_socket.unlink(missing_ok=True)
    else:
        web.run_app(
            app, host=args.address, port=args.port, access_log=None, print=None, backlog=1024
        )
    sys.exit(0)


if __name__ == "__main__":
    main()
