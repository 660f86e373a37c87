//! A minimal HTTP/1.1 client for the agents' own API: members asking each
//! other for their WAL positions during an election, and `pgwarden ctl`
//! talking to an agent.
//!
//! `http://`, and `https://` once [`trust`] has named the CA of the
//! members' certificates. One connection per request: the API is small,
//! requests are rare, and a fresh connection never carries a half-read
//! answer from an earlier request that timed out.

use std::sync::{Arc, RwLock};
use std::time::Duration;

use base64::Engine as _;
use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

/// What `https://` requests trust; set once at start by the agent or
/// `pgwarden ctl`.
static TLS: RwLock<Option<tokio_rustls::TlsConnector>> = RwLock::new(None);

/// Makes `https://` requests trust the CA certificates in `ca` (PEM), and
/// only them.
pub fn trust(ca: &std::path::Path) -> Result<(), String> {
    trust_with(ca, None)
}

/// [`trust`], presenting the certificate and key files of `identity` to
/// servers that ask for a client certificate.
pub fn trust_with(
    ca: &std::path::Path,
    identity: Option<(&std::path::Path, &std::path::Path)>,
) -> Result<(), String> {
    let config = crate::tls::client_config(ca, identity)?;
    *TLS.write().unwrap_or_else(|e| e.into_inner()) =
        Some(tokio_rustls::TlsConnector::from(Arc::clone(&config)));
    Ok(())
}

/// An answer: the status code and the body as text.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Response {
    /// The HTTP status code.
    pub status: u16,
    /// The body, decoded as UTF-8 (invalid sequences replaced).
    pub body: String,
}

impl Response {
    /// Whether the status is 2xx.
    pub fn is_success(&self) -> bool {
        (200..300).contains(&self.status)
    }
}

