//! Checks of the HTTP ports' defences that the connection manager's and
//! the agent's tests share.

use std::net::SocketAddr;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Connections an HTTP port of pgwarden serves at once.
pub const MAX_HTTP_CONNECTIONS: usize = 256;

/// Checks that the HTTP server at `addr` closes a connection past its
/// [`MAX_HTTP_CONNECTIONS`] at once, unanswered, and closes connections
/// that send no whole request head (nothing, or half of one) within 30
/// seconds. Leaves no connection open.
pub async fn drops_idle_and_excess_connections(addr: SocketAddr) {
    let mut idle = Vec::new();
    for i in 0..MAX_HTTP_CONNECTIONS {
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        if i == 0 {
            // Half a request head, then nothing.
            s.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n")
                .await
                .unwrap();
        }
        idle.push(s);
    }
    // Every slot is held: the next connection is closed unanswered.
    let mut excess = tokio::net::TcpStream::connect(addr).await.unwrap();
    let _ = excess
        .write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        .await;
    let mut buf = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(5), excess.read_to_end(&mut buf)).await;
    assert!(
        matches!(read, Ok(Ok(0)) | Ok(Err(_))),
        "an excess connection was served: {read:?} {:?}",
        String::from_utf8_lossy(&buf)
    );
    // The idle ones are closed by the server, the half-sent head too.
    for s in idle.iter_mut().take(2) {
        let mut b = [0u8; 64];
        let r = tokio::time::timeout(Duration::from_secs(30), s.read(&mut b))
            .await
            .expect("an idle HTTP connection was kept open");
        assert!(matches!(r, Ok(0) | Err(_)), "{r:?}");
    }
}
