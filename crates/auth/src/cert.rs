//! The name in a client certificate that `cert` authentication and
//! `clientcert=verify-full` compare with the user name.
//!
//! PostgreSQL takes the subject's first common name (OID 2.5.4.3) with
//! OpenSSL's `X509_NAME_get_text_by_NID`, which copies the raw bytes of the
//! attribute's string value whatever its ASN.1 string type, and compares
//! them byte for byte with the user name (`check_usermap` without a map).
//! [`subject_common_name`] returns those same bytes, so a certificate that
//! would not log in to PostgreSQL as a user does not log in to pgwarden as
//! that user either.
//!
//! The certificate has already been verified by the TLS stack (rustls and
//! webpki) when this runs, but the walk still treats the bytes as hostile:
//! it reads strict DER through `untrusted`, the bounds-checked reader that
//! webpki itself parses certificates with, and never panics.

use std::fmt;

use untrusted::{Input, Reader};

/// A certificate whose subject could not be read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CertNameError(&'static str);

impl fmt::Display for CertNameError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "malformed certificate: {}", self.0)
    }
}

impl std::error::Error for CertNameError {}

const SEQUENCE: u8 = 0x30;
const SET: u8 = 0x31;
const INTEGER: u8 = 0x02;
const OID: u8 = 0x06;
/// `[0] EXPLICIT Version` at the start of a v2 or v3 `TBSCertificate`.
const VERSION: u8 = 0xa0;
/// The content octets of OID 2.5.4.3, `id-at-commonName`.
const COMMON_NAME: &[u8] = &[0x55, 0x04, 0x03];

/// Universal string types an X.500 attribute value can have (the
/// `DirectoryString` choices, plus the IA5, visible, numeric and videotex
/// strings OpenSSL also accepts there).
fn is_string_type(tag: u8) -> bool {
    matches!(
        tag,
        0x0c // UTF8String
            | 0x12 // NumericString
            | 0x13 // PrintableString
            | 0x14 // TeletexString
            | 0x15 // VideotexString
            | 0x16 // IA5String
            | 0x1a // VisibleString
            | 0x1c // UniversalString
            | 0x1e // BMPString
    )
}

/// The raw value of the first common name in the subject of a DER
/// certificate (the bytes PostgreSQL compares with the user name), or
/// `None` when the subject has no common name.
///
/// The bytes are not decoded: a `UTF8String` or `PrintableString` name is
/// its text, while a `BMPString` or `UniversalString` name holds NUL bytes
/// and so never equals a user name, as in PostgreSQL.
pub fn subject_common_name(cert: &[u8]) -> Result<Option<&[u8]>, CertNameError> {
    let malformed = CertNameError("not a DER certificate");
    let subject = Input::from(cert).read_all(malformed.clone(), |r| {
        let certificate = expect(r, SEQUENCE)?;
        let tbs = certificate.read_all(malformed.clone(), |r| {
            // signatureAlgorithm and signatureValue follow; webpki has
            // checked them.
            let tbs = expect(r, SEQUENCE)?;
            r.skip_to_end();
            Ok(tbs)
        })?;
        tbs.read_all(malformed.clone(), |r| {
            if r.peek(VERSION) {
                expect(r, VERSION)?;
            }
            expect(r, INTEGER)?; // serialNumber
            expect(r, SEQUENCE)?; // signature
            expect(r, SEQUENCE)?; // issuer
            expect(r, SEQUENCE)?; // validity
            let subject = expect(r, SEQUENCE)?;
            // subjectPublicKeyInfo and the optional fields.
            r.skip_to_end();
            Ok(subject)
        })
    })?;
    let mut first = None;
    // Name ::= SEQUENCE OF RelativeDistinguishedName; each is a SET OF
    // AttributeTypeAndValue. OpenSSL flattens them in DER order, and so
    // "first" means the first in that order.
    subject.read_all(CertNameError("bad subject"), |names| {
        while !names.at_end() {
            let rdn = expect(names, SET)?;
            rdn.read_all(CertNameError("bad subject"), |attrs| {
                while !attrs.at_end() {
                    let attr = expect(attrs, SEQUENCE)?;
                    attr.read_all(CertNameError("bad subject attribute"), |r| {
                        let oid = expect(r, OID)?;
                        let (tag, value) = read_tlv(r)?;
                        if oid.as_slice_less_safe() == COMMON_NAME && first.is_none() {
                            if !is_string_type(tag) {
                                return Err(CertNameError("the common name is not a string"));
                            }
                            first = Some(value.as_slice_less_safe());
                        }
                        Ok(())
                    })?;
                }
                Ok(())
            })?;
        }
        Ok(())
    })?;
    Ok(first)
}

