// Many concurrent PostgreSQL JDBC clients on a small transaction pool,
// each mixing what Java applications do, with the driver's defaults
// (server-side statements after five uses, batches sent as one pipeline)
// and with server-side statements from the first use.
//
// Usage: java -cp postgresql.jar JdbcMix.java PORT
// Every operation checks its own result; any error an operation did not
// ask for (a statement that vanished or already exists, a cancel nobody
// sent, a hang) fails the run, with the list printed.

import java.sql.BatchUpdateException;
import java.sql.Connection;
import java.sql.DriverManager;
import java.sql.PreparedStatement;
import java.sql.ResultSet;
import java.sql.SQLException;
import java.sql.Savepoint;
import java.sql.Statement;
import java.util.ArrayList;
import java.util.Collections;
import java.util.List;
import java.util.Properties;
import java.util.Random;

public class JdbcMix {
    static final int ROUNDS = 100;
    static final List<String> failures = Collections.synchronizedList(new ArrayList<>());
    static int port;

    static Connection connect(String prepareThreshold) throws SQLException {
        Properties p = new Properties();
        p.setProperty("user", "postgres");
        p.setProperty("prepareThreshold", prepareThreshold);
        p.setProperty("connectTimeout", "20");
        p.setProperty("socketTimeout", "60");
        return DriverManager.getConnection("jdbc:postgresql://127.0.0.1:" + port + "/postgres", p);
    }

    static void check(boolean ok, String what) {
        if (!ok) {
            throw new AssertionError(what);
        }
    }

