//! pg_hba.conf: tokenizer, `@file` includes, line parser and rule matching.
#![no_main]

use std::io;
use std::net::IpAddr;
use std::path::Path;

use libfuzzer_sys::fuzz_target;
use pgwarden_auth::hba::{no_match_message, reject_message};
use pgwarden_auth::{ConnType, Hba, HbaContext};

fuzz_target!(|data: &[u8]| {
    // Input: the main file, a NUL, then what every `@file` include reads.
    let (main, include) = match data.iter().position(|b| *b == 0) {
        Some(at) => (&data[..at], &data[at + 1..]),
        None => (data, &[][..]),
    };
    let main = String::from_utf8_lossy(main);
    let include = String::from_utf8_lossy(include);
    let read = |p: &Path| -> io::Result<String> {
        if p.ends_with("missing") {
            Err(io::Error::new(io::ErrorKind::NotFound, "not found"))
        } else {
            Ok(include.clone().into_owned())
        }
    };
    let Ok(hba) = Hba::parse(&main, Path::new("/etc/pg_hba.conf"), &read) else {
        return;
    };
    let roles = |_: &str| vec!["admins".to_owned()];
    let locals: [(IpAddr, u8); 3] = [
        (IpAddr::from([10, 0, 0, 1]), 8),
        ("::1".parse().unwrap(), 200),
        ("::ffff:1.2.3.4".parse().unwrap(), 0),
    ];
    let addrs: [Option<IpAddr>; 4] = [
        None,
        Some(IpAddr::from([10, 0, 0, 7])),
        Some("::1".parse().unwrap()),
        Some("::ffff:10.0.0.1".parse().unwrap()),
    ];
    for (i, addr) in addrs.into_iter().enumerate() {
        let conn_type = match (addr, i % 2) {
            (None, _) => ConnType::Local,
            (Some(_), n) => ConnType::Host { ssl: n == 0 },
        };
        for (db, user) in [("app", "app"), ("all", "admins"), ("replication", "x")] {
            let ctx = HbaContext {
                physical_replication: db == "replication",
                roles_of_user: &roles,
                local_addrs: &locals,
                ..HbaContext::new(conn_type, db, user, addr)
            };
            let _ = hba.find(&ctx);
            let _ = no_match_message(&ctx);
            let _ = reject_message(&ctx);
        }
    }
});
