//! Property test: no parser panics, whatever bytes it is given.
//!
//! Inputs come from a fixed-seed xorshift generator so that a failure is
//! reproducible, in three flavours: uniform random bytes, packets with a
//! plausible header in front of random bytes, and SQL-like text assembled
//! from fragments that drive the lexer through all of its states.

use bytes::BytesMut;
use pgwarden_wire::effects::{statements, words, Effects};
use pgwarden_wire::message::{self, body, peek_header, split_message};
use pgwarden_wire::readonly::{
    check_read_only, check_read_only_bytes, options_set_read_only_guc, startup_sets_read_only_guc,
};
use pgwarden_wire::startup::{parse_startup, StartupFrame, MAX_STARTUP_PACKET};

struct XorShift(u64);

impl XorShift {
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    fn bytes(&mut self, max_len: usize) -> Vec<u8> {
        let len = self.below(max_len + 1);
        (0..len).map(|_| self.next() as u8).collect()
    }
}

const ROUNDS: usize = 20_000;

fn all_body_accessors(b: &[u8]) {
    let _ = message::query_text(b);
    let _ = message::query_bytes(b);
    let _ = message::parse_message(b);
    let _ = message::function_call_oid(b);
    let _ = message::bind_names(b);
    let _ = message::close_target(b);
    let _ = message::describe_target(b);
    let _ = message::parameter_status(b);
    let _ = message::ready_for_query_status(b);
    let _ = message::backend_key_data(b);
    let _ = message::authentication_code(b);
    if let Ok(f) = message::error_fields(b) {
        let _ = message::ErrorSummary::from_fields(&f);
    }
    if let Ok(f) = message::error_fields_raw(b) {
        let _ = message::find_raw_field(&f, b'C');
    }
}

fn startup_bytes(buf: &[u8]) {
    let mut b = BytesMut::from(buf);
    let before = b.len();
    match parse_startup(&mut b) {
        Ok(Some(frame)) => {
            let used = before - b.len();
            assert!((8..=MAX_STARTUP_PACKET).contains(&used));
            if let StartupFrame::Startup(m) = frame {
                assert!(m.user().is_some());
                assert!(m.database().is_some());
                let _ = startup_sets_read_only_guc(&m);
                let _ = m.negotiation(0);
                let mut again = m.encode();
                assert_eq!(
                    parse_startup(&mut again),
                    Ok(Some(StartupFrame::Startup(m)))
                );
            }
        }
        Ok(None) | Err(_) => assert_eq!(b.len(), before),
    }
}

fn framing_bytes(buf: &[u8], max_len: usize) {
    let _ = peek_header(buf, max_len);
    let mut b = BytesMut::from(buf);
    let mut total = 0;
    while let Ok(Some((tag, m))) = split_message(&mut b, max_len) {
        assert_eq!(m[0], tag);
        assert!(m.len() >= 5);
        total += m.len();
        all_body_accessors(body(&m));
    }
    assert_eq!(total + b.len(), buf.len());
}

fn sql_bytes(buf: &[u8]) {
    let _ = check_read_only_bytes(buf);
    session_effects(buf);
    let text = String::from_utf8_lossy(buf);
    let _ = check_read_only(&text);
    let _ = options_set_read_only_guc(&text);
}

/// The pool's session-state check, with the invariants the fuzz target
/// (`fuzz/fuzz_targets/effects.rs`) asserts.
fn session_effects(buf: &[u8]) {
    let all = Effects::of(buf);
    let bytewise = buf
        .split(|b| !(b.is_ascii_alphanumeric() || *b == b'_'))
        .filter(|w| !w.is_empty());
    assert!(words(buf).eq(bytewise), "words differ: {buf:?}");
    let mut at = 0;
    for s in statements(buf) {
        assert_eq!(s.as_ptr() as usize - buf.as_ptr() as usize, at, "{buf:?}");
        at += s.len();
        if at < buf.len() {
            assert_eq!(buf[at], b';', "{buf:?}");
            at += 1;
        }
    }
    assert_eq!(at, buf.len(), "{buf:?}");
    let (pins, drops) = statements(buf)
        .map(Effects::of)
        .fold((false, false), |(p, d), e| (p | e.pins, d | e.drops));
    assert_eq!((all.pins, all.drops), (pins, drops), "{buf:?}");
}

