//! Two nodes with certificates from one CA exchange envelopes in both directions, in order.

mod common;

use common::*;
use grandis_fabric::{Payload, Topology, Transport, TransportError};
use grandis_quic::frame::{FRAME_OVERHEAD, PREAMBLE_BYTES};
use grandis_quic::Framing;

#[test]
fn two_nodes_exchange_envelopes_in_order_both_ways() {
    let dir = tempfile::tempdir().unwrap();
    let topo = Topology {
        servers: 2,
        devices: 1,
    };
    let nodes = nodes(dir.path(), topo, &["alpha", "beta"]);
    let mut ta = nodes[0].take_transports().unwrap();
    let mut tb = nodes[1].take_transports().unwrap();
    assert_eq!(ta.len(), 1);
    assert!(
        nodes[0].take_transports().is_err(),
        "transports handed out twice"
    );
    let (a, b) = (&mut ta[0], &mut tb[0]);
    assert_eq!((a.rank(), b.rank()), (0, 1));

    // Sends before the connection exists are queued, not lost and not blocking.
    a.send(1, env(0, Payload::Bytes(b"early".to_vec())))
        .unwrap();
    nodes[1].connect(0, nodes[0].local_addr()).unwrap();
    nodes[0].wait_connected(WAIT).unwrap();
    assert!(nodes[0].is_connected(1) && nodes[1].is_connected(0));

    // Many messages each way, sent before anything is received (send never waits), with one
    // large message to exercise flow control.
    let n = 200u32;
    let big: Vec<f32> = (0..1_000_000).map(|i| i as f32 * 0.5).collect();
    let mut payload_bytes = [5u64, 0u64];
    for i in 0..n {
        let pa = Payload::F32(vec![i as f32; (i % 7) as usize]);
        let pb = Payload::Bytes(vec![i as u8; (i % 5) as usize]);
        payload_bytes[0] += pa.byte_len() as u64;
        payload_bytes[1] += pb.byte_len() as u64;
        a.send(1, env(i + 1, pa)).unwrap();
        b.send(0, env(i + 1, pb)).unwrap();
        if i == n / 2 {
            b.send(0, env(9999, Payload::F32(big.clone()))).unwrap();
            payload_bytes[1] += 4 * big.len() as u64;
        }
    }
    let first = b.recv(0, WAIT).unwrap();
    assert_eq!(first, env(0, Payload::Bytes(b"early".to_vec())));
    for i in 0..n {
        let got = b.recv(0, WAIT).unwrap();
        assert_eq!(
            got,
            env(i + 1, Payload::F32(vec![i as f32; (i % 7) as usize]))
        );
        let got = a.recv(1, WAIT).unwrap();
        assert_eq!(
            got,
            env(i + 1, Payload::Bytes(vec![i as u8; (i % 5) as usize]))
        );
        if i == n / 2 {
            let got = a.recv(1, WAIT).unwrap();
            assert_eq!(got, env(9999, Payload::F32(big.clone())));
        }
    }
    // Nothing more is queued.
    assert_eq!(
        a.recv(1, std::time::Duration::from_millis(50)),
        Err(TransportError::Timeout)
    );
    // Invalid peers are errors, not panics.
    assert!(matches!(
        a.send(0, env(0, Payload::F32(vec![]))),
        Err(TransportError::Failed(_))
    ));
    assert!(matches!(
        a.send(7, env(0, Payload::F32(vec![]))),
        Err(TransportError::Failed(_))
    ));

    // Received statistics are complete as soon as the envelopes were handed over.
    let (sa, sb) = (nodes[0].stats(), nodes[1].stats());
    assert_eq!(sb.frames_received, u64::from(n) + 1);
    assert_eq!(sb.payload_bytes_received, payload_bytes[0]);
    assert_eq!(sa.frames_received, u64::from(n) + 1);
    assert_eq!(sa.payload_bytes_received, payload_bytes[1]);
    for s in [sa, sb] {
        assert_eq!(s.streams_accepted, 1);
        assert_eq!(
            s.bytes_received,
            s.payload_bytes_received
                + s.frames_received * FRAME_OVERHEAD as u64
                + PREAMBLE_BYTES as u64
        );
    }
    // Sent statistics: final after an orderly shutdown (transports dropped first).
    drop(ta);
    drop(tb);
    let mut it = nodes.into_iter();
    let (na, nb) = (it.next().unwrap(), it.next().unwrap());
    let sa = na.shutdown(WAIT);
    let sb = nb.shutdown(WAIT);
    assert_eq!(sa.payload_bytes_sent, payload_bytes[0]);
    assert_eq!(sb.payload_bytes_sent, payload_bytes[1]);
    assert_eq!(sa.frames_sent, u64::from(n) + 1);
    assert_eq!(sb.frames_sent, u64::from(n) + 1);
    for s in [sa, sb] {
        assert_eq!(s.bytes_sent, s.payload_bytes_sent + s.framing_bytes_sent());
    }
    // What one side wrote is what the other read.
    assert_eq!(sa.bytes_sent, sb.bytes_received);
    assert_eq!(sb.bytes_sent, sa.bytes_received);
}
