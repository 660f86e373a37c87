//! Property test: nothing panics, whatever a peer or a configuration file
//! contains.
//!
//! Inputs come from a fixed-seed xorshift generator so that a failure is
//! reproducible: uniform random bytes, and text assembled from fragments of
//! valid messages and lines, which reaches much deeper into the parsers than
//! noise does.

use std::io;
use std::net::IpAddr;
use std::path::Path;

use pgwarden_auth::hba::{no_match_message, reject_message};
use pgwarden_auth::scram::{MECHANISM, MECHANISM_PLUS, NONCE_LEN};
use pgwarden_auth::{
    md5_response, subject_common_name, tls_server_end_point, verify_md5, ClientKey, ConnType, Hba,
    HbaContext, ScramClient, ScramSecret, ScramServer,
};

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

    fn pick<'a>(&mut self, items: &[&'a str]) -> &'a str {
        items[self.below(items.len())]
    }

    /// Up to `max` fragments, glued together.
    fn assemble(&mut self, fragments: &[&str], max: usize) -> String {
        let n = self.below(max + 1);
        (0..n).map(|_| self.pick(fragments)).collect()
    }
}

const ROUNDS: usize = 5_000;

/// A cheap secret (one iteration) so that rounds stay fast.
fn secret() -> ScramSecret {
    ScramSecret::from_password("pencil", b"saltsaltsaltsalt", 1).unwrap()
}

const SCRAM_FRAGMENTS: &[&str] = &[
    "n",
    "y",
    "p",
    ",",
    ",,",
    "=",
    "n=",
    "r=",
    "s=",
    "i=",
    "c=",
    "p=",
    "v=",
    "e=",
    "m=",
    "a=",
    "biws",
    "eSws",
    "abc",
    "user",
    "=2C",
    "=3D",
    "QUJD",
    "AAAA",
    "====",
    "4096",
    "0",
    "-1",
    "99999999999",
    " ",
    "\0",
    "é",
    "x=y",
    "r=abc",
    "p=tls-server-end-point",
    "tls-unique",
];

#[test]
fn scram_secret_parse() {
    let mut rng = XorShift(0x5eed_0001);
    let good = secret().to_string();
    let fragments = [
        "SCRAM-SHA-256",
        "$",
        ":",
        "4096",
        "0",
        "-",
        "QUJD",
        "=",
        "==",
        "AAAA",
        "+",
        "/",
        "é",
        " ",
    ];
    for _ in 0..ROUNDS {
        let _ = ScramSecret::parse(&String::from_utf8_lossy(&rng.bytes(80)));
        let _ = ScramSecret::parse(&rng.assemble(&fragments, 12));
        // Truncations and single-byte damage of a valid secret.
        let cut = rng.below(good.len() + 1);
        let _ = ScramSecret::parse(good.get(..cut).unwrap_or(""));
        let mut damaged = good.clone().into_bytes();
        let at = rng.below(damaged.len());
        damaged[at] = rng.next() as u8;
        let _ = ScramSecret::parse(&String::from_utf8_lossy(&damaged));
    }
}

#[test]
fn scram_server_messages() {
    let mut rng = XorShift(0x5eed_0002);
    let secret = secret();
    for _ in 0..ROUNDS {
        let mut server = ScramServer::new(&secret, [1u8; NONCE_LEN]);
        let first = if rng.below(2) == 0 {
            rng.bytes(64)
        } else {
            rng.assemble(SCRAM_FRAGMENTS, 10).into_bytes()
        };
        let _ = server.client_first(&first);

        // A valid first message, then a garbage final one.
        let mut server = ScramServer::new(&secret, [1u8; NONCE_LEN]);
        server.client_first(b"n,,n=,r=abc").unwrap();
        let last = if rng.below(2) == 0 {
            rng.bytes(100)
        } else {
            rng.assemble(SCRAM_FRAGMENTS, 14).into_bytes()
        };
        let _ = server.client_final(&last);
        let _ = server.client_final(&last);

        // The same with SCRAM-SHA-256-PLUS offered, and either mechanism.
        let mechanism = [MECHANISM, MECHANISM_PLUS, "x"][rng.below(3)];
        let mut server =
            ScramServer::new(&secret, [1u8; NONCE_LEN]).with_channel_binding([9u8; 32]);
        let _ = server.initial_response(mechanism, &first);
        let mut server =
            ScramServer::new(&secret, [1u8; NONCE_LEN]).with_channel_binding([9u8; 32]);
        server
            .initial_response(MECHANISM_PLUS, b"p=tls-server-end-point,,n=,r=abc")
            .unwrap();
        let _ = server.client_final(&last);
        let _ = server.client_final(&last);
    }
}

