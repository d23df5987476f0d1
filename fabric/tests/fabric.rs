//! Behaviour of the in-process fabric: delivery, accounting, collectives, link emulation and
//! failure handling. Timing is only ever asserted as a lower bound.

// Rounds index a 3-D pattern and double as layer numbers; ranges read clearer here.
#![allow(clippy::needless_range_loop)]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use grandis_fabric::{
    Counters, Direction, Fabric, FabricConfig, FabricError, LinkClass, LinkModel, Phase, Tag,
    Topology,
};
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// A generous timeout so that a broken test fails instead of hanging, yet never trips when
/// things work.
const TEST_TIMEOUT: Duration = Duration::from_secs(60);

fn config(servers: usize, devices: usize) -> FabricConfig {
    FabricConfig {
        recv_timeout: TEST_TIMEOUT,
        ..FabricConfig::new(servers, devices)
    }
}

fn fabric_error(e: &anyhow::Error) -> Option<&FabricError> {
    e.chain().find_map(|c| c.downcast_ref::<FabricError>())
}

/// pattern[round][src][dst] = Some(len): src sends len values to dst in that round.
type Pattern = Vec<Vec<Vec<Option<usize>>>>;

fn value(round: usize, src: usize, dst: usize, k: usize) -> f32 {
    // Exact in f32 for the sizes used here (< 2^24), so equality checks are exact.
    ((((round * 13 + src) * 13 + dst) * 64) + k) as f32
}

#[test]
fn exchange_delivers_random_patterns_and_counts_bytes_exactly() {
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    for trial in 0..12u32 {
        let servers = rng.gen_range(1..=3);
        let devices = rng.gen_range(1..=4);
        let topo = Topology { servers, devices };
        let world = topo.world();
        let rounds = 3;
        let pattern: Pattern = (0..rounds)
            .map(|_| {
                (0..world)
                    .map(|src| {
                        (0..world)
                            .map(|dst| {
                                (src != dst && rng.gen_bool(0.6)).then(|| rng.gen_range(0..=40))
                            })
                            .collect()
                    })
                    .collect()
            })
            .collect();
        let order_seed: u64 = rng.gen();
        let fabric = Fabric::new(config(servers, devices)).unwrap();
        let pattern_ref = &pattern;
        let counters = fabric
            .run(move |mut ep| {
                let me = ep.rank();
                let mut rng = ChaCha8Rng::seed_from_u64(order_seed ^ me as u64);
                for round in 0..rounds {
                    let tag = Tag::forward(trial, round as u32);
                    let sends: Vec<(usize, Vec<f32>)> = (0..world)
                        .filter_map(|dst| {
                            pattern_ref[round][me][dst]
                                .map(|n| (dst, (0..n).map(|k| value(round, me, dst, k)).collect()))
                        })
                        .collect();
                    let mut expect: Vec<(usize, usize)> = (0..world)
                        .filter_map(|src| pattern_ref[round][src][me].map(|n| (src, n)))
                        .collect();
                    // Any order of expect_from must work; results come back in that order.
                    expect.shuffle(&mut rng);
                    let got = if round % 2 == 0 {
                        let from: Vec<usize> = expect.iter().map(|&(p, _)| p).collect();
                        ep.exchange(sends, &from, tag)?
                    } else {
                        ep.exchange_sized(sends, &expect, tag)?
                    };
                    assert_eq!(got.len(), expect.len());
                    for ((peer, data), &(want_peer, n)) in got.iter().zip(&expect) {
                        assert_eq!(*peer, want_peer);
                        let want: Vec<f32> =
                            (0..n).map(|k| value(round, want_peer, me, k)).collect();
                        assert_eq!(data, &want, "round {round}: {want_peer} -> {me}");
                    }
                }
                Ok(ep.counters())
            })
            .unwrap();

        // Per-rank accounting equals the payload sizes of the pattern, per class and layer.
        for (me, c) in counters.iter().enumerate() {
            let e = c.epoch(trial).expect("epoch present");
            for round in 0..rounds {
                for class in [LinkClass::IntraServer, LinkClass::InterServer] {
                    let sent: u64 = (0..world)
                        .filter(|&d| topo.class(me, d) == class)
                        .filter_map(|d| pattern[round][me][d])
                        .map(|n| 4 * n as u64)
                        .sum();
                    let recv: u64 = (0..world)
                        .filter(|&s| topo.class(s, me) == class)
                        .filter_map(|s| pattern[round][s][me])
                        .map(|n| 4 * n as u64)
                        .sum();
                    let layer = round as u32;
                    assert_eq!(
                        e.bytes_for(class, layer, Phase::Forward, Direction::Sent),
                        sent
                    );
                    assert_eq!(
                        e.bytes_for(class, layer, Phase::Forward, Direction::Received),
                        recv
                    );
                }
            }
        }
        // Summed over ranks, every byte sent was received, and the headline fields agree.
        let total = Counters::sum(&counters);
        let e = total.epoch(trial).unwrap();
        for class in [LinkClass::IntraServer, LinkClass::InterServer] {
            assert_eq!(
                e.bytes(class, Direction::Sent),
                e.bytes(class, Direction::Received)
            );
        }
        let expect_inter: u64 = (0..rounds)
            .flat_map(|r| (0..world).flat_map(move |s| (0..world).map(move |d| (r, s, d))))
            .filter(|&(_, s, d)| topo.class(s, d) == LinkClass::InterServer)
            .filter_map(|(r, s, d)| pattern[r][s][d])
            .map(|n| 4 * n as u64)
            .sum();
        assert_eq!(e.bytes_inter_server, expect_inter);
        assert_eq!(
            e.bytes_intra_server,
            e.bytes(LinkClass::IntraServer, Direction::Sent)
        );
        let calls: u64 = e.calls.iter().map(|c| c.calls).sum();
        assert_eq!(calls, (world * rounds) as u64);
    }
}

