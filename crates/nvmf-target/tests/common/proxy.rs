//! A TCP proxy in front of a target that misbehaves on demand: the peer (or target) that
//! dies or hangs mid-transfer, or is gone. Shared by the target's and the host's tests.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// What the proxy does, switched at any time.
#[derive(Default)]
pub struct Faults {
    /// Close each connection once `after` more bytes came from the target: it died.
    pub cut: AtomicBool,
    /// Stop forwarding once `after` more bytes came, holding the connection open: it hangs.
    pub stall: AtomicBool,
    /// Close new connections at once: nothing answers there.
    pub gone: AtomicBool,
}

/// Starts a proxy to `to`; its address.
pub async fn proxy(to: SocketAddr, faults: Arc<Faults>, after: u64) -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((c, _)) = l.accept().await {
            if faults.gone.load(Relaxed) {
                continue;
            }
            let Ok(s) = TcpStream::connect(to).await else { continue };
            let faults = faults.clone();
            tokio::spawn(async move {
                let (mut cr, mut cw) = c.into_split();
                let (mut sr, mut sw) = s.into_split();
                tokio::spawn(async move {
                    let _ = tokio::io::copy(&mut cr, &mut sw).await;
                });
                let mut buf = vec![0u8; 64 * 1024];
                let mut sent = 0u64;
                while let Ok(n) = sr.read(&mut buf).await {
                    if n == 0 {
                        return;
                    }
                    let (cut, stall) = (faults.cut.load(Relaxed), faults.stall.load(Relaxed));
                    if cut || stall {
                        sent += n as u64;
                        if sent > after {
                            if stall {
                                tokio::time::sleep(Duration::from_secs(30)).await;
                            }
                            return;
                        }
                    }
                    if cw.write_all(&buf[..n]).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    addr
}
