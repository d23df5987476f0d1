//! A node's proof of identity on the control plane: the daemon signs a message naming its
//! label and a coordinator's one-time challenge with its node certificate's key; the
//! coordinator checks that the certificate is the cluster CA's, is valid for that label,
//! and made the signature. The data plane proves the same identity with mutual TLS
//! ([`crate::tls`]); the control plane is HTTP with bearer tokens shared by every daemon, so
//! without this a holder of the token could act as any label.

use std::path::Path;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::CertificateDer;
use rustls::SignatureScheme;

use crate::certs::{load_certs, verify_issued_by, NodeIdentity};
use crate::error::{QuicError, Result};

/// The schemes a node signs with, most preferred first (`init_cluster` writes P-256 keys).
const SCHEMES: [SignatureScheme; 4] = [
    SignatureScheme::ECDSA_NISTP256_SHA256,
    SignatureScheme::ECDSA_NISTP384_SHA384,
    SignatureScheme::ED25519,
    SignatureScheme::RSA_PSS_SHA256,
];

/// A signature by a node's key and the certificate chain that names the node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Signed {
    /// The node's certificate first, then any intermediates, as PEM.
    pub chain_pem: String,
    /// The TLS signature scheme code (`SignatureScheme` as u16).
    pub scheme: u16,
    pub signature: Vec<u8>,
}

impl NodeIdentity {
    /// Signs `message` with this node's private key.
    pub fn sign(&self, message: &[u8]) -> Result<Signed> {
        let key = rustls::crypto::ring::default_provider()
            .key_provider
            .load_private_key(self.key.clone_key())
            .map_err(|e| QuicError::Config(format!("node {}: unusable key: {e}", self.name)))?;
        let signer = key.choose_scheme(&SCHEMES).ok_or_else(|| {
            QuicError::Config(format!(
                "node {}: its key signs none of {SCHEMES:?}",
                self.name
            ))
        })?;
        let signature = signer
            .sign(message)
            .map_err(|e| QuicError::Config(format!("node {}: signing failed: {e}", self.name)))?;
        let blocks: Vec<pem::Pem> = self
            .chain
            .iter()
            .map(|c| pem::Pem::new("CERTIFICATE", c.to_vec()))
            .collect();
        let chain_pem = pem::encode_many_config(
            &blocks,
            pem::EncodeConfig::new().set_line_ending(pem::LineEnding::LF),
        );
        Ok(Signed {
            chain_pem,
            scheme: u16::from(signer.scheme()),
            signature,
        })
    }
}

impl NodeIdentity {
    /// The proof that this node registers as its own name, over a coordinator's `challenge`.
    pub fn prove_registration(&self, challenge: &str) -> Result<grandis_wire::NodeProof> {
        use base64::Engine;
        let signed = self.sign(&grandis_wire::registration_message(&self.name, challenge))?;
        Ok(grandis_wire::NodeProof {
            challenge: challenge.to_string(),
            certificate: signed.chain_pem,
            scheme: signed.scheme,
            signature: base64::engine::general_purpose::STANDARD.encode(signed.signature),
        })
    }
}

/// The cluster CA, as a verifier of nodes' signatures.
#[derive(Clone, Debug)]
pub struct ClusterCa {
    ca: Vec<CertificateDer<'static>>,
}

impl ClusterCa {
    /// Reads the CA certificate(s) (`ca.pem` of `grandis certs init`).
    pub fn load(path: &Path) -> Result<ClusterCa> {
        let ca = load_certs(path)?;
        // An unusable CA is an error now, not a refusal of every daemon later.
        for c in &ca {
            webpki::anchor_from_trusted_cert(c).map_err(|e| QuicError::File {
                path: path.to_path_buf(),
                message: format!("not a usable CA certificate: {e}"),
            })?;
        }
        Ok(ClusterCa { ca })
    }

    /// Checks that `proof` proves that its sender holds node `name`'s key: it signed the
    /// registration of `name` over the proof's challenge (whose freshness the caller checks).
    pub fn verify_registration(
        &self,
        name: &str,
        proof: &grandis_wire::NodeProof,
    ) -> Result<(), String> {
        use base64::Engine;
        let signature = base64::engine::general_purpose::STANDARD
            .decode(&proof.signature)
            .map_err(|e| format!("the signature is not base64: {e}"))?;
        let signed = Signed {
            chain_pem: proof.certificate.clone(),
            scheme: proof.scheme,
            signature,
        };
        self.verify(
            name,
            &grandis_wire::registration_message(name, &proof.challenge),
            &signed,
        )
    }

