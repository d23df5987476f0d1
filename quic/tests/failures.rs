//! Failure paths: a peer that disappears, a rank whose transport is dropped, malformed and
//! oversized frames. Every one ends in an error naming the peer, never in a hang or a panic.

mod common;

use std::time::{Duration, Instant};

use common::*;
use grandis_fabric::{Endpoint, FabricError, Payload, Tag, Topology, Transport, TransportError};
use grandis_quic::frame::Preamble;
use grandis_quic::QuicNode;

const TOPO: Topology = Topology {
    servers: 2,
    devices: 1,
};

fn pair(max_frame_a: Option<usize>) -> (tempfile::TempDir, QuicNode, QuicNode) {
    let dir = tempfile::tempdir().unwrap();
    grandis_quic::init_cluster(dir.path(), &["a", "b"]).unwrap();
    let mut ca = config(dir.path(), TOPO, &["a", "b"], 0);
    if let Some(m) = max_frame_a {
        ca.max_frame_bytes = m;
    }
    let a = QuicNode::bind(ca).unwrap();
    let b = QuicNode::bind(config(dir.path(), TOPO, &["a", "b"], 1)).unwrap();
    b.connect(0, a.local_addr()).unwrap();
    a.wait_connected(WAIT).unwrap();
    (dir, a, b)
}

#[test]
fn dropped_peer_node_gives_peer_gone_not_a_hang() {
    let (_dir, a, b) = pair(None);
    let ta = a.take_transports().unwrap().pop().unwrap();
    let mut tb = b.take_transports().unwrap().pop().unwrap();
    let mut ep = Endpoint::with_transport(TOPO, 0, Box::new(ta), WAIT).unwrap();
    tb.send(0, env(0, Payload::F32(vec![1.0]))).unwrap();
    // Messages already delivered are still received.
    assert_eq!(ep.recv(1, Tag::other(0, 0)).unwrap(), vec![1.0]);
    // The whole peer node goes away while its rank's transport still exists.
    let start = Instant::now();
    drop(b);
    let err = ep.recv(1, Tag::other(1, 0)).unwrap_err();
    assert!(
        matches!(err, FabricError::PeerGone { peer: 1, .. }),
        "{err}"
    );
    assert!(start.elapsed() < WAIT, "took the whole timeout");
    // Sends to the vanished peer fail too (once the node has noticed the closed connection).
    let deadline = Instant::now() + WAIT;
    loop {
        match ep.send(1, vec![2.0], Tag::other(2, 0)) {
            Err(e) => {
                assert!(e.is_peer_gone(), "{e}");
                break;
            }
            Ok(()) => {
                assert!(
                    Instant::now() < deadline,
                    "sends to a vanished peer keep succeeding"
                );
                std::thread::sleep(Duration::from_millis(10));
            }
        }
    }
    assert!(!a.is_connected(1));
    drop(tb);
}

#[test]
fn dropped_rank_transport_gives_disconnected_even_if_it_never_sent() {
    let (_dir, a, b) = pair(None);
    let mut ta = a.take_transports().unwrap().pop().unwrap();
    let tb = b.take_transports().unwrap().pop().unwrap();
    drop(tb);
    assert_eq!(ta.recv(1, WAIT), Err(TransportError::Disconnected));
    // The nodes themselves are still connected.
    assert!(a.is_connected(1) && b.is_connected(0));
}

#[test]
fn malformed_frame_is_an_error_naming_the_peer() {
    let (_dir, a, b) = pair(None);
    let ta = a.take_transports().unwrap().pop().unwrap();
    let mut tb = b.take_transports().unwrap().pop().unwrap();
    let mut ep = Endpoint::with_transport(TOPO, 0, Box::new(ta), WAIT).unwrap();
    // A stream for pair 1→0 whose only frame claims f32 values but carries 3 bytes.
    let mut raw = Preamble { src: 1, dst: 0 }.encode().to_vec();
    raw.extend_from_slice(&20u32.to_le_bytes());
    raw.extend_from_slice(&[0u8; 16]); // tag (epoch, layer, phase) and op, all variant 0
    raw.push(0); // kind: f32
    raw.extend_from_slice(&[1, 2, 3]);
    b.send_raw_stream_for_tests(0, &raw).unwrap();
    let err = ep.recv(1, Tag::forward(0, 0)).unwrap_err();
    let text = err.to_string();
    let b_addr = b.local_addr().to_string();
    assert!(
        matches!(err, FabricError::Transport { peer: 1, .. }),
        "{text}"
    );
    assert!(
        text.contains("malformed data from server 1 (b at")
            && text.contains(&b_addr)
            && text.contains("not a multiple of 4"),
        "{text}"
    );
    // The connection is closed; the misbehaving side learns why.
    let err = tb.recv(0, WAIT).unwrap_err();
    match err {
        TransportError::Failed(m) => assert!(m.contains("protocol violation"), "{m}"),
        other => panic!("expected a failure with a reason, got {other:?}"),
    }
    // Later receives on the victim keep reporting the reason instead of hanging.
    let err = ep.recv(1, Tag::forward(0, 1)).unwrap_err().to_string();
    assert!(err.contains("malformed data from server 1"), "{err}");
}

