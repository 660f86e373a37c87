//! The subject common name of a client certificate: the certificate has
//! been verified by the TLS stack, but it is still bytes from a peer.
#![no_main]

use libfuzzer_sys::fuzz_target;
use pgwarden_auth::subject_common_name;

fuzz_target!(|data: &[u8]| {
    if let Ok(Some(name)) = subject_common_name(data) {
        // The name is a slice of the input, never more.
        assert!(name.len() < data.len());
    }
});
