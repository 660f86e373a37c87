"""Operations an application does, through pgwarden, with psycopg 3.

Usage: psycopg_ops.py RW_PORT RO_PORT. Exits non-zero on the first failure.
"""
import sys
import threading
import time

import psycopg
from psycopg import errors, sql

rw_port, ro_port = sys.argv[1], sys.argv[2]
dsn = "host=127.0.0.1 user=postgres dbname=postgres port={}"

# Server-side prepared statements from the first execution on.
with psycopg.connect(dsn.format(rw_port), prepare_threshold=0) as conn:
    with conn.cursor() as cur:
        cur.execute("DROP TABLE IF EXISTS py_items")
        cur.execute("CREATE TABLE py_items (id int primary key, name text)")
    conn.commit()
    # A transaction that commits and one that rolls back.
    with conn.transaction():
        for i in range(20):
            conn.execute("INSERT INTO py_items VALUES (%s, %s)", (i, f"item {i}"))
    try:
        with conn.transaction():
            conn.execute("INSERT INTO py_items VALUES (100, 'rolled back')")
            raise RuntimeError("abort")
    except RuntimeError:
        pass
    n = conn.execute("SELECT count(*) FROM py_items").fetchone()[0]
    assert n == 20, n
    prepared = conn.execute(
        "SELECT count(*) FROM pg_prepared_statements"
    ).fetchone()[0]
    assert prepared > 0, "prepare_threshold=0 should prepare on the server"
    # COPY both ways.
    with conn.cursor() as cur:
        with cur.copy("COPY py_items FROM STDIN") as copy:
            for i in range(1000, 1500):
                copy.write_row((i, f"copied {i}"))
        conn.commit()
        out = []
        with cur.copy("COPY (SELECT id FROM py_items WHERE id >= 1000 ORDER BY id) TO STDOUT") as copy:
            for row in copy.rows():
                out.append(int(row[0]))
        assert out == list(range(1000, 1500)), out[:5]
    # Binary results.
    with conn.cursor(binary=True) as cur:
        cur.execute("SELECT %s::bytea, 2.5::float8", (b"\x00\xff",))
        assert cur.fetchone() == (b"\x00\xff", 2.5)

# LISTEN/NOTIFY between two sessions.
with psycopg.connect(dsn.format(rw_port), autocommit=True) as listener, \
        psycopg.connect(dsn.format(rw_port), autocommit=True) as notifier:
    listener.execute("LISTEN py_channel")
    notifier.execute("NOTIFY py_channel, 'ping'")
    got = None
    for note in listener.notifies(timeout=10):
        got = note
        break
    assert got is not None and got.payload == "ping", got

# Cancel a running query.
with psycopg.connect(dsn.format(rw_port)) as conn:
    def cancel_soon():
        time.sleep(0.5)
        conn.cancel()
    t = threading.Thread(target=cancel_soon)
    t.start()
    try:
        conn.execute("SELECT pg_sleep(20)")
        raise AssertionError("query was not cancelled")
    except errors.QueryCanceled:
        pass
    t.join()

# The read-only port: reads work, writes and escapes are refused.
with psycopg.connect(dsn.format(ro_port), prepare_threshold=0) as conn:
    assert conn.execute("SHOW transaction_read_only").fetchone()[0] == "on"
    conn.execute("SELECT 1").fetchone()
    conn.rollback()
    for stmt in ["CREATE TABLE nope (x int)", "SET default_transaction_read_only = off"]:
        try:
            conn.execute(stmt)
            raise AssertionError(f"{stmt} was not refused")
        except errors.ReadOnlySqlTransaction:
            conn.rollback()
print("psycopg: all operations passed")