#[test]
fn stream_for_a_foreign_rank_pair_is_a_protocol_violation() {
    let (_dir, a, b) = pair(None);
    let mut ta = a.take_transports().unwrap().pop().unwrap();
    // Server 1 hosts only rank 1; a stream claiming to come from rank 0 is forged.
    let raw = Preamble { src: 0, dst: 0 }.encode();
    b.send_raw_stream_for_tests(0, &raw).unwrap();
    match ta.recv(1, WAIT) {
        Err(TransportError::Failed(m)) => {
            assert!(m.contains("malformed data from server 1 (b at"), "{m}");
            assert!(m.contains("ranks 0→0"), "{m}");
        }
        other => panic!("expected a failure naming the peer, got {other:?}"),
    }
}

#[test]
fn oversized_frames_are_refused_by_sender_and_receiver() {
    // Node a accepts frames of at most 1 KiB; b's default is much larger.
    let (_dir, a, b) = pair(Some(1024));
    let mut ta = a.take_transports().unwrap().pop().unwrap();
    let mut tb = b.take_transports().unwrap().pop().unwrap();
    // The sender's own limit is checked before anything is queued.
    match ta.send(1, env(0, Payload::Bytes(vec![0; 2000]))) {
        Err(TransportError::Failed(m)) => {
            assert!(m.contains("exceeds the maximum of 1024 bytes"), "{m}")
        }
        other => panic!("{other:?}"),
    }
    // A small message still goes through, then a frame larger than a's limit arrives.
    tb.send(0, env(1, Payload::Bytes(vec![7; 10]))).unwrap();
    tb.send(0, env(2, Payload::Bytes(vec![0; 2000]))).unwrap();
    assert_eq!(
        ta.recv(1, WAIT).unwrap(),
        env(1, Payload::Bytes(vec![7; 10]))
    );
    match ta.recv(1, WAIT) {
        Err(TransportError::Failed(m)) => {
            assert!(
                m.contains("server 1 (b at") && m.contains("exceeds the maximum of 1024 bytes"),
                "{m}"
            )
        }
        other => panic!("expected a failure naming the peer, got {other:?}"),
    }
}

#[test]
fn establish_gives_up_soon_after_a_cancel_whichever_side_is_waiting() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    let dir = tempfile::tempdir().unwrap();
    grandis_quic::init_cluster(dir.path(), &["a", "b"]).unwrap();
    // A port nothing answers on: a UDP socket that is bound but never read.
    let silent = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    for server in [0, 1] {
        // Server 0 waits to be dialled; server 1 dials server 0, which never answers.
        let node = QuicNode::bind(config(dir.path(), TOPO, &["a", "b"], server)).unwrap();
        let mut addrs = vec![silent.local_addr().unwrap(); 2];
        addrs[server] = node.local_addr();
        let cancel = Arc::new(AtomicBool::new(false));
        let c2 = cancel.clone();
        let setter = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(300));
            c2.store(true, Ordering::SeqCst);
        });
        let started = Instant::now();
        let err = node
            .establish(&addrs, Duration::from_secs(60), &|| {
                cancel.load(Ordering::SeqCst)
            })
            .unwrap_err();
        assert!(
            matches!(err, grandis_quic::QuicError::Cancelled),
            "server {server}: {err}"
        );
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "server {server}: {:?}",
            started.elapsed()
        );
        setter.join().unwrap();
    }
}
