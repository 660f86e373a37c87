//! A pool's counters over a stats period: the totals the admin console
//! shows, and the averages over the last complete period that PgBouncer's
//! `avg_*` columns carry (its 1.18 definitions, so that dashboards built
//! for it read the same figures).

use std::time::Duration;

/// A pool's counters at one moment; they only grow.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Totals {
    /// Transactions served.
    pub xact_count: u64,
    /// Queries and extended-protocol batches completed.
    pub query_count: u64,
    /// Bytes received from clients.
    pub received: u64,
    /// Bytes sent to clients.
    pub sent: u64,
    /// Microseconds server connections were lent.
    pub xact_us: u64,
    /// Microseconds servers worked on queries.
    pub query_us: u64,
    /// Microseconds clients waited for a server connection.
    pub wait_us: u64,
}

impl Totals {
    /// Adds another pool's counters, for sums over pools.
    pub fn add(&mut self, o: &Totals) {
        self.xact_count += o.xact_count;
        self.query_count += o.query_count;
        self.received += o.received;
        self.sent += o.sent;
        self.xact_us += o.xact_us;
        self.query_us += o.query_us;
        self.wait_us += o.wait_us;
    }

    /// The averages from `older` to these totals over `span`: counts,
    /// bytes and waiting per second; transaction and query times per
    /// transaction and per query. Integer division, as PgBouncer's; all
    /// zero over an empty span.
    pub fn averages_since(&self, older: &Totals, span: Duration) -> Averages {
        let us = span.as_micros();
        if us == 0 {
            return Averages::default();
        }
        let per_second = |new: u64, old: u64| {
            (u128::from(new.saturating_sub(old)) * 1_000_000 / us).min(u128::from(u64::MAX)) as u64
        };
        let per_item =
            |new: u64, old: u64, n: u64| new.saturating_sub(old).checked_div(n).unwrap_or(0);
        let xacts = self.xact_count.saturating_sub(older.xact_count);
        let queries = self.query_count.saturating_sub(older.query_count);
        Averages {
            xact_count: per_second(self.xact_count, older.xact_count),
            query_count: per_second(self.query_count, older.query_count),
            received: per_second(self.received, older.received),
            sent: per_second(self.sent, older.sent),
            xact_time: per_item(self.xact_us, older.xact_us, xacts),
            query_time: per_item(self.query_us, older.query_us, queries),
            wait_time: per_second(self.wait_us, older.wait_us),
        }
    }
}

/// PgBouncer's `avg_*` figures over one stats period.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Averages {
    /// Transactions per second.
    pub xact_count: u64,
    /// Queries per second.
    pub query_count: u64,
    /// Bytes per second received from clients.
    pub received: u64,
    /// Bytes per second sent to clients.
    pub sent: u64,
    /// Microseconds per transaction.
    pub xact_time: u64,
    /// Microseconds per query.
    pub query_time: u64,
    /// Microseconds of clients' waiting per second.
    pub wait_time: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_per_second_and_times_per_item() {
        let older = Totals {
            xact_count: 100,
            query_count: 300,
            received: 1_000,
            sent: 50_000,
            xact_us: 10_000,
            query_us: 6_000,
            wait_us: 0,
        };
        let newer = Totals {
            xact_count: 700,
            query_count: 1_500,
            received: 121_000,
            sent: 650_000,
            xact_us: 910_000,
            query_us: 606_000,
            wait_us: 30_000,
        };
        assert_eq!(
            newer.averages_since(&older, Duration::from_secs(60)),
            Averages {
                xact_count: 10,
                query_count: 20,
                received: 2_000,
                sent: 10_000,
                xact_time: 1_500,
                query_time: 500,
                wait_time: 500,
            }
        );
        // Rounded down, as PgBouncer does: 2 transactions in 3 s.
        let two = Totals {
            xact_count: 2,
            ..Totals::default()
        };
        assert_eq!(
            two.averages_since(&Totals::default(), Duration::from_secs(3))
                .xact_count,
            0
        );
    }

    #[test]
    fn an_idle_or_empty_period_gives_zeros() {
        let t = Totals {
            xact_count: 5,
            xact_us: 500,
            ..Totals::default()
        };
        assert_eq!(
            t.averages_since(&t, Duration::from_secs(60)),
            Averages::default()
        );
        assert_eq!(
            t.averages_since(&Totals::default(), Duration::ZERO),
            Averages::default()
        );
        // Counters never go back; if a pool were replaced mid-period the
        // difference is clamped, not wrapped.
        assert_eq!(
            Totals::default().averages_since(&t, Duration::from_secs(1)),
            Averages::default()
        );
    }

    #[test]
    fn sums_over_pools() {
        let mut sum = Totals::default();
        let one = Totals {
            xact_count: 1,
            query_count: 2,
            received: 3,
            sent: 4,
            xact_us: 5,
            query_us: 6,
            wait_us: 7,
        };
        sum.add(&one);
        sum.add(&one);
        assert_eq!(sum.xact_count + sum.wait_us, 16);
        assert_eq!((sum.received, sum.sent, sum.query_us), (6, 8, 12));
    }
}
