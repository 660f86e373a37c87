//! What pgwarden reads in certificates: the name in a client certificate
//! that `cert` authentication and `clientcert=verify-full` compare with the
//! user name, and the hash of its own certificate that SCRAM channel
//! binding (`tls-server-end-point`) is made of.
//!
//! PostgreSQL takes the subject's first common name (OID 2.5.4.3) with
//! OpenSSL's `X509_NAME_get_text_by_NID`, which copies the raw bytes of the
//! attribute's string value whatever its ASN.1 string type, and compares
//! them byte for byte with the user name (`check_usermap` without a map).
//! [`subject_common_name`] returns those same bytes, so a certificate that
//! would not log in to PostgreSQL as a user does not log in to pgwarden as
//! that user either.
//!
//! [`tls_server_end_point`] is RFC 5929's channel-binding data, as
//! PostgreSQL's `be_tls_get_certificate_hash` and libpq compute it: the
//! certificate hashed with the hash function of its signature algorithm,
//! SHA-256 in place of MD5 and SHA-1.
//!
//! A client certificate has already been verified by the TLS stack (rustls
//! and webpki) when this runs, but the walk still treats the bytes as
//! hostile: it reads strict DER through `untrusted`, the bounds-checked
//! reader that webpki itself parses certificates with, and never panics.

use std::fmt;

use sha2::{Digest, Sha224, Sha256, Sha384, Sha512};
use untrusted::{Input, Reader};

/// A certificate that could not be read: not DER, or not shaped like an
/// X.509 certificate where it was looked at.
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
const BIT_STRING: u8 = 0x03;
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

/// The hash function of `tls-server-end-point` channel binding for a
/// certificate (RFC 5929, section 4.1).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EndPointHash {
    /// SHA-224.
    Sha224,
    /// SHA-256, also for certificates signed with MD5 or SHA-1.
    Sha256,
    /// SHA-384.
    Sha384,
    /// SHA-512.
    Sha512,
}

impl EndPointHash {
    /// The hash of `data`.
    pub fn digest(self, data: &[u8]) -> Vec<u8> {
        match self {
            EndPointHash::Sha224 => Sha224::digest(data).to_vec(),
            EndPointHash::Sha256 => Sha256::digest(data).to_vec(),
            EndPointHash::Sha384 => Sha384::digest(data).to_vec(),
            EndPointHash::Sha512 => Sha512::digest(data).to_vec(),
        }
    }
}

