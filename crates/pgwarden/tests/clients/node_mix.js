// Many concurrent node-postgres clients on a small transaction pool, each
// mixing what Node.js applications do.
//
// Usage: NODE_PATH=DIR/node_modules node node_mix.js PORT [CLIENTS]
// node-postgres prepares a named statement once per connection and then
// only binds it; it passes statement_timeout as a start-up parameter;
// queries without parameters go through the simple protocol, which allows
// several statements in one. Every operation checks its own result; any
// error an operation did not ask for, or a hang, fails the run.

const { Client } = require("pg");

const port = Number(process.argv[2]);
const clients = Number(process.argv[3] || 8);
const ROUNDS = 100;
const failures = [];

function check(ok, what) {
  if (!ok) throw new Error(`check failed: ${what}`);
}

// A small deterministic generator, so a failing run can be replayed.
function rng(seed) {
  let s = seed * 2654435761 + 1;
  return () => {
    s = (s * 1103515245 + 12345) % 2147483648;
    return s / 2147483648;
  };
}

async function client(seed) {
  const rnd = rng(seed + 1);
  const table = `node_mix_${seed}`;
  const c = new Client({
    host: "127.0.0.1",
    port,
    user: "postgres",
    database: "postgres",
    application_name: `node_mix_${seed}`,
    // Sent in the start-up packet: it must follow the client to every
    // server it lands on.
    statement_timeout: 300,
  });
  await c.connect();
  await c.query(`CREATE TABLE IF NOT EXISTS ${table} (id int PRIMARY KEY, v text)`);
  await c.query(`TRUNCATE ${table}`);
  let next = 0;
  let expected = 0;
  for (let i = 0; i < ROUNDS; i++) {
    const r = rnd();
    try {
      if (r < 0.25) {
        // A named statement: Parse once on this connection, then only
        // Bind/Execute, whichever server the client lands on.
        const res = await c.query({
          name: "double",
          text: "SELECT $1::int * 2 AS v, $2::text AS t",
          values: [i, `r${i}`],
        });
        check(res.rows[0].v === i * 2 && res.rows[0].t === `r${i}`, JSON.stringify(res.rows));
      } else if (r < 0.4) {
        await c.query("BEGIN");
        const n = 1 + Math.floor(rnd() * 10);
        for (let k = 0; k < n; k++) {
          await c.query({
            name: "insert",
            text: `INSERT INTO ${table} VALUES ($1, $2)`,
            values: [next + k, "z".repeat(k * 11)],
          });
        }
        if (rnd() < 0.5) {
          await c.query("COMMIT");
          next += n;
          expected += n;
        } else {
          await c.query("ROLLBACK");
        }
      } else if (r < 0.5) {
        // An error in a transaction: the transaction is rolled back, the
        // named statement stays usable.
        await c.query("BEGIN");
        await c.query({ name: "insert", text: `INSERT INTO ${table} VALUES ($1, $2)`, values: [next, "a"] });
        let failed = false;
        try {
          await c.query({ name: "insert", text: `INSERT INTO ${table} VALUES ($1, $2)`, values: [next, "b"] });
        } catch (e) {
          failed = true;
          check(e.code === "23505", `code ${e.code}`);
        }
        check(failed, "a duplicate key was accepted");
        try {
          await c.query("SELECT 1");
          check(false, "a statement ran in an aborted transaction");
        } catch (e) {
          check(e.code === "25P02", `code ${e.code}`);
        }
        await c.query("ROLLBACK");
      } else if (r < 0.52) {
        // statement_timeout from the start-up packet cancels a slow one.
        try {
          await c.query("SELECT pg_sleep(3)");
          check(false, "pg_sleep(3) outlived statement_timeout = 300ms");
        } catch (e) {
          check(e.code === "57014", `code ${e.code}: ${e.message}`);
        }
      } else if (r < 0.66) {
        // Several statements in one simple Query.
        const res = await c.query(`SELECT ${i} AS a; SELECT count(*)::int AS n FROM ${table}; SHOW statement_timeout`);
        check(res.length === 3, `results ${res.length}`);
        check(res[0].rows[0].a === i, "first");
        check(res[1].rows[0].n === expected, `count ${res[1].rows[0].n} != ${expected}`);
        check(res[2].rows[0].statement_timeout === "300ms", `statement_timeout ${res[2].rows[0].statement_timeout}`);
      } else if (r < 0.72) {
        const res = await c.query("SHOW application_name");
        check(res.rows[0].application_name === `node_mix_${seed}`, res.rows[0].application_name);
      } else if (r < 0.8) {
        // Large values both ways, as arrays.
        const big = "q".repeat(100000 + Math.floor(rnd() * 100000));
        const res = await c.query({ text: "SELECT length($1::text) AS n, $1::text AS b", values: [big], rowMode: "array" });
        check(res.rows[0][0] === big.length && res.rows[0][1] === big, "big value");
      } else if (r < 0.85) {
        // An error outside a transaction; the client goes on.
        try {
          await c.query({ name: "bad", text: "SELECT 1 / $1::int", values: [0] });
          check(false, "division by zero passed");
        } catch (e) {
          check(e.code === "22012", `code ${e.code}`);
        }
      } else {
        const res = await c.query({ text: `SELECT count(*)::int AS n FROM ${table} WHERE id >= $1`, values: [0] });
        check(res.rows[0].n === expected, `count ${res.rows[0].n} != ${expected}`);
      }
    } catch (e) {
      failures.push(`node ${seed} round ${i}: ${e.message}`);
      try {
        await c.query("ROLLBACK");
      } catch (_) {
        // nothing to roll back
      }
    }
  }
  const res = await c.query(`SELECT count(*)::int AS n FROM ${table}`);
  if (res.rows[0].n !== expected) failures.push(`node ${seed}: final count ${res.rows[0].n} != ${expected}`);
  await c.query(`DROP TABLE ${table}`);
  await c.end();
}

async function main() {
  const all = [];
  for (let i = 0; i < clients; i++) {
    all.push(client(i).catch((e) => failures.push(`node ${i}: ${e.stack || e}`)));
  }
  const hung = new Promise((resolve) => setTimeout(() => resolve("hung"), 120000).unref());
  const outcome = await Promise.race([Promise.all(all).then(() => "done"), hung]);
  if (outcome === "hung") failures.push("clients hung");
  if (failures.length > 0) {
    console.log(`${failures.length} failures:`);
    for (const f of failures) console.log(`  ${f}`);
    process.exit(1);
  }
  console.log(`ok: ${clients} clients x ${ROUNDS} rounds`);
  process.exit(0);
}

main();
