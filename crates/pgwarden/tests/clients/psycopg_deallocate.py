"""Clients of a small transaction pool whose psycopg 3 statement cache
keeps two statements, so that nearly every query evicts one.

psycopg drops an evicted statement with `DEALLOCATE name` where libpq
cannot close it at protocol level (psycopg 3.0 and 3.1, and later ones
with a libpq older than 17), and inside a pipeline that statement goes
through the extended protocol. Whatever libpq this psycopg has, it is
made to do so here.

Usage: psycopg_deallocate.py PORT. Any error fails the run, with the
list printed.
"""
import sys
import threading

import psycopg
from psycopg import _connection_base

_connection_base._HAS_SEND_CLOSE = False

port = int(sys.argv[1])
CLIENTS = 4
ROUNDS = 40
failures = []


def run(seed):
    conn = psycopg.connect(
        host="127.0.0.1", port=port, user="postgres", dbname="postgres",
        autocommit=True, prepare_threshold=0,
    )
    conn.prepared_max = 2
    for i in range(ROUNDS):
        try:
            got = []
            # Reading a result inside the pipeline syncs it: the statement
            # it evicted is dropped in the pipeline, with the next query.
            if i % 3 == 2:
                # In a transaction: its statements and DEALLOCATEs stay on
                # one server.
                with conn.pipeline(), conn.transaction():
                    for k in range(4):
                        cur = conn.execute(f"select %s::int + {k}", [i])
                        got.append(cur.fetchone()[0])
            else:
                with conn.pipeline():
                    for k in range(4):
                        cur = conn.execute(f"select %s::int + {k}", [i])
                        got.append(cur.fetchone()[0])
            assert got == [i + k for k in range(4)], got
            # Outside a pipeline too, each query on whichever server.
            v = conn.execute(f"select %s::int * {seed + 2}", [i]).fetchone()[0]
            assert v == i * (seed + 2), v
        except Exception as e:  # noqa: BLE001 - every error is a failure
            failures.append(f"client {seed} round {i}: {type(e).__name__}: {e}")
            conn.close()
            return
    conn.close()


threads = [threading.Thread(target=run, args=(n,)) for n in range(CLIENTS)]
for t in threads:
    t.start()
for t in threads:
    t.join()
if failures:
    print("\n".join(failures))
    sys.exit(1)
print(f"{CLIENTS} clients, {ROUNDS} rounds each: ok")
