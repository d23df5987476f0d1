//! A full fabric run over QUIC: 2 servers × 2 ranks in one process, each server's ranks as
//! threads with the hybrid transport of its node, against the in-process `Fabric::run`.

mod common;

use common::*;
use grandis_fabric::{Counters, Direction, Endpoint, Fabric, FabricConfig, LinkClass, Tag};
use grandis_quic::frame::{FRAME_OVERHEAD, PREAMBLE_BYTES};

const SERVERS: usize = 2;
const DEVICES: usize = 2;

/// Deterministic values of very different magnitudes, so that summation order matters.
fn values(seed: u64, n: usize) -> Vec<f32> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15).wrapping_add(1);
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let mant = (x >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
            let exp = ((x >> 8) % 40) as i32 - 20;
            mant * 2f32.powi(exp)
        })
        .collect()
}

fn halo_len(src: usize, dst: usize, epoch: u32) -> usize {
    (src * 37 + dst * 11 + epoch as usize * 5) % 50
}

/// What every rank does: two epochs of halo exchange and gradient all-reduce, then a
/// broadcast and a barrier. Returns the bits of everything it received and its counters.
fn work(mut ep: Endpoint) -> anyhow::Result<(Vec<u32>, Counters)> {
    let r = ep.rank();
    let world = ep.world();
    let mut bits = Vec::new();
    for epoch in 0..2u32 {
        let sends: Vec<_> = (0..world)
            .filter(|&p| p != r)
            .map(|p| {
                let seed = (epoch as u64) << 32 | (r as u64) << 16 | p as u64;
                (p, values(seed, halo_len(r, p, epoch)))
            })
            .collect();
        let expect: Vec<_> = (0..world)
            .filter(|&p| p != r)
            .map(|p| (p, halo_len(p, r, epoch)))
            .collect();
        let got = ep.exchange_sized(sends, &expect, Tag::forward(epoch, 0))?;
        for (p, v) in got {
            let seed = (epoch as u64) << 32 | (p as u64) << 16 | r as u64;
            anyhow::ensure!(v == values(seed, halo_len(p, r, epoch)), "halo from {p}");
            bits.extend(v.iter().map(|x| x.to_bits()));
        }
        let mut grad = values(1000 + r as u64 * 7 + epoch as u64, 1001);
        ep.all_reduce_sum(&mut grad, Tag::all_reduce(epoch, 0))?;
        bits.extend(grad.iter().map(|x| x.to_bits()));
    }
    let mut b = if r == 3 {
        values(77, 33)
    } else {
        vec![0.0; 33]
    };
    ep.broadcast(&mut b, 3, Tag::other(2, 0))?;
    bits.extend(b.iter().map(|x| x.to_bits()));
    ep.barrier(Tag::other(2, 1))?;
    Ok((bits, ep.counters()))
}

#[test]
fn fabric_over_quic_matches_in_process_fabric_bit_for_bit() {
    let reference = Fabric::new(FabricConfig::new(SERVERS, DEVICES))
        .unwrap()
        .run(work)
        .unwrap();

    let dir = tempfile::tempdir().unwrap();
    let topo = grandis_fabric::Topology {
        servers: SERVERS,
        devices: DEVICES,
    };
    let nodes = nodes(dir.path(), topo, &["s0", "s1"]);
    mesh(&nodes);
    let transports: Vec<_> = nodes.iter().map(|n| n.take_transports().unwrap()).collect();
    let results: Vec<(Vec<u32>, Counters)> = std::thread::scope(|scope| {
        let handles: Vec<_> = transports
            .into_iter()
            .flatten()
            .map(|t| {
                scope.spawn(move || {
                    let rank = t.rank();
                    let ep = Endpoint::with_transport(topo, rank, Box::new(t), WAIT).unwrap();
                    work(ep).unwrap()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(results.len(), 4);
    for (rank, ((bits, counters), (ref_bits, ref_counters))) in
        results.iter().zip(&reference).enumerate()
    {
        assert_eq!(
            bits, ref_bits,
            "rank {rank} differs from the in-process fabric"
        );
        for class in [LinkClass::InterServer, LinkClass::IntraServer] {
            for dir in [Direction::Sent, Direction::Received] {
                assert_eq!(
                    counters.bytes(class, dir),
                    ref_counters.bytes(class, dir),
                    "rank {rank} {class:?} {dir:?}"
                );
            }
        }
    }
    // The all-reduce result is the same on every rank.
    let tail = |b: &Vec<u32>| b[b.len() - 33 - 1001..b.len() - 33].to_vec();
    assert!(results.iter().all(|(b, _)| tail(b) == tail(&results[0].0)));

    // Wire bytes per server against the fabric's counters of that server's ranks.
    let stats: Vec<_> = nodes.into_iter().map(|n| n.shutdown(WAIT)).collect();
    for (s, st) in stats.iter().enumerate() {
        let mine = Counters::sum(results[s * DEVICES..(s + 1) * DEVICES].iter().map(|r| &r.1));
        let inter_sent = mine.bytes(LinkClass::InterServer, Direction::Sent);
        let inter_recv = mine.bytes(LinkClass::InterServer, Direction::Received);
        let msgs_sent: u64 = mine
            .epochs
            .iter()
            .flat_map(|e| &e.links)
            .filter(|l| l.class == LinkClass::InterServer)
            .map(|l| l.messages_sent)
            .sum();
        assert!(inter_sent > 0);
        assert_eq!(st.payload_bytes_sent, inter_sent, "server {s}");
        assert_eq!(st.payload_bytes_received, inter_recv, "server {s}");
        assert_eq!(st.frames_sent, msgs_sent, "server {s}");
        // One stream per ordered remote pair: 2 local × 2 remote ranks.
        assert_eq!(st.streams_opened, (DEVICES * DEVICES) as u64);
        assert_eq!(
            st.bytes_sent,
            inter_sent
                + msgs_sent * FRAME_OVERHEAD as u64
                + st.streams_opened * PREAMBLE_BYTES as u64,
            "server {s}"
        );
    }
    assert_eq!(stats[0].bytes_sent, stats[1].bytes_received);
    assert_eq!(stats[1].bytes_sent, stats[0].bytes_received);
}
