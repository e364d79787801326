"""An asyncio event loop whose timers fire within microseconds instead of up to a millisecond late.

asyncio sleeps in `epoll_wait`, whose timeout is whole milliseconds, rounded up (and a float such as
0.003 s, stored a hair above 3 ms, becomes 4 ms): every `asyncio.sleep` and `call_at` wakes 0-2 ms
late, so a mock that should send at 200 ms sends at ~200.7 ms, and a client's arrival schedule slips
the same way. Here the selector waits with `select()` on the epoll file descriptor itself
(microsecond timeout; the descriptor becomes readable as soon as any registered socket has an
event), then collects the events with a non-blocking epoll. No busy-waiting.
"""
from __future__ import annotations

import asyncio
import select
import selectors

if hasattr(selectors, "EpollSelector"):
    class PreciseSelector(selectors.EpollSelector):
        def select(self, timeout=None):
            if timeout is not None and timeout > 0:
                select.select([self._selector.fileno()], [], [], timeout)
                timeout = 0
            return super().select(timeout)
else:  # pragma: no cover - not Linux
    PreciseSelector = selectors.DefaultSelector


def new_loop() -> asyncio.AbstractEventLoop:
    return asyncio.SelectorEventLoop(PreciseSelector())


def run(coro):
    """asyncio.run on the precise loop."""
    with asyncio.Runner(loop_factory=new_loop) as runner:
        return runner.run(coro)
