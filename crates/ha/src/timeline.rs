//! Timeline history: whether a standby's history parted from its
//! source's (a leader, or a standby cluster's remote primary), so that
//! only pg_rewind lets it follow again.
//!
//! When a replica is promoted, the WAL the old primary had sent to other
//! replicas but not to it is gone from the new timeline. A replica that
//! replayed some of that WAL cannot follow the new leader (PostgreSQL says
//! "new timeline N forked off current database system timeline M before
//! current recovery point") and needs pg_rewind, however often its WAL
//! receiver reconnects. The leader's `NNNNNNNN.history` file says where
//! each earlier timeline ended. The standby's own timeline is read from
//! the names of its WAL segment files as well as from its control file,
//! whose checkpoint may predate a timeline switch it followed; believing
//! the control file alone would rewind a standby that is fine, and
//! pg_rewind then fails on it.

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

/// The part of a WAL segment file's name after its timeline (16 upper-case
/// hex digits) for the segment holding `lsn`, with segments of
/// `segment_size` bytes. Names compare as the positions they hold.
pub fn segment_name_suffix(lsn: u64, segment_size: u64) -> String {
    let segment = lsn / segment_size.max(1);
    let per_id = (1u64 << 32) / segment_size.clamp(1, 1 << 32);
    format!("{:08X}{:08X}", segment / per_id, segment % per_id)
}

/// The timeline in a WAL segment file's name, if it is one.
pub fn segment_timeline(name: &str) -> Option<u32> {
    if name.len() != 24 || !name.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    u32::from_str_radix(&name[..8], 16).ok()
}

/// The `(parent timeline, switch point)` entries of a history file, in
/// order; lines that are not entries (comments, blanks) are skipped.
fn entries(history: &str) -> Vec<(u32, u64)> {
    history
        .lines()
        .filter_map(|line| {
            let mut fields = line.split_whitespace();
            let parent: u32 = fields.next()?.parse().ok()?;
            Some((parent, parse_lsn(fields.next()?)?))
        })
        .collect()
}

/// Where a server stands in its history: its timeline, and the text of
/// that timeline's history file when it has one and it could be read
/// (timeline 1 has none).
#[derive(Debug, Clone, Copy)]
pub struct Standing<'a> {
    /// The timeline the server is on.
    pub tli: u32,
    /// The text of its `NNNNNNNN.history` file.
    pub history: Option<&'a str>,
}

/// Whether a standby at `local`, having replayed up to `replayed`, can no
/// longer stream from a source at `source` without a rewind, because the
/// two histories went different ways.
///
/// - A standby on a later timeline than its source's has a history the
///   source never had: PostgreSQL does not stream from a source on a
///   lower timeline.
/// - The standby's history must be the start of the source's; two
///   timelines of the same number born at different points are two
///   histories.
/// - On an earlier timeline, the standby must not have replayed past the
///   point where the source's history left that timeline.
///
/// What cannot be read says nothing: a missing history file never makes
/// the answer `true` by itself.
pub fn diverged_from_source(local: Standing<'_>, replayed: u64, source: Standing<'_>) -> bool {
    if local.tli > source.tli {
        return true;
    }
    if let (Some(l), Some(s)) = (local.history, source.history) {
        let (l, s) = (entries(l), entries(s));
        if !s.starts_with(&l) {
            return true;
        }
    }
    if local.tli == source.tli {
        return false;
    }
    match source.history {
        Some(h) => match switchpoint(h, local.tli) {
            Some(fork) => replayed > fork,
            // The source's history never went through this timeline.
            None => true,
        },
        None => false,
    }
}