/// Reads one DER element with the given tag and returns its contents.
fn expect<'a>(r: &mut Reader<'a>, tag: u8) -> Result<Input<'a>, CertNameError> {
    match read_tlv(r)? {
        (t, value) if t == tag => Ok(value),
        _ => Err(CertNameError("unexpected element")),
    }
}

/// Reads one DER element: its tag and its contents. Only the forms a
/// certificate's fields use are accepted: single-byte tags and definite
/// lengths in their shortest encoding, up to four length bytes.
fn read_tlv<'a>(r: &mut Reader<'a>) -> Result<(u8, Input<'a>), CertNameError> {
    let truncated = |_| CertNameError("truncated");
    let tag = r.read_byte().map_err(truncated)?;
    if tag & 0x1f == 0x1f {
        return Err(CertNameError("multi-byte tag"));
    }
    let first = r.read_byte().map_err(truncated)?;
    let len = if first < 0x80 {
        usize::from(first)
    } else {
        let count = usize::from(first & 0x7f);
        // 0x80 is BER's indefinite length; more than four bytes is longer
        // than any certificate.
        if count == 0 || count > 4 {
            return Err(CertNameError("unsupported length"));
        }
        let mut len = 0usize;
        for _ in 0..count {
            len = (len << 8) | usize::from(r.read_byte().map_err(truncated)?);
        }
        // DER: the shortest form, so no leading zero byte and no long form
        // for what fits in the short one.
        if len < 0x80 || len >> (8 * (count - 1)) == 0 {
            return Err(CertNameError("non-minimal length"));
        }
        len
    };
    let value = r.read_bytes(len).map_err(truncated)?;
    Ok((tag, value))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A DER element with `tag` around `content`.
    fn tlv(tag: u8, content: &[u8]) -> Vec<u8> {
        let mut out = vec![tag];
        let n = content.len();
        if n < 0x80 {
            out.push(n as u8);
        } else if n < 0x100 {
            out.extend([0x81, n as u8]);
        } else {
            out.extend([0x82, (n >> 8) as u8, n as u8]);
        }
        out.extend_from_slice(content);
        out
    }

    fn attr(oid: &[u8], tag: u8, value: &[u8]) -> Vec<u8> {
        tlv(SEQUENCE, &[tlv(OID, oid), tlv(tag, value)].concat())
    }

    /// A certificate shell around `subject` (the contents of the Name);
    /// `version` adds the v3 version field.
    fn cert(subject: &[u8], version: bool) -> Vec<u8> {
        let mut tbs = Vec::new();
        if version {
            tbs.extend(tlv(VERSION, &tlv(INTEGER, &[2])));
        }
        tbs.extend(tlv(INTEGER, &[1]));
        tbs.extend(tlv(SEQUENCE, &tlv(OID, &[0x2a, 0x86, 0x48])));
        tbs.extend(tlv(SEQUENCE, &tlv(SET, &attr(COMMON_NAME, 0x0c, b"CA"))));
        tbs.extend(tlv(SEQUENCE, &[tlv(0x17, b"x"), tlv(0x17, b"y")].concat()));
        tbs.extend(tlv(SEQUENCE, subject));
        tbs.extend(tlv(SEQUENCE, &[]));
        let body = [
            tlv(SEQUENCE, &tbs),
            tlv(SEQUENCE, &tlv(OID, &[0x2a])),
            tlv(0x03, &[0, 1, 2]),
        ]
        .concat();
        tlv(SEQUENCE, &body)
    }

    const ORG: &[u8] = &[0x55, 0x04, 0x0a];

    #[test]
    fn first_common_name_in_der_order() {
        let subject = [
            tlv(SET, &attr(ORG, 0x0c, b"Example")),
            tlv(SET, &attr(COMMON_NAME, 0x13, b"alice")),
            tlv(SET, &attr(COMMON_NAME, 0x0c, b"bob")),
        ]
        .concat();
        for version in [true, false] {
            assert_eq!(
                subject_common_name(&cert(&subject, version)),
                Ok(Some(&b"alice"[..]))
            );
        }
        // The issuer's common name ("CA") is not the subject's.
        let org_only = tlv(SET, &attr(ORG, 0x0c, b"Example"));
        assert_eq!(subject_common_name(&cert(&org_only, true)), Ok(None));
        assert_eq!(subject_common_name(&cert(&[], true)), Ok(None));
    }

    #[test]
    fn multi_valued_rdns_and_raw_bytes() {
        let subject = tlv(
            SET,
            &[
                attr(ORG, 0x0c, b"Example"),
                attr(COMMON_NAME, 0x0c, "zoë".as_bytes()),
            ]
            .concat(),
        );
        assert_eq!(
            subject_common_name(&cert(&subject, true)),
            Ok(Some("zoë".as_bytes()))
        );
        // A BMPString keeps its UCS-2 bytes, NULs included.
        let bmp = tlv(SET, &attr(COMMON_NAME, 0x1e, &[0, b'a', 0, b'l']));
        assert_eq!(
            subject_common_name(&cert(&bmp, true)),
            Ok(Some(&[0, b'a', 0, b'l'][..]))
        );
        // A long name takes the long length form.
        let long = "x".repeat(300);
        let subject = tlv(SET, &attr(COMMON_NAME, 0x0c, long.as_bytes()));
        assert_eq!(
            subject_common_name(&cert(&subject, true)),
            Ok(Some(long.as_bytes()))
        );
    }

    #[test]
    fn malformed_input_is_an_error() {
        let good = cert(&tlv(SET, &attr(COMMON_NAME, 0x0c, b"alice")), true);
        assert!(subject_common_name(&good).is_ok());
        assert!(subject_common_name(b"").is_err());
        assert!(subject_common_name(b"-----BEGIN CERTIFICATE-----").is_err());
        // Every truncation, and trailing garbage.
        for n in 0..good.len() {
            assert!(subject_common_name(&good[..n]).is_err(), "prefix {n}");
        }
        assert!(subject_common_name(&[good.clone(), vec![0]].concat()).is_err());
        // A common name that is not a string.
        let bad = cert(&tlv(SET, &attr(COMMON_NAME, SEQUENCE, &[])), true);
        assert!(subject_common_name(&bad).is_err());
        // Non-minimal and indefinite lengths are not DER.
        let tlv_of = |bytes: &[u8]| {
            Input::from(bytes).read_all(CertNameError("trailing"), |r| {
                read_tlv(r).map(|(t, v)| (t, v.len()))
            })
        };
        assert_eq!(tlv_of(&[0x04, 0x01, 0xaa]), Ok((0x04, 1)));
        assert!(tlv_of(&[0x04, 0x81, 0x01, 0xaa]).is_err());
        let mut padded = vec![0x04, 0x82, 0x00, 0x80];
        padded.extend([0; 0x80]);
        assert!(tlv_of(&padded).is_err());
        let mut minimal = vec![0x04, 0x81, 0x80];
        minimal.extend([0; 0x80]);
        assert_eq!(tlv_of(&minimal), Ok((0x04, 0x80)));
        assert!(tlv_of(&[0x04, 0x85, 1, 0, 0, 0, 0]).is_err());
        assert!(tlv_of(&[0x1f, 0x01, 0x00]).is_err());
        let mut indefinite = good.clone();
        indefinite[1] = 0x80;
        assert!(subject_common_name(&indefinite).is_err());
    }
}
