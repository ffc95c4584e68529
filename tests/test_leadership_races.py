"""Leadership's races on a real etcd: a resign that lands while a call is out must leave
no key behind and no leader. Etcd is reached through a proxy that holds chosen calls."""

from __future__ import annotations

import asyncio
from itertools import count

import aiohttp
from aiohttp import web

from narwhal.etcd import Etcd
from narwhal.router.config import HA
from narwhal.router.ha.leadership import Leadership, Role
from tests.support import EtcdServer

_keys = count()


async def holding(target: str, path: str, hold_s: float) -> tuple[web.AppRunner, str]:
    """A proxy to `target` that holds every call to `path` for `hold_s` before passing it."""
    session = aiohttp.ClientSession()

    async def forward(request: web.Request) -> web.Response:
        body = await request.read()
        if request.path == path:
            await asyncio.sleep(hold_s)
        async with session.post(target + request.path, data=body) as r:
            return web.Response(status=r.status, body=await r.read())

    app = web.Application()
    app.router.add_post("/{tail:.*}", forward)
    app.on_cleanup.append(lambda _: session.close())
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    return runner, f"http://127.0.0.1:{port}"


def test_a_resign_while_the_lease_grant_is_out_leaves_no_key(etcd: EtcdServer) -> None:
    async def main() -> None:
        runner, url = await holding(etcd.url, "/v3/lease/grant", 0.5)
        key = f"/r{next(_keys)}/leader"
        lead = Leadership(HA((url,), key, 30))
        task = asyncio.create_task(lead.run_forever())
        await asyncio.sleep(0.2)  # the grant is out
        await lead.resign()
        await asyncio.wait_for(task, 5)
        direct = Etcd([etcd.url])
        try:
            # With a 30 s TTL, a key put on the late lease would outlive the router by 30 s.
            assert await direct.get(key.encode()) is None
        finally:
            await direct.close()
            await lead.close()
            await runner.cleanup()

    asyncio.run(main())


def test_a_resign_during_the_take_over_hook_never_leaves_it_leading(etcd: EtcdServer) -> None:
    async def main() -> None:
        key = f"/r{next(_keys)}/leader"
        lead = Leadership(HA((etcd.url,), key, 30))
        hook_started = asyncio.Event()
        proceed = asyncio.Event()

        async def take_over() -> None:  # reads the wave and profiles: takes a while
            hook_started.set()
            await proceed.wait()

        lead.on_lead = take_over
        task = asyncio.create_task(lead.run_forever())
        await asyncio.wait_for(hook_started.wait(), 5)
        await lead.resign()  # SIGUSR1 arrives now
        proceed.set()
        await asyncio.wait_for(task, 5)
        direct = Etcd([etcd.url])
        try:
            assert lead.role is Role.STOPPING and lead.serving() is not None
            assert await direct.get(key.encode()) is None
        finally:
            await direct.close()
            await lead.close()

    asyncio.run(main())
