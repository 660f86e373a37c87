//! A client connection, in plaintext or TLS.

use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::BytesMut;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::TcpStream;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio_rustls::rustls::ServerConfig;
use tokio_rustls::server::TlsStream;
use tokio_rustls::TlsAcceptor;

/// A client's socket: plain TCP until the client asks for TLS.
pub(crate) enum ClientStream {
    Plain(TcpStream),
    Tls(Box<TlsSession>),
    /// A Unix-domain socket (`listen.unix_socket_dir`).
    Local(tokio::net::UnixStream),
    /// Only while a handshake owns the socket, or after it failed.
    Gone,
}

/// A client's TLS connection.
pub(crate) struct TlsSession {
    stream: TlsStream<TcpStream>,
    /// The `tls-server-end-point` data of the certificate this connection's
    /// handshake presented, from the [`ClientTls`] that ran it.
    end_point: Option<Arc<[u8]>>,
}

impl TlsSession {
    /// The TLS stream.
    pub fn stream(&mut self) -> &mut TlsStream<TcpStream> {
        &mut self.stream
    }
}

fn gone() -> io::Error {
    io::Error::new(io::ErrorKind::NotConnected, "connection gone")
}

impl ClientStream {
    /// Whether a plain socket's readiness, as the event loop last saw it,
    /// shows nothing to read (no system call, no waker registered). Always
    /// false for TLS, whose library may hold decrypted bytes the socket
    /// no longer shows.
    pub fn quiet(&self) -> bool {
        match self {
            ClientStream::Plain(s) => crate::sock::quiet(s),
            ClientStream::Local(s) => crate::sock::quiet(s),
            ClientStream::Tls(_) | ClientStream::Gone => false,
        }
    }

    /// Writes all of `buf`. A plain socket with room takes it at once,
    /// with no future polled and no waker registered (the common case: a
    /// reply smaller than the socket's buffer); what it does not take is
    /// written as `write_all` does.
    pub async fn send_all(&mut self, buf: &[u8]) -> io::Result<()> {
        let n = self.try_send(buf)?;
        if n < buf.len() {
            self.send_rest(&buf[n..]).await?;
        }
        Ok(())
    }