/// Why a request got no usable answer. As elsewhere in the workspace, the
/// message names what failed and the underlying error is the
/// [`source`](std::error::Error::source), so print the chain (`{:#}` with
/// anyhow) to see both.
#[derive(Debug, thiserror::Error)]
pub enum HttpError {
    /// The URL is not of the form `http://host[:port][/path][?query]`.
    #[error("invalid URL {url:?}: {reason}")]
    InvalidUrl {
        /// The URL as given.
        url: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// The method name is not a valid HTTP token.
    #[error("invalid HTTP method {0:?}")]
    InvalidMethod(String),
    /// No connection could be made.
    #[error("cannot connect to {addr}")]
    Connect {
        /// `host:port` connected to.
        addr: String,
        /// The underlying error.
        source: std::io::Error,
    },
    /// The TLS handshake failed (an untrusted certificate, one that does not
    /// name the host), or no CA was configured for an `https://` URL.
    #[error("TLS with {addr} failed: {reason}")]
    Tls {
        /// `host:port` connected to.
        addr: String,
        /// Why.
        reason: String,
    },
    /// The connection broke or the server spoke something other than HTTP.
    #[error("HTTP exchange with {addr} failed")]
    Protocol {
        /// `host:port` connected to.
        addr: String,
        /// The underlying error.
        source: hyper::Error,
    },
    /// No complete answer within the time-out.
    #[error("no answer from {url} within {timeout:?}")]
    Timeout {
        /// The URL requested.
        url: String,
        /// The time-out that passed.
        timeout: Duration,
    },
    /// The request could not be built (e.g. a header with invalid bytes).
    #[error("cannot build the request: {0}")]
    Request(#[from] hyper::http::Error),
    /// A 2xx answer whose body is not the JSON expected.
    #[error("invalid JSON from {url}")]
    Json {
        /// The URL requested.
        url: String,
        /// The decoding error.
        source: serde_json::Error,
    },
    /// A non-2xx answer where success was required.
    #[error("{url} answered {status}: {body}")]
    Status {
        /// The URL requested.
        url: String,
        /// The status code.
        status: u16,
        /// The body of the answer.
        body: String,
    },
}

/// The parts of an `http://` or `https://` URL a request needs.
#[derive(Debug, PartialEq, Eq)]
struct Target {
    /// `host:port` to connect to (IPv6 hosts in brackets).
    addr: String,
    /// For `https://`: the host name (or address) the certificate must
    /// name.
    tls_name: Option<String>,
    /// The `Host` header value.
    host_header: String,
    /// Path and query, at least `/`.
    path_and_query: String,
}

fn parse_url(url: &str) -> Result<Target, HttpError> {
    let invalid = |reason| HttpError::InvalidUrl {
        url: url.to_string(),
        reason,
    };
    let (rest, tls, default_port) = if let Some(r) = url.strip_prefix("http://") {
        (r, false, 80)
    } else if let Some(r) = url.strip_prefix("https://") {
        (r, true, 443)
    } else {
        return Err(invalid("only http:// and https:// URLs are supported"));
    };
    let (authority, path) = match rest.find(['/', '?']) {
        Some(i) if rest.as_bytes()[i] == b'?' => (&rest[..i], format!("/{}", &rest[i..])),
        Some(i) => (&rest[..i], rest[i..].to_string()),
        None => (rest, "/".to_string()),
    };
    if authority.is_empty() {
        return Err(invalid("no host"));
    }
    if authority.contains('@') {
        return Err(invalid("credentials in the URL are not supported"));
    }
    // A bracketed IPv6 literal contains colons of its own; the port is what
    // follows the closing bracket.
    let (host, port) = if let Some(v6) = authority.strip_prefix('[') {
        let end = v6.find(']').ok_or_else(|| invalid("unclosed '['"))?;
        let after = &v6[end + 1..];
        let port = match after.strip_prefix(':') {
            Some(p) => Some(p),
            None if after.is_empty() => None,
            None => return Err(invalid("garbage after the IPv6 address")),
        };
        (&authority[..end + 2], port)
    } else {
        match authority.rsplit_once(':') {
            Some((h, p)) => (h, Some(p)),
            None => (authority, None),
        }
    };
    if host.is_empty() || host == "[]" {
        return Err(invalid("no host"));
    }
    let port: u16 = match port {
        Some(p) => p.parse().map_err(|_| invalid("invalid port"))?,
        None => default_port,
    };
    Ok(Target {
        addr: format!("{host}:{port}"),
        tls_name: tls.then(|| {
            host.trim_start_matches('[')
                .trim_end_matches(']')
                .to_string()
        }),
        host_header: authority.to_string(),
        path_and_query: path,
    })
}

/// Sends one request and reads the whole answer, all within `timeout`.
///
/// `body` is sent as JSON; `auth` as HTTP basic credentials. Any status
/// counts as an answer: the caller decides what a 503 means.
pub async fn request(
    method: &str,
    url: &str,
    body: Option<&serde_json::Value>,
    auth: Option<(&str, &str)>,
    timeout: Duration,
) -> Result<Response, HttpError> {
    let method = hyper::Method::from_bytes(method.as_bytes())
        .map_err(|_| HttpError::InvalidMethod(method.to_string()))?;
    let target = parse_url(url)?;
    let mut req = hyper::Request::builder()
        .method(method)
        .uri(target.path_and_query.as_str())
        .header(hyper::header::HOST, target.host_header.as_str())
        .header(hyper::header::ACCEPT, "application/json");
    if let Some((user, password)) = auth {
        let token = base64::engine::general_purpose::STANDARD.encode(format!("{user}:{password}"));
        req = req.header(hyper::header::AUTHORIZATION, format!("Basic {token}"));
    }
    let payload = match body {
        Some(v) => {
            req = req.header(hyper::header::CONTENT_TYPE, "application/json");
            Bytes::from(v.to_string())
        }
        None => Bytes::new(),
    };
    let req = req.body(Full::new(payload))?;
    tokio::time::timeout(timeout, send(&target, req))
        .await
        .map_err(|_| HttpError::Timeout {
            url: url.to_string(),
            timeout,
        })?
}

async fn send(target: &Target, req: hyper::Request<Full<Bytes>>) -> Result<Response, HttpError> {
    let addr = target.addr.as_str();
    let stream = TcpStream::connect(addr)
        .await
        .map_err(|source| HttpError::Connect {
            addr: addr.to_string(),
            source,
        })?;
    // Small requests and answers: waiting for Nagle would only add latency.
    let _ = stream.set_nodelay(true);
    let Some(name) = &target.tls_name else {
        return exchange(addr, stream, req).await;
    };
    let tls_error = |reason: String| HttpError::Tls {
        addr: addr.to_string(),
        reason,
    };
    let connector = TLS
        .read()
        .unwrap_or_else(|e| e.into_inner())
        .clone()
        .ok_or_else(|| {
            tls_error("no CA is configured for https:// (agent.api_ca_file)".to_string())
        })?;
    let server_name = tokio_rustls::rustls::pki_types::ServerName::try_from(name.clone())
        .map_err(|e| tls_error(format!("{name:?} is not a valid TLS server name: {e}")))?;
    let stream = connector
        .connect(server_name, stream)
        .await
        .map_err(|e| tls_error(e.to_string()))?;
    exchange(addr, stream, req).await
}

/// One request and its answer on an open connection.
async fn exchange<S>(
    addr: &str,
    stream: S,
    req: hyper::Request<Full<Bytes>>,
) -> Result<Response, HttpError>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let protocol = |source| HttpError::Protocol {
        addr: addr.to_string(),
        source,
    };
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(protocol)?;
    // The connection future drives the socket; it ends when the answer has
    // been read and `sender` is dropped, or with the caller's time-out.
    let driver = tokio::spawn(async move {
        let _ = conn.await;
    });
    let result = async {
        let resp = sender.send_request(req).await.map_err(protocol)?;
        let status = resp.status().as_u16();
        let bytes = resp
            .into_body()
            .collect()
            .await
            .map_err(protocol)?
            .to_bytes();
        Ok(Response {
            status,
            body: String::from_utf8_lossy(&bytes).into_owned(),
        })
    }
    .await;
    driver.abort();
    result
}

/// GETs `url` and decodes a 2xx answer as JSON; any other status is an
/// [`HttpError::Status`].
pub async fn get_json(url: &str, timeout: Duration) -> Result<serde_json::Value, HttpError> {
    let resp = request("GET", url, None, None, timeout).await?;
    if !resp.is_success() {
        return Err(HttpError::Status {
            url: url.to_string(),
            status: resp.status,
            body: resp.body,
        });
    }
    serde_json::from_str(&resp.body).map_err(|source| HttpError::Json {
        url: url.to_string(),
        source,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(addr: &str, host: &str, path: &str) -> Target {
        Target {
            addr: addr.into(),
            tls_name: None,
            host_header: host.into(),
            path_and_query: path.into(),
        }
    }

    #[test]
    fn urls_split_into_address_host_and_path() {
        assert_eq!(
            parse_url("http://127.0.0.1:8008/patroni").unwrap(),
            t("127.0.0.1:8008", "127.0.0.1:8008", "/patroni")
        );
        assert_eq!(parse_url("http://db1").unwrap(), t("db1:80", "db1", "/"));
        assert_eq!(
            parse_url("http://db1:8008?lag=1MB").unwrap(),
            t("db1:8008", "db1:8008", "/?lag=1MB")
        );
        assert_eq!(
            parse_url("http://[::1]:8008/replica?lag=16kB").unwrap(),
            t("[::1]:8008", "[::1]:8008", "/replica?lag=16kB")
        );
        assert_eq!(
            parse_url("http://[::1]").unwrap(),
            t("[::1]:80", "[::1]", "/")
        );
        let tls = |addr: &str, host: &str, name: &str| Target {
            tls_name: Some(name.into()),
            ..t(addr, host, "/patroni")
        };
        assert_eq!(
            parse_url("https://db1.example/patroni").unwrap(),
            tls("db1.example:443", "db1.example", "db1.example")
        );
        assert_eq!(
            parse_url("https://[::1]:8008/patroni").unwrap(),
            tls("[::1]:8008", "[::1]:8008", "::1")
        );
    }

    #[test]
    fn unsupported_urls_are_refused_with_a_reason() {
        for bad in [
            "ftp://db1:8008/",
            "db1:8008",
            "http://",
            "http://:8008/",
            "http://db1:port/",
            "http://db1:99999/",
            "http://u:p@db1/",
            "http://[::1/",
        ] {
            let e = parse_url(bad).unwrap_err();
            assert!(matches!(e, HttpError::InvalidUrl { .. }), "{bad}: {e}");
        }
    }
}
