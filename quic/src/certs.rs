//! Cluster certificates: a self-signed cluster CA and one certificate + key per node, as PEM
//! files in one directory (`ca.pem`, `ca.key`, `<node>.pem`, `<node>.key`), and the loader that
//! reads a node's identity back with errors that name the file.
//!
//! Every node certificate carries its node name as DNS subject alternative name (optionally
//! also `localhost` and `127.0.0.1`) and both the server and client extended key usages, since
//! every daemon accepts connections from some peers and dials others. Keys are ECDSA P-256
//! (ring). Files are written through a temporary sibling and a rename; key files get mode 0600
//! before any key byte is written.

use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair,
    KeyUsagePurpose,
};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};

use crate::error::{QuicError, Result};

/// File name of the cluster CA certificate inside a certificate directory.
pub const CA_CERT_FILE: &str = "ca.pem";
/// File name of the cluster CA private key inside a certificate directory.
pub const CA_KEY_FILE: &str = "ca.key";

/// Options of [`init_cluster_with`].
#[derive(Clone, Debug)]
pub struct InitOptions {
    /// Also put `localhost` and `127.0.0.1` into every node certificate (single-host tests).
    pub include_localhost: bool,
    /// Validity of the CA and node certificates in days from now.
    pub validity_days: u32,
    /// Replace existing files instead of refusing.
    pub overwrite: bool,
}

impl Default for InitOptions {
    fn default() -> Self {
        InitOptions {
            include_localhost: false,
            validity_days: 3650,
            overwrite: false,
        }
    }
}

/// Paths written by [`init_cluster_with`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClusterFiles {
    /// `ca.pem`.
    pub ca_cert: PathBuf,
    /// `ca.key`.
    pub ca_key: PathBuf,
    /// `(node name, <node>.pem, <node>.key)` in the order given.
    pub nodes: Vec<(String, PathBuf, PathBuf)>,
}

/// Path of node `name`'s certificate in `dir`.
pub fn node_cert_path(dir: &Path, name: &str) -> PathBuf {
    dir.join(format!("{name}.pem"))
}

/// Path of node `name`'s private key in `dir`.
pub fn node_key_path(dir: &Path, name: &str) -> PathBuf {
    dir.join(format!("{name}.key"))
}

/// Checks that `name` can be a node name: a DNS name (it goes into the certificate and is what
/// peers verify) made of ASCII letters, digits, `-` and `.` (it also names files), not `ca`.
pub fn validate_node_name(name: &str) -> Result<()> {
    let bad = |why: &str| QuicError::Config(format!("invalid node name {name:?}: {why}"));
    if name.is_empty() {
        return Err(bad("empty"));
    }
    if name.len() > 253 {
        return Err(bad("longer than 253 characters"));
    }
    if let Some(c) = name
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || *c == '-' || *c == '.'))
    {
        return Err(bad(&format!(
            "character {c:?} is not allowed (use letters, digits, '-' and '.')"
        )));
    }
    if name.starts_with('.') || name.starts_with('-') {
        return Err(bad("must start with a letter or digit"));
    }
    if name == "ca" {
        return Err(bad("\"ca\" is reserved for the cluster CA files"));
    }
    if name.parse::<std::net::IpAddr>().is_ok() {
        return Err(bad("must be a name, not an IP address"));
    }
    match ServerName::try_from(name) {
        Ok(ServerName::DnsName(_)) => Ok(()),
        _ => Err(bad("not a valid DNS name")),
    }
}

/// [`init_cluster_with`] with default options (no `localhost` names, 10 years, no overwrite).
pub fn init_cluster(dir: impl AsRef<Path>, nodes: &[impl AsRef<str>]) -> Result<ClusterFiles> {
    init_cluster_with(dir, nodes, &InitOptions::default())
}