    /// Sends what a plain socket takes of `buf` now, without waiting; how
    /// much that was (TLS: nothing, [`send_rest`](Self::send_rest) does it).
    #[inline]
    pub fn try_send(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            ClientStream::Plain(s) => taken(crate::sock::try_send(s, buf)),
            ClientStream::Local(s) => taken(crate::sock::try_send(s, buf)),
            ClientStream::Tls(_) | ClientStream::Gone => Ok(0),
        }
    }

    /// Writes all of `buf`, waiting for room as needed.
    pub async fn send_rest(&mut self, buf: &[u8]) -> io::Result<()> {
        self.write_all(buf).await?;
        // TLS may hold the end in its buffer while the socket is full;
        // see `relay::send_all`.
        self.flush().await
    }

    /// Whether the session runs over TLS.
    pub fn is_tls(&self) -> bool {
        matches!(self, ClientStream::Tls(_))
    }

    /// Whether the client came in on a Unix-domain socket.
    pub fn is_local(&self) -> bool {
        matches!(self, ClientStream::Local(_))
    }

    /// Reads what is available into `buf`, with at least `min` spare bytes
    /// in it. On plain TCP the buffer is grown only once the socket is
    /// readable, so an idle client holds no buffer. A poll function rather
    /// than an `async fn`: the session loop polls it in place, with no
    /// future to build per poll.
    #[inline(always)]
    pub fn poll_read_some(
        &mut self,
        cx: &mut Context<'_>,
        buf: &mut BytesMut,
        min: usize,
    ) -> Poll<io::Result<usize>> {
        use tokio_util::io::poll_read_buf;
        // Readiness is polled first (no buffer is taken before the socket
        // has bytes), then the read: `sock::poll_recv` rather than a
        // `try_read`, because a short read clears the readiness, which
        // saves the next call a recv() that would only say EAGAIN (one
        // system call per transaction). Readiness without data is rare;
        // the buffer then waits with the socket.
        match self {
            ClientStream::Plain(s) => {
                std::task::ready!(s.poll_read_ready(cx))?;
                crate::bufcache::ready_for_read(buf, min);
                crate::sock::poll_recv(s, cx, buf)
            }
            ClientStream::Local(s) => {
                std::task::ready!(s.poll_read_ready(cx))?;
                crate::bufcache::ready_for_read(buf, min);
                crate::sock::poll_recv(s, cx, buf)
            }
            ClientStream::Tls(s) => {
                crate::bufcache::ready_for_read(buf, min);
                poll_read_buf(Pin::new(&mut s.stream), cx, buf)
            }
            ClientStream::Gone => Poll::Ready(Err(gone())),
        }
    }

    /// Resolves once the client has closed its side of the connection (or
    /// it was shut down, as a kill does), reading nothing: what it sent
    /// stays for the session. Bytes waiting unread (a pipelined message,
    /// TLS's close_notify) hide a close behind them; it then waits on.
    pub async fn closed(&self) {
        match self {
            ClientStream::Plain(s) => crate::sock::closed(s).await,
            ClientStream::Local(s) => crate::sock::closed(s).await,
            ClientStream::Tls(s) => crate::sock::closed(s.stream.get_ref().0).await,
            ClientStream::Gone => {}
        }
    }

    /// The descriptor of the client's TCP socket (-1 once gone).
    pub fn raw_fd(&self) -> std::os::fd::RawFd {
        use std::os::fd::AsRawFd;
        match self {
            ClientStream::Plain(s) => s.as_raw_fd(),
            ClientStream::Local(s) => s.as_raw_fd(),
            ClientStream::Tls(s) => s.stream.get_ref().0.as_raw_fd(),
            ClientStream::Gone => -1,
        }
    }

    /// The end-entity certificate the client presented in the TLS
    /// handshake. The acceptor only asks for one when `tls.client_ca` is
    /// set, and a certificate that does not chain to it fails the
    /// handshake, so one returned here has been verified. `None` on
    /// plaintext, or when the client sent none.
    pub fn peer_certificate(&self) -> Option<&CertificateDer<'static>> {
        match self {
            ClientStream::Tls(s) => s.stream.get_ref().1.peer_certificates()?.first(),
            _ => None,
        }
    }

    /// The `tls-server-end-point` channel-binding data of the certificate
    /// the client received in this connection's handshake: what a client
    /// binding SCRAM to the connection sends. `None` on plaintext, or when
    /// RFC 5929 defines no binding for the certificate.
    pub fn tls_server_end_point(&self) -> Option<&[u8]> {
        match self {
            ClientStream::Tls(s) => s.end_point.as_deref(),
            _ => None,
        }
    }

    /// On a Unix-domain socket, the name of the operating-system user
    /// running the client, as the kernel reports it (`SO_PEERCRED`);
    /// `Err` says why there is none.
    pub fn peer_os_user(&self) -> Result<String, String> {
        let ClientStream::Local(s) = self else {
            return Err("not a Unix-domain socket".into());
        };
        let uid = s.peer_cred().map_err(|e| e.to_string())?.uid();
        os_user_name(uid)
    }

    /// Runs the TLS handshake on a plain connection, in place.
    pub async fn upgrade(&mut self, tls: &ClientTls) -> io::Result<()> {
        match std::mem::replace(self, ClientStream::Gone) {
            ClientStream::Plain(s) => {
                *self = ClientStream::Tls(Box::new(TlsSession {
                    stream: tls.acceptor.accept(s).await?,
                    end_point: tls.end_point.clone(),
                }));
                Ok(())
            }
            other => {
                *self = other;
                Ok(())
            }
        }
    }
}

impl AsyncRead for ClientStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            ClientStream::Plain(s) => Pin::new(s).poll_read(cx, buf),
            ClientStream::Local(s) => Pin::new(s).poll_read(cx, buf),
            ClientStream::Tls(s) => Pin::new(&mut s.stream).poll_read(cx, buf),
            ClientStream::Gone => Poll::Ready(Err(gone())),
        }
    }
}

