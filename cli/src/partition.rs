//! `grandis partition`: split a dataset over servers, then devices within each server.

use std::path::PathBuf;

use anyhow::Context;
use grandis_partition::{PartitionConfig, PartitionMethod, PartitionReport};

#[derive(clap::Args)]
pub struct PartitionArgs {
    /// Dataset directory to partition.
    dataset: PathBuf,
    /// Number of servers (first level: minimises the inter-server edge cut).
    #[arg(long)]
    servers: u32,
    /// Devices per server (second level, on each server's induced subgraph).
    #[arg(long, default_value_t = 1)]
    devices: u32,
    /// Partitioning method at both levels.
    #[arg(long, default_value = "metis", value_parser = ["metis", "spring", "random", "bytegnn"])]
    method: String,
    /// Output partition directory (partition.json, id maps, relabelled dataset/).
    #[arg(long)]
    out: PathBuf,
    /// Random seed (METIS, random; SPRING is deterministic by construction).
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Balance factor β: SPRING merges no cluster past β·|V|/parts vertices, ByteGNN fills no
    /// part past it.
    #[arg(long, default_value_t = 1.05)]
    balance: f64,
    /// ByteGNN's block radius: hops of the search around each train/validation/test vertex
    /// (set it to the model's layers).
    #[arg(long, default_value_t = 2)]
    block_hops: u32,
    /// Also order the vertices inside each device's range by METIS clusters of about this many
    /// vertices (neighbours get nearby ids: faster aggregation on big graphs). Off by default.
    #[arg(long)]
    cluster_vertices: Option<u64>,
    /// Replace the output directory if it exists.
    #[arg(long)]
    force: bool,
    /// Print the quality report as one JSON object.
    #[arg(long)]
    json: bool,
}

pub fn run(args: PartitionArgs) -> anyhow::Result<()> {
    let method: PartitionMethod = args.method.parse()?;
    let cfg = PartitionConfig {
        servers: args.servers,
        devices: args.devices,
        method,
        seed: args.seed,
        balance_factor: args.balance,
        block_hops: args.block_hops,
        cluster_vertices: args.cluster_vertices,
    };
    let report = grandis_partition::partition_dataset(&args.dataset, &args.out, &cfg, args.force)
        .with_context(|| {
        format!(
            "partitioning {} into {}",
            args.dataset.display(),
            args.out.display()
        )
    })?;
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        print_report(&report, &args.out);
    }
    Ok(())
}

fn print_report(r: &PartitionReport, out: &std::path::Path) {
    let q = &r.quality;
    let pct = |x: u64| 100.0 * x as f64 / q.undirected_edges.max(1) as f64;
    println!(
        "wrote {} ({} servers x {} devices, {})",
        out.display(),
        r.servers,
        r.devices,
        r.method
    );
    println!(
        "  edge cut: inter-server {} ({:.1}%), intra-server {} ({:.1}%) of {} undirected edges",
        q.inter_server_cut,
        pct(q.inter_server_cut),
        q.intra_server_cut,
        pct(q.intra_server_cut),
        q.undirected_edges
    );
    println!(
        "  replication factor: devices {:.3}, servers {:.3}",
        q.replication_factor, q.server_replication_factor
    );
    println!(
        "  balance (max/mean) devices: vertices {:.3}, edges {:.3}, train {:.3}; servers: {:.3}, {:.3}, {:.3}",
        q.vertex_balance,
        q.edge_balance,
        q.train_balance,
        q.server_vertex_balance,
        q.server_edge_balance,
        q.server_train_balance
    );
    if let Some(c) = &r.clusters {
        println!(
            "  locality: {} clusters; {:.1}% of the directed edges join vertices of one cluster",
            c.count,
            100.0 * c.edges_inside as f64 / r.num_edges.max(1) as f64
        );
    }
    println!(
        "  {:.2} s ({:.2} s partitioning), peak RSS {:.1} MiB",
        r.seconds,
        r.assign_seconds,
        r.peak_rss_bytes as f64 / (1u64 << 20) as f64
    );
}