/// Creates a cluster CA and one certificate + key per node under `dir` (created if missing).
/// Refuses, before writing anything, when a file it would write already exists (unless
/// `options.overwrite`), when a node name is invalid or repeated, or when `nodes` is empty.
pub fn init_cluster_with(
    dir: impl AsRef<Path>,
    nodes: &[impl AsRef<str>],
    options: &InitOptions,
) -> Result<ClusterFiles> {
    let dir = dir.as_ref();
    if nodes.is_empty() {
        return Err(QuicError::Config("no node names given".into()));
    }
    if options.validity_days == 0 {
        return Err(QuicError::Config(
            "certificate validity must be at least 1 day".into(),
        ));
    }
    let mut names: Vec<String> = Vec::with_capacity(nodes.len());
    for n in nodes {
        let n = n.as_ref();
        validate_node_name(n)?;
        if names.iter().any(|m| m.eq_ignore_ascii_case(n)) {
            return Err(QuicError::Config(format!(
                "node name {n:?} is given twice (names are case-insensitive)"
            )));
        }
        names.push(n.to_string());
    }
    let files = ClusterFiles {
        ca_cert: dir.join(CA_CERT_FILE),
        ca_key: dir.join(CA_KEY_FILE),
        nodes: names
            .iter()
            .map(|n| (n.clone(), node_cert_path(dir, n), node_key_path(dir, n)))
            .collect(),
    };
    if !options.overwrite {
        let all = [&files.ca_cert, &files.ca_key]
            .into_iter()
            .chain(files.nodes.iter().flat_map(|(_, c, k)| [c, k]));
        for p in all {
            if p.exists() {
                return Err(QuicError::File {
                    path: p.clone(),
                    message: "already exists (pass --force to replace it)".into(),
                });
            }
        }
    }

    let now = time::OffsetDateTime::now_utc();
    // A day of slack for clocks that are slightly behind.
    let not_before = now - time::Duration::days(1);
    let not_after = now + time::Duration::days(i64::from(options.validity_days));
    let gen = |what: &str, e: rcgen::Error| QuicError::CertGen {
        what: what.to_string(),
        message: e.to_string(),
    };

    let ca_key = KeyPair::generate().map_err(|e| gen("the CA key", e))?;
    let mut ca_params =
        CertificateParams::new(Vec::<String>::new()).map_err(|e| gen("the CA certificate", e))?;
    // A distinct name per CA: with a shared name, a certificate from another cluster would
    // be matched to our CA by name and fail with a puzzling "bad signature" instead of
    // "unknown issuer".
    let ca_id: String = ca_key
        .public_key_raw()
        .iter()
        .rev()
        .take(6)
        .map(|b| format!("{b:02x}"))
        .collect();
    ca_params
        .distinguished_name
        .push(DnType::CommonName, format!("grandis cluster CA {ca_id}"));
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    ca_params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    ca_params.not_before = not_before;
    ca_params.not_after = not_after;
    let ca_cert = ca_params
        .self_signed(&ca_key)
        .map_err(|e| gen("the CA certificate", e))?;

    let mut issued = Vec::with_capacity(names.len());
    for name in &names {
        let what = format!("the certificate of node {name}");
        let key = KeyPair::generate().map_err(|e| gen(&what, e))?;
        let mut sans = vec![name.clone()];
        if options.include_localhost {
            sans.push("localhost".into());
            sans.push("127.0.0.1".into());
        }
        let mut params = CertificateParams::new(sans).map_err(|e| gen(&what, e))?;
        params.distinguished_name.push(DnType::CommonName, name);
        params.is_ca = IsCa::ExplicitNoCa;
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        params.not_before = not_before;
        params.not_after = not_after;
        let cert = params
            .signed_by(&key, &ca_cert, &ca_key)
            .map_err(|e| gen(&what, e))?;
        issued.push((cert.pem(), key.serialize_pem()));
    }

    // Keys first and the CA certificate last: a directory with `ca.pem` is complete.
    write_key(&files.ca_key, &ca_key.serialize_pem())?;
    for ((_, cert_path, key_path), (cert_pem, key_pem)) in files.nodes.iter().zip(&issued) {
        write_key(key_path, key_pem)?;
        write_public(cert_path, cert_pem)?;
    }
    write_public(&files.ca_cert, &ca_cert.pem())?;
    tracing::info!(
        dir = %dir.display(),
        nodes = names.len(),
        "cluster CA and node certificates written"
    );
    Ok(files)
}