impl AsyncWrite for ClientStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            ClientStream::Plain(s) => Pin::new(s).poll_write(cx, data),
            ClientStream::Local(s) => Pin::new(s).poll_write(cx, data),
            ClientStream::Tls(s) => Pin::new(&mut s.stream).poll_write(cx, data),
            ClientStream::Gone => Poll::Ready(Err(gone())),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            ClientStream::Plain(s) => Pin::new(s).poll_flush(cx),
            ClientStream::Local(s) => Pin::new(s).poll_flush(cx),
            ClientStream::Tls(s) => Pin::new(&mut s.stream).poll_flush(cx),
            ClientStream::Gone => Poll::Ready(Err(gone())),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            ClientStream::Plain(s) => Pin::new(s).poll_shutdown(cx),
            ClientStream::Local(s) => Pin::new(s).poll_shutdown(cx),
            ClientStream::Tls(s) => Pin::new(&mut s.stream).poll_shutdown(cx),
            ClientStream::Gone => Poll::Ready(Err(gone())),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            ClientStream::Plain(s) => Pin::new(s).poll_write_vectored(cx, bufs),
            ClientStream::Local(s) => Pin::new(s).poll_write_vectored(cx, bufs),
            ClientStream::Tls(s) => Pin::new(&mut s.stream).poll_write_vectored(cx, bufs),
            ClientStream::Gone => Poll::Ready(Err(gone())),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            ClientStream::Plain(s) => s.is_write_vectored(),
            ClientStream::Local(s) => s.is_write_vectored(),
            ClientStream::Tls(s) => s.stream.is_write_vectored(),
            ClientStream::Gone => false,
        }
    }
}

/// TLS towards clients: the acceptor, and the channel-binding data of the
/// certificate it presents.
pub struct ClientTls {
    acceptor: TlsAcceptor,
    /// `tls-server-end-point` data of the acceptor's certificate, `None`
    /// when RFC 5929 defines none for it. It travels with the acceptor
    /// into each session it accepts, so that a client binds to the
    /// certificate its own handshake sent, whatever a reload has loaded
    /// since.
    end_point: Option<Arc<[u8]>>,
}

/// Builds a TLS acceptor (TLS 1.2 and 1.3) from PEM files. With
/// `client_ca`, clients are asked for a certificate: one that does not chain
/// to those CAs fails the handshake, as in PostgreSQL, while a client that
/// sends none still connects and the hba rule decides whether that will do.
///
/// The first certificate of `cert` is the one clients receive; its
/// `tls-server-end-point` hash is computed here, once per load, for SCRAM
/// channel binding.
pub fn tls_acceptor(
    cert: &std::path::Path,
    key: &std::path::Path,
    client_ca: Option<&std::path::Path>,
) -> Result<ClientTls, String> {
    use tokio_rustls::rustls::server::WebPkiClientVerifier;
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(cert)
        .map_err(|e| format!("{}: {e}", cert.display()))?
        .collect::<Result<_, _>>()
        .map_err(|e| format!("{}: {e}", cert.display()))?;
    if certs.is_empty() {
        return Err(format!("{}: no certificate found", cert.display()));
    }
    let key = PrivateKeyDer::from_pem_file(key).map_err(|e| format!("{}: {e}", key.display()))?;
    // A certificate without a binding still serves TLS; only PLUS is not
    // offered with it.
    let end_point = match pgwarden_auth::tls_server_end_point(&certs[0]) {
        Ok(Some(data)) => Some(Arc::from(data)),
        Ok(None) => {
            tracing::warn!(
                cert = %cert.display(),
                "SCRAM-SHA-256-PLUS is not offered: the certificate's signature algorithm \
                 defines no tls-server-end-point channel binding (RFC 5929)"
            );
            None
        }
        Err(e) => {
            tracing::warn!(
                cert = %cert.display(),
                error = %e,
                "SCRAM-SHA-256-PLUS is not offered: the certificate's signature algorithm \
                 cannot be read"
            );
            None
        }
    };
    let provider = Arc::new(tokio_rustls::rustls::crypto::ring::default_provider());
    let builder = ServerConfig::builder_with_provider(provider.clone())
        .with_protocol_versions(&[
            &tokio_rustls::rustls::version::TLS13,
            &tokio_rustls::rustls::version::TLS12,
        ])
        .map_err(|e| e.to_string())?;
    let builder = match client_ca {
        None => builder.with_no_client_auth(),
        Some(ca) => {
            let roots = load_ca(ca)?;
            let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
                .allow_unauthenticated()
                .build()
                .map_err(|e| format!("{}: {e}", ca.display()))?;
            builder.with_client_cert_verifier(verifier)
        }
    };
    let config = builder
        .with_single_cert(certs, key)
        .map_err(|e| format!("certificate and key do not fit: {e}"))?;
    Ok(ClientTls {
        acceptor: TlsAcceptor::from(Arc::new(config)),
        end_point,
    })
}