#[test]
fn random_bytes() {
    let mut rng = XorShift(0x9E37_79B9_7F4A_7C15);
    for _ in 0..ROUNDS {
        let max = if rng.below(4) == 0 { 600 } else { 40 };
        let buf = rng.bytes(max);
        startup_bytes(&buf);
        framing_bytes(&buf, 1 + rng.below(1 << 16));
        all_body_accessors(&buf);
        sql_bytes(&buf);
    }
}

#[test]
fn plausible_packets() {
    let mut rng = XorShift(0xD1B5_4A32_D192_ED03);
    let codes: [u32; 6] = [
        196_608, 196_610, 80_877_102, 80_877_103, 80_877_104, 131_072,
    ];
    let words: [&[u8]; 10] = [
        b"user\0",
        b"database\0",
        b"options\0",
        b"-c transaction_read_only=off\0",
        b"_pq_.x\0",
        b"\0",
        b"bob\0",
        b"\xff\0",
        b"",
        b"\0\0",
    ];
    for _ in 0..ROUNDS {
        let mut body = Vec::new();
        for _ in 0..rng.below(8) {
            body.extend_from_slice(words[rng.below(words.len())]);
        }
        let mut pkt = Vec::new();
        let len = if rng.below(8) == 0 {
            rng.next() as u32
        } else {
            body.len() as u32 + 8
        };
        pkt.extend_from_slice(&len.to_be_bytes());
        pkt.extend_from_slice(&codes[rng.below(codes.len())].to_be_bytes());
        pkt.extend_from_slice(&body);
        startup_bytes(&pkt);
        startup_bytes(&pkt[..rng.below(pkt.len() + 1)]);

        let mut msg = vec![b"QPBCDSZKRE"[rng.below(10)]];
        let len = if rng.below(8) == 0 {
            rng.next() as u32
        } else {
            body.len() as u32 + 4
        };
        msg.extend_from_slice(&len.to_be_bytes());
        msg.extend_from_slice(&body);
        framing_bytes(&msg, 1 << 20);
    }
}

#[test]
fn sql_like_text() {
    let mut rng = XorShift(0x2545_F491_4F6C_DD1D);
    let pieces: [&str; 61] = [
        "'",
        "''",
        "\"",
        "\"\"",
        "$$",
        "$a$",
        "$1",
        "$",
        "--",
        "/*",
        "*/",
        "\n",
        " ",
        "\t",
        "E'",
        "e'",
        "U&'",
        "u&\"",
        "B'",
        "N'",
        "\\",
        "\\'",
        "\\x",
        "\\u",
        "\\U",
        "\\0",
        "+",
        "0041",
        "UESCAPE",
        "'!'",
        ";",
        "(",
        ")",
        ",",
        ".",
        "SET",
        "RESET",
        "ALL",
        "set_config",
        "transaction_read_only",
        "READ",
        "WRITE",
        "1.5e",
        "\u{e9}",
        // What the pool's session-state check looks for.
        "LISTEN",
        "DISCARD",
        "DEALLOCATE",
        "PREPARE",
        "CREATE",
        "TEMP",
        "pg_temp",
        "pg_temp_3",
        "pg_advisory_lock",
        "WITH",
        "HOLD",
        "SESSION",
        "AUTHORIZATION",
        "LOCAL",
        "TimeZone",
        "true",
        "x",
    ];
    for _ in 0..ROUNDS {
        let mut sql = String::new();
        for _ in 0..rng.below(40) {
            sql.push_str(pieces[rng.below(pieces.len())]);
        }
        let _ = check_read_only(&sql);
        let _ = options_set_read_only_guc(&sql);
        session_effects(sql.as_bytes());
    }
}

#[test]
fn deep_nesting_terminates() {
    // Worst case for the recursive check: constants inside constants, each
    // level with a backslash so that both string modes are tried.
    let mut sql = String::from("SELECT '\\' ");
    for _ in 0..12 {
        sql = format!("SELECT '\\', '{}'", sql.replace('\'', "''"));
    }
    let _ = check_read_only(&sql.repeat(50));
}