fn store_err(path: &Path, e: grandis_store::StoreError) -> QuicError {
    QuicError::File {
        path: path.to_path_buf(),
        message: format!("cannot write: {e}"),
    }
}

fn write_public(path: &Path, pem: &str) -> Result<()> {
    grandis_store::write_file_atomic(path, pem.as_bytes()).map_err(|e| store_err(path, e))
}

fn write_key(path: &Path, pem: &str) -> Result<()> {
    grandis_store::write_file_atomic_with(path, |file| {
        use std::io::Write;
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            // Restrict the temporary file before a single key byte is in it.
            file.get_ref()
                .set_permissions(std::fs::Permissions::from_mode(0o600))?;
        }
        file.write_all(pem.as_bytes())
    })
    .map_err(|e| store_err(path, e))
}

/// The `grandis certs init` command: `nodes` is a comma-separated list of node names. Prints
/// what it wrote to stdout.
pub fn run_init(out: &Path, nodes: &str, options: &InitOptions) -> anyhow::Result<ClusterFiles> {
    let names: Vec<&str> = nodes
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .collect();
    if names.is_empty() {
        anyhow::bail!("--nodes lists no node names (expected e.g. --nodes a,b,c)");
    }
    let files = init_cluster_with(out, &names, options)?;
    println!(
        "wrote the cluster CA and {} node certificates to {}",
        files.nodes.len(),
        out.display()
    );
    println!(
        "  give each node {CA_CERT_FILE}, <node>.pem and <node>.key; keep {CA_KEY_FILE} off the \
         nodes (it signs new members)"
    );
    Ok(files)
}

/// What a node needs for mutual TLS: the cluster CA certificate(s), its own certificate chain
/// and its private key.
#[derive(Debug)]
pub struct NodeIdentity {
    /// The node's name (as in its certificate).
    pub name: String,
    /// Trusted cluster CA certificates.
    pub ca: Vec<CertificateDer<'static>>,
    /// The node's certificate first, then any intermediates.
    pub chain: Vec<CertificateDer<'static>>,
    /// The node's private key.
    pub key: PrivateKeyDer<'static>,
}

impl Clone for NodeIdentity {
    fn clone(&self) -> Self {
        NodeIdentity {
            name: self.name.clone(),
            ca: self.ca.clone(),
            chain: self.chain.clone(),
            key: self.key.clone_key(),
        }
    }
}

impl NodeIdentity {
    /// Loads node `name` from a directory written by [`init_cluster`].
    pub fn load(dir: impl AsRef<Path>, name: &str) -> Result<NodeIdentity> {
        let dir = dir.as_ref();
        NodeIdentity::load_files(
            name,
            &dir.join(CA_CERT_FILE),
            &node_cert_path(dir, name),
            &node_key_path(dir, name),
        )
    }

    /// Loads and cross-checks a node identity from explicit files: the certificate must match
    /// the key, chain to the CA and be valid for `name`.
    pub fn load_files(
        name: &str,
        ca_path: &Path,
        cert_path: &Path,
        key_path: &Path,
    ) -> Result<NodeIdentity> {
        validate_node_name(name)?;
        let ca = load_certs(ca_path)?;
        let chain = load_certs(cert_path)?;
        let key = load_key(key_path)?;
        let provider = rustls::crypto::ring::default_provider();
        let signer = provider
            .key_provider
            .load_private_key(key.clone_key())
            .map_err(|e| QuicError::File {
                path: key_path.to_path_buf(),
                message: format!("unusable private key: {e}"),
            })?;
        let certified = rustls::sign::CertifiedKey::new(chain.clone(), signer);
        match certified.keys_match() {
            Ok(()) => {}
            Err(rustls::Error::InconsistentKeys(rustls::InconsistentKeys::Unknown)) => {
                // The key type cannot report its public key; the TLS handshake will tell.
            }
            Err(e) => {
                return Err(QuicError::File {
                    path: key_path.to_path_buf(),
                    message: format!(
                        "does not match the certificate in {} ({e})",
                        cert_path.display()
                    ),
                })
            }
        }
        verify_issued_by(&chain[0], &ca, name).map_err(|message| QuicError::File {
            path: cert_path.to_path_buf(),
            message: format!("{message} (CA: {})", ca_path.display()),
        })?;
        Ok(NodeIdentity {
            name: name.to_string(),
            ca,
            chain,
            key,
        })
    }
}

