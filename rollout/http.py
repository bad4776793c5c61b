"""The rollouts' HTTP surface on an admin port (the control plane's, the operator's), behind its
guard (meshfn.common.adminauth): GET /rollouts (what `meshfn rollout status` shows; any role)
and POST /rollouts/actions {"rollout": NAME, "action": promote|abort|pause|resume}: the auditor
role, with a token (never a console session), recorded as the principal the guard
authenticated. It takes JSON only: a page on another origin cannot send that without a CORS
preflight, which these ports never grant."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from meshfn.common import peerjson
from meshfn.common.adminauth import AUDITOR, Forbidden, require

from .controller import ActionError, Event

Act = Callable[[str, str, str], Awaitable[Event]]
Documents = Callable[[], list[dict[str, Any]]]


def add_routes(app: web.Application, documents: Documents, act: Act) -> None:
    async def rollouts(_: web.Request) -> web.Response:
        return web.json_response({"rollouts": documents()})

    async def actions(request: web.Request) -> web.Response:
        return await _action(request, documents, act)

    app.router.add_get("/rollouts", rollouts)
    app.router.add_post("/rollouts/actions", actions)


async def _action(request: web.Request, documents: Documents, act: Act) -> web.Response:
    principal = require(request, AUDITOR)
    if principal.via == "session":  # a browser's cookie: never the way to move traffic
        raise Forbidden("rollout actions take a token (meshfn rollout), not a console session")
    if request.content_type != "application/json":
        return web.json_response({"error": "send application/json"}, status=415)
    try:
        body = peerjson.loads(await request.read())
    except ValueError:
        return web.json_response({"error": "the body is not JSON"}, status=400)
    if not isinstance(body, dict) or not all(
        isinstance(body.get(k), str) for k in ("rollout", "action")
    ):
        return web.json_response({"error": "give rollout and action (strings)"}, status=400)
    try:
        event = await act(body["rollout"], body["action"], principal.name)
    except ActionError as exc:
        return web.json_response({"error": str(exc)}, status=exc.status)
    rollout = next(d for d in documents() if d["rollout"] == event.rollout)
    return web.json_response({"event": event.describe(), "rollout": rollout})
