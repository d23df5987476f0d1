//! rustls and quinn configurations for mutual TLS inside one cluster, with the ring provider.

use std::sync::{Arc, Once};
use std::time::Duration;

use quinn::crypto::rustls::{QuicClientConfig, QuicServerConfig};
use rustls::crypto::CryptoProvider;
use rustls::server::WebPkiClientVerifier;
use rustls::RootCertStore;

use crate::certs::NodeIdentity;
use crate::error::{QuicError, Result};

/// ALPN protocol id; a peer speaking anything else fails the TLS handshake.
pub(crate) const ALPN: &[u8] = b"grandis-quic/1";

static INSTALL: Once = Once::new();

/// Installs rustls' ring crypto provider as the process default, once. Every configuration of
/// this crate also names the provider explicitly, so this only matters for other rustls users
/// in the process; if one of them installed another provider first, that one stays (rustls
/// allows only one) and this is logged at debug level.
pub fn install_crypto_provider() {
    INSTALL.call_once(|| {
        if rustls::crypto::ring::default_provider()
            .install_default()
            .is_err()
        {
            tracing::debug!("a rustls crypto provider was already installed; keeping it");
        }
    });
}

pub(crate) fn provider() -> Arc<CryptoProvider> {
    install_crypto_provider();
    Arc::new(rustls::crypto::ring::default_provider())
}

fn roots(identity: &NodeIdentity) -> Result<Arc<RootCertStore>> {
    let mut roots = RootCertStore::empty();
    for ca in &identity.ca {
        roots
            .add(ca.clone())
            .map_err(|e| QuicError::Tls(format!("cluster CA certificate is unusable: {e}")))?;
    }
    Ok(Arc::new(roots))
}

/// Transport parameters shared by both directions.
pub(crate) fn transport_config(
    max_uni_streams: u32,
    idle_timeout: Duration,
    keep_alive: Duration,
) -> Result<Arc<quinn::TransportConfig>> {
    let mut t = quinn::TransportConfig::default();
    t.max_concurrent_uni_streams(quinn::VarInt::from_u32(max_uni_streams));
    // Only the handshake uses a bidirectional stream.
    t.max_concurrent_bidi_streams(quinn::VarInt::from_u32(4));
    t.max_idle_timeout(Some(idle_timeout.try_into().map_err(|_| {
        QuicError::Config(format!(
            "idle timeout {idle_timeout:?} is too long for QUIC"
        ))
    })?));
    t.keep_alive_interval(Some(keep_alive));
    // Datacentre links with large messages: generous windows so that one halo exchange is not
    // throttled by flow control. Receivers drain streams promptly into the ranks' queues.
    t.stream_receive_window(quinn::VarInt::from_u32(16 << 20));
    t.receive_window(quinn::VarInt::from_u32(256 << 20));
    t.send_window(256 << 20);
    Ok(Arc::new(t))
}

/// Server side: our certificate, and client certificates must chain to the cluster CA.
pub(crate) fn server_config(
    identity: &NodeIdentity,
    transport: Arc<quinn::TransportConfig>,
) -> Result<quinn::ServerConfig> {
    let provider = provider();
    let verifier = WebPkiClientVerifier::builder_with_provider(roots(identity)?, provider.clone())
        .build()
        .map_err(|e| QuicError::Tls(format!("client certificate verifier: {e}")))?;
    let mut tls = rustls::ServerConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(|e| QuicError::Tls(e.to_string()))?
        .with_client_cert_verifier(verifier)
        .with_single_cert(identity.chain.clone(), identity.key.clone_key())
        .map_err(|e| QuicError::Tls(format!("node certificate of {}: {e}", identity.name)))?;
    tls.alpn_protocols = vec![ALPN.to_vec()];
    let crypto = QuicServerConfig::try_from(tls).map_err(|e| QuicError::Tls(e.to_string()))?;
    let mut config = quinn::ServerConfig::with_crypto(Arc::new(crypto));
    config.transport_config(transport);
    Ok(config)
}

/// Client side: the server must chain to the cluster CA and carry the expected node name (the
/// name is passed per connection); we present our own certificate.
pub(crate) fn client_config(
    identity: &NodeIdentity,
    transport: Arc<quinn::TransportConfig>,
) -> Result<quinn::ClientConfig> {
    let mut tls = rustls::ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(|e| QuicError::Tls(e.to_string()))?
        .with_root_certificates(roots(identity)?)
        .with_client_auth_cert(identity.chain.clone(), identity.key.clone_key())
        .map_err(|e| QuicError::Tls(format!("node certificate of {}: {e}", identity.name)))?;
    tls.alpn_protocols = vec![ALPN.to_vec()];
    let crypto = QuicClientConfig::try_from(tls).map_err(|e| QuicError::Tls(e.to_string()))?;
    let mut config = quinn::ClientConfig::new(Arc::new(crypto));
    config.transport_config(transport);
    Ok(config)
}
