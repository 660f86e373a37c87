//! The first bytes a client sends: StartupMessage, SSLRequest,
//! GSSENCRequest and CancelRequest, as `parse_startup` frames them.
#![no_main]

use bytes::BytesMut;
use libfuzzer_sys::fuzz_target;
use pgwarden_wire::readonly::startup_sets_read_only_guc;
use pgwarden_wire::startup::{parse_startup, StartupFrame, MAX_STARTUP_PACKET};

fuzz_target!(|data: &[u8]| {
    let mut buf = BytesMut::from(data);
    let before = buf.len();
    match parse_startup(&mut buf) {
        Ok(Some(frame)) => {
            let used = before - buf.len();
            assert!((8..=MAX_STARTUP_PACKET).contains(&used));
            if let StartupFrame::Startup(msg) = frame {
                let _ = startup_sets_read_only_guc(&msg);
                let _ = msg.negotiation(0);
                let _ = msg.negotiation(2);
                let _ = msg.protocol_options().count();
                // What the proxy forwards upstream must parse back the same.
                let mut again = msg.encode();
                assert_eq!(
                    parse_startup(&mut again),
                    Ok(Some(StartupFrame::Startup(msg)))
                );
            }
        }
        // Incomplete or refused input must not be consumed.
        Ok(None) | Err(_) => assert_eq!(buf.len(), before),
    }
});