    static void client(int seed, String threshold) {
        Random rnd = new Random(seed);
        String table = "jdbc_mix_" + seed;
        try (Connection c = connect(threshold)) {
            try (Statement s = c.createStatement()) {
                s.execute("CREATE TABLE IF NOT EXISTS " + table + " (id int PRIMARY KEY, v text)");
                s.execute("TRUNCATE " + table);
            }
            int nextId = 0;
            long expected = 0;
            for (int i = 0; i < ROUNDS; i++) {
                double r = rnd.nextDouble();
                try {
                    if (r < 0.25) {
                        // The same statement again and again: after
                        // prepareThreshold uses it becomes a named
                        // server-side statement, which must follow the
                        // client to whichever server it lands on.
                        try (PreparedStatement ps = c.prepareStatement("SELECT ?::int * 2, ?::text")) {
                            ps.setInt(1, i);
                            ps.setString(2, "r" + i);
                            try (ResultSet rs = ps.executeQuery()) {
                                check(rs.next(), "a row");
                                check(rs.getInt(1) == i * 2, "value " + rs.getInt(1));
                                check(rs.getString(2).equals("r" + i), "text " + rs.getString(2));
                            }
                        }
                    } else if (r < 0.4) {
                        // A batch: many Bind/Execute pairs and one Sync.
                        c.setAutoCommit(false);
                        try (PreparedStatement ps = c.prepareStatement("INSERT INTO " + table + " VALUES (?, ?)")) {
                            int n = 1 + rnd.nextInt(40);
                            for (int k = 0; k < n; k++) {
                                ps.setInt(1, nextId + k);
                                ps.setString(2, "x".repeat(k * 10));
                                ps.addBatch();
                            }
                            int[] counts = ps.executeBatch();
                            check(counts.length == n, "batch counts " + counts.length);
                            if (rnd.nextBoolean()) {
                                c.commit();
                                nextId += n;
                                expected += n;
                            } else {
                                c.rollback();
                            }
                        } finally {
                            c.setAutoCommit(true);
                        }
                    } else if (r < 0.5) {
                        // A batch that fails part way: nothing of it stays.
                        c.setAutoCommit(false);
                        try (PreparedStatement ps = c.prepareStatement("INSERT INTO " + table + " VALUES (?, ?)")) {
                            ps.setInt(1, nextId);
                            ps.setString(2, "a");
                            ps.addBatch();
                            ps.setInt(1, nextId); // duplicate key
                            ps.setString(2, "b");
                            ps.addBatch();
                            try {
                                ps.executeBatch();
                                throw new AssertionError("a duplicate key was accepted");
                            } catch (BatchUpdateException e) {
                                check("23505".equals(e.getSQLState())
                                        || (e.getNextException() != null && "23505".equals(e.getNextException().getSQLState())),
                                        "state " + e.getSQLState());
                            }
                            c.rollback();
                        } finally {
                            c.setAutoCommit(true);
                        }
                    } else if (r < 0.6) {
                        // Savepoints: an error inside, rolled back to.
                        c.setAutoCommit(false);
                        try (PreparedStatement ins = c.prepareStatement("INSERT INTO " + table + " VALUES (?, 'sp')")) {
                            ins.setInt(1, nextId);
                            ins.executeUpdate();
                            Savepoint sp = c.setSavepoint();
                            try (Statement s = c.createStatement()) {
                                s.executeQuery("SELECT 1/0");
                                throw new AssertionError("division by zero passed");
                            } catch (SQLException e) {
                                check("22012".equals(e.getSQLState()), "state " + e.getSQLState());
                            }
                            c.rollback(sp);
                            c.commit();
                            nextId += 1;
                            expected += 1;
                        } finally {
                            c.setAutoCommit(true);
                        }
                    } else if (r < 0.7) {
                        // A cursor: with autocommit off and a fetch size,
                        // the driver reads through a named portal in
                        // several Execute round trips of one transaction.
                        c.setAutoCommit(false);
                        try (PreparedStatement ps = c.prepareStatement("SELECT g FROM generate_series(1, ?) g")) {
                            ps.setFetchSize(7);
                            int n = 20 + rnd.nextInt(50);
                            ps.setInt(1, n);
                            long sum = 0;
                            int rows = 0;
                            try (ResultSet rs = ps.executeQuery()) {
                                while (rs.next()) {
                                    sum += rs.getInt(1);
                                    rows++;
                                }
                            }
                            check(rows == n && sum == (long) n * (n + 1) / 2, "cursor rows " + rows + " sum " + sum);
                            c.commit();
                        } finally {
                            c.setAutoCommit(true);
                        }
                    } else if (r < 0.72) {
                        // A timeout: the driver cancels the statement.
                        try (Statement s = c.createStatement()) {
                            s.setQueryTimeout(1);
                            s.execute("SELECT pg_sleep(3)");
                            throw new AssertionError("pg_sleep(3) outlived a 1 s timeout");
                        } catch (SQLException e) {
                            check("57014".equals(e.getSQLState()), "state " + e.getSQLState() + ": " + e.getMessage());
                        }
                    } else if (r < 0.76) {
                        // A read-only transaction (BEGIN READ ONLY, sent
                        // in one pipeline with its first statement).
                        c.setAutoCommit(false);
                        c.setReadOnly(true);
                        try (Statement s = c.createStatement()) {
                            try (ResultSet rs = s.executeQuery("SHOW transaction_read_only")) {
                                check(rs.next() && rs.getString(1).equals("on"), "read only");
                            }
                            try {
                                s.executeUpdate("INSERT INTO " + table + " VALUES (-1, 'ro')");
                                throw new AssertionError("a write in a read-only transaction passed");
                            } catch (SQLException e) {
                                check("25006".equals(e.getSQLState()), "state " + e.getSQLState());
                            }
                            c.rollback();
                        } finally {
                            c.setReadOnly(false);
                            c.setAutoCommit(true);
                        }
                    } else if (r < 0.8) {
                        // RETURNING through getGeneratedKeys.
                        try (PreparedStatement ps = c.prepareStatement(
                                "INSERT INTO " + table + " VALUES (?, 'k')", new String[] {"id"})) {
                            ps.setInt(1, nextId);
                            check(ps.executeUpdate() == 1, "one row");
                            try (ResultSet keys = ps.getGeneratedKeys()) {
                                check(keys.next() && keys.getInt(1) == nextId, "generated key");
                            }
                            nextId += 1;
                            expected += 1;
                        }
                    } else if (r < 0.83) {
                        // The driver forgets its statements on DISCARD ALL;
                        // the pool must forget them on that server too.
                        try (Statement s = c.createStatement()) {
                            s.execute(rnd.nextBoolean() ? "DISCARD ALL" : "DEALLOCATE ALL");
                        }
                    } else if (r < 0.88) {
                        // Metadata queries (large catalog statements).
                        ResultSet rs = c.getMetaData().getColumns(null, "public", table, null);
                        int cols = 0;
                        while (rs.next()) {
                            cols++;
                        }
                        rs.close();
                        check(cols == 2, "columns " + cols);
                    } else {
                        try (Statement s = c.createStatement();
                             ResultSet rs = s.executeQuery("SELECT count(*) FROM " + table)) {
                            check(rs.next() && rs.getLong(1) == expected, "count " + rs.getLong(1) + " != " + expected);
                        }
                    }
                } catch (Throwable e) {
                    failures.add("jdbc " + seed + " (prepareThreshold " + threshold + ") round " + i + ": " + e);
                    try {
                        if (!c.getAutoCommit()) {
                            c.rollback();
                            c.setAutoCommit(true);
                        }
                    } catch (SQLException ignored) {
                        return;
                    }
                }
            }
            try (Statement s = c.createStatement(); ResultSet rs = s.executeQuery("SELECT count(*) FROM " + table)) {
                check(rs.next() && rs.getLong(1) == expected, "final count " + rs.getLong(1) + " != " + expected);
                s.execute("DROP TABLE " + table);
            }
        } catch (Throwable e) {
            failures.add("jdbc " + seed + " (prepareThreshold " + threshold + "): " + e);
        }
    }

    public static void main(String[] args) throws Exception {
        port = Integer.parseInt(args[0]);
        int clients = args.length > 1 ? Integer.parseInt(args[1]) : 8;
        List<Thread> threads = new ArrayList<>();
        for (int i = 0; i < clients; i++) {
            final int seed = i;
            // Half with the driver's default, half with server-side
            // statements from the first use.
            final String threshold = i % 2 == 0 ? "5" : "-1";
            Thread t = new Thread(() -> client(seed, threshold));
            t.start();
            threads.add(t);
        }
        for (Thread t : threads) {
            t.join(240_000);
            if (t.isAlive()) {
                failures.add("a client hung");
            }
        }
        if (!failures.isEmpty()) {
            System.out.println(failures.size() + " failures:");
            for (String f : failures) {
                System.out.println("  " + f);
            }
            System.exit(1);
        }
        System.out.println("ok: " + clients + " clients x " + ROUNDS + " rounds");
        System.exit(0);
    }
}