/// Content octets of the signature algorithm OIDs whose hash function is
/// known, with the hash `tls-server-end-point` takes for each: the
/// signature's own, except that MD5 and SHA-1 are replaced by SHA-256 (RFC
/// 5929, section 4.1), as OpenSSL's `OBJ_find_sigid_algs` reports them to
/// PostgreSQL.
const SIGNATURE_HASHES: &[(&[u8], EndPointHash)] = &[
    // 1.2.840.113549.1.1.{4,5,11,12,13,14}: md5, sha1, sha256, sha384,
    // sha512 and sha224 WithRSAEncryption.
    (
        &[0x2a, 0x86, 0x48, 0x86, 0xf7, 0x0d, 0x01, 0x01, 0x04],
        EndPointHash::Sha256,
    ),
    (
        &[0x2a, 0x86, 0x48, 0x86, 0xf7, 0x0d, 0x01, 0x01, 0x05],
        EndPointHash::Sha256,
    ),
    (
        &[0x2a, 0x86, 0x48, 0x86, 0xf7, 0x0d, 0x01, 0x01, 0x0b],
        EndPointHash::Sha256,
    ),
    (
        &[0x2a, 0x86, 0x48, 0x86, 0xf7, 0x0d, 0x01, 0x01, 0x0c],
        EndPointHash::Sha384,
    ),
    (
        &[0x2a, 0x86, 0x48, 0x86, 0xf7, 0x0d, 0x01, 0x01, 0x0d],
        EndPointHash::Sha512,
    ),
    (
        &[0x2a, 0x86, 0x48, 0x86, 0xf7, 0x0d, 0x01, 0x01, 0x0e],
        EndPointHash::Sha224,
    ),
    // 1.2.840.10045.4.1 and 1.2.840.10045.4.3.{1,2,3,4}: ecdsa-with-SHA1,
    // -SHA224, -SHA256, -SHA384, -SHA512.
    (
        &[0x2a, 0x86, 0x48, 0xce, 0x3d, 0x04, 0x01],
        EndPointHash::Sha256,
    ),
    (
        &[0x2a, 0x86, 0x48, 0xce, 0x3d, 0x04, 0x03, 0x01],
        EndPointHash::Sha224,
    ),
    (
        &[0x2a, 0x86, 0x48, 0xce, 0x3d, 0x04, 0x03, 0x02],
        EndPointHash::Sha256,
    ),
    (
        &[0x2a, 0x86, 0x48, 0xce, 0x3d, 0x04, 0x03, 0x03],
        EndPointHash::Sha384,
    ),
    (
        &[0x2a, 0x86, 0x48, 0xce, 0x3d, 0x04, 0x03, 0x04],
        EndPointHash::Sha512,
    ),
    // 1.2.840.10040.4.3 and 2.16.840.1.101.3.4.3.{1,2}: dsa-with-sha1,
    // -sha224, -sha256.
    (
        &[0x2a, 0x86, 0x48, 0xce, 0x38, 0x04, 0x03],
        EndPointHash::Sha256,
    ),
    (
        &[0x60, 0x86, 0x48, 0x01, 0x65, 0x03, 0x04, 0x03, 0x01],
        EndPointHash::Sha224,
    ),
    (
        &[0x60, 0x86, 0x48, 0x01, 0x65, 0x03, 0x04, 0x03, 0x02],
        EndPointHash::Sha256,
    ),
];

/// 1.2.840.113549.1.1.10, RSASSA-PSS: the hash is in the parameters.
const RSASSA_PSS: &[u8] = &[0x2a, 0x86, 0x48, 0x86, 0xf7, 0x0d, 0x01, 0x01, 0x0a];

/// Hash algorithm OIDs a PSS signature may name, with the hash
/// `tls-server-end-point` takes for each (SHA-1 becomes SHA-256).
const PSS_HASHES: &[(&[u8], EndPointHash)] = &[
    // 1.3.14.3.2.26, SHA-1.
    (&[0x2b, 0x0e, 0x03, 0x02, 0x1a], EndPointHash::Sha256),
    // 2.16.840.1.101.3.4.2.{1,2,3,4}: SHA-256, SHA-384, SHA-512, SHA-224.
    (
        &[0x60, 0x86, 0x48, 0x01, 0x65, 0x03, 0x04, 0x02, 0x01],
        EndPointHash::Sha256,
    ),
    (
        &[0x60, 0x86, 0x48, 0x01, 0x65, 0x03, 0x04, 0x02, 0x02],
        EndPointHash::Sha384,
    ),
    (
        &[0x60, 0x86, 0x48, 0x01, 0x65, 0x03, 0x04, 0x02, 0x03],
        EndPointHash::Sha512,
    ),
    (
        &[0x60, 0x86, 0x48, 0x01, 0x65, 0x03, 0x04, 0x02, 0x04],
        EndPointHash::Sha224,
    ),
];

/// `[0] EXPLICIT HashAlgorithm` in RSASSA-PSS-params.
const PSS_HASH_ALGORITHM: u8 = 0xa0;

