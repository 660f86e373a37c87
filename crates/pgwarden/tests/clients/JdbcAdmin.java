// The admin console through the PostgreSQL JDBC driver, with its default
// extended protocol and with preferQueryMode=simple (what PgBouncer's
// console needs). The driver sends SET extra_float_digits when it connects.
//
// Usage: java -cp postgresql.jar JdbcAdmin.java PORT

import java.sql.Connection;
import java.sql.DriverManager;
import java.sql.PreparedStatement;
import java.sql.ResultSet;
import java.sql.SQLException;
import java.sql.Statement;
import java.util.Properties;

public class JdbcAdmin {
    public static void main(String[] args) throws Exception {
        int port = Integer.parseInt(args[0]);
        for (String mode : new String[] {"extended", "simple"}) {
            Properties p = new Properties();
            p.setProperty("user", "postgres");
            p.setProperty("preferQueryMode", mode);
            try (Connection c = DriverManager.getConnection("jdbc:postgresql://127.0.0.1:" + port + "/pgwarden", p)) {
                try (Statement s = c.createStatement(); ResultSet rs = s.executeQuery("SHOW POOLS")) {
                    // Counts are integers, names text, as PgBouncer sends them
                    // (simple protocol; the extended one describes text).
                    java.sql.ResultSetMetaData md = rs.getMetaData();
                    for (int i = 1; i <= md.getColumnCount() && mode.equals("simple"); i++) {
                        String col = md.getColumnLabel(i);
                        int t = md.getColumnType(i);
                        if (col.equals("cl_active") && t != java.sql.Types.BIGINT) {
                            throw new AssertionError(mode + ": cl_active is of type " + t);
                        }
                        if (col.equals("database") && t != java.sql.Types.VARCHAR) {
                            throw new AssertionError(mode + ": database is of type " + t);
                        }
                    }
                    int n = 0;
                    while (rs.next()) {
                        rs.getString("cl_active");
                        rs.getString("sv_idle");
                        n++;
                    }
                    if (n == 0) {
                        throw new AssertionError(mode + ": SHOW POOLS gave no rows");
                    }
                }
                // The same command again and again becomes a named
                // server-side statement after five uses.
                for (int i = 0; i < 7; i++) {
                    try (PreparedStatement ps = c.prepareStatement("SHOW STATS"); ResultSet rs = ps.executeQuery()) {
                        if (!rs.next() || rs.getString("total_xact_count") == null) {
                            throw new AssertionError(mode + ": SHOW STATS");
                        }
                    }
                }
                try (Statement s = c.createStatement()) {
                    s.executeQuery("SHOW NOTHING");
                    throw new AssertionError(mode + ": an unknown command passed");
                } catch (SQLException e) {
                    if (!"0A000".equals(e.getSQLState())) {
                        throw new AssertionError(mode + ": state " + e.getSQLState());
                    }
                }
                try (Statement s = c.createStatement(); ResultSet rs = s.executeQuery("SHOW CLIENTS")) {
                    rs.getMetaData().getColumnCount();
                }
            }
        }
        System.out.println("ok");
    }
}
