"""Bodies over 64 KiB are parsed and translated in a lane of their own, paced, so that six sent at
once cannot hold every thread of the event loop's pool; smaller bodies use the pool."""

from __future__ import annotations

import asyncio
import threading
import time

from gyrfalcon.api.context import LARGE_BODY_BYTES, LARGE_BODY_REST, ServerContext
from gyrfalcon.config import Settings
from gyrfalcon.plugins import plugin_manager


def test_large_bodies_take_their_paced_lane_and_small_ones_the_pool(tiny_engine, tiny_model_dir):
    ctx = ServerContext(tiny_engine, Settings(model=str(tiny_model_dir)), plugin_manager())
    busy_s = 0.02

    def parse() -> str:  # a body's parsing: CPU time on the thread that runs it
        start = time.thread_time()
        while time.thread_time() - start < busy_s:
            pass
        return threading.current_thread().name

    async def main():
        small = await ctx.in_body_lane(b"x" * LARGE_BODY_BYTES, parse)
        large = await ctx.in_body_lane(b"x" * (LARGE_BODY_BYTES + 1), parse)
        start = time.perf_counter()
        await ctx.in_body_lane(b"x" * (LARGE_BODY_BYTES + 1), lambda: None)  # after the lane's rest
        return small, large, time.perf_counter() - start

    small, large, waited = asyncio.run(main())
    assert LARGE_BODY_BYTES == 64 << 10
    assert large.startswith("gyrfalcon-large-bodies") and not small.startswith("gyrfalcon-large-bodies")
    assert waited >= 0.9 * LARGE_BODY_REST * busy_s
