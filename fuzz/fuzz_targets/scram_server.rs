//! The server side of a SCRAM-SHA-256 exchange as pgwarden runs it
//! towards clients: SASLInitialResponse body, client-first-message, then
//! client-final-message, with and without channel binding
//! (`SCRAM-SHA-256-PLUS`).
#![no_main]

use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use pgwarden_auth::{ScramSecret, ScramServer};
use pgwarden_wire::message;

fn secret() -> &'static ScramSecret {
    // One iteration keeps each run cheap; the parsing does not depend on it.
    static SECRET: OnceLock<ScramSecret> = OnceLock::new();
    SECRET.get_or_init(|| ScramSecret::from_password("pencil", b"saltsaltsaltsalt", 1).unwrap())
}

fuzz_target!(|data: &[u8]| {
    // Input: SASLInitialResponse body, a 0xFF 0x00 separator, then the
    // client-final-message. Without a separator everything is the first
    // message; a raw client-first is tried too, so that the fuzzer does not
    // have to build the body framing to reach the SCRAM parser.
    let (initial, last) = match data.windows(2).position(|w| w == [0xff, 0]) {
        Some(at) => (&data[..at], &data[at + 2..]),
        None => (data, &[][..]),
    };
    let firsts = [
        message::sasl_initial_response(initial)
            .ok()
            .and_then(|(_, d)| d),
        Some(initial),
    ];
    for first in firsts.into_iter().flatten() {
        // Without channel binding (plaintext clients), then with it offered
        // (TLS clients) for either mechanism the client may choose. The
        // nonce is fixed so that a found input reproduces.
        let servers = [
            (ScramServer::new(secret(), [1u8; 18]), "SCRAM-SHA-256"),
            (
                ScramServer::new(secret(), [1u8; 18]).with_channel_binding([9u8; 32]),
                "SCRAM-SHA-256",
            ),
            (
                ScramServer::new(secret(), [1u8; 18]).with_channel_binding([9u8; 32]),
                "SCRAM-SHA-256-PLUS",
            ),
        ];
        for (mut server, mechanism) in servers {
            if server.initial_response(mechanism, first).is_ok() {
                let _ = server.client_final(last);
                // Out of order after the end: must be an error, not a panic.
                let _ = server.client_final(last);
            }
        }
    }
});