#[test]
fn scram_client_messages() {
    let mut rng = XorShift(0x5eed_0003);
    let key = ClientKey::from_bytes([7u8; 32]);
    for _ in 0..ROUNDS {
        let mut client = ScramClient::with_client_key(key.clone(), Some([8u8; 32]), [1u8; 18]);
        let first = client.client_first().unwrap();
        let nonce = String::from_utf8_lossy(&first[first.len() - 24..]).into_owned();
        let msg = match rng.below(3) {
            0 => rng.bytes(100),
            1 => rng.assemble(SCRAM_FRAGMENTS, 10).into_bytes(),
            _ => format!(
                "r={nonce}{},s={},i={}",
                rng.pick(SCRAM_FRAGMENTS),
                rng.pick(SCRAM_FRAGMENTS),
                rng.pick(SCRAM_FRAGMENTS)
            )
            .into_bytes(),
        };
        if client.server_first(&msg).is_ok() {
            let fin = if rng.below(2) == 0 {
                rng.bytes(60)
            } else {
                rng.assemble(SCRAM_FRAGMENTS, 6).into_bytes()
            };
            let _ = client.server_final(&fin);
        }

        // The password path, with a server-first that may carry any
        // iteration count.
        let mut client = ScramClient::with_password(rng.bytes(8), [2u8; 18]);
        let _ = client.client_first();
        let _ = client.server_first(&rng.bytes(40));
        let _ = client.server_final(&rng.bytes(40));
    }
}

#[test]
fn md5_inputs() {
    let mut rng = XorShift(0x5eed_0004);
    for _ in 0..ROUNDS {
        let secret = String::from_utf8_lossy(&rng.bytes(40)).into_owned();
        let response = String::from_utf8_lossy(&rng.bytes(40)).into_owned();
        let salt = [rng.next() as u8, 2, 3, 4];
        let _ = verify_md5(&secret, salt, &response);
        let _ = md5_response(&secret, salt);
    }
}

const HBA_FRAGMENTS: &[&str] = &[
    "local",
    "host",
    "hostssl",
    "hostnossl",
    "hostgssenc",
    "hostnogssenc",
    "all",
    "sameuser",
    "samerole",
    "samegroup",
    "replication",
    "+",
    "+admins",
    "@",
    "@inc",
    "@loop",
    "\"",
    "\"\"",
    "#",
    ",",
    " ",
    "\t",
    "\r",
    "\n",
    "\\",
    "\\\n",
    "/",
    "/8",
    "/33",
    "/-0",
    "10.0.0.1",
    "255.255.0.0",
    "::1",
    "fe80::",
    "samehost",
    "samenet",
    "trust",
    "reject",
    "md5",
    "password",
    "scram-sha-256",
    "cert",
    "ldap",
    "=",
    "clientcert=verify-ca",
    "clientcert=verify-full",
    "clientname=DN",
    "map=x",
    "é",
    "0",
    "x",
];