/// Sequential reference with the documented order: devices folded in device order per server,
/// then server sums folded in server order, each fold starting from its first term.
fn reference_sum(bufs: &[Vec<f32>], topo: Topology) -> Vec<f32> {
    let server_sum = |s: usize| {
        let mut acc = bufs[topo.rank_of(s, 0)].clone();
        for d in 1..topo.devices {
            for (a, b) in acc.iter_mut().zip(&bufs[topo.rank_of(s, d)]) {
                *a += *b;
            }
        }
        acc
    };
    let mut acc = server_sum(0);
    for s in 1..topo.servers {
        for (a, b) in acc.iter_mut().zip(server_sum(s)) {
            *a += b;
        }
    }
    acc
}

#[test]
fn all_reduce_sum_is_bit_identical_to_the_sequential_reference() {
    let mut rng = ChaCha8Rng::seed_from_u64(11);
    for trial in 0..16u32 {
        let servers = rng.gen_range(1..=4);
        let devices = rng.gen_range(1..=4);
        let topo = Topology { servers, devices };
        let n = if trial == 0 {
            0
        } else {
            rng.gen_range(1..=300)
        };
        // Magnitudes spread over many decades so that a different order changes the bits.
        let make = |rng: &mut ChaCha8Rng| -> Vec<Vec<f32>> {
            (0..topo.world())
                .map(|_| {
                    (0..n)
                        .map(|_| {
                            if rng.gen_bool(0.05) {
                                -0.0
                            } else {
                                rng.gen_range(-1.0f32..1.0) * 10f32.powi(rng.gen_range(-4..7))
                            }
                        })
                        .collect()
                })
                .collect()
        };
        let first = make(&mut rng);
        let second = make(&mut rng);
        let (first_ref, second_ref) = (&first, &second);
        let fabric = Fabric::new(config(servers, devices)).unwrap();
        let tag = Tag::all_reduce(trial, 0);
        let results = fabric
            .run(move |mut ep| {
                let mut a = first_ref[ep.rank()].clone();
                let mut b = second_ref[ep.rank()].clone();
                // Two reductions with the same tag back to back must not get mixed up.
                ep.all_reduce_sum(&mut a, tag)?;
                ep.all_reduce_sum(&mut b, tag)?;
                Ok((a, b, ep.counters()))
            })
            .unwrap();
        let want_a = reference_sum(&first, topo);
        let want_b = reference_sum(&second, topo);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        for (rank, (a, b, _)) in results.iter().enumerate() {
            assert_eq!(
                bits(a),
                bits(&want_a),
                "trial {trial} rank {rank} (S={servers} G={devices} n={n})"
            );
            assert_eq!(bits(b), bits(&want_b), "trial {trial} rank {rank}");
        }
        // Accounting: per reduction, 2(G-1)n values per server inside servers and
        // 2(S-1)n values between heads (reduce-scatter + all-gather), all under AllReduce.
        let total = Counters::sum(results.iter().map(|(_, _, c)| c));
        let reductions = 2;
        let intra = (reductions * servers * 2 * (devices - 1) * n * 4) as u64;
        let inter = (reductions * 2 * (servers - 1) * n * 4) as u64;
        let e = total
            .epoch(trial)
            .expect("collectives are counted even when empty");
        assert_eq!(e.bytes_intra_server, intra);
        assert_eq!(e.bytes_inter_server, inter);
        assert_eq!(
            e.bytes_where(Direction::Sent, |r| r.phase != Phase::AllReduce),
            0
        );
        assert_eq!(e.bytes(LinkClass::InterServer, Direction::Received), inter);
    }
}