    /// Checks that `signed` is node `name`'s signature of `message`: its certificate is
    /// issued by this CA (and current), valid for `name`, and its key made the signature.
    /// The message says which check failed.
    pub fn verify(&self, name: &str, message: &[u8], signed: &Signed) -> Result<(), String> {
        let chain = CertificateDer::pem_slice_iter(signed.chain_pem.as_bytes())
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(|e| format!("the certificate is not valid PEM: {e}"))?;
        let cert = chain
            .first()
            .ok_or("no certificate (expected a \"BEGIN CERTIFICATE\" block)")?;
        verify_issued_by(cert, &self.ca, name)?;
        let scheme = SignatureScheme::from(signed.scheme);
        if !SCHEMES.contains(&scheme) {
            return Err(format!("signature scheme {scheme:?} is not accepted"));
        }
        let algs = rustls::crypto::ring::default_provider()
            .signature_verification_algorithms
            .mapping
            .iter()
            .find(|(s, _)| *s == scheme)
            .map(|(_, algs)| *algs)
            .unwrap_or_default();
        let ee = webpki::EndEntityCert::try_from(cert)
            .map_err(|e| format!("cannot parse the certificate: {e}"))?;
        // TLS 1.3 semantics: a scheme names one algorithm; try each implementation of it.
        if algs.iter().any(|alg| {
            ee.verify_signature(*alg, message, &signed.signature)
                .is_ok()
        }) {
            Ok(())
        } else {
            Err("the signature does not verify with the certificate's key".into())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::certs::{init_cluster_with, InitOptions, CA_CERT_FILE};

    #[test]
    fn a_node_proves_its_own_name_and_no_other() {
        let dir = tempfile::tempdir().unwrap();
        init_cluster_with(dir.path(), &["a", "b"], &InitOptions::default()).unwrap();
        let other = tempfile::tempdir().unwrap();
        init_cluster_with(other.path(), &["a"], &InitOptions::default()).unwrap();
        let ca = ClusterCa::load(&dir.path().join(CA_CERT_FILE)).unwrap();
        let a = NodeIdentity::load(dir.path(), "a").unwrap();
        let signed = a.sign(b"register a 123").unwrap();
        ca.verify("a", b"register a 123", &signed).unwrap();
        // Another name, another message, a flipped signature byte.
        let e = ca.verify("b", b"register a 123", &signed).unwrap_err();
        assert!(e.contains("not valid for node name \"b\""), "{e}");
        let e = ca.verify("a", b"register a 124", &signed).unwrap_err();
        assert!(e.contains("does not verify"), "{e}");
        let mut flipped = signed.clone();
        let last = flipped.signature.len() - 1;
        flipped.signature[last] ^= 1;
        assert!(ca.verify("a", b"register a 123", &flipped).is_err());
        // A node of another cluster (same name, another CA).
        let stranger = NodeIdentity::load(other.path(), "a").unwrap();
        let e = ca
            .verify("a", b"m", &stranger.sign(b"m").unwrap())
            .unwrap_err();
        assert!(e.contains("not issued by the cluster CA"), "{e}");
        // b's certificate with a's signature.
        let b = NodeIdentity::load(dir.path(), "b").unwrap();
        let mixed = Signed {
            chain_pem: b.sign(b"m").unwrap().chain_pem,
            ..a.sign(b"m").unwrap()
        };
        assert!(ca.verify("b", b"m", &mixed).is_err());
        // A registration proof: for its own name and challenge only.
        let proof = a.prove_registration("c1").unwrap();
        ca.verify_registration("a", &proof).unwrap();
        assert!(ca.verify_registration("b", &proof).is_err());
        let replayed = grandis_wire::NodeProof {
            challenge: "c2".into(),
            ..proof
        };
        assert!(ca.verify_registration("a", &replayed).is_err());
        // Garbage instead of a certificate.
        let junk = Signed {
            chain_pem: "not pem".into(),
            ..signed
        };
        assert!(ca.verify("a", b"register a 123", &junk).is_err());
    }
}