/// The CA certificates of a PEM file (at least one).
fn load_ca(ca: &std::path::Path) -> Result<tokio_rustls::rustls::RootCertStore, String> {
    let mut roots = tokio_rustls::rustls::RootCertStore::empty();
    for c in CertificateDer::pem_file_iter(ca).map_err(|e| format!("{}: {e}", ca.display()))? {
        let c = c.map_err(|e| format!("{}: {e}", ca.display()))?;
        roots.add(c).map_err(|e| format!("{}: {e}", ca.display()))?;
    }
    if roots.is_empty() {
        return Err(format!("{}: no CA certificate found", ca.display()));
    }
    Ok(roots)
}

/// Whether a failed TLS handshake failed on the client's certificate
/// (the only certificate the server side verifies): not chained to
/// `client_ca`, expired, not for client authentication, and the like.
pub(crate) fn is_client_certificate_error(e: &io::Error) -> bool {
    e.get_ref()
        .and_then(|inner| inner.downcast_ref::<tokio_rustls::rustls::Error>())
        .is_some_and(|e| matches!(e, tokio_rustls::rustls::Error::InvalidCertificate(_)))
}

/// How pgwarden uses TLS on its connections to the servers (libpq's
/// `sslmode` names).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ServerTlsMode {
    /// Plaintext; no SSLRequest.
    #[default]
    Disable,
    /// TLS if the server answers `S`, plaintext if it answers `N`; no
    /// certificate check.
    Prefer,
    /// TLS or fail; no certificate check (protects against passive
    /// eavesdropping only).
    Require,
    /// TLS with a certificate chain to the configured CA; any host name.
    VerifyCa,
    /// As `VerifyCa`, and the certificate must name the host as configured.
    VerifyFull,
}

/// TLS settings for server connections, ready to use.
#[derive(Clone, Default)]
pub struct ServerTls {
    mode: ServerTlsMode,
    connector: Option<tokio_rustls::TlsConnector>,
}

impl std::fmt::Debug for ServerTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerTls")
            .field("mode", &self.mode)
            .finish_non_exhaustive()
    }
}

