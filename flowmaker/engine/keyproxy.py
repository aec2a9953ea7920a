"""An API-key check in front of an engine that has none of its own (TensorRT-LLM's `trtllm-serve` has no
`--api-key`: NVIDIA/TensorRT-LLM#9950).

    python -m flowmaker.engine.keyproxy --host H --port P -- trtllm-serve MODEL --host H --port P ...

runs the engine command with its `--host` rewritten to 127.0.0.1 and its `--port` to a free loopback port,
and serves H:P itself: every `/v1/...` request must carry `Authorization: Bearer <key>` (the key from
`FLOWMAKER_ENGINE_API_KEY`, as the deployer passes it to every engine) or gets vLLM's answer, 401
`{"error": "Unauthorized"}`; everything else (`/health`, `/metrics`) passes, as with vLLM's `--api-key`.
Requests and responses are relayed as they come (streams included). The engine never sees the key
(it is removed from its environment). The proxy exits with the engine's exit code when the engine ends,
and stops the engine when it is stopped; it sits in the engine's process group, so the deployer's
group kill reaches both.
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import os
import signal
import sys
from collections.abc import Sequence

import aiohttp
from aiohttp import web

from flowmaker.ports import free_port

KEY_ENV = "FLOWMAKER_ENGINE_API_KEY"
KEY_VARS = ("FLOWMAKER_ENGINE_API_KEY", "VLLM_API_KEY")  # never handed to the engine behind the proxy
_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailers",
                  "transfer-encoding", "upgrade", "host", "content-length", "authorization"})


def upstream_command(argv: Sequence[str], port: int) -> list[str]:
    """`argv` with the value after `--host` set to 127.0.0.1 and after `--port` to `port` (added when absent)."""
    out = list(argv)
    for flag, value in (("--host", "127.0.0.1"), ("--port", str(port))):
        if flag in out[1:]:
            i = out.index(flag, 1)
            if i + 1 < len(out):
                out[i + 1] = value
                continue
        out += [flag, value]
    return out


def authorized(header: str | None, key: str) -> bool:
    if not header or not header.startswith("Bearer "):
        return False
    return hmac.compare_digest(header[7:].encode(), key.encode())


def make_app(key: str, upstream: str) -> web.Application:
    session: dict[str, aiohttp.ClientSession] = {}

    async def start(app: web.Application) -> None:
        session["s"] = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None), auto_decompress=False)

    async def stop(app: web.Application) -> None:
        await session["s"].close()

    async def relay(request: web.Request) -> web.StreamResponse:
        if request.path.startswith("/v1") and not authorized(request.headers.get("Authorization"), key):
            return web.json_response({"error": "Unauthorized"}, status=401)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        body = await request.read()
        try:
            async with session["s"].request(request.method, upstream + request.rel_url.raw_path_qs, headers=headers,
                                            data=body or None, allow_redirects=False) as r:
                resp = web.StreamResponse(status=r.status, reason=r.reason)
                for k, v in r.headers.items():
                    if k.lower() not in _HOP:
                        resp.headers.add(k, v)
                await resp.prepare(request)
                async for chunk in r.content.iter_any():
                    await resp.write(chunk)
                await resp.write_eof()
                return resp
        except aiohttp.ClientConnectionError:
            # The engine is not listening yet (loading weights) or has gone: not ready.
            return web.json_response({"error": "engine unavailable"}, status=503)

    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.on_startup.append(start)
    app.on_cleanup.append(stop)
    app.router.add_route("*", "/{tail:.*}", relay)
    return app


async def run(host: str, port: int, argv: Sequence[str]) -> int:
    key = os.environ.get(KEY_ENV, "")
    if not key:
        print(f"keyproxy: {KEY_ENV} is not set; refusing to serve the engine without a key", file=sys.stderr)
        return 2
    up_port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in KEY_VARS}
    child = await asyncio.create_subprocess_exec(*upstream_command(argv, up_port), env=env)
    runner = web.AppRunner(make_app(key, f"http://127.0.0.1:{up_port}"), access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
        print(f"keyproxy: {host}:{port} -> 127.0.0.1:{up_port} (pid {child.pid}), /v1 requires the key", flush=True)
        loop = asyncio.get_running_loop()
        def forward(sig: int) -> None:
            if child.returncode is None:
                child.send_signal(sig)
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, forward, sig)
        return await child.wait()
    finally:
        if child.returncode is None:
            child.kill()
            await child.wait()
        await runner.cleanup()


def main(args: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m flowmaker.engine.keyproxy", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--host", required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- the engine command")
    ns = ap.parse_args(args)
    cmd = ns.command[1:] if ns.command[:1] == ["--"] else ns.command
    if not cmd:
        ap.error("the engine command is missing (after --)")
    rc = asyncio.run(run(ns.host, ns.port, cmd))
    sys.exit(rc if rc >= 0 else 128 - rc)


if __name__ == "__main__":
    main()
