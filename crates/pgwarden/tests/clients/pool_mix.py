"""Many concurrent clients of a small transaction pool, each mixing what
applications do, with psycopg 3 (threads) and asyncpg (tasks).

Usage: pool_mix.py PORT. Every operation checks its own result; any error
an operation did not ask for (a statement that vanished or already exists,
a cancel nobody sent, a hang) fails the run, with the list printed.
"""
import asyncio
import random
import sys
import threading

import asyncpg
import psycopg
from psycopg import errors

port = int(sys.argv[1])
ROUNDS = 120
failures = []


def psycopg_client(seed):
    """Pipelines with a failing statement in the middle, transactions in
    pipelines, DISCARD ALL (drops every statement of the server it runs
    on), with server-side statements from the first use."""
    rnd = random.Random(seed)
    conn = psycopg.connect(
        host="127.0.0.1", port=port, user="postgres", dbname="postgres",
        autocommit=True, prepare_threshold=0,
    )
    for i in range(ROUNDS):
        r = rnd.random()
        try:
            if r < 0.05:
                conn.execute("DISCARD ALL")
            elif r < 0.3:
                with conn.pipeline():
                    cur = conn.cursor()
                    cur.execute("select %s::int + 1", [i])
                    if rnd.random() < 0.5:
                        try:
                            cur.execute("select 1/%s::int", [0])
                        except errors.DivisionByZero:
                            pass
                    cur.execute("select %s::int * 2", [i])
            elif r < 0.45:
                with conn.pipeline(), conn.transaction():
                    conn.execute("select %s::int", [i])
                    assert conn.execute("select %s::text", [str(i)]).fetchone()[0] == str(i)
            elif r < 0.6:
                with conn.transaction():
                    conn.execute("select %s::int", [i])
                    conn.execute("select pg_sleep(0.001)")
            else:
                v = conn.execute("select %s::int * 3", [i]).fetchone()[0]
                assert v == i * 3, v
        except errors.DivisionByZero:
            pass  # the pipeline's own error, raised at its end
        except Exception as e:  # noqa: BLE001 - every other error is a failure
            failures.append(f"psycopg {seed} round {i}: {type(e).__name__}: {e}")
    conn.close()


async def asyncpg_client(seed):
    """asyncpg with its statement cache on (the default; PgBouncer users
    must turn it off), transactions, cursors, COPY, executemany, errors,
    and timeouts, which cancel the statement."""
    rnd = random.Random(seed)

    async def connect():
        return await asyncpg.connect(host="127.0.0.1", port=port, user="postgres", database="postgres")

    c = await connect()
    for i in range(ROUNDS):
        r = rnd.random()
        try:
            if r < 0.3:
                assert await c.fetchval("select $1::int * 3", i) == i * 3
            elif r < 0.4:
                st = await c.prepare("select $1::int + $2::int")
                assert await st.fetchval(i, 1) == i + 1
            elif r < 0.5:
                async with c.transaction():
                    await c.execute("insert into pool_mix values ($1, $2)", i, str(seed))
                    n = await c.fetchval("select count(*) from pool_mix where id = $1 and v = $2", i, str(seed))
                    assert n >= 1, n
            elif r < 0.55:
                async with c.transaction():
                    n = 0
                    async for _ in c.cursor("select g from generate_series(1, $1) g", 50, prefetch=7):
                        n += 1
                    assert n == 50, n
            elif r < 0.6:
                await c.executemany("insert into pool_mix values ($1, $2)", [(i, "m"), (i + 1, "m")])
            elif r < 0.65:
                await c.copy_records_to_table("pool_mix", records=[(i, "c"), (i, "d")])
            elif r < 0.75:
                try:
                    await c.fetchval("select 1/$1::int", 0)
                    raise AssertionError("no division by zero")
                except asyncpg.exceptions.DivisionByZeroError:
                    pass
            elif r < 0.8:
                try:
                    async with c.transaction():
                        await c.execute("insert into pool_mix values ($1, 'x')", i)
                        await c.execute("select 1/0")
                except asyncpg.exceptions.DivisionByZeroError:
                    pass
            elif r < 0.88:
                try:
                    await c.fetchval("select pg_sleep(1)", timeout=0.05)
                    raise AssertionError("no timeout")
                except asyncio.TimeoutError:
                    pass
                # asyncpg closes the connection itself when a timeout
                # catches it mid-protocol (it does so on PostgreSQL too).
                if c.is_closed():
                    c = await connect()
            else:
                rows = await c.fetch("select g, md5(g::text) from generate_series(1, $1) g", 200)
                assert len(rows) == 200, len(rows)
        except Exception as e:  # noqa: BLE001
            failures.append(f"asyncpg {seed} round {i}: {type(e).__name__}: {e}")
    await c.close()


async def asyncpg_clients(n):
    c = await asyncpg.connect(host="127.0.0.1", port=port, user="postgres", database="postgres")
    await c.execute("drop table if exists pool_mix; create table pool_mix (id int, v text)")
    await c.close()
    await asyncio.gather(*[asyncpg_client(s) for s in range(n)])


threads = [threading.Thread(target=psycopg_client, args=(s,)) for s in range(6)]
for t in threads:
    t.start()
asyncio.run(asyncio.wait_for(asyncpg_clients(12), 120))
for t in threads:
    t.join(120)
    if t.is_alive():
        failures.append("a psycopg client hangs")
if failures:
    print(f"{len(failures)} failures:", *failures[:20], sep="\n")
    sys.exit(1)
print("ok")