impl ServerTls {
    /// Builds the client side of TLS for `mode`; `ca` (PEM, one or more
    /// certificates) is required by the verifying modes.
    pub fn new(mode: ServerTlsMode, ca: Option<&std::path::Path>) -> Result<ServerTls, String> {
        use tokio_rustls::rustls::client::WebPkiServerVerifier;
        use tokio_rustls::rustls::ClientConfig;
        if mode == ServerTlsMode::Disable {
            return Ok(ServerTls::default());
        }
        let provider = Arc::new(tokio_rustls::rustls::crypto::ring::default_provider());
        let verifier: Arc<dyn ServerCertVerifier> = match mode {
            ServerTlsMode::VerifyCa | ServerTlsMode::VerifyFull => {
                let ca = ca.ok_or("server_tls = verify-ca/verify-full needs tls.server_ca")?;
                let roots = load_ca(ca)?;
                let webpki =
                    WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider.clone())
                        .build()
                        .map_err(|e| format!("{}: {e}", ca.display()))?;
                if mode == ServerTlsMode::VerifyFull {
                    webpki
                } else {
                    Arc::new(AnyName(webpki))
                }
            }
            _ => Arc::new(NoVerification(provider.clone())),
        };
        let config = ClientConfig::builder_with_provider(provider)
            .with_protocol_versions(&[
                &tokio_rustls::rustls::version::TLS13,
                &tokio_rustls::rustls::version::TLS12,
            ])
            .map_err(|e| e.to_string())?
            .dangerous()
            .with_custom_certificate_verifier(verifier)
            .with_no_client_auth();
        Ok(ServerTls {
            mode,
            connector: Some(tokio_rustls::TlsConnector::from(Arc::new(config))),
        })
    }

    /// The mode in force.
    pub fn mode(&self) -> ServerTlsMode {
        self.mode
    }

    /// Negotiates TLS on a fresh server connection (SSLRequest, then the
    /// handshake), as the mode asks. `host` is the host as configured: the
    /// name (or IP address) `verify-full` checks.
    pub async fn start(&self, mut tcp: TcpStream, host: &str) -> Result<ServerStream, String> {
        use tokio::io::AsyncWriteExt;
        let Some(connector) = &self.connector else {
            return Ok(ServerStream::Plain(tcp));
        };
        // SSLRequest: length 8, code 1234.5679.
        const SSL_REQUEST: [u8; 8] = [0, 0, 0, 8, 0x04, 0xd2, 0x16, 0x2f];
        tcp.write_all(&SSL_REQUEST)
            .await
            .map_err(|e| format!("SSLRequest: {e}"))?;
        // One byte, read alone: anything after it would be plaintext the
        // server sent before the handshake (CVE-2021-23222).
        let mut answer = [0u8; 1];
        tcp.read_exact(&mut answer)
            .await
            .map_err(|e| format!("SSLRequest: {e}"))?;
        match answer[0] {
            b'S' => {}
            b'N' if self.mode == ServerTlsMode::Prefer => return Ok(ServerStream::Plain(tcp)),
            b'N' => {
                return Err(format!(
                    "the server does not support TLS (ssl = off) and server_tls = {}",
                    self.mode.name()
                ))
            }
            other => return Err(format!("unexpected answer to SSLRequest: {other:#04x}")),
        }
        let name = ServerName::try_from(host.to_string())
            .map_err(|e| format!("\"{host}\" is not a valid TLS server name: {e}"))?;
        let tls = connector.connect(name, tcp).await.map_err(|e| {
            format!(
                "TLS handshake failed (server_tls = {}): {e}",
                self.mode.name()
            )
        })?;
        Ok(ServerStream::Tls(Box::new(tls)))
    }
}

impl ServerTlsMode {
    /// The configuration name.
    pub fn name(self) -> &'static str {
        match self {
            ServerTlsMode::Disable => "disable",
            ServerTlsMode::Prefer => "prefer",
            ServerTlsMode::Require => "require",
            ServerTlsMode::VerifyCa => "verify-ca",
            ServerTlsMode::VerifyFull => "verify-full",
        }
    }
}

use tokio_rustls::rustls::client::danger::{
    HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier,
};
use tokio_rustls::rustls::pki_types::{ServerName, UnixTime};
use tokio_rustls::rustls::{CertificateError, DigitallySignedStruct, SignatureScheme};

/// `verify-ca`: the chain must lead to the CA, whatever names the
/// certificate carries (PostgreSQL's `verify-ca`); rustls has no such mode,
/// so a name mismatch from the full check is forgiven.
#[derive(Debug)]
struct AnyName(Arc<tokio_rustls::rustls::client::WebPkiServerVerifier>);