/// Whether a server shut down cleanly on timeline `local_tli`, its last
/// checkpoint (the shutdown checkpoint, its last WAL record) at
/// `checkpoint`, must be rewound to follow a source at `source`; `false`
/// means it can start as the source's standby as it is.
///
/// The record's end is not in the control file, but no timeline forks
/// inside a record: the source's history left the local timeline either
/// at or before the record's start (it lacks the record) or at or after
/// its end (it has it).
pub fn needs_rewind_after_clean_shutdown(
    local_tli: u32,
    checkpoint: u64,
    source: Standing<'_>,
) -> bool {
    diverged_from_source(
        Standing {
            tli: local_tli,
            history: None,
        },
        checkpoint.saturating_add(1),
        source,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_clean_shutdown_the_source_received_needs_no_rewind() {
        let source = |history| Standing {
            tli: 3,
            history: Some(history),
        };
        let h = "1\t0/501A8E0\tno recovery target specified\n\
                 2\t0/7000148\tno recovery target specified\n";
        // The shutdown checkpoint at 0/70000C0 ends before the fork.
        assert!(!needs_rewind_after_clean_shutdown(2, 0x70000C0, source(h)));
        // The source forked before the record or at its start: it lacks it.
        assert!(needs_rewind_after_clean_shutdown(2, 0x7000148, source(h)));
        assert!(needs_rewind_after_clean_shutdown(2, 0x7000200, source(h)));
        // Earlier timelines: against their own switch points.
        assert!(!needs_rewind_after_clean_shutdown(1, 0x5000000, source(h)));
        assert!(needs_rewind_after_clean_shutdown(1, 0x6000000, source(h)));
        // On the source's own timeline, or ahead of it.
        assert!(!needs_rewind_after_clean_shutdown(3, 0x9000000, source(h)));
        assert!(needs_rewind_after_clean_shutdown(4, 0x9000000, source(h)));
        // A history that does not go through the local timeline.
        let other = "1\t0/501A8E0\tno recovery target specified\n";
        assert!(needs_rewind_after_clean_shutdown(
            5,
            0x1000,
            Standing {
                tli: 6,
                history: Some(other)
            }
        ));
    }

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
        assert!(diverged_from_source(
            at(1, None),
            0x501A948,
            at(2, Some(HISTORY))
        ));
        // Up to the fork is shared history.
        assert!(!diverged_from_source(
            at(1, None),
            0x501A8E0,
            at(2, Some(HISTORY))
        ));
        assert!(!diverged_from_source(
            at(1, None),
            0x5000000,
            at(2, Some(HISTORY))
        ));
    }

    #[test]
    fn segment_names_as_postgresql_writes_them() {
        const MB16: u64 = 16 << 20;
        // pg_walfile_name('0/501A8E0') on timeline 1 = 000000010000000000000005
        assert_eq!(segment_name_suffix(0x501A8E0, MB16), "0000000000000005");
        assert_eq!(
            segment_name_suffix((0x16 << 32) | 0xB374D848, MB16),
            "00000016000000B3"
        );
        assert_eq!(
            segment_name_suffix(0x1_0000_0000, 1 << 30),
            "0000000100000000"
        );
        assert_eq!(segment_timeline("000000020000000000000005"), Some(2));
        assert_eq!(segment_timeline("0000000A0000000100000005"), Some(10));
        for not_a_segment in [
            "00000002.history",
            "000000020000000000000005.partial",
            "archive_status",
            "",
        ] {
            assert_eq!(segment_timeline(not_a_segment), None, "{not_a_segment}");
        }
    }

    fn at(tli: u32, history: Option<&str>) -> Standing<'_> {
        Standing { tli, history }
    }

    #[test]
    fn a_standby_diverged_from_its_source_when_their_histories_part() {
        const ONE: &str = "1\t0/501A8E0\tno recovery target specified\n";
        // Same timeline, same history: nothing to do, however far it got.
        assert!(!diverged_from_source(at(1, None), u64::MAX, at(1, None)));
        assert!(!diverged_from_source(
            at(2, Some(ONE)),
            u64::MAX,
            at(2, Some(ONE))
        ));
        // The source failed over: only WAL past its fork needs a rewind.
        assert!(diverged_from_source(
            at(1, None),
            0x501A948,
            at(3, Some(HISTORY))
        ));
        assert!(!diverged_from_source(
            at(1, None),
            0x501A8E0,
            at(3, Some(HISTORY))
        ));
        assert!(!diverged_from_source(
            at(2, Some(ONE)),
            0x7000148,
            at(3, Some(HISTORY))
        ));
        assert!(diverged_from_source(
            at(2, Some(ONE)),
            0x7000149,
            at(3, Some(HISTORY))
        ));
        // The standby was promoted itself: a timeline the source never had.
        assert!(diverged_from_source(at(2, Some(ONE)), 0, at(1, None)));
        // Timeline 2 born elsewhere on each side.
        let other_two = "1\t0/6000000\tno recovery target specified\n";
        assert!(diverged_from_source(
            at(2, Some(other_two)),
            0,
            at(2, Some(ONE))
        ));
        assert!(diverged_from_source(
            at(2, Some(other_two)),
            0,
            at(3, Some(HISTORY))
        ));
        // A source history that never went through the standby's timeline.
        assert!(diverged_from_source(
            at(2, None),
            0,
            at(3, Some("1\t0/10\tx\n"))
        ));
        // Unreadable files say nothing.
        assert!(!diverged_from_source(at(1, None), u64::MAX, at(3, None)));
        assert!(!diverged_from_source(
            at(2, None),
            u64::MAX,
            at(2, Some(ONE))
        ));
    }
}