/// The hash function of `tls-server-end-point` for a DER certificate,
/// chosen by the certificate's signature algorithm (the outer
/// `signatureAlgorithm`, which OpenSSL reports): the signature's own hash,
/// or SHA-256 for MD5 and SHA-1 signatures. RSASSA-PSS uses the hash named
/// in its parameters (SHA-1, the default, again becoming SHA-256), as
/// PostgreSQL does when built with OpenSSL's `X509_get_signature_info`.
///
/// `Ok(None)` when RFC 5929 defines no binding for the certificate: a
/// signature with no hash of its own (Ed25519, Ed448) or one unknown here.
/// PostgreSQL fails such an exchange; pgwarden does not offer channel
/// binding with such a certificate instead.
pub fn end_point_hash(cert: &[u8]) -> Result<Option<EndPointHash>, CertNameError> {
    let malformed = CertNameError("not a DER certificate");
    let algorithm = Input::from(cert).read_all(malformed.clone(), |r| {
        let certificate = expect(r, SEQUENCE)?;
        certificate.read_all(malformed.clone(), |r| {
            expect(r, SEQUENCE)?; // tbsCertificate
            let algorithm = expect(r, SEQUENCE)?;
            expect(r, BIT_STRING)?; // signatureValue
            Ok(algorithm)
        })
    })?;
    algorithm.read_all(CertNameError("bad signature algorithm"), |r| {
        let oid = expect(r, OID)?.as_slice_less_safe();
        if oid == RSASSA_PSS {
            return pss_hash(r);
        }
        // The parameters (NULL for RSA, absent for ECDSA) say nothing more.
        r.skip_to_end();
        Ok(SIGNATURE_HASHES
            .iter()
            .find(|(known, _)| *known == oid)
            .map(|&(_, hash)| hash))
    })
}

/// The hash of RSASSA-PSS-params (RFC 4055): `hashAlgorithm`, the first
/// field, defaults to SHA-1, which binding replaces with SHA-256.
fn pss_hash(r: &mut Reader<'_>) -> Result<Option<EndPointHash>, CertNameError> {
    if r.at_end() {
        return Ok(Some(EndPointHash::Sha256));
    }
    let params = expect(r, SEQUENCE)?;
    params.read_all(CertNameError("bad RSASSA-PSS parameters"), |r| {
        if !r.peek(PSS_HASH_ALGORITHM) {
            r.skip_to_end();
            return Ok(Some(EndPointHash::Sha256));
        }
        let hash = expect(r, PSS_HASH_ALGORITHM)?;
        // maskGenAlgorithm, saltLength and trailerField follow.
        r.skip_to_end();
        hash.read_all(CertNameError("bad RSASSA-PSS hash"), |r| {
            let algorithm = expect(r, SEQUENCE)?;
            algorithm.read_all(CertNameError("bad RSASSA-PSS hash"), |r| {
                let oid = expect(r, OID)?.as_slice_less_safe();
                r.skip_to_end();
                Ok(PSS_HASHES
                    .iter()
                    .find(|(known, _)| *known == oid)
                    .map(|&(_, hash)| hash))
            })
        })
    })
}

