//! Tagged-message framing and every body accessor, including the
//! PasswordMessage and SASLInitialResponse bodies read during
//! authentication.
#![no_main]

use bytes::BytesMut;
use libfuzzer_sys::fuzz_target;
use pgwarden_wire::message::{self, body, peek_header, split_message};

fn accessors(b: &[u8]) {
    let _ = message::query_text(b);
    let _ = message::query_bytes(b);
    let _ = message::parse_message(b);
    let _ = message::bind_names(b);
    let _ = message::close_target(b);
    let _ = message::describe_target(b);
    let _ = message::parameter_status(b);
    let _ = message::ready_for_query_status(b);
    let _ = message::backend_key_data(b);
    let _ = message::authentication_code(b);
    let _ = message::password_message(b);
    if let Ok((_, Some(data))) = message::sasl_initial_response(b) {
        assert!(data.len() <= b.len());
    }
    if let Ok(fields) = message::error_fields(b) {
        let _ = message::ErrorSummary::from_fields(&fields);
    }
}

fuzz_target!(|data: &[u8]| {
    // The first two bytes pick the length bound, so that both the
    // "too long" and the "complete" paths are reached.
    let (max_len, input) = match data {
        [a, b, rest @ ..] => (usize::from(u16::from_be_bytes([*a, *b])) + 1, rest),
        _ => (1 << 16, data),
    };
    let _ = peek_header(input, max_len);
    let mut buf = BytesMut::from(input);
    let mut total = 0;
    while let Ok(Some((tag, msg))) = split_message(&mut buf, max_len) {
        assert_eq!(msg[0], tag);
        assert!(msg.len() >= 5);
        total += msg.len();
        accessors(body(&msg));
    }
    assert_eq!(total + buf.len(), input.len());
    accessors(input);
});
