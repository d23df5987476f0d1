//! `grandis bench modes`: the shape of GraNNDIS Figure 8 — FB_base against FLX with k = 1..L
//! on one synthetic power-law graph, S servers x G devices as threads over the emulated fabric
//! (inter-server bandwidth a fraction of the intra-server one). Per mode: epoch time split into
//! compute / intra comm / inter comm / feature fetch / all-reduce, halo bytes per link class,
//! the inter-server bytes of replicated vertices' features fetched from their home server (per
//! epoch, and once at setup: what FLX preloading pays), and the speedup over FB_base run in the
//! same invocation; then the paper's performance model (Eqs. 1-5) evaluated
//! on the rates measured here. Sampled rows follow (GraNNDIS Figures 9-10): FLX-EAS (k = L,
//! expansion-aware sampling) against FB_base and exact FLX k = L, and cooperative batching
//! with GraphSAGE fanouts (CoB-SAGE) against CoB with EAS (CoB-EAS), same co-batch size.

use anyhow::Context;
use grandis_parallel::{
    JobSpec, Machine, Mode, ParallelOptions, ParallelReport, Priority, Sampling,
};
use grandis_trainer::TrainOptions;

#[derive(clap::Args)]
pub struct BenchModesArgs {
    #[command(flatten)]
    pub graph: super::graph::BenchGraphArgs,
    /// Inter-server bandwidth per server NIC = intra-bandwidth / this.
    #[arg(long, default_value_t = 8.0)]
    pub inter_ratio: f64,
    /// FLX-EAS / CoB-EAS: external hops h.
    #[arg(long, default_value_t = 1)]
    pub eas_hops: usize,
    /// FLX-EAS / CoB-EAS: external fanout f.
    #[arg(long, default_value_t = 15)]
    pub eas_fanout: usize,
    /// CoB-SAGE fanouts, one per layer (default 25,10,5,... cut to --layers).
    #[arg(long)]
    pub fanouts: Option<String>,
    /// CoB-SAGE / CoB-EAS: co-batch size per server.
    #[arg(long, default_value_t = 1024)]
    pub cobatch_size: usize,
    /// Skip the sampled rows (FLX-EAS, CoB-SAGE, CoB-EAS).
    #[arg(long)]
    pub no_sampled: bool,
    /// Print one JSON object as the last stdout line.
    #[arg(long)]
    pub json: bool,
}

struct Row {
    name: String,
    report: ParallelReport,
}