#[test]
fn broadcast_from_every_root_reaches_every_rank() {
    let (servers, devices) = (3, 2);
    let topo = Topology { servers, devices };
    let world = topo.world();
    let len = 17;
    let fabric = Fabric::new(config(servers, devices)).unwrap();
    let counters = fabric
        .run(move |mut ep| {
            for root in 0..world {
                let tag = Tag::other(0, root as u32);
                let mut buf: Vec<f32> = if ep.rank() == root {
                    (0..len).map(|i| (root * 100 + i) as f32).collect()
                } else {
                    vec![f32::NAN; len]
                };
                ep.broadcast(&mut buf, root, tag)?;
                let want: Vec<f32> = (0..len).map(|i| (root * 100 + i) as f32).collect();
                assert_eq!(buf, want, "root {root} at rank {}", ep.rank());

                let mine = if ep.rank() == root {
                    format!("hello from {root}").into_bytes()
                } else {
                    Vec::new()
                };
                let got = ep.broadcast_bytes(mine, root, Tag::other(1, root as u32))?;
                assert_eq!(got, format!("hello from {root}").into_bytes());
            }
            Ok(ep.counters())
        })
        .unwrap();
    let total = Counters::sum(&counters);
    let e = total.epoch(0).unwrap();
    // Per root: one message to each other server's head, and G-1 deliveries inside each server.
    let per_root_inter = ((servers - 1) * len * 4) as u64;
    let per_root_intra = (servers * (devices - 1) * len * 4) as u64;
    assert_eq!(e.bytes_inter_server, world as u64 * per_root_inter);
    assert_eq!(e.bytes_intra_server, world as u64 * per_root_intra);
}

#[test]
fn barrier_waits_for_every_rank() {
    let (servers, devices) = (2, 3);
    let world = servers * devices;
    let arrived = AtomicUsize::new(0);
    let arrived = &arrived;
    let fabric = Fabric::new(config(servers, devices)).unwrap();
    fabric
        .run(move |mut ep| {
            for round in 0..4 {
                // Stagger arrivals so that a missing barrier would be observed.
                std::thread::sleep(Duration::from_millis(((ep.rank() * 7 + round) % 5) as u64));
                arrived.fetch_add(1, Ordering::SeqCst);
                ep.barrier(Tag::other(round as u32, 0))?;
                let seen = arrived.load(Ordering::SeqCst);
                assert!(
                    seen >= (round + 1) * world,
                    "rank {} left barrier {round} after only {seen} arrivals",
                    ep.rank()
                );
            }
            Ok(())
        })
        .unwrap();
}

#[test]
fn emulated_inter_bandwidth_delays_delivery_by_at_least_n_over_bw() {
    let cfg = FabricConfig {
        inter: LinkModel::new(2e6, Duration::ZERO),
        ..config(2, 1)
    };
    let start = Instant::now();
    let fabric = Fabric::new(cfg).unwrap();
    let arrivals = fabric
        .run(move |mut ep| {
            let tag = Tag::forward(0, 0);
            if ep.rank() == 0 {
                ep.send(1, vec![1.0; 50_000], tag)?; // 200 KB
                Ok(None)
            } else {
                let v = ep.recv_exact(0, 50_000, tag)?;
                assert_eq!(v.len(), 50_000);
                Ok(Some((Instant::now(), ep.counters())))
            }
        })
        .unwrap();
    let (arrived, counters) = arrivals[1].clone().unwrap();
    assert!(
        arrived - start >= Duration::from_millis(100),
        "{:?}",
        arrived - start
    );
    assert!(
        counters
            .epoch(0)
            .unwrap()
            .wait_seconds(LinkClass::InterServer)
            > 0.0
    );
}