fn read_file(path: &Path) -> Result<Vec<u8>> {
    std::fs::read(path).map_err(|e| QuicError::File {
        path: path.to_path_buf(),
        message: format!("cannot read: {e}"),
    })
}

/// Reads all PEM certificates of `path` (at least one).
pub fn load_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>> {
    let bytes = read_file(path)?;
    let certs = CertificateDer::pem_slice_iter(&bytes)
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|e| QuicError::File {
            path: path.to_path_buf(),
            message: format!("not valid PEM: {e}"),
        })?;
    if certs.is_empty() {
        return Err(QuicError::File {
            path: path.to_path_buf(),
            message: "contains no PEM certificate (expected a \"BEGIN CERTIFICATE\" block)".into(),
        });
    }
    Ok(certs)
}

/// Reads the PEM private key of `path` (PKCS#8, PKCS#1 or SEC1).
pub fn load_key(path: &Path) -> Result<PrivateKeyDer<'static>> {
    let bytes = read_file(path)?;
    PrivateKeyDer::from_pem_slice(&bytes).map_err(|e| QuicError::File {
        path: path.to_path_buf(),
        message: match e {
            rustls::pki_types::pem::Error::NoItemsFound => {
                "contains no PEM private key (expected a \"BEGIN PRIVATE KEY\" block)".into()
            }
            other => format!("not a valid PEM private key: {other}"),
        },
    })
}

/// Checks that `cert` is valid for node `name`. TLS already proved that it chains to the
/// cluster CA; this binds the certificate to the identity the peer claims in its hello, so a
/// node cannot pose as another server.
pub(crate) fn cert_matches_name(cert: &CertificateDer<'_>, name: &str) -> Result<(), String> {
    let server_name = ServerName::try_from(name)
        .map_err(|e| format!("{name:?} is not a valid node name: {e}"))?;
    let ee = webpki::EndEntityCert::try_from(cert)
        .map_err(|e| format!("cannot parse the peer's certificate: {e}"))?;
    ee.verify_is_valid_for_subject_name(&server_name)
        .map_err(|e| format!("the peer's certificate is not valid for node name {name:?}: {e}"))
}

