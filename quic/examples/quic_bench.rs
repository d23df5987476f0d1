//! Loopback throughput of the QUIC data plane: two nodes (servers) × G ranks in one process.
//!
//! `cargo run -p grandis-quic --example quic_bench [--release] -- [MB_PER_MESSAGE] [MESSAGES]
//! [DEVICES]` (defaults 4, 64, 2). Prints the point-to-point throughput from rank 0 to the
//! first rank of server 1, and the time of a fabric `all_reduce_sum` of 16 MiB over both
//! servers, with the wire bytes against the payload bytes. Numbers on loopback measure the CPU
//! cost of QUIC + TLS + framing, not a network.

use std::time::{Duration, Instant};

use grandis_fabric::{Endpoint, Envelope, Header, Op, Payload, Tag, Topology, Transport};
use grandis_quic::{init_cluster, Framing, NodeConfig, NodeIdentity, QuicNode};

fn arg(i: usize, default: usize) -> usize {
    std::env::args()
        .nth(i)
        .map(|s| {
            s.parse()
                .unwrap_or_else(|_| panic!("argument {i} must be a number, got {s:?}"))
        })
        .unwrap_or(default)
}

fn main() -> anyhow::Result<()> {
    let mb = arg(1, 4);
    let messages = arg(2, 64);
    let devices = arg(3, 2);
    let topo = Topology {
        servers: 2,
        devices,
    };
    let dir = tempfile::tempdir()?;
    let names = ["bench-a", "bench-b"];
    init_cluster(dir.path(), &names)?;
    let roster: Vec<String> = names.iter().map(|s| s.to_string()).collect();
    let nodes = (0..2)
        .map(|s| {
            let id = NodeIdentity::load(dir.path(), names[s])?;
            Ok(QuicNode::bind(NodeConfig::new(
                topo,
                roster.clone(),
                s,
                "127.0.0.1:0".parse()?,
                id,
            ))?)
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    nodes[1].connect(0, nodes[0].local_addr())?;
    nodes[0].wait_connected(Duration::from_secs(10))?;
    let mut ta = nodes[0].take_transports()?;
    let mut tb = nodes[1].take_transports()?;

    // Point to point: rank 0 → rank G.
    let n = mb * (1 << 20) / 4;
    let data: Vec<f32> = (0..n).map(|i| i as f32).collect();
    let env = |e: u32| Envelope {
        header: Header {
            tag: Tag::other(e, 0),
            op: Op::PointToPoint,
        },
        payload: Payload::F32(data.clone()),
    };
    let start = Instant::now();
    let dst = devices;
    std::thread::scope(|s| -> anyhow::Result<()> {
        let rx = &mut tb[0];
        let h = s.spawn(move || {
            for _ in 0..messages {
                rx.recv(0, Duration::from_secs(60)).expect("recv");
            }
        });
        for e in 0..messages {
            ta[0]
                .send(dst, env(e as u32))
                .map_err(|e| anyhow::anyhow!("{e:?}"))?;
        }
        h.join().map_err(|_| anyhow::anyhow!("receiver panicked"))?;
        Ok(())
    })?;
    let secs = start.elapsed().as_secs_f64();
    let bytes = (messages * n * 4) as f64;
    println!(
        "point-to-point: {messages} × {mb} MiB in {secs:.3} s = {:.1} MiB/s",
        bytes / secs / (1 << 20) as f64
    );

    // All-reduce of 16 MiB over all ranks.
    let len = 4 << 20;
    let transports: Vec<_> = ta.into_iter().chain(tb).collect();
    let times: Vec<f64> = std::thread::scope(|s| {
        let hs: Vec<_> = transports
            .into_iter()
            .enumerate()
            .map(|(rank, t)| {
                s.spawn(move || {
                    let mut ep =
                        Endpoint::with_transport(topo, rank, Box::new(t), Duration::from_secs(60))
                            .expect("endpoint");
                    let mut buf = vec![rank as f32; len];
                    let mut best = f64::MAX;
                    for round in 0..3 {
                        let start = Instant::now();
                        ep.all_reduce_sum(&mut buf, Tag::all_reduce(round, 0))
                            .expect("all-reduce");
                        best = best.min(start.elapsed().as_secs_f64());
                    }
                    best
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().expect("rank")).collect()
    });
    let worst = times.iter().cloned().fold(0.0, f64::max);
    println!(
        "all_reduce_sum of {} MiB over 2 × {devices} ranks: best of 3 = {:.3} s (slowest rank)",
        (len * 4) >> 20,
        worst
    );
    let mut it = nodes.into_iter();
    let (a, b) = (it.next().unwrap(), it.next().unwrap());
    for (name, st) in [
        ("server 0", a.shutdown(Duration::from_secs(10))),
        ("server 1", b.shutdown(Duration::from_secs(10))),
    ] {
        println!(
            "{name}: wire bytes sent {} = payload {} + framing {} ({} frames, {} streams)",
            st.bytes_sent,
            st.payload_bytes_sent,
            st.framing_bytes_sent(),
            st.frames_sent,
            st.streams_opened
        );
    }
    Ok(())
}