pub fn run(args: BenchModesArgs) -> anyhow::Result<()> {
    let super::graph::BenchGraph {
        dataset: ds,
        stats,
        part,
        config,
    } = args.graph.build("bench-modes")?;
    let view = ds.view();
    // Through serde so that options the trainer adds later take their defaults.
    let opts: TrainOptions = serde_json::from_value(serde_json::json!({
        "epochs": args.graph.epochs.unwrap_or(3).max(2),
        "lr": 0.01,
        "weight_decay": 5e-4,
        "adamw": false,
        "grad_clip": null,
        // Benchmarks time epochs: only the final accuracies.
        "eval": "end",
        "seed": args.graph.seed,
    }))?;
    let inter_bw = args.graph.intra_bandwidth / args.inter_ratio;
    let (intra, inter) = args.graph.links(args.inter_ratio);
    let mut rows: Vec<Row> = Vec::new();
    let mut modes: Vec<(String, ParallelOptions)> = std::iter::once((Mode::Fb, None))
        .chain((1..=args.graph.layers).map(|k| (Mode::Flx, Some(k))))
        .map(|(mode, k)| {
            let name = match k {
                None => "FB_base".to_string(),
                Some(k) => format!("FLX k={k}"),
            };
            (
                name,
                ParallelOptions {
                    job: JobSpec {
                        mode,
                        preload_hops: k.map(|k| k as u32),
                        ..JobSpec::default()
                    },
                    ..Default::default()
                },
            )
        })
        .collect();
    if !args.no_sampled {
        let eas = Sampling::Eas {
            hops: args.eas_hops as u32,
            fanout: args.eas_fanout as u32,
            priority: Priority::Degree,
        };
        let fanouts: Vec<u32> = match &args.fanouts {
            Some(f) => f
                .split(',')
                .map(|x| x.trim().parse::<u32>())
                .collect::<Result<_, _>>()
                .with_context(|| format!("--fanouts {f}: expected integers like 25,10,5"))?,
            None => (0..args.graph.layers as u32)
                .map(|i| [25, 10].get(i as usize).copied().unwrap_or(5))
                .collect(),
        };
        let cob = |sampling| ParallelOptions {
            job: JobSpec {
                mode: Mode::Cob,
                batch_size: Some(args.cobatch_size as u32),
                sampling,
                ..JobSpec::default()
            },
            ..Default::default()
        };
        modes.push((
            "FLX-EAS".into(),
            ParallelOptions {
                job: JobSpec {
                    mode: Mode::Flx,
                    preload_hops: Some(args.graph.layers as u32),
                    sampling: eas.clone(),
                    ..JobSpec::default()
                },
                ..Default::default()
            },
        ));
        modes.push((
            "CoB-SAGE".into(),
            cob(Sampling::Fanout {
                fanouts,
                relation_fanouts: Default::default(),
            }),
        ));
        modes.push(("CoB-EAS".into(), cob(eas)));
    }
    for (name, popts) in modes {
        let popts = ParallelOptions {
            machine: Machine {
                intra,
                inter,
                threads_per_rank: Some(args.graph.threads_per_rank),
                ..popts.machine
            },
            ..popts
        };
        eprintln!("running {name} ...");
        let report =
            grandis_parallel::train(view, &part, config.clone(), &opts, &popts, &mut |s| {
                eprintln!("  epoch {} loss {:.4} {:.3}s", s.epoch, s.loss, s.seconds)
            })
            .with_context(|| format!("running {name}"))?;
        rows.push(Row { name, report });
    }

    let base = rows[0].report.execution.time_split.epoch_s;
    let epoch_of = |name: &str| {
        rows.iter()
            .find(|r| r.name == name)
            .map(|r| r.report.execution.time_split.epoch_s)
    };
    let flx_full = format!("FLX k={}", args.graph.layers);
    // Sampled rows are also compared with their exact / GraphSAGE counterpart.
    let versus = |name: &str| -> Option<(&'static str, f64)> {
        match name {
            "FLX-EAS" => epoch_of(&flx_full).map(|t| ("FLX k=L", t)),
            "CoB-EAS" => epoch_of("CoB-SAGE").map(|t| ("CoB-SAGE", t)),
            _ => None,
        }
    };
    println!(
        "{:<10} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8} {:>14} {:>14} {:>14} {:>12} {:>11} {:>12} \
         {:>8} {:>18}",
        "mode",
        "epoch_s",
        "compute",
        "intra",
        "inter",
        "fetch",
        "allred",
        "inter_B/ep",
        "intra_B/ep",
        "fetch_B/ep",
        "fetch_setup",
        "replicated",
        "vertex-layers",
        "vs FB",
        "vs counterpart"
    );
    for r in &rows {
        let t = &r.report.execution.time_split;
        let vs = versus(&r.name)
            .map(|(n, b)| format!("{:.2}x vs {n}", b / t.epoch_s))
            .unwrap_or_default();
        println!(
            "{:<10} {:>8.3} {:>8.3} {:>8.3} {:>8.3} {:>8.3} {:>8.3} {:>14} {:>14} {:>14} {:>12} \
             {:>11} {:>12} {:>7.2}x {:>18}",
            r.name,
            t.epoch_s,
            t.compute_s,
            t.intra_comm_s,
            t.inter_comm_s,
            t.fetch_s,
            t.all_reduce_s,
            r.report.execution.halo_bytes_per_epoch.inter_server,
            r.report.execution.halo_bytes_per_epoch.intra_server,
            r.report.execution.fetch_bytes_per_epoch.inter_server,
            r.report.execution.setup_fetch_bytes.inter_server,
            r.report.execution.replicated_vertices,
            r.report.execution.computed_vertex_layers,
            base / t.epoch_s,
            vs
        );
    }

    // The paper's model on our measured rates. Widths are equal (features = hidden), so a
    // vertex row is `hidden * 4` bytes in every exchange; the inter-server NIC is shared by
    // the G devices of a server, so per device B_inter is the NIC bandwidth / G.
    let (ns, ng) = (args.graph.servers as f64, args.graph.devices as f64);
    let v = stats.num_vertices as f64;
    let e = stats.num_edges as f64;
    let d = e / v;
    let l = args.graph.layers as f64;
    let row_bytes = (args.graph.hidden * 4) as f64;
    let fb = &rows[0].report;
    // C: vertex-layers per second of one device, from FB_base's compute time (each device
    // computes V / (Ns Ng) rows per layer, forward and backward).
    let c = v * l / (ns * ng) / fb.execution.time_split.compute_s;
    let b_intra = args.graph.intra_bandwidth / row_bytes;
    let b_inter = inter_bw / ng / row_bytes;
    let t_prev = v * l / (ns * ng * c)
        + e / (ns * ng) * ((ng - 1.0) / (ng * ns) / b_intra + (1.0 - 1.0 / ns) / b_inter);
    // D^alpha L: how much bigger the preloaded (k = L) graph is than the plain one.
    let full = rows
        .iter()
        .find(|r| r.name == flx_full)
        .map(|r| &r.report)
        .context("at least one FLX run")?;
    let growth = (v + full.execution.replicated_vertices as f64) / v;
    let t_pre =
        growth * v * l / (ns * ng * c) + growth * e / (ns * ng) * ((ng - 1.0) / ng / b_intra);
    let lhs = c / b_inter;
    let rhs = (growth - 1.0) / d;
    println!(
        "model: C = {c:.0} vertex-layers/s/device, B_intra = {b_intra:.0} rows/s, B_inter = \
         {b_inter:.0} rows/s/device, D = {d:.1}, D^a L ~ {growth:.2}"
    );
    println!(
        "model: T_prev (Eq. 1) = {t_prev:.2}s, T_preload (Eq. 2, k = L) = {t_pre:.2}s, \
         predicted speedup {:.2}x; Eq. 5: C/B_inter = {lhs:.2} vs (D^a L - 1)/D = {rhs:.2} \
         -> preloading {} pay off",
        t_prev / t_pre,
        if lhs > rhs { "should" } else { "should not" }
    );
    if args.json {
        let json = serde_json::json!({
            "bench": "modes",
            "graph": stats,
            "servers": args.graph.servers,
            "devices": args.graph.devices,
            "layers": args.graph.layers,
            "features": args.graph.features,
            "hidden": args.graph.hidden,
            "intra_bandwidth": args.graph.intra_bandwidth,
            "inter_bandwidth": inter_bw,
            "threads_per_rank": args.graph.threads_per_rank,
            "modes": rows.iter().map(|r| serde_json::json!({
                "name": r.name,
                "preload_hops": r.report.execution.preload_hops,
                "time": r.report.execution.time_split,
                "halo_bytes_per_epoch": r.report.execution.halo_bytes_per_epoch,
                "all_reduce_bytes_per_epoch": r.report.execution.all_reduce_bytes_per_epoch,
                "fetch_bytes_per_epoch": r.report.execution.fetch_bytes_per_epoch,
                "setup_fetch_bytes": r.report.execution.setup_fetch_bytes,
                "replicated_vertices": r.report.execution.replicated_vertices,
                "memory": r.report.execution.memory,
                "speedup_vs_fb": base / r.report.execution.time_split.epoch_s,
                "speedup_vs_counterpart": versus(&r.name).map(|(n, b)| serde_json::json!({
                    "counterpart": n,
                    "speedup": b / r.report.execution.time_split.epoch_s,
                })),
                "sampling": r.report.execution.sampling,
                "iterations_per_epoch": r.report.execution.iterations_per_epoch,
                "sampled_edges": r.report.execution.sampled_edges,
                "computed_vertices_per_layer": r.report.execution.computed_vertices_per_layer,
                "beta": r.report.execution.beta,
                "losses": r.report.train.epochs.iter().map(|s| s.loss).collect::<Vec<_>>(),
            })).collect::<Vec<_>>(),
            "model": {
                "C_vertex_layers_per_s": c,
                "B_intra_rows_per_s": b_intra,
                "B_inter_rows_per_s_per_device": b_inter,
                "D": d,
                "D_alpha_L": growth,
                "T_prev_s": t_prev,
                "T_preload_s": t_pre,
                "eq5_lhs": lhs,
                "eq5_rhs": rhs,
            },
        });
        println!("{json}");
    }
    Ok(())
}