impl ServerCertVerifier for AnyName {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, tokio_rustls::rustls::Error> {
        match self
            .0
            .verify_server_cert(end_entity, intermediates, server_name, ocsp_response, now)
        {
            Err(tokio_rustls::rustls::Error::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            )) => Ok(ServerCertVerified::assertion()),
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, tokio_rustls::rustls::Error> {
        self.0.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, tokio_rustls::rustls::Error> {
        self.0.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.supported_verify_schemes()
    }
}

/// `prefer` and `require`: any certificate is accepted (as libpq does in
/// these modes), but the handshake signatures are still checked, so the
/// peer holds the key of the certificate it shows.
#[derive(Debug)]
struct NoVerification(Arc<tokio_rustls::rustls::crypto::CryptoProvider>);

impl ServerCertVerifier for NoVerification {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, tokio_rustls::rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, tokio_rustls::rustls::Error> {
        tokio_rustls::rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, tokio_rustls::rustls::Error> {
        tokio_rustls::rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

/// A server connection: plain TCP, or TLS when `server_tls` asked for it
/// and the server agreed.
pub enum ServerStream {
    /// Plaintext.
    Plain(TcpStream),
    /// TLS (boxed: the session state is large and most connections are
    /// plain).
    Tls(Box<tokio_rustls::client::TlsStream<TcpStream>>),
}

impl std::fmt::Debug for ServerStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ServerStream::Plain(_) => f.write_str("ServerStream::Plain"),
            ServerStream::Tls(_) => f.write_str("ServerStream::Tls"),
        }
    }
}

/// TCP timings of every client and server connection pgwarden opens or
/// accepts (PostgreSQL's `tcp_keepalives_*` and `tcp_user_timeout`);
/// `None` keeps the system's.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TcpTimings {
    /// Idle time before the first keepalive probe (whole seconds).
    pub keepalives_idle: Option<Duration>,
    /// Time between unanswered probes (whole seconds).
    pub keepalives_interval: Option<Duration>,
    /// Unanswered probes before the connection is dropped.
    pub keepalives_count: Option<u32>,
    /// Longest sent data may stay unacknowledged before the connection is
    /// dropped.
    pub user_timeout: Option<Duration>,
}

/// The timings in force, 0 for the system's: process-wide, since one
/// connection manager runs per process, and read with no lock by every
/// new connection.
static KEEPALIVE_IDLE_S: AtomicU32 = AtomicU32::new(0);
static KEEPALIVE_INTERVAL_S: AtomicU32 = AtomicU32::new(0);
static KEEPALIVE_COUNT: AtomicU32 = AtomicU32::new(0);
static USER_TIMEOUT_MS: AtomicU32 = AtomicU32::new(0);

/// Makes `t` the timings of connections opened or accepted from now on.
pub(crate) fn set_tcp_timings(t: &TcpTimings) {
    let secs =
        |d: Option<Duration>| d.map_or(0, |d| u32::try_from(d.as_secs()).unwrap_or(u32::MAX));
    KEEPALIVE_IDLE_S.store(secs(t.keepalives_idle), Ordering::Relaxed);
    KEEPALIVE_INTERVAL_S.store(secs(t.keepalives_interval), Ordering::Relaxed);
    KEEPALIVE_COUNT.store(t.keepalives_count.unwrap_or(0), Ordering::Relaxed);
    let ms = t
        .user_timeout
        .map_or(0, |d| u32::try_from(d.as_millis()).unwrap_or(u32::MAX));
    USER_TIMEOUT_MS.store(ms, Ordering::Relaxed);
}

/// Socket options for every client and server connection: no Nagle
/// delay, and TCP keepalive, as PostgreSQL and libpq set it, so a peer
/// that vanished without a word (a crashed host, a NAT or load balancer
/// that forgot the flow) is found out and its connection, and the backend
/// behind a relayed session, freed. With the system's timings unless
/// configured ([`set_tcp_timings`]): two hours of silence before the first
/// probe is longer than many middleboxes keep an idle flow.
pub(crate) fn tune(tcp: &TcpStream) {
    let _ = tcp.set_nodelay(true);
    let sock = socket2::SockRef::from(tcp);
    let idle = KEEPALIVE_IDLE_S.load(Ordering::Relaxed);
    let interval = KEEPALIVE_INTERVAL_S.load(Ordering::Relaxed);
    let count = KEEPALIVE_COUNT.load(Ordering::Relaxed);
    if idle == 0 && interval == 0 && count == 0 {
        let _ = sock.set_keepalive(true);
    } else {
        let mut k = socket2::TcpKeepalive::new();
        if idle > 0 {
            k = k.with_time(Duration::from_secs(idle.into()));
        }
        if interval > 0 {
            k = k.with_interval(Duration::from_secs(interval.into()));
        }
        if count > 0 {
            k = k.with_retries(count);
        }
        let _ = sock.set_tcp_keepalive(&k);
    }
    let user = USER_TIMEOUT_MS.load(Ordering::Relaxed);
    if user > 0 {
        let _ = sock.set_tcp_user_timeout(Some(Duration::from_millis(user.into())));
    }
}

/// What a `try_write` took: nothing when the socket had no room.
pub(crate) fn taken(r: io::Result<usize>) -> io::Result<usize> {
    match r {
        Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(0),
        r => r,
    }
}

impl ServerStream {
    /// Sends what the socket takes of `buf` now, without waiting; how much
    /// that was (TLS: nothing, the caller's polled writes do it).
    pub fn try_send(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            ServerStream::Plain(s) => taken(crate::sock::try_send(s, buf)),
            ServerStream::Tls(_) => Ok(0),
        }
    }

