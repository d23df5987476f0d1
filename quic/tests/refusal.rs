//! Mutual TLS and the hello handshake refuse peers that are not part of the cluster: a
//! certificate from another CA, a certificate for another node name, another cluster shape.
//! Refusals are logged with `tracing::warn!` naming the remote address and the reason.

mod common;

use std::io::Write;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use common::*;
use grandis_fabric::{Payload, Topology, Transport, TransportError};
use grandis_quic::{init_cluster, NodeIdentity, QuicNode};

/// Everything logged at WARN or above by any thread of this test binary.
fn captured_log() -> Arc<Mutex<Vec<u8>>> {
    static LOG: OnceLock<Arc<Mutex<Vec<u8>>>> = OnceLock::new();
    LOG.get_or_init(|| {
        let buf = Arc::new(Mutex::new(Vec::new()));
        struct W(Arc<Mutex<Vec<u8>>>);
        impl Write for W {
            fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
                self.0.lock().unwrap().extend_from_slice(b);
                Ok(b.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let sink = buf.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_max_level(tracing::Level::WARN)
            .with_ansi(false)
            .with_writer(move || W(sink.clone()))
            .finish();
        tracing::subscriber::set_global_default(subscriber).expect("one global subscriber");
        buf
    })
    .clone()
}

fn log_text() -> String {
    String::from_utf8_lossy(&captured_log().lock().unwrap()).into_owned()
}

/// Waits until `cond` holds (server-side refusals are recorded asynchronously).
fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + WAIT;
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

const TOPO: Topology = Topology {
    servers: 2,
    devices: 1,
};

#[test]
fn certificate_from_another_ca_is_refused_both_ways_and_nothing_is_delivered() {
    captured_log();
    let good_dir = tempfile::tempdir().unwrap();
    let rogue_dir = tempfile::tempdir().unwrap();
    init_cluster(good_dir.path(), &["a", "b"]).unwrap();
    init_cluster(rogue_dir.path(), &["b"]).unwrap();
    let good = QuicNode::bind(config(good_dir.path(), TOPO, &["a", "b"], 0)).unwrap();
    let rogue = QuicNode::bind(config(rogue_dir.path(), TOPO, &["a", "b"], 1)).unwrap();
    let mut good_t = good.take_transports().unwrap();
    let mut rogue_t = rogue.take_transports().unwrap();
    // The rogue queues a message for rank 0; it must never arrive.
    rogue_t[0]
        .send(0, env(0, Payload::Bytes(b"let me in".to_vec())))
        .unwrap();

    // The rogue dials: the good node's client verifier rejects its certificate.
    let err = rogue.connect(0, good.local_addr()).unwrap_err().to_string();
    assert!(err.contains("connection to server 0 (a at"), "{err}");
    let rogue_addr = rogue.local_addr();
    eventually("the incoming refusal", || {
        good.refusals()
            .iter()
            .any(|r| !r.outgoing && r.remote == rogue_addr)
    });
    let incoming = good.refusals().into_iter().find(|r| !r.outgoing).unwrap();
    assert!(
        incoming.reason.to_lowercase().contains("certificate"),
        "{incoming:?}"
    );

    // The good node dials the rogue: its server certificate is not from the cluster CA.
    let err = good.connect(1, rogue_addr).unwrap_err().to_string();
    assert!(err.contains("connection to server 1 (b at"), "{err}");
    assert!(err.to_lowercase().contains("certificate"), "{err}");
    let outgoing = good.refusals().into_iter().find(|r| r.outgoing).unwrap();
    assert_eq!(outgoing.remote, rogue_addr);

    // Both refusals were logged at WARN with the remote address and the reason.
    eventually("the warnings", || {
        log_text()
            .lines()
            .filter(|l| l.contains("WARN") && l.contains(&rogue_addr.to_string()))
            .count()
            >= 2
    });
    let log = log_text();
    assert!(log.contains("refused QUIC connection"), "{log}");

    // Nothing was delivered and nobody is connected.
    assert!(!good.is_connected(1) && !rogue.is_connected(0));
    assert_eq!(
        good_t[0].recv(1, Duration::from_millis(300)),
        Err(TransportError::Timeout)
    );
    assert_eq!(good.stats().frames_received, 0);
    assert_eq!(good.stats().streams_accepted, 0);
}

#[test]
fn certificate_for_another_node_name_is_refused() {
    captured_log();
    let dir = tempfile::tempdir().unwrap();
    init_cluster(dir.path(), &["a", "b", "c"]).unwrap();
    let good = QuicNode::bind(config(dir.path(), TOPO, &["a", "b"], 0)).unwrap();
    // A cluster member ("c") posing as server 1 ("b"): same CA, wrong name.
    let c = NodeIdentity::load(dir.path(), "c").unwrap();
    let mut cfg = config(dir.path(), TOPO, &["a", "b"], 1);
    cfg.identity = NodeIdentity {
        name: "b".into(),
        ..c
    };
    let impostor = QuicNode::bind(cfg).unwrap();

    // Dialling in: TLS passes (same CA), the hello check binds the certificate to "b".
    let err = impostor
        .connect(0, good.local_addr())
        .unwrap_err()
        .to_string();
    assert!(err.contains("not valid for node name \"b\""), "{err}");
    // Being dialled: the client checks the server's name during TLS.
    let err = good
        .connect(1, impostor.local_addr())
        .unwrap_err()
        .to_string();
    assert!(err.to_lowercase().contains("certificate"), "{err}");
    assert!(!good.is_connected(1));
}

#[test]
fn handshake_mismatch_closes_the_connection_with_a_reason() {
    captured_log();
    let dir = tempfile::tempdir().unwrap();
    init_cluster(dir.path(), &["a", "b"]).unwrap();
    let a = QuicNode::bind(config(dir.path(), TOPO, &["a", "b"], 0)).unwrap();
    let other_shape = Topology {
        servers: 2,
        devices: 2,
    };
    let b = QuicNode::bind(config(dir.path(), other_shape, &["a", "b"], 1)).unwrap();
    let err = b.connect(0, a.local_addr()).unwrap_err().to_string();
    assert!(
        err.contains("peer rejected the handshake") && err.contains("cluster shape mismatch"),
        "{err}"
    );
    assert!(!a.is_connected(1) && !b.is_connected(0));
    assert!(a
        .refusals()
        .iter()
        .any(|r| r.reason.contains("cluster shape mismatch")));

    // A second connection between the same pair is refused; the first keeps working.
    let b = QuicNode::bind(config(dir.path(), TOPO, &["a", "b"], 1)).unwrap();
    b.connect(0, a.local_addr()).unwrap();
    let err = b.connect(0, a.local_addr()).unwrap_err().to_string();
    assert!(err.contains("already connected"), "{err}");
    let mut ta = a.take_transports().unwrap();
    let mut tb = b.take_transports().unwrap();
    tb[0].send(0, env(1, Payload::F32(vec![1.0, 2.0]))).unwrap();
    assert_eq!(
        ta[0].recv(1, WAIT).unwrap(),
        env(1, Payload::F32(vec![1.0, 2.0]))
    );
}
