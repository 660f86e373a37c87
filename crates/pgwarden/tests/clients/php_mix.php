<?php
// Many concurrent PHP clients (PDO pgsql with native prepares, and the
// pgsql extension) on a small transaction pool, one process each.
//
// Usage: php php_mix.php PORT [CLIENTS]
// PDO names its server-side statements itself and drops each one with a
// DEALLOCATE statement when the PHP object goes away; the pgsql extension
// lets the application name them, and reuse a name after DEALLOCATE for a
// different query. Every operation checks its own result; any error an
// operation did not ask for, or a wrong result, fails the run.

$port = (int)$argv[1];
$clients = isset($argv[2]) ? (int)$argv[2] : 8;
const ROUNDS = 100;

function check($ok, $what) {
    if (!$ok) {
        throw new Exception("check failed: $what");
    }
}

function pdo_client($port, $seed) {
    mt_srand($seed);
    $failures = [];
    $table = "php_mix_$seed";
    $db = new PDO("pgsql:host=127.0.0.1;port=$port;dbname=postgres", "postgres", null, [
        PDO::ATTR_ERRMODE => PDO::ERRMODE_EXCEPTION,
        PDO::ATTR_EMULATE_PREPARES => false,
    ]);
    $db->exec("CREATE TABLE IF NOT EXISTS $table (id int PRIMARY KEY, v text)");
    $db->exec("TRUNCATE $table");
    $next = 0;
    $expected = 0;
    $kept = null;
    for ($i = 0; $i < ROUNDS; $i++) {
        $r = mt_rand() / mt_getrandmax();
        try {
            if ($r < 0.3) {
                // A new statement object each time: prepared under a new
                // name, used, and dropped with DEALLOCATE when it goes.
                $st = $db->prepare("SELECT ?::int * 2 AS v, ?::text AS t");
                $st->execute([$i, "r$i"]);
                $row = $st->fetch(PDO::FETCH_ASSOC);
                check($row['v'] == $i * 2 && $row['t'] === "r$i", "row " . json_encode($row));
                $st = null;
            } elseif ($r < 0.45) {
                // One statement, many executions, in a transaction.
                $db->beginTransaction();
                $st = $db->prepare("INSERT INTO $table VALUES (?, ?)");
                $n = 1 + mt_rand(0, 9);
                for ($k = 0; $k < $n; $k++) {
                    $st->execute([$next + $k, str_repeat("y", $k * 7)]);
                }
                if (mt_rand(0, 1)) {
                    $db->commit();
                    $next += $n;
                    $expected += $n;
                } else {
                    $db->rollBack();
                }
                $st = null;
            } elseif ($r < 0.55) {
                // An error inside a transaction: the statement that
                // failed and the transaction are both cleaned up.
                $db->beginTransaction();
                $st = $db->prepare("INSERT INTO $table VALUES (?, 'dup')");
                $st->execute([$next]);
                try {
                    $st->execute([$next]);
                    throw new Exception("a duplicate key was accepted");
                } catch (PDOException $e) {
                    check($e->getCode() === '23505', "state " . $e->getCode());
                }
                $db->rollBack();
                $st = null;
            } elseif ($r < 0.6) {
                // PDO does not know that these drop its statements: the
                // kept one goes first (its DEALLOCATE runs now).
                $kept = null;
                $db->exec(mt_rand(0, 1) ? "DISCARD ALL" : "DEALLOCATE ALL");
            } elseif ($r < 0.7) {
                // Statements kept across transactions while others come
                // and go.
                if ($kept === null || mt_rand(0, 3) == 0) {
                    $kept = $db->prepare("SELECT count(*) FROM $table WHERE id >= ?");
                }
                $kept->execute([0]);
                $c = (int)$kept->fetchColumn();
                check($c === $expected, "count $c != $expected");
            } else {
                $v = $db->query("SELECT $i + 1")->fetchColumn();
                check((int)$v === $i + 1, "simple $v");
            }
        } catch (Throwable $e) {
            $failures[] = "pdo $seed round $i: " . get_class($e) . ": " . $e->getMessage();
            if ($db->inTransaction()) {
                $db->rollBack();
            }
        }
    }
    $c = (int)$db->query("SELECT count(*) FROM $table")->fetchColumn();
    if ($c !== $expected) {
        $failures[] = "pdo $seed: final count $c != $expected";
    }
    $db->exec("DROP TABLE $table");
    return $failures;
}

