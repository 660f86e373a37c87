#!/usr/bin/env python3
"""Holds N idle PostgreSQL client connections.

    idle_clients.py HOST PORT N [USER] [DATABASE]

Opens N TCP connections, sends a StartupMessage on each and reads until
ReadyForQuery (trust authentication only: any password request counts as a
failure), at most 200 startups in flight. Then prints one line
"ok=K failed=F" (plus "first_error=..." when F > 0) and holds the
connections open and idle until stdin reaches end of file; then sends
Terminate on each, closes them and exits (status 1 if any failed).
Needs `ulimit -n` above N.
"""

import asyncio
import struct
import sys

IN_FLIGHT = 200
TIMEOUT = 60


def error_text(body: bytes) -> str:
    fields = {}
    for part in body.split(b"\0"):
        if part:
            fields[chr(part[0])] = part[1:].decode(errors="replace")
    return f"{fields.get('S', 'ERROR')}: {fields.get('M', '?')} (SQLSTATE {fields.get('C', '?')})"


async def open_one(host, port, user, database, sem, held, errors):
    async with sem:
        writer = None
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(host, port), TIMEOUT
            )
            params = b"user\0%s\0database\0%s\0\0" % (user.encode(), database.encode())
            writer.write(struct.pack("!ii", 8 + len(params), 196608) + params)
            await writer.drain()
            while True:
                head = await asyncio.wait_for(reader.readexactly(5), TIMEOUT)
                kind, length = head[:1], struct.unpack("!i", head[1:])[0]
                body = await asyncio.wait_for(reader.readexactly(length - 4), TIMEOUT)
                if kind == b"R":
                    code = struct.unpack("!i", body[:4])[0]
                    if code != 0:
                        raise RuntimeError(f"authentication request {code} (only trust is supported)")
                elif kind == b"E":
                    raise RuntimeError(error_text(body))
                elif kind == b"Z":
                    break
            held.append((reader, writer))
        except Exception as e:  # noqa: BLE001 - reported, not raised
            errors.append(f"{type(e).__name__}: {e}")
            if writer is not None:
                writer.close()


async def main():
    host, port, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    user = sys.argv[4] if len(sys.argv) > 4 else "postgres"
    database = sys.argv[5] if len(sys.argv) > 5 else "postgres"
    sem = asyncio.Semaphore(IN_FLIGHT)
    held, errors = [], []
    await asyncio.gather(
        *(open_one(host, port, user, database, sem, held, errors) for _ in range(n))
    )
    line = f"ok={len(held)} failed={len(errors)}"
    if errors:
        line += f" first_error={errors[0]!r}"
    print(line, flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    for _, writer in held:
        try:
            writer.write(b"X\0\0\0\4")
            writer.close()
        except Exception:  # noqa: BLE001
            pass
    await asyncio.sleep(0.5)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
