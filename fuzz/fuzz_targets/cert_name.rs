//! The DER certificate readers: the subject common name of a client
//! certificate (verified by the TLS stack first, but still bytes from a
//! peer), and the signature algorithm that picks the hash of
//! `tls-server-end-point` channel binding.
#![no_main]

use libfuzzer_sys::fuzz_target;
use pgwarden_auth::{end_point_hash, subject_common_name, tls_server_end_point};

fuzz_target!(|data: &[u8]| {
    if let Ok(Some(name)) = subject_common_name(data) {
        // The name is a slice of the input, never more.
        assert!(name.len() < data.len());
    }
    let hash = end_point_hash(data);
    let binding = tls_server_end_point(data);
    // The binding data exists exactly when a hash was chosen, and is that
    // hash's digest of the whole certificate.
    match (hash, binding) {
        (Ok(Some(h)), Ok(Some(b))) => assert_eq!(h.digest(data), b),
        (Ok(None), Ok(None)) | (Err(_), Err(_)) => {}
        (h, b) => panic!("hash {h:?} and binding {b:?} disagree"),
    }
});