#[test]
fn devices_of_a_server_share_its_inter_server_nic() {
    // Ranks 0 and 1 (server 0) each send 100 KB to server 1 at 2 MB/s per NIC: together they
    // need at least 0.1 s, although each message alone would need only 0.05 s.
    let cfg = FabricConfig {
        inter: LinkModel::new(2e6, Duration::ZERO),
        ..config(2, 2)
    };
    let start = Instant::now();
    let fabric = Fabric::new(cfg).unwrap();
    let arrivals = fabric
        .run(move |mut ep| {
            let tag = Tag::forward(0, 0);
            match ep.rank() {
                0 | 1 => {
                    ep.send(ep.rank() + 2, vec![0.5; 25_000], tag)?;
                    Ok(None)
                }
                r => {
                    ep.recv_exact(r - 2, 25_000, tag)?;
                    Ok(Some(Instant::now()))
                }
            }
        })
        .unwrap();
    let last = arrivals.iter().flatten().max().unwrap();
    assert!(
        *last - start >= Duration::from_millis(100),
        "{:?}",
        *last - start
    );
}

#[test]
fn emulated_intra_latency_delays_delivery() {
    let cfg = FabricConfig {
        intra: LinkModel {
            bandwidth_bytes_per_s: None,
            latency: Duration::from_millis(30),
        },
        ..config(1, 2)
    };
    let start = Instant::now();
    let fabric = Fabric::new(cfg).unwrap();
    let arrivals = fabric
        .run(move |mut ep| {
            let tag = Tag::backward(0, 1);
            let peer = 1 - ep.rank();
            let got = ep.exchange(vec![(peer, vec![ep.rank() as f32])], &[peer], tag)?;
            assert_eq!(got, vec![(peer, vec![peer as f32])]);
            Ok(Instant::now())
        })
        .unwrap();
    for a in arrivals {
        assert!(a - start >= Duration::from_millis(30));
    }
}