/// Checks that `cert` chains to one of `ca` and is valid for `name`, for clear errors at load
/// time instead of an opaque handshake failure later.
pub(crate) fn verify_issued_by(
    cert: &CertificateDer<'_>,
    ca: &[CertificateDer<'static>],
    name: &str,
) -> Result<(), String> {
    let anchors = ca
        .iter()
        .map(|c| {
            webpki::anchor_from_trusted_cert(c)
                .map_err(|e| format!("CA certificate is unusable: {e}"))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let ee = webpki::EndEntityCert::try_from(cert)
        .map_err(|e| format!("cannot parse the certificate: {e}"))?;
    let algs = rustls::crypto::ring::default_provider()
        .signature_verification_algorithms
        .all;
    ee.verify_for_usage(
        algs,
        &anchors,
        &[],
        UnixTime::now(),
        webpki::KeyUsage::client_auth(),
        None,
        None,
    )
    .map_err(|e| format!("not issued by the cluster CA (or expired): {e}"))?;
    cert_matches_name(cert, name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_names_are_checked() {
        for ok in ["a", "node-1", "gpu07.rack3", "A"] {
            validate_node_name(ok).unwrap();
        }
        for bad in ["", "ca", "a b", "a/b", "../x", ".a", "-a", "127.0.0.1", "é"] {
            assert!(validate_node_name(bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn init_writes_loadable_files_with_private_keys() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("certs");
        let files = init_cluster(&out, &["a", "b"]).unwrap();
        assert_eq!(files.nodes.len(), 2);
        for p in [&files.ca_cert, &files.ca_key] {
            assert!(p.is_file());
        }
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            for p in [&files.ca_key, &files.nodes[0].2, &files.nodes[1].2] {
                let mode = std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
                assert_eq!(mode, 0o600, "{}", p.display());
            }
        }
        let id = NodeIdentity::load(&out, "b").unwrap();
        assert_eq!(id.name, "b");
        assert_eq!(id.chain.len(), 1);
        // No stray temporary files.
        let mut names: Vec<_> = std::fs::read_dir(&out)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        names.sort();
        assert_eq!(
            names,
            ["a.key", "a.pem", "b.key", "b.pem", "ca.key", "ca.pem"]
        );
        // A second init refuses to overwrite, naming the file.
        let err = init_cluster(&out, &["a"]).unwrap_err().to_string();
        assert!(
            err.contains("ca.pem") && err.contains("already exists"),
            "{err}"
        );
        init_cluster_with(
            &out,
            &["a"],
            &InitOptions {
                overwrite: true,
                ..Default::default()
            },
        )
        .unwrap();
    }

    #[test]
    fn init_rejects_bad_node_lists() {
        let dir = tempfile::tempdir().unwrap();
        let none: [&str; 0] = [];
        assert!(init_cluster(dir.path(), &none).is_err());
        let err = init_cluster(dir.path(), &["a", "A"])
            .unwrap_err()
            .to_string();
        assert!(err.contains("twice"), "{err}");
        let err = run_init(dir.path(), " , ", &InitOptions::default())
            .unwrap_err()
            .to_string();
        assert!(err.contains("--nodes"), "{err}");
        // Nothing was written by the failed attempts.
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
        run_init(dir.path(), "x, y", &InitOptions::default()).unwrap();
        NodeIdentity::load(dir.path(), "y").unwrap();
    }

    #[test]
    fn loader_errors_name_the_file_and_the_problem() {
        let dir = tempfile::tempdir().unwrap();
        init_cluster(dir.path(), &["a", "b"]).unwrap();
        let other = tempfile::tempdir().unwrap();
        init_cluster(other.path(), &["a"]).unwrap();
        let d = dir.path();

        // Missing.
        let err = NodeIdentity::load(d, "c").unwrap_err().to_string();
        assert!(
            err.contains("c.pem") && err.contains("cannot read"),
            "{err}"
        );
        // Not PEM.
        std::fs::write(d.join("junk.pem"), "hello").unwrap();
        let err = load_certs(&d.join("junk.pem")).unwrap_err().to_string();
        assert!(
            err.contains("junk.pem") && err.contains("no PEM certificate"),
            "{err}"
        );
        let err = load_key(&d.join("junk.pem")).unwrap_err().to_string();
        assert!(
            err.contains("junk.pem") && err.contains("no PEM private key"),
            "{err}"
        );
        // Key of another node.
        let err =
            NodeIdentity::load_files("a", &d.join("ca.pem"), &d.join("a.pem"), &d.join("b.key"))
                .unwrap_err()
                .to_string();
        assert!(
            err.contains("b.key") && err.contains("does not match") && err.contains("a.pem"),
            "{err}"
        );
        // Certificate from another CA.
        let err = NodeIdentity::load_files(
            "a",
            &d.join("ca.pem"),
            &other.path().join("a.pem"),
            &other.path().join("a.key"),
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("not issued by the cluster CA"), "{err}");
        // Certificate of another name.
        let err =
            NodeIdentity::load_files("b", &d.join("ca.pem"), &d.join("a.pem"), &d.join("a.key"))
                .unwrap_err()
                .to_string();
        assert!(err.contains("not valid for node name \"b\""), "{err}");
    }
}