function pgsql_client($port, $seed) {
    mt_srand($seed);
    $failures = [];
    $conn = pg_connect("host=127.0.0.1 port=$port dbname=postgres user=postgres");
    if (!$conn) {
        return ["pgsql $seed: cannot connect"];
    }
    for ($i = 0; $i < ROUNDS; $i++) {
        $r = mt_rand() / mt_getrandmax();
        try {
            if ($r < 0.4) {
                // The same name for a different query after DEALLOCATE:
                // every server must run the query the name means now.
                $k = mt_rand(1, 1000);
                check(pg_prepare($conn, "q", "SELECT \$1::int + $k") !== false, "prepare: " . pg_last_error($conn));
                $res = pg_execute($conn, "q", [$i]);
                check($res !== false, "execute: " . pg_last_error($conn));
                check((int)pg_fetch_result($res, 0, 0) === $i + $k, "q gave " . pg_fetch_result($res, 0, 0));
                $res = pg_execute($conn, "q", [$i + 1]);
                check($res !== false && (int)pg_fetch_result($res, 0, 0) === $i + 1 + $k, "q again");
                check(pg_query($conn, "DEALLOCATE q") !== false, "deallocate: " . pg_last_error($conn));
            } elseif ($r < 0.5) {
                // DEALLOCATE of a name that was never prepared fails as
                // PostgreSQL fails it.
                $res = @pg_query($conn, "DEALLOCATE never_prepared_$i");
                check($res === false, "deallocate of an unknown statement passed");
                check(strpos(pg_last_error($conn), "does not exist") !== false, "error " . pg_last_error($conn));
            } elseif ($r < 0.6) {
                // A statement prepared with PREPARE in SQL.
                $k = mt_rand(1, 1000);
                check(pg_query($conn, "PREPARE sq(int) AS SELECT \$1 * $k") !== false, "PREPARE: " . pg_last_error($conn));
                $res = pg_query($conn, "EXECUTE sq($i)");
                check($res !== false && (int)pg_fetch_result($res, 0, 0) === $i * $k, "EXECUTE: " . pg_last_error($conn));
                check(pg_query($conn, "DEALLOCATE PREPARE sq") !== false, "DEALLOCATE PREPARE: " . pg_last_error($conn));
            } elseif ($r < 0.7) {
                // An asynchronous query cancelled by the application.
                check(pg_send_query($conn, "SELECT pg_sleep(5)"), "send");
                usleep(50000);
                check(pg_cancel_query($conn), "cancel");
                while (($res = pg_get_result($conn)) !== false) {
                    // The cancelled query's result (or an error) is consumed.
                }
                $res = pg_query($conn, "SELECT 7");
                check($res !== false && (int)pg_fetch_result($res, 0, 0) === 7, "after cancel: " . pg_last_error($conn));
            } else {
                $res = pg_query_params($conn, "SELECT \$1::text || 'x'", ["v$i"]);
                check($res !== false && pg_fetch_result($res, 0, 0) === "v{$i}x", "params");
            }
        } catch (Throwable $e) {
            $failures[] = "pgsql $seed round $i: " . $e->getMessage();
            @pg_query($conn, "ROLLBACK");
        }
    }
    pg_close($conn);
    return $failures;
}

$children = [];
for ($c = 0; $c < $clients; $c++) {
    $out = sys_get_temp_dir() . "/php_mix_" . getmypid() . "_client_$c";
    $pid = pcntl_fork();
    if ($pid === 0) {
        try {
            $f = $c % 2 == 0 ? pdo_client($port, $c) : pgsql_client($port, $c);
        } catch (Throwable $e) {
            $f = ["client $c: " . get_class($e) . ": " . $e->getMessage()];
        }
        file_put_contents($out, json_encode($f));
        exit(0);
    }
    $children[$pid] = $out;
}
$failures = [];
$deadline = time() + 120;
while (count($children) > 0) {
    $pid = pcntl_wait($status, WNOHANG);
    if ($pid > 0) {
        $out = $children[$pid];
        unset($children[$pid]);
        $f = json_decode((string)@file_get_contents($out), true);
        @unlink($out);
        if (!is_array($f)) {
            $failures[] = "a client ended without a report";
        } else {
            $failures = array_merge($failures, $f);
        }
    } elseif (time() > $deadline) {
        foreach (array_keys($children) as $p) {
            posix_kill($p, SIGKILL);
        }
        $failures[] = count($children) . " clients hung: " . implode(", ", array_map(fn($o) => basename($o), $children));
        break;
    } else {
        usleep(20000);
    }
}
if ($failures) {
    echo count($failures) . " failures:\n";
    foreach ($failures as $f) {
        echo "  $f\n";
    }
    exit(1);
}
echo "ok: $clients clients x " . ROUNDS . " rounds\n";
