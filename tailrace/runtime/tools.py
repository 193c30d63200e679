"""ToolPool: where a multi-turn run's tools run -- a few threads beside the driver's loop.

The scheduler has no threads and the driver's loop must never wait on a tool, so each tool call is
submitted here and its answer comes back as an event: the driver's wait for worker messages also
wakes on this pool's socket (`waitable`), then `take` hands over the finished calls with their
times. A call that raises (the environment's own bug) is an answer too: `Failed` with the reason.
"""

from __future__ import annotations

import queue
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class Done:
    key: str  # the request whose call this answers
    value: Any  # what the call returned, or a `Failed`
    t0: float  # perf_counter when it started and finished
    t1: float


@dataclass(frozen=True)
class Failed:
    error: str


class ToolPool:
    def __init__(self, threads: int) -> None:
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="tool")
        self._done: queue.SimpleQueue[Done] = queue.SimpleQueue()
        self._rx, self._tx = socket.socketpair()
        self._rx.setblocking(False)
        self.in_flight = 0

    @property
    def waitable(self) -> socket.socket:
        """Readable once a call has finished (for `multiprocessing.connection.wait`)."""
        return self._rx

    def submit(self, key: str, call: Callable[[], Any]) -> None:
        self.in_flight += 1
        self._pool.submit(self._run, key, call)

    def _run(self, key: str, call: Callable[[], Any]) -> None:
        t0 = time.perf_counter()
        try:
            value = call()
        except Exception as e:  # noqa: BLE001 -- reported as the call's answer, never raised in a thread
            value = Failed(f"{type(e).__name__}: {e}")
        self._done.put(Done(key, value, t0, time.perf_counter()))
        self._tx.send(b"\0")

    def take(self) -> list[Done]:
        """The calls finished since the last take."""
        try:
            while self._rx.recv(4096):
                pass
        except BlockingIOError:
            pass
        out = []
        while True:
            try:
                out.append(self._done.get_nowait())
            except queue.Empty:
                break
        self.in_flight -= len(out)
        return out

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._rx.close()
        self._tx.close()