    /// The socket's descriptor (for a kill to shut it down).
    pub fn raw_fd(&self) -> std::os::fd::RawFd {
        use std::os::fd::AsRawFd;
        match self {
            ServerStream::Plain(s) => s.as_raw_fd(),
            ServerStream::Tls(s) => s.get_ref().0.as_raw_fd(),
        }
    }

    /// See [`ClientStream::send_all`].
    pub async fn send_all(&mut self, buf: &[u8]) -> io::Result<()> {
        let n = match self {
            ServerStream::Plain(s) => taken(crate::sock::try_send(s, buf))?,
            ServerStream::Tls(_) => 0,
        };
        if n < buf.len() {
            self.write_all(&buf[n..]).await?;
            self.flush().await?;
        }
        Ok(())
    }

    /// Reads what is available into `buf`, growing it to hold at least
    /// `min` spare bytes first.
    pub fn poll_read_some(
        &mut self,
        cx: &mut Context<'_>,
        buf: &mut BytesMut,
        min: usize,
    ) -> Poll<io::Result<usize>> {
        crate::bufcache::ready_for_read(buf, min);
        match self {
            ServerStream::Plain(s) => crate::sock::poll_recv(s, cx, buf),
            ServerStream::Tls(s) => tokio_util::io::poll_read_buf(Pin::new(s.as_mut()), cx, buf),
        }
    }

    /// See [`ClientStream::quiet`].
    pub fn quiet(&self) -> bool {
        match self {
            ServerStream::Plain(s) => crate::sock::quiet(s),
            ServerStream::Tls(_) => false,
        }
    }

    /// Whether the server sent anything, closed or failed since its socket
    /// was last read to the end: an idle server connection says nothing
    /// unless it is going away (a FATAL before the close, as after
    /// `pg_terminate_backend` or `idle_session_timeout`). Costs no system
    /// call unless the event loop saw the socket become readable.
    pub fn spoke_while_idle(&self) -> bool {
        let tcp = match self {
            ServerStream::Plain(s) => s,
            ServerStream::Tls(s) => s.get_ref().0,
        };
        // `try_io` looks at the readiness the event loop recorded before
        // calling the peek, and registers no waker: a checkout must not
        // displace the waker of the task that will read the socket next.
        let peek = || {
            let mut byte = [std::mem::MaybeUninit::<u8>::uninit(); 1];
            socket2::SockRef::from(tcp).peek(&mut byte)
        };
        match tcp.try_io(tokio::io::Interest::READABLE, peek) {
            Err(e) => e.kind() != io::ErrorKind::WouldBlock,
            // Bytes, or the end of the stream.
            Ok(_) => true,
        }
    }

    /// The server's address.
    pub fn peer_addr(&self) -> io::Result<std::net::SocketAddr> {
        match self {
            ServerStream::Plain(s) => s.peer_addr(),
            ServerStream::Tls(s) => s.get_ref().0.peer_addr(),
        }
    }

    /// Whether the connection is encrypted.
    pub fn is_tls(&self) -> bool {
        matches!(self, ServerStream::Tls(_))
    }