#[test]
fn dropped_endpoint_fails_peers_instead_of_hanging() {
    let mut eps = Fabric::new(config(2, 2)).unwrap().into_endpoints();
    let tag = Tag::forward(3, 1);
    // A message sent before the drop is still delivered; the next receive fails.
    eps[3].send(0, vec![1.0, 2.0], tag).unwrap();
    let gone = eps.pop().unwrap();
    drop(gone);
    assert_eq!(eps[0].recv(3, tag).unwrap(), vec![1.0, 2.0]);
    let err = eps[0].recv(3, tag).unwrap_err();
    assert!(
        matches!(
            err,
            FabricError::PeerGone {
                rank: 0,
                peer: 3,
                ..
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("peer rank 3"), "{err}");
    // Exchanges and sends towards it fail too.
    let err = eps[1].exchange(vec![], &[3], tag).unwrap_err();
    assert!(
        matches!(err, FabricError::PeerGone { peer: 3, .. }),
        "{err}"
    );
    let err = eps[2].send(3, vec![0.0], tag).unwrap_err();
    assert!(
        matches!(err, FabricError::PeerGone { peer: 3, .. }),
        "{err}"
    );
}

#[test]
fn a_panicking_worker_fails_the_run_with_its_rank() {
    let fabric = Fabric::new(config(2, 2)).unwrap();
    let err = fabric
        .run(|mut ep| {
            if ep.rank() == 3 {
                panic!("boom in the model");
            }
            let mut buf = vec![1.0; 8];
            ep.all_reduce_sum(&mut buf, Tag::all_reduce(0, 0))?;
            Ok(buf)
        })
        .unwrap_err();
    let msg = format!("{err:#}");
    assert!(msg.contains("rank 3 panicked"), "{msg}");
    assert!(msg.contains("boom in the model"), "{msg}");
}

#[test]
fn run_reports_the_root_cause_not_its_consequences() {
    let fabric = Fabric::new(config(2, 2)).unwrap();
    // Rank 3 passes a buffer of the wrong length: its head (rank 2) detects it and fails;
    // everyone else then sees rank 2 disappear. The reported error is the size mismatch.
    let err = fabric
        .run(|mut ep| {
            let n = if ep.rank() == 3 { 5 } else { 4 };
            let mut buf = vec![1.0; n];
            ep.all_reduce_sum(&mut buf, Tag::all_reduce(2, 0))?;
            Ok(())
        })
        .unwrap_err();
    match fabric_error(&err) {
        Some(FabricError::SizeMismatch {
            rank: 2,
            peer: 3,
            expected: 4,
            got: 5,
            ..
        }) => {}
        other => panic!("unexpected root cause {other:?}: {err:#}"),
    }
}

#[test]
fn receive_timeout_names_peer_and_tag() {
    let mut cfg = config(1, 2);
    cfg.recv_timeout = Duration::from_millis(20);
    let mut eps = Fabric::new(cfg).unwrap().into_endpoints();
    let err = eps[0].recv(1, Tag::backward(7, 2)).unwrap_err();
    assert!(
        matches!(err, FabricError::Timeout { rank: 0, peer: 1, tag, .. } if tag == Tag::backward(7, 2)),
        "{err}"
    );
    let msg = err.to_string();
    assert!(
        msg.contains("rank 1") && msg.contains("epoch 7 layer 2 backward"),
        "{msg}"
    );
    // The peer is still alive and usable afterwards.
    eps[1].send(0, vec![3.0], Tag::backward(7, 2)).unwrap();
    assert_eq!(eps[0].recv(1, Tag::backward(7, 2)).unwrap(), vec![3.0]);
}

#[test]
fn wrong_tag_operation_size_or_kind_is_an_error() {
    let mut eps = Fabric::new(config(1, 2)).unwrap().into_endpoints();
    let (a, b) = (Tag::forward(0, 1), Tag::forward(0, 2));

    eps[1].send(0, vec![1.0], a).unwrap();
    let err = eps[0].recv(1, b).unwrap_err();
    assert!(
        matches!(err, FabricError::TagMismatch { expected, got, .. } if expected == b && got == a),
        "{err}"
    );

    // Same tag, different operation: an exchange message is not a point-to-point message.
    eps[1].exchange(vec![(0, vec![1.0])], &[], a).unwrap();
    let err = eps[0].recv(1, a).unwrap_err();
    assert!(matches!(err, FabricError::TagMismatch { .. }), "{err}");

    eps[1].send(0, vec![1.0, 2.0], a).unwrap();
    let err = eps[0].recv_exact(1, 3, a).unwrap_err();
    assert!(
        matches!(
            err,
            FabricError::SizeMismatch {
                expected: 3,
                got: 2,
                ..
            }
        ),
        "{err}"
    );

    eps[1].exchange(vec![(0, vec![1.0; 4])], &[], b).unwrap();
    let err = eps[0].exchange_sized(vec![], &[(1, 5)], b).unwrap_err();
    assert!(
        matches!(
            err,
            FabricError::SizeMismatch {
                peer: 1,
                expected: 5,
                got: 4,
                ..
            }
        ),
        "{err}"
    );

    eps[1].send_bytes(0, b"meta".to_vec(), a).unwrap();
    let err = eps[0].recv(1, a).unwrap_err();
    assert!(matches!(err, FabricError::PayloadKind { .. }), "{err}");
    eps[1].send(0, vec![1.0], a).unwrap();
    let err = eps[0].recv_bytes(1, a).unwrap_err();
    assert!(matches!(err, FabricError::PayloadKind { .. }), "{err}");
}

#[test]
fn invalid_peers_are_rejected_before_anything_is_sent() {
    let mut cfg = config(1, 3);
    cfg.recv_timeout = Duration::from_millis(10);
    let mut eps = Fabric::new(cfg).unwrap().into_endpoints();
    let tag = Tag::forward(0, 0);
    type Sends = Vec<(usize, Vec<f32>)>;
    let cases: Vec<(Sends, Vec<usize>)> = vec![
        (vec![(0, vec![1.0])], vec![]),                 // self
        (vec![(9, vec![1.0])], vec![]),                 // out of range
        (vec![(1, vec![1.0]), (1, vec![2.0])], vec![]), // duplicate send
        (vec![(1, vec![1.0])], vec![2, 2]),             // duplicate expect
        (vec![(1, vec![1.0])], vec![5]),                // expect out of range
    ];
    for (sends, expect) in cases {
        let err = eps[0].exchange(sends, &expect, tag).unwrap_err();
        assert!(
            matches!(err, FabricError::InvalidPeer { rank: 0, .. }),
            "{err}"
        );
    }
    // Nothing reached rank 1 from the rejected calls.
    let err = eps[1].recv(0, tag).unwrap_err();
    assert!(matches!(err, FabricError::Timeout { .. }), "{err}");
    let err = eps[0].send(0, vec![], tag).unwrap_err();
    assert!(matches!(err, FabricError::InvalidPeer { .. }), "{err}");
    let err = eps[0].broadcast(&mut [1.0], 3, tag).unwrap_err();
    assert!(
        matches!(err, FabricError::InvalidPeer { peer: 3, .. }),
        "{err}"
    );
}

#[test]
fn counters_serialise_sum_and_reset() {
    let fabric = Fabric::new(config(2, 1)).unwrap();
    let per_rank = fabric
        .run(|mut ep| {
            let peer = 1 - ep.rank();
            for epoch in 0..2 {
                ep.exchange(vec![(peer, vec![0.0; 10])], &[peer], Tag::forward(epoch, 0))?;
                ep.exchange(vec![(peer, vec![0.0; 3])], &[peer], Tag::backward(epoch, 0))?;
            }
            let before = ep.take_counters();
            assert_eq!(ep.counters(), Counters::default());
            Ok(before)
        })
        .unwrap();
    let total = Counters::sum(&per_rank);
    assert_eq!(total.epochs.len(), 2);
    for e in &total.epochs {
        assert_eq!(e.bytes_inter_server, 2 * (40 + 12));
        assert_eq!(e.bytes_intra_server, 0);
        assert!(e.seconds >= 0.0);
    }
    assert_eq!(total.bytes_inter_server(), 4 * (40 + 12));
    let mut merged = per_rank[0].clone();
    merged.merge(&per_rank[1]);
    assert_eq!(merged, total);

    let json = serde_json::to_string(&total).unwrap();
    assert!(json.contains("\"bytes_inter_server\""), "{json}");
    assert!(
        json.contains("\"inter_server\"") && json.contains("\"forward\""),
        "{json}"
    );
    let back: Counters = serde_json::from_str(&json).unwrap();
    // Integers round-trip exactly; seconds may differ in the last bit of the f64 parse.
    assert_eq!(back.epochs.len(), total.epochs.len());
    for (b, t) in back.epochs.iter().zip(&total.epochs) {
        assert_eq!(b.epoch, t.epoch);
        assert_eq!(b.bytes_inter_server, t.bytes_inter_server);
        assert_eq!(b.links.len(), t.links.len());
        for (bl, tl) in b.links.iter().zip(&t.links) {
            assert_eq!(
                (bl.class, bl.layer, bl.phase),
                (tl.class, tl.layer, tl.phase)
            );
            assert_eq!(
                (bl.bytes_sent, bl.bytes_received),
                (tl.bytes_sent, tl.bytes_received)
            );
            assert!((bl.wait_seconds - tl.wait_seconds).abs() <= 1e-12);
        }
        assert!((b.seconds - t.seconds).abs() <= 1e-12);
    }
}

#[test]
fn bad_configurations_are_rejected_with_the_field_named() {
    let cases = [
        (FabricConfig::new(0, 2), "servers"),
        (FabricConfig::new(2, 0), "devices"),
        (
            FabricConfig {
                inter: LinkModel::new(-1.0, Duration::ZERO),
                ..FabricConfig::new(2, 2)
            },
            "inter.bandwidth_bytes_per_s",
        ),
        (
            FabricConfig {
                intra: LinkModel::new(f64::NAN, Duration::ZERO),
                ..FabricConfig::new(2, 2)
            },
            "intra.bandwidth_bytes_per_s",
        ),
        (
            FabricConfig {
                recv_timeout: Duration::ZERO,
                ..FabricConfig::new(1, 1)
            },
            "recv_timeout",
        ),
    ];
    for (cfg, field) in cases {
        let err = Fabric::new(cfg).unwrap_err();
        assert!(matches!(err, FabricError::Config(_)));
        assert!(err.to_string().contains(field), "{err}");
    }
    // A single rank is a valid (degenerate) cluster; its collectives are no-ops.
    let mut eps = Fabric::new(FabricConfig::new(1, 1))
        .unwrap()
        .into_endpoints();
    let mut buf = vec![1.5, -2.0];
    eps[0]
        .all_reduce_sum(&mut buf, Tag::all_reduce(0, 0))
        .unwrap();
    eps[0].barrier(Tag::other(0, 0)).unwrap();
    assert_eq!(buf, vec![1.5, -2.0]);
}
