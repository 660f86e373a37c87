//! The read-only SQL guard: lexer, statement classification and the
//! `options` startup parameter check.
#![no_main]

use libfuzzer_sys::fuzz_target;
use pgwarden_wire::readonly::{check_read_only, check_read_only_bytes, options_set_read_only_guc};

fuzz_target!(|data: &[u8]| {
    let bytes = check_read_only_bytes(data);
    if let Ok(text) = std::str::from_utf8(data) {
        // The byte and text entry points must agree on UTF-8 input.
        assert_eq!(check_read_only(text).is_ok(), bytes.is_ok());
        let _ = options_set_read_only_guc(text);
    }
});