    /// The local end of the connection (SHOW SERVERS).
    pub fn local_addr(&self) -> Option<std::net::SocketAddr> {
        match self {
            ServerStream::Plain(s) => s.local_addr().ok(),
            ServerStream::Tls(s) => s.get_ref().0.local_addr().ok(),
        }
    }
}

impl AsyncRead for ServerStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            ServerStream::Plain(s) => Pin::new(s).poll_read(cx, buf),
            ServerStream::Tls(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for ServerStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            ServerStream::Plain(s) => Pin::new(s).poll_write(cx, data),
            ServerStream::Tls(s) => Pin::new(s.as_mut()).poll_write(cx, data),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            ServerStream::Plain(s) => Pin::new(s).poll_flush(cx),
            ServerStream::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            ServerStream::Plain(s) => Pin::new(s).poll_shutdown(cx),
            ServerStream::Tls(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            ServerStream::Plain(s) => Pin::new(s).poll_write_vectored(cx, bufs),
            ServerStream::Tls(s) => Pin::new(s.as_mut()).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            ServerStream::Plain(s) => s.is_write_vectored(),
            ServerStream::Tls(s) => s.is_write_vectored(),
        }
    }
}

/// The name of user `uid` in the system's user database.
fn os_user_name(uid: u32) -> Result<String, String> {
    match nix::unistd::User::from_uid(nix::unistd::Uid::from_raw(uid)) {
        Ok(Some(u)) => Ok(u.name),
        Ok(None) => Err(format!("local user with ID {uid} does not exist")),
        Err(e) => Err(format!("could not look up local user ID {uid}: {e}")),
    }
}

#[cfg(test)]
mod tests {
    use super::{set_tcp_timings, tune, TcpTimings};
    use std::time::Duration;

    /// Configured timings reach the sockets tuned after them; unset ones
    /// leave the system's.
    #[tokio::test]
    async fn tuned_sockets_take_the_configured_tcp_timings() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let connect = || async { tokio::net::TcpStream::connect(addr).await.unwrap() };
        let system = connect().await;
        let s = socket2::SockRef::from(&system);
        let (idle, interval, count) = (
            s.tcp_keepalive_time().unwrap(),
            s.tcp_keepalive_interval().unwrap(),
            s.tcp_keepalive_retries().unwrap(),
        );

        set_tcp_timings(&TcpTimings {
            keepalives_idle: Some(Duration::from_secs(61)),
            keepalives_interval: Some(Duration::from_secs(7)),
            keepalives_count: Some(4),
            user_timeout: Some(Duration::from_millis(12_500)),
        });
        let tuned = connect().await;
        tune(&tuned);
        let t = socket2::SockRef::from(&tuned);
        assert!(t.keepalive().unwrap());
        assert_eq!(t.tcp_keepalive_time().unwrap(), Duration::from_secs(61));
        assert_eq!(t.tcp_keepalive_interval().unwrap(), Duration::from_secs(7));
        assert_eq!(t.tcp_keepalive_retries().unwrap(), 4);
        assert_eq!(
            t.tcp_user_timeout().unwrap(),
            Some(Duration::from_millis(12_500))
        );

        set_tcp_timings(&TcpTimings {
            keepalives_count: Some(3),
            ..TcpTimings::default()
        });
        let partly = connect().await;
        tune(&partly);
        let t = socket2::SockRef::from(&partly);
        assert!(t.keepalive().unwrap());
        assert_eq!(t.tcp_keepalive_time().unwrap(), idle);
        assert_eq!(t.tcp_keepalive_interval().unwrap(), interval);
        assert_eq!(t.tcp_keepalive_retries().unwrap(), 3);
        assert_eq!(t.tcp_user_timeout().unwrap(), None);

        set_tcp_timings(&TcpTimings::default());
        let plain = connect().await;
        tune(&plain);
        let t = socket2::SockRef::from(&plain);
        assert!(t.keepalive().unwrap());
        assert_eq!(t.tcp_keepalive_retries().unwrap(), count);
        assert_eq!(t.tcp_user_timeout().unwrap(), None);
    }
}
