//! Stored verifiers and the other password paths: SCRAM secret parsing,
//! md5 responses, and the client side of SCRAM against a hostile server.
#![no_main]

use libfuzzer_sys::fuzz_target;
use pgwarden_auth::{is_md5_secret, md5_response, verify_md5, ClientKey, ScramClient, ScramSecret};
use pgwarden_wire::message;

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    if let Ok(secret) = ScramSecret::parse(&text) {
        // Display must write back something parse accepts.
        assert!(ScramSecret::parse(&secret.to_string()).is_ok());
    }
    let _ = is_md5_secret(&text);
    let salt = [1, 2, 3, 4];
    let _ = md5_response(&text, salt);
    if let Ok(response) = message::password_message(data) {
        let _ = verify_md5("md5a3556571e93b0d20722ba62be61e8c2d", salt, response);
        let _ = verify_md5(&text, salt, response);
    }

    // The client side with a known key: no PBKDF2, so any iteration count
    // the server sends is cheap. Input: server-first, 0xFF 0x00,
    // server-final.
    let (first, last) = match data.windows(2).position(|w| w == [0xff, 0]) {
        Some(at) => (&data[..at], &data[at + 2..]),
        None => (data, &[][..]),
    };
    let mut client =
        ScramClient::with_client_key(ClientKey::from_bytes([7; 32]), Some([8; 32]), [1u8; 18]);
    if client.client_first().is_ok() && client.server_first(first).is_ok() {
        let _ = client.server_final(last);
    }
});
