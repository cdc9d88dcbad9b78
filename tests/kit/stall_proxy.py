"""A TCP relay to one upstream address that can be told to stall: a hung peer on demand,
for tests (``tests.kit.stall_proxy`` drives it).

    python tests/kit/stall_proxy.py UPSTREAM_HOST:PORT

Prints ``listening PORT`` once it accepts connections. Each line on stdin is a command,
answered on stdout once it has taken effect: ``stall`` (stop relaying in both
directions; connections stay open and bytes wait in the kernel's buffers) -> ``stalled``;
``resume`` -> ``resumed``. It runs as its own process so that nothing in the caller, not
even a call that holds the GIL, can keep it from relaying.
"""

from __future__ import annotations

import asyncio
import sys


async def main(upstream: str) -> None:
    host, port = upstream.rsplit(":", 1)
    flowing = asyncio.Event()
    flowing.set()

    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                await flowing.wait()
                writer.write(data)
                await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()

    async def relay(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await flowing.wait()
        upstream_reader, upstream_writer = await asyncio.open_connection(host, int(port))
        await asyncio.gather(pipe(reader, upstream_writer), pipe(upstream_reader, writer))

    server = await asyncio.start_server(relay, "127.0.0.1", 0)
    print("listening", server.sockets[0].getsockname()[1], flush=True)
    loop = asyncio.get_running_loop()
    commands = {"stall": (flowing.clear, "stalled"), "resume": (flowing.set, "resumed")}
    while line := await loop.run_in_executor(None, sys.stdin.readline):
        act, answer = commands[line.strip()]
        act()
        print(answer, flush=True)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
