//! The hello exchange and peer checks: dialling a peer, answering an incoming connection.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use quinn::{ConnectionError, ReadError, VarInt};

use super::close::{close_reason, short, CLOSE_HANDSHAKE_REJECTED};
use super::connection::install;
use super::state::Shared;
use crate::frame::{Hello, MAX_HELLO_BYTES};

/// Prefix of the reason when a peer does not answer in time (retried by `establish`).
pub(super) const NO_ANSWER: &str = "no answer within";

pub(super) async fn dial(
    shared: Arc<Shared>,
    endpoint: quinn::Endpoint,
    client: quinn::ClientConfig,
    server: usize,
    addr: SocketAddr,
    timeout: Duration,
) -> std::result::Result<(), String> {
    let name = shared.roster[server].clone();
    let work = async {
        let connecting = endpoint
            .connect_with(client, addr, &name)
            .map_err(|e| format!("cannot start connecting: {e}"))?;
        let conn = connecting.await.map_err(|e| {
            if matches!(e, ConnectionError::TimedOut) {
                // Nobody answered (the peer's daemon may not be up yet): retryable.
                return format!("{NO_ANSWER} the QUIC idle timeout");
            }
            let reason = format!("TLS/QUIC handshake failed: {}", close_reason(&e));
            shared.refuse(addr, true, reason.clone());
            reason
        })?;
        let reply = async {
            let (mut send, mut recv) = conn.open_bi().await.map_err(|e| close_reason(&e))?;
            let hello = shared.hello.encode().map_err(|e| e.to_string())?;
            send.write_all(&hello).await.map_err(|e| e.to_string())?;
            send.finish().map_err(|e| e.to_string())?;
            recv.read_to_end(4 + MAX_HELLO_BYTES)
                .await
                .map_err(|e| match e {
                    quinn::ReadToEndError::Read(ReadError::ConnectionLost(c)) => close_reason(&c),
                    other => other.to_string(),
                })
        }
        .await;
        let checked = reply.and_then(|bytes| {
            let hello = Hello::decode(&bytes).map_err(|e| e.to_string())?;
            shared.check_hello(&hello, Some(server))
        });
        if let Err(reason) = checked {
            conn.close(VarInt::from_u32(CLOSE_HANDSHAKE_REJECTED), short(&reason));
            shared.refuse(addr, true, reason.clone());
            return Err(reason);
        }
        install(&shared, server, conn, addr)
            .inspect_err(|reason| shared.refuse(addr, true, reason.clone()))
    };
    match tokio::time::timeout(timeout, work).await {
        Ok(r) => r,
        Err(_) => Err(format!("{NO_ANSWER} {timeout:?}")),
    }
}

pub(super) async fn accept_loop(shared: Arc<Shared>, endpoint: quinn::Endpoint, timeout: Duration) {
    while let Some(incoming) = endpoint.accept().await {
        let shared = shared.clone();
        tokio::spawn(async move {
            let addr = incoming.remote_address();
            match tokio::time::timeout(timeout, answer(&shared, incoming)).await {
                Ok(Ok(())) => {}
                Ok(Err(reason)) => shared.refuse(addr, false, reason),
                Err(_) => shared.refuse(
                    addr,
                    false,
                    format!("handshake did not complete within {timeout:?}"),
                ),
            }
        });
    }
}

/// Accepts one incoming connection: TLS (the verifier checks the client certificate against
/// the cluster CA), then the peer's hello, the binding of its certificate to the name it
/// claims, and our hello in reply.
pub(super) async fn answer(
    shared: &Arc<Shared>,
    incoming: quinn::Incoming,
) -> std::result::Result<(), String> {
    let addr = incoming.remote_address();
    let conn = incoming
        .await
        .map_err(|e| format!("TLS/QUIC handshake failed: {}", close_reason(&e)))?;
    let reject = |reason: String| {
        conn.close(VarInt::from_u32(CLOSE_HANDSHAKE_REJECTED), short(&reason));
        reason
    };
    let (mut send, mut recv) = conn.accept_bi().await.map_err(|e| close_reason(&e))?;
    let bytes = recv
        .read_to_end(4 + MAX_HELLO_BYTES)
        .await
        .map_err(|e| reject(format!("cannot read the hello: {e}")))?;
    let hello = Hello::decode(&bytes).map_err(|e| reject(e.to_string()))?;
    let server = shared.check_hello(&hello, None).map_err(&reject)?;
    let certs = conn
        .peer_identity()
        .and_then(|id| {
            id.downcast::<Vec<rustls::pki_types::CertificateDer<'static>>>()
                .ok()
        })
        .ok_or_else(|| reject("the peer presented no certificate".into()))?;
    let leaf = certs
        .first()
        .ok_or_else(|| reject("the peer presented an empty certificate chain".into()))?;
    crate::certs::cert_matches_name(leaf, &shared.roster[server]).map_err(&reject)?;
    // Install before replying, so that a duplicate connection is rejected before the dialer
    // installs it. Streams our writers open now are buffered by QUIC until the dialer, which
    // installs on our hello, accepts them.
    install(shared, server, conn.clone(), addr).map_err(&reject)?;
    let own = shared.hello.encode().map_err(|e| reject(e.to_string()))?;
    send.write_all(&own)
        .await
        .map_err(|e| reject(format!("cannot send the hello: {e}")))?;
    send.finish().map_err(|e| reject(e.to_string()))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::frame::{check_hello, HELLO_MAGIC, PROTOCOL_VERSION};

    fn hello(server: u32, name: &str) -> Hello {
        Hello {
            magic: HELLO_MAGIC,
            version: PROTOCOL_VERSION,
            servers: 3,
            devices: 2,
            server,
            first_rank: server * 2,
            ranks: 2,
            name: name.into(),
            session: 7,
        }
    }

    #[test]
    fn hello_checks_name_every_mismatch() {
        let roster: Vec<String> = ["a", "b", "c"].iter().map(|s| s.to_string()).collect();
        let own = hello(0, "a");
        assert_eq!(check_hello(&own, &roster, &hello(2, "c"), None), Ok(2));
        assert_eq!(check_hello(&own, &roster, &hello(1, "b"), Some(1)), Ok(1));
        let cases: Vec<(Hello, Option<usize>, &str)> = vec![
            (
                Hello {
                    version: 99,
                    ..hello(1, "b")
                },
                None,
                "protocol version mismatch: peer speaks version 99",
            ),
            (
                Hello {
                    devices: 4,
                    first_rank: 4,
                    ranks: 4,
                    ..hello(1, "b")
                },
                None,
                "cluster shape mismatch",
            ),
            (
                Hello {
                    session: 6,
                    ..hello(1, "b")
                },
                None,
                "peer is in session 6 (job), this node in session 7",
            ),
            (hello(5, "b"), None, "outside the 3 servers"),
            (hello(0, "a"), None, "own server index"),
            (hello(2, "c"), Some(1), "expected server 1"),
            (hello(1, "c"), None, "roster names server 1 \"b\""),
            (
                Hello {
                    first_rank: 0,
                    ..hello(1, "b")
                },
                None,
                "do not match server 1",
            ),
        ];
        for (h, expected, msg) in cases {
            let err = check_hello(&own, &roster, &h, expected).unwrap_err();
            assert!(err.contains(msg), "{err:?} should contain {msg:?}");
        }
    }
}
