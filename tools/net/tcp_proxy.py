"""A TCP proxy on loopback that delays every byte by a fixed time, and can be cut.

Stands between two regions' NATS gateway ports (``services/launcher/nats_cluster.py``):
``delay_s`` is the one-way delay injected in each direction (netem is not available in these
machines' kernels), so a round trip over it costs ``2 * delay_s``; ``cut()`` closes every
connection and refuses new ones, as a network partition between the regions would (the
servers keep retrying their gateway connections; ``heal()`` lets them through again).
Runs its own event loop on a thread, so tests and benchmarks drive it from synchronous code.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time

CHUNK = 65536


class DelayProxy:
    def __init__(self, target_port: int, delay_s: float = 0.0, listen_port: int = 0) -> None:
        self.target_port = target_port
        self.delay_s = delay_s
        self.listen_port = listen_port
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.server: asyncio.Server | None = None
        self.writers: set[asyncio.StreamWriter] = set()
        self.cut_now = False

    def start(self) -> DelayProxy:
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._listen(), self.loop).result(10)
        return self

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.listen_port}"

    async def _listen(self) -> None:
        self.server = await asyncio.start_server(self._on_client, "127.0.0.1", self.listen_port)
        self.listen_port = self.server.sockets[0].getsockname()[1]

    async def _on_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.cut_now:
            writer.close()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.close()
            return
        self.writers |= {writer, up_writer}
        # stop() cancels every task; a client task that ends cancelled makes asyncio's stream
        # callback (task.exception()) log a traceback per connection (3.11).
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(
                self._pipe(reader, up_writer), self._pipe(up_reader, writer), return_exceptions=True
            )
        for w in (writer, up_writer):
            self.writers.discard(w)
            w.close()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Copy bytes, each chunk released ``delay_s`` after it arrived (order kept; the
        delay adds latency, not a throughput cap)."""
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def release() -> None:
            while True:
                due, data = await queue.get()
                if not data:
                    break
                wait = due - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                writer.write(data)
                await writer.drain()
            writer.close()

        sender = asyncio.create_task(release())
        try:
            while data := await reader.read(CHUNK):
                queue.put_nowait((time.monotonic() + self.delay_s, data))
        finally:
            queue.put_nowait((0.0, b""))
            with contextlib.suppress(Exception):
                await sender

    def cut(self) -> None:
        """Close every connection through the proxy and refuse new ones."""

        def close_all() -> None:
            self.cut_now = True
            for w in list(self.writers):
                w.transport.abort()

        self.loop.call_soon_threadsafe(close_all)

    def heal(self) -> None:
        self.loop.call_soon_threadsafe(setattr, self, "cut_now", False)

    def stop(self) -> None:
        self.cut()

        async def close() -> None:
            if self.server is not None:
                self.server.close()
            await asyncio.sleep(0)  # the aborted connections' tasks see their end
            current = asyncio.current_task()
            tasks = [t for t in asyncio.all_tasks() if t is not current]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(close(), self.loop).result(5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


def main() -> None:
    """``python -m tools.net.tcp_proxy --delay-ms D PORT...``: one delaying proxy per target
    port, in a process of its own (a benchmark's own Python work then does not delay the
    link). Writes the listen addresses as one JSON list line; runs until stdin closes."""
    import argparse
    import json
    import sys

    p = argparse.ArgumentParser(prog="python -m tools.net.tcp_proxy")
    p.add_argument("--delay-ms", type=float, default=0.0, help="one way, each direction")
    p.add_argument("ports", type=int, nargs="+", help="the target ports on loopback")
    args = p.parse_args()
    proxies = [DelayProxy(port, args.delay_ms / 1000).start() for port in args.ports]
    sys.stdout.write(json.dumps([proxy.address for proxy in proxies]) + "\n")
    sys.stdout.flush()
    try:
        sys.stdin.read()
    finally:
        for proxy in proxies:
            proxy.stop()


if __name__ == "__main__":
    main()
