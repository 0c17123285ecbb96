"""Prefill's bootstrap server (SGLang's port 8998): the KV handoff between decode and prefill.

Decode registers each room with `POST /pdsim/room` (its session id and process start time ride
along, which is how prefill notices a decode that restarted under it) and keeps the response open:
prefill streams the room's states as JSON lines, `waiting` (registered: KVPoll.WaitingForInput),
`transferring`, then `success`, `failed` or `aborted`. The response names the prefill incarnation
(decode caches it per address, as SGLang's connection_pool); a registration naming an earlier
incarnation is refused with 409. A decode that dies closes the stream;
prefill sees that when it tries to send the KV. `GET /health` is static, as SGLang's: it only
proves the bootstrap listener is alive.
"""

from __future__ import annotations

import json

from aiohttp import web

from pdsim.engine import SESSION_HEADER, PrefillEngine, Registration

FINAL_STATES = ("success", "failed", "aborted")


def build_bootstrap_app(engine: PrefillEngine) -> web.Application:
    async def health(_request: web.Request) -> web.Response:
        return web.Response(text="OK")

    async def route(_request: web.Request) -> web.Response:
        # What SGLang's bootstrap server answers decode about the prefill's parallel layout.
        return web.json_response(
            {
                "prefill_attn_tp_size": engine.cfg.tp_size,
                "prefill_dp_size": 1,
                "prefill_pp_size": 1,
                "prefill_page_size": 1,
            }
        )

    async def room(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        try:
            reg = Registration(
                room=int(body["room"]),
                rid=str(body.get("rid", "")),
                session_id=str(body["session_id"]),
                decode_start_time=float(body["start_time"]),
                decode_url=str(body.get("decode_url", "")),
                is_closing=lambda: request.transport is None or request.transport.is_closing(),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise web.HTTPBadRequest(text=f"bad registration: {exc}") from None
        cached = body.get("prefill_session")
        if cached is not None and cached != engine.session_id:
            # Decode reused the metadata of the prefill process this one replaced at the same
            # address: in SGLang its send goes to that process's rank ports and never arrives.
            raise web.HTTPConflict(text="stale prefill bootstrap metadata")
        resp = web.StreamResponse(
            headers={"Content-Type": "application/x-ndjson", SESSION_HEADER: engine.session_id}
        )
        await resp.prepare(request)
        engine.register_room(reg)
        try:
            await resp.write(b'{"state": "waiting"}\n')
            while True:
                event = await reg.events.get()
                await resp.write(json.dumps(event).encode() + b"\n")
                if event["state"] in FINAL_STATES:
                    break
        except ConnectionResetError:
            pass
        finally:
            engine.unregister_room(reg)
        return resp

    async def room_abort(request: web.Request) -> web.Response:
        body = await request.json()
        engine.decode_aborted_room(int(body["room"]))
        return web.json_response({"ok": True})

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/route", route)
    app.router.add_post("/pdsim/room", room)
    app.router.add_post("/pdsim/room/abort", room_abort)
    return app