/// The `tls-server-end-point` channel-binding data of a DER certificate:
/// its hash with [`end_point_hash`]'s function, what a client binding to
/// the certificate it received puts in SCRAM's `c=` attribute. `Ok(None)`
/// when RFC 5929 defines none for the certificate.
pub fn tls_server_end_point(cert: &[u8]) -> Result<Option<Vec<u8>>, CertNameError> {
    Ok(end_point_hash(cert)?.map(|hash| hash.digest(cert)))
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

    /// A certificate shell signed with the algorithm whose
    /// AlgorithmIdentifier contents are `algorithm`.
    fn signed_with(algorithm: &[u8]) -> Vec<u8> {
        let tbs = [
            tlv(INTEGER, &[1]),
            tlv(SEQUENCE, algorithm),
            tlv(SEQUENCE, &[]),
        ]
        .concat();
        let body = [
            tlv(SEQUENCE, &tbs),
            tlv(SEQUENCE, algorithm),
            tlv(BIT_STRING, &[0, 1, 2]),
        ]
        .concat();
        tlv(SEQUENCE, &body)
    }

    const NULL: &[u8] = &[0x05, 0x00];

    fn rsa(last: u8) -> Vec<u8> {
        let oid = [0x2a, 0x86, 0x48, 0x86, 0xf7, 0x0d, 0x01, 0x01, last];
        [tlv(OID, &oid), NULL.to_vec()].concat()
    }

    /// RSASSA-PSS with `hash` (a hash algorithm OID) in its parameters.
    fn pss(hash: Option<&[u8]>) -> Vec<u8> {
        let mut params = Vec::new();
        if let Some(hash) = hash {
            let algorithm = tlv(SEQUENCE, &[tlv(OID, hash), NULL.to_vec()].concat());
            params.extend(tlv(PSS_HASH_ALGORITHM, &algorithm));
        }
        // maskGenAlgorithm (MGF1 with SHA-256) and saltLength, which do not
        // matter.
        params.extend(tlv(
            0xa1,
            &tlv(
                SEQUENCE,
                &[
                    tlv(OID, &[0x2a, 0x86, 0x48, 0x86, 0xf7, 0x0d, 0x01, 0x01, 0x08]),
                    tlv(
                        SEQUENCE,
                        &tlv(OID, &[0x60, 0x86, 0x48, 0x01, 0x65, 0x03, 0x04, 0x02, 0x01]),
                    ),
                ]
                .concat(),
            ),
        ));
        params.extend(tlv(0xa2, &tlv(INTEGER, &[32])));
        [tlv(OID, RSASSA_PSS), tlv(SEQUENCE, &params)].concat()
    }

    #[test]
    fn end_point_hash_of_generated_certificates() {
        use rcgen::{CertificateParams, KeyPair};
        let make = |alg: &'static rcgen::SignatureAlgorithm| {
            let key = KeyPair::generate_for(alg).unwrap();
            CertificateParams::new(vec!["localhost".to_string()])
                .unwrap()
                .self_signed(&key)
                .unwrap()
                .der()
                .to_vec()
        };
        let p256 = make(&rcgen::PKCS_ECDSA_P256_SHA256);
        assert_eq!(end_point_hash(&p256), Ok(Some(EndPointHash::Sha256)));
        let data = tls_server_end_point(&p256).unwrap().unwrap();
        assert_eq!(data, Sha256::digest(&p256).to_vec());

        let p384 = make(&rcgen::PKCS_ECDSA_P384_SHA384);
        assert_eq!(end_point_hash(&p384), Ok(Some(EndPointHash::Sha384)));
        let data = tls_server_end_point(&p384).unwrap().unwrap();
        assert_eq!(data.len(), 48);
        assert_eq!(data, Sha384::digest(&p384).to_vec());

        // Ed25519 hashes nothing itself: RFC 5929 defines no binding.
        let ed = make(&rcgen::PKCS_ED25519);
        assert_eq!(end_point_hash(&ed), Ok(None));
        assert_eq!(tls_server_end_point(&ed), Ok(None));
    }

    #[test]
    fn end_point_hash_follows_the_signature_algorithm() {
        let ecdsa = |tail: &[u8]| {
            tlv(
                OID,
                &[&[0x2a, 0x86, 0x48, 0xce, 0x3d, 0x04][..], tail].concat(),
            )
        };
        let sha2 = |n: u8| [0x60, 0x86, 0x48, 0x01, 0x65, 0x03, 0x04, 0x02, n];
        let sha1 = [0x2b, 0x0e, 0x03, 0x02, 0x1a];
        let cases: Vec<(&str, Vec<u8>, Option<EndPointHash>)> = vec![
            // MD5 and SHA-1 are replaced by SHA-256.
            (
                "md5WithRSAEncryption",
                rsa(0x04),
                Some(EndPointHash::Sha256),
            ),
            (
                "sha1WithRSAEncryption",
                rsa(0x05),
                Some(EndPointHash::Sha256),
            ),
            (
                "sha256WithRSAEncryption",
                rsa(0x0b),
                Some(EndPointHash::Sha256),
            ),
            (
                "sha384WithRSAEncryption",
                rsa(0x0c),
                Some(EndPointHash::Sha384),
            ),
            (
                "sha512WithRSAEncryption",
                rsa(0x0d),
                Some(EndPointHash::Sha512),
            ),
            (
                "sha224WithRSAEncryption",
                rsa(0x0e),
                Some(EndPointHash::Sha224),
            ),
            (
                "ecdsa-with-SHA1",
                ecdsa(&[0x01]),
                Some(EndPointHash::Sha256),
            ),
            (
                "ecdsa-with-SHA256",
                ecdsa(&[0x03, 0x02]),
                Some(EndPointHash::Sha256),
            ),
            (
                "ecdsa-with-SHA384",
                ecdsa(&[0x03, 0x03]),
                Some(EndPointHash::Sha384),
            ),
            (
                "ecdsa-with-SHA512",
                ecdsa(&[0x03, 0x04]),
                Some(EndPointHash::Sha512),
            ),
            (
                "RSASSA-PSS SHA-256",
                pss(Some(&sha2(1))),
                Some(EndPointHash::Sha256),
            ),
            (
                "RSASSA-PSS SHA-384",
                pss(Some(&sha2(2))),
                Some(EndPointHash::Sha384),
            ),
            (
                "RSASSA-PSS SHA-512",
                pss(Some(&sha2(3))),
                Some(EndPointHash::Sha512),
            ),
            (
                "RSASSA-PSS SHA-1",
                pss(Some(&sha1)),
                Some(EndPointHash::Sha256),
            ),
            // hashAlgorithm left out: SHA-1 by default.
            ("RSASSA-PSS default", pss(None), Some(EndPointHash::Sha256)),
            (
                "RSASSA-PSS no parameters",
                tlv(OID, RSASSA_PSS),
                Some(EndPointHash::Sha256),
            ),
            // A hash not known here (SHA3-256), Ed25519, Ed448, a made-up OID.
            ("RSASSA-PSS SHA3-256", pss(Some(&sha2(8))), None),
            ("Ed25519", tlv(OID, &[0x2b, 0x65, 0x70]), None),
            ("Ed448", tlv(OID, &[0x2b, 0x65, 0x71]), None),
            ("unknown", tlv(OID, &[0x2a, 0x03]), None),
        ];
        for (name, algorithm, hash) in cases {
            let cert = signed_with(&algorithm);
            assert_eq!(end_point_hash(&cert), Ok(hash), "{name}");
            let data = tls_server_end_point(&cert).unwrap();
            assert_eq!(data, hash.map(|h| h.digest(&cert)), "{name}");
        }
        assert_eq!(EndPointHash::Sha224.digest(b"").len(), 28);
        assert_eq!(EndPointHash::Sha512.digest(b"").len(), 64);
    }

    #[test]
    fn end_point_hash_of_malformed_input_is_an_error() {
        let good = signed_with(&rsa(0x0b));
        assert!(end_point_hash(&good).is_ok());
        assert!(end_point_hash(b"").is_err());
        for n in 0..good.len() {
            assert!(end_point_hash(&good[..n]).is_err(), "prefix {n}");
        }
        assert!(end_point_hash(&[good.clone(), vec![0]].concat()).is_err());
        // The algorithm is no OID, the signature no BIT STRING.
        assert!(end_point_hash(&signed_with(&tlv(INTEGER, &[1]))).is_err());
        let mut octets = good.clone();
        let at = octets.len() - 5;
        assert_eq!(octets[at], BIT_STRING);
        octets[at] = 0x04;
        assert!(end_point_hash(&octets).is_err());
        // PSS parameters that are not a SEQUENCE, or a hash that is not an
        // AlgorithmIdentifier.
        let pss_int = [tlv(OID, RSASSA_PSS), tlv(INTEGER, &[1])].concat();
        assert!(end_point_hash(&signed_with(&pss_int)).is_err());
        let pss_bad = [
            tlv(OID, RSASSA_PSS),
            tlv(SEQUENCE, &tlv(PSS_HASH_ALGORITHM, &tlv(INTEGER, &[1]))),
        ]
        .concat();
        assert!(end_point_hash(&signed_with(&pss_bad)).is_err());
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
