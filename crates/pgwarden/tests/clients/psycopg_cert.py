"""One login through pgwarden with psycopg 3, for the client certificate tests.

Usage: psycopg_cert.py CONNINFO. On success prints "ok <current_user>
<TLS in use>", on a refused connection "error <message>"; exits 0 either
way so that the caller compares the output.
"""
import sys

import psycopg

try:
    with psycopg.connect(sys.argv[1]) as conn:
        (user,) = conn.execute("SELECT current_user").fetchone()
        print("ok", user, conn.pgconn.ssl_in_use)
except psycopg.OperationalError as e:
    print("error", str(e).strip().replace("\n", " "))