#[test]
fn hba_files() {
    let mut rng = XorShift(0x5eed_0005);
    let includes = std::cell::RefCell::new(XorShift(0x5eed_0006));
    let read = |p: &Path| -> io::Result<String> {
        let mut rng = includes.borrow_mut();
        if p.ends_with("loop") {
            return Ok("@loop".into());
        }
        match rng.below(3) {
            0 => Err(io::Error::new(io::ErrorKind::NotFound, "nope")),
            1 => Ok(String::from_utf8_lossy(&rng.bytes(30)).into_owned()),
            _ => Ok(rng.assemble(HBA_FRAGMENTS, 6)),
        }
    };
    let locals: [(IpAddr, u8); 3] = [
        ("10.0.0.1".parse().unwrap(), 8),
        ("::1".parse().unwrap(), 200),
        ("::ffff:1.2.3.4".parse().unwrap(), 0),
    ];
    let roles = |_: &str| vec!["admins".to_owned()];
    let addrs: [Option<IpAddr>; 4] = [
        None,
        Some("10.0.0.7".parse().unwrap()),
        Some("::1".parse().unwrap()),
        Some("::ffff:10.0.0.1".parse().unwrap()),
    ];
    let mut parsed = 0;
    for round in 0..ROUNDS {
        let text = if round % 4 == 0 {
            String::from_utf8_lossy(&rng.bytes(200)).into_owned()
        } else {
            // Mostly well-formed lines with damage here and there.
            let mut text = String::new();
            for _ in 0..=rng.below(4) {
                let conn = rng.pick(&["local", "host", "hostssl", "hostnossl", "hostgssenc"]);
                let addr = if conn == "local" {
                    ""
                } else {
                    rng.pick(&[
                        "all",
                        "10.0.0.0/8",
                        "::1/128",
                        "10.0.0.1 255.0.0.0",
                        "samenet",
                    ])
                };
                let (db, user, options) = if rng.below(4) != 0 {
                    (
                        rng.pick(&[
                            "all",
                            "app",
                            "sameuser",
                            "samerole",
                            "replication",
                            "\"all\"",
                            "a,b",
                            "@inc",
                        ])
                        .to_owned(),
                        rng.pick(&["all", "+admins", "x", "\"+x\"", "@inc", "x, +admins"])
                            .to_owned(),
                        if conn == "hostssl" {
                            rng.pick(&["", "clientcert=verify-full", "clientname=CN"])
                                .to_owned()
                        } else {
                            String::new()
                        },
                    )
                } else {
                    (
                        rng.assemble(HBA_FRAGMENTS, 2),
                        rng.assemble(HBA_FRAGMENTS, 2),
                        rng.assemble(HBA_FRAGMENTS, 2),
                    )
                };
                let method = match conn {
                    "hostssl" => rng.pick(&["trust", "md5", "cert", "reject"]),
                    _ => rng.pick(&["trust", "md5", "scram-sha-256", "reject"]),
                };
                text.push_str(&format!("{conn} {db} {user} {addr} {method} {options}\n"));
            }
            if rng.below(3) == 0 {
                text.push_str(&rng.assemble(HBA_FRAGMENTS, 8));
            }
            text
        };
        let Ok(hba) = Hba::parse(&text, Path::new("/etc/pg_hba.conf"), &read) else {
            continue;
        };
        parsed += 1;
        for addr in addrs {
            let conn_type = if addr.is_none() && rng.below(2) == 0 {
                ConnType::Local
            } else {
                ConnType::Host {
                    ssl: rng.below(2) == 0,
                }
            };
            let ctx = HbaContext {
                physical_replication: rng.below(4) == 0,
                roles_of_user: &roles,
                local_addrs: &locals,
                ..HbaContext::new(conn_type, rng.pick(HBA_FRAGMENTS), "x", addr)
            };
            let _ = hba.find(&ctx);
            let _ = no_match_message(&ctx);
            let _ = reject_message(&ctx);
        }
    }
    // The generator must reach the matcher, not only the error paths.
    assert!(parsed > ROUNDS / 20, "only {parsed} files parsed");
}

#[test]
fn client_certificates() {
    use rcgen::{CertificateParams, DnType, KeyPair};
    let mut rng = XorShift(0x5eed_0007);
    let mut params = CertificateParams::new(vec!["client".to_string()]).unwrap();
    params
        .distinguished_name
        .push(DnType::OrganizationName, "pgwarden");
    params.distinguished_name.push(DnType::CommonName, "alice");
    let cert = params.self_signed(&KeyPair::generate().unwrap()).unwrap();
    let der = cert.der().to_vec();
    assert_eq!(subject_common_name(&der), Ok(Some(&b"alice"[..])));
    let mut named = 0;
    for _ in 0..ROUNDS {
        let mut input = der.clone();
        match rng.below(4) {
            // A few bytes changed anywhere, lengths and tags included.
            0 | 1 => {
                for _ in 0..=rng.below(4) {
                    let i = rng.below(input.len());
                    input[i] = rng.next() as u8;
                }
            }
            // Cut short, or with something appended.
            2 => {
                input.truncate(rng.below(der.len()));
                input.extend(rng.bytes(8));
            }
            _ => input = rng.bytes(64),
        }
        if let Ok(Some(_)) = subject_common_name(&input) {
            named += 1;
        }
        let _ = tls_server_end_point(&input);
    }
    // Most single changes leave a readable subject: the walk is exercised
    // beyond its first error.
    assert!(named > ROUNDS / 20, "only {named} names read");
}
