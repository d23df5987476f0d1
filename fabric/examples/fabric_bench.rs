//! Rough throughput figures of the in-process fabric (not a test: no assertions on time).
//!
//! `cargo run --release -p grandis-fabric --example fabric_bench [servers] [devices]`
//!
//! Prints, for S × G worker threads: the time of one all-to-all exchange round with 1 MiB per
//! peer and with 64 B per peer (the fixed per-round cost), the time of an all-reduce of 4 Mi
//! values, and, with an emulated 100 MB/s inter-server NIC, the measured vs modelled time of
//! an exchange round.

use std::time::{Duration, Instant};

use grandis_fabric::{Fabric, FabricConfig, LinkModel, Tag};

fn exchange_rounds(cfg: FabricConfig, values_per_peer: usize, rounds: u32) -> Duration {
    let world = cfg.servers * cfg.devices;
    let fabric = Fabric::new(cfg).expect("valid config");
    let per_rank = fabric
        .run(move |mut ep| {
            let me = ep.rank();
            let peers: Vec<usize> = (0..world).filter(|&p| p != me).collect();
            ep.barrier(Tag::other(0, 0))?;
            let start = Instant::now();
            for round in 0..rounds {
                let sends = peers
                    .iter()
                    .map(|&p| (p, vec![me as f32; values_per_peer]))
                    .collect();
                let got = ep.exchange(sends, &peers, Tag::forward(round, 0))?;
                std::hint::black_box(got);
            }
            ep.barrier(Tag::other(1, 0))?;
            Ok(start.elapsed())
        })
        .expect("benchmark run");
    per_rank.into_iter().max().unwrap_or_default() / rounds
}

fn all_reduce_time(cfg: FabricConfig, n: usize, rounds: u32) -> Duration {
    let fabric = Fabric::new(cfg).expect("valid config");
    let per_rank = fabric
        .run(move |mut ep| {
            let mut buf = vec![ep.rank() as f32; n];
            ep.barrier(Tag::other(0, 0))?;
            let start = Instant::now();
            for round in 0..rounds {
                ep.all_reduce_sum(&mut buf, Tag::all_reduce(round, 0))?;
            }
            Ok(start.elapsed())
        })
        .expect("benchmark run");
    per_rank.into_iter().max().unwrap_or_default() / rounds
}

fn main() {
    let mut args = std::env::args().skip(1).map(|a| a.parse::<usize>());
    let servers = args.next().and_then(Result::ok).unwrap_or(2);
    let devices = args.next().and_then(Result::ok).unwrap_or(2);
    let base = FabricConfig::new(servers, devices);
    let world = servers * devices;
    println!("fabric_bench: {servers} servers x {devices} devices = {world} ranks");

    let big = 256 * 1024; // 1 MiB of f32 per peer
    let t = exchange_rounds(base, big, 20);
    let moved = (world * (world - 1) * big * 4) as f64;
    println!(
        "exchange 1 MiB/peer: {:.3} ms/round, {:.2} GB/s aggregate payload",
        t.as_secs_f64() * 1e3,
        moved / t.as_secs_f64() / 1e9
    );
    let t = exchange_rounds(base, 16, 2000);
    println!("exchange 64 B/peer:  {:.1} us/round", t.as_secs_f64() * 1e6);

    let n = 4 * 1024 * 1024;
    let t = all_reduce_time(base, n, 10);
    println!(
        "all_reduce_sum 4 Mi f32 (16 MiB): {:.2} ms/call",
        t.as_secs_f64() * 1e3
    );

    if servers > 1 {
        let bw = 100e6;
        let cfg = FabricConfig {
            inter: LinkModel::new(bw, Duration::ZERO),
            ..base
        };
        let values = 64 * 1024; // 256 KiB per peer
        let t = exchange_rounds(cfg, values, 5);
        // Each server NIC sends G devices × (S-1)·G remote peers × 256 KiB per round.
        let per_nic = (devices * (servers - 1) * devices * values * 4) as f64;
        println!(
            "emulated inter 100 MB/s, 256 KiB/peer: {:.1} ms/round measured, {:.1} ms modelled NIC time",
            t.as_secs_f64() * 1e3,
            per_nic / bw * 1e3
        );
    }
}
