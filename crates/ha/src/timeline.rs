//! Timeline history: whether a replica replayed WAL that the leader's
//! timeline does not contain.
//!
//! When a replica is promoted, the WAL the old primary had sent to other
//! replicas but not to it is gone from the new timeline. A replica that
//! replayed some of that WAL cannot follow the new leader (PostgreSQL says
//! "new timeline N forked off current database system timeline M before
//! current recovery point") and needs pg_rewind, however often its WAL
//! receiver reconnects. The leader's `NNNNNNNN.history` file says where
//! each earlier timeline ended.

/// Parses an LSN written as PostgreSQL prints it (`16/B374D848`).
pub fn parse_lsn(text: &str) -> Option<u64> {
    let (hi, lo) = text.trim().split_once('/')?;
    let hi = u32::from_str_radix(hi, 16).ok()?;
    let lo = u32::from_str_radix(lo, 16).ok()?;
    Some((u64::from(hi) << 32) | u64::from(lo))
}

/// The name of the history file of timeline `tli`, in `pg_wal`.
pub fn history_file_name(tli: u32) -> String {
    format!("{tli:08X}.history")
}

/// Where timeline `tli` ended according to `history` (the text of a
/// timeline history file): the first LSN that is not part of it on the
/// history's timeline. `None` when the history does not go through `tli`.
pub fn switchpoint(history: &str, tli: u32) -> Option<u64> {
    history.lines().find_map(|line| {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            return None;
        }
        let mut fields = line.split_whitespace();
        let parent: u32 = fields.next()?.parse().ok()?;
        let lsn = parse_lsn(fields.next()?)?;
        (parent == tli).then_some(lsn)
    })
}

/// Whether a replica that replayed WAL up to `replayed` on timeline `tli`
/// went past the point where the timeline of `history` forked off `tli`.
/// A history that does not go through `tli` says nothing: `false`.
pub fn replayed_past_fork(history: &str, tli: u32, replayed: u64) -> bool {
    switchpoint(history, tli).is_some_and(|fork| replayed > fork)
}

#[cfg(test)]
mod tests {
    use super::*;

    const HISTORY: &str = "1\t0/501A8E0\tno recovery target specified\n\n\
                           2\t0/7000148\tno recovery target specified\n";

    #[test]
    fn lsns_parse_as_postgres_prints_them() {
        assert_eq!(parse_lsn("0/501A8E0"), Some(0x501A8E0));
        assert_eq!(parse_lsn("16/B374D848"), Some((0x16 << 32) | 0xB374D848));
        assert_eq!(parse_lsn("0/0"), Some(0));
        for bad in ["", "0", "0/", "/1", "x/1", "0/1/2", "100000000/0"] {
            assert_eq!(parse_lsn(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn file_names_are_eight_upper_case_hex_digits() {
        assert_eq!(history_file_name(2), "00000002.history");
        assert_eq!(history_file_name(26), "0000001A.history");
    }

    #[test]
    fn the_switchpoint_of_each_earlier_timeline() {
        assert_eq!(switchpoint(HISTORY, 1), Some(0x501A8E0));
        assert_eq!(switchpoint(HISTORY, 2), Some(0x7000148));
        assert_eq!(switchpoint(HISTORY, 3), None);
        assert_eq!(switchpoint("# comment\n\n", 1), None);
        assert_eq!(switchpoint("garbage line\n1 0/10 x", 1), Some(0x10));
    }

    #[test]
    fn only_wal_past_the_fork_needs_a_rewind() {
        // The case seen: the old primary sent a record to one replica only.
        assert!(replayed_past_fork(HISTORY, 1, 0x501A948));
        // Up to the fork is shared history.
        assert!(!replayed_past_fork(HISTORY, 1, 0x501A8E0));
        assert!(!replayed_past_fork(HISTORY, 1, 0x5000000));
        // A replica already on the leader's timeline, or an unknown one.
        assert!(!replayed_past_fork(HISTORY, 3, u64::MAX));
    }
}
