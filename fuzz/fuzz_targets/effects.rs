//! What a query does to a pooled session: the word scanner, the statement
//! splitter and the session-state check, on arbitrary bytes (the check
//! reads raw query text in any client encoding).
#![no_main]

use libfuzzer_sys::fuzz_target;
use pgwarden_wire::effects::{statements, words, Effects};

fuzz_target!(|data: &[u8]| {
    let all = Effects::of(data);

    // The scanner classifies 64 bytes at a time; it must find the words a
    // byte-at-a-time split finds, wherever the blocks cut them.
    let bytewise = data
        .split(|b| !(b.is_ascii_alphanumeric() || *b == b'_'))
        .filter(|w| !w.is_empty());
    assert!(words(data).eq(bytewise), "words differ");

    // The statements partition the query at its semicolons.
    let mut at = 0;
    for s in statements(data) {
        let start = s.as_ptr() as usize - data.as_ptr() as usize;
        assert_eq!(start, at, "statements out of order");
        at = start + s.len();
        if at < data.len() {
            assert_eq!(data[at], b';', "a statement ends before a semicolon");
            at += 1;
        }
    }
    assert_eq!(at, data.len(), "statements leave bytes out");

    // A query pins its client, or drops the session's prepared statements,
    // exactly when one of its statements does.
    let (pins, drops) = statements(data)
        .map(Effects::of)
        .fold((false, false), |(p, d), e| (p | e.pins, d | e.drops));
    assert_eq!((all.pins, all.drops), (pins, drops), "query and statements disagree");
});
