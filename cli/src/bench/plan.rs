//! `grandis bench plan`: the performance model against measurement. On one synthetic graph,
//! S servers x G devices as threads over emulated links (inter-server bandwidth a fraction of
//! the intra-server one, several fractions), every candidate of the planner is predicted
//! (`grandis_parallel::planner`, compute calibrated here, links as emulated) and then run;
//! the table gives predicted and measured epoch seconds and their ratio, and per link setting
//! whether the plan the planner chooses is within 10 % of the best measured one by the
//! planner's own rule (a sampled plan only when `--exact-preference` times faster).

use anyhow::Context;
use grandis_parallel::auto::{plan_rates, Placement};
use grandis_parallel::planner::{candidates, choose, plan, rule, rule_cost, Counting};
use grandis_parallel::{Compute, Machine, ParallelOptions, Sampling};
use grandis_trainer::TrainOptions;
use grandis_wire::{LinkRate, PlanRates, ServerRates};
use std::time::Duration;

#[derive(clap::Args)]
pub struct BenchPlanArgs {
    #[command(flatten)]
    pub graph: super::graph::BenchGraphArgs,
    /// Inter-server bandwidth per server NIC = intra-bandwidth / each of these.
    #[arg(long, value_delimiter = ',', default_value = "4,8,32")]
    pub inter_ratios: Vec<f64>,
    /// Co-batch size per server of the cob candidates (and half, quarter); mb: / devices.
    #[arg(long, default_value_t = 1024)]
    pub cobatch_size: usize,
    /// GraphSAGE fanouts of the cob and mb candidates, one per layer (default 25,10,5 cut
    /// to --layers).
    #[arg(long, value_delimiter = ',')]
    pub fanouts: Option<Vec<u32>>,
    /// Only the candidates whose name starts with one of these (e.g. fb,flx,cob).
    #[arg(long, value_delimiter = ',')]
    pub only: Option<Vec<String>>,
    /// A sampled plan is chosen over the fastest exact one only when predicted this many
    /// times faster.
    #[arg(long, default_value_t = grandis_wire::defaults::EXACT_PREFERENCE)]
    pub exact_preference: f64,
    /// Runs of every candidate (all candidates once, then all again in reverse order, ...); a
    /// candidate's measured epoch is its fastest run's. On a shared machine another process's
    /// load slows some runs by 10-30 %; the fastest of two is what the model predicts: the
    /// machine's own speed.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    pub runs: u32,
    /// Print one JSON object as the last stdout line.
    #[arg(long)]
    pub json: bool,
}

pub fn run(args: BenchPlanArgs) -> anyhow::Result<()> {
    let super::graph::BenchGraph {
        dataset: ds,
        part,
        config,
        ..
    } = args.graph.build("bench-plan")?;
    let view = ds.view();
    let opts: TrainOptions = serde_json::from_value(serde_json::json!({
        "epochs": args.graph.epochs.unwrap_or(3).max(2), "lr": 0.01, "weight_decay": 5e-4, "adamw": false,
        "grad_clip": null, "eval": "never", "seed": args.graph.seed,
    }))?;
    let measured = ServerRates {
        device: Compute::Cpu.name(),
        compute: grandis_parallel::measure::compute_rate(
            &grandis_engine::CpuBackend::new(Some(args.graph.threads_per_rank))?,
            args.graph.hidden,
        )?,
        // Each ratio's links are the emulated ones, set below.
        intra: None,
        inter: None,
        seconds: 0.0,
        memory_copy_bytes_per_s: 0.0,
    };
    // Every rank and the plan builders share this machine's cores.
    let placement = Placement {
        compute: Compute::Cpu,
        threads_per_rank: args.graph.threads_per_rank,
        ranks_per_machine: args.graph.servers * args.graph.devices,
        one_machine: true,
    };
    let calibrated = plan_rates(view, &config, &[measured], &placement)?;
    eprintln!(
        "compute: {:.2} GFLOP/s dense, {:.2} G edge-columns/s aggregation, a training step \
         {:.2}x what those account for (its dense products {:.2}x, its aggregation {:.2}x)",
        calibrated.compute.gemm_flops_per_s / 1e9,
        calibrated.compute.aggregation_edge_cols_per_s / 1e9,
        calibrated.calibration,
        calibrated.kernel_factors().dense,
        calibrated.kernel_factors().aggregation
    );
    let ctx = grandis_parallel::plan_context(&view, &part)?;
    let fanouts = args.fanouts.clone().unwrap_or_else(|| {
        (0..args.graph.layers)
            .map(|i| [25, 10].get(i).copied().unwrap_or(5))
            .collect()
    });
    let mut cands = candidates(
        args.graph.layers,
        args.cobatch_size,
        args.graph.devices,
        &Sampling::Fanout {
            fanouts,
            relation_fanouts: Default::default(),
        },
    );
    if let Some(only) = &args.only {
        cands.retain(|c| only.iter().any(|o| c.name().starts_with(o.as_str())));
    }
    let mut rows = Vec::new();
    for &ratio in &args.inter_ratios {
        let inter_bw = args.graph.intra_bandwidth / ratio;
        let latency = Duration::from_secs_f64(args.graph.inter_latency_ms / 1e3);
        let rates = PlanRates {
            intra: LinkRate {
                bandwidth_bytes_per_s: args.graph.intra_bandwidth,
                latency_s: 0.0,
            },
            inter: LinkRate {
                bandwidth_bytes_per_s: inter_bw,
                latency_s: latency.as_secs_f64(),
            },
            ..calibrated
        };
        let (intra, inter) = args.graph.links(ratio);
        let base = ParallelOptions {
            machine: Machine {
                threads_per_rank: Some(args.graph.threads_per_rank),
                intra,
                inter,
                ..Machine::default()
            },
            ..Default::default()
        };
        let planned = plan(
            view,
            &part,
            &ctx,
            &config,
            args.graph.seed,
            &base,
            &cands,
            &rates,
            Counting::Every,
        )?;
        let chosen = choose(&planned, args.exact_preference);
        // Every run's time split, per candidate (none for one that does not fit).
        let mut runs: Vec<Vec<grandis_wire::TimeSplit>> = vec![Vec::new(); planned.len()];
        // Every run's epoch seconds after the first (rank 0's), per candidate.
        let mut epochs: Vec<Vec<Vec<f64>>> = vec![Vec::new(); planned.len()];
        for run in 0..args.runs {
            // Every other round in reverse: a run can inherit what the one before it left (a
            // 200k graph's flx-eas h=1 f=5 measured 0.87-0.91 s run first, 0.99-1.24 s right
            // after flx k=3), so no candidate always follows the same one.
            let order: Vec<usize> = match run % 2 {
                0 => (0..planned.len()).collect(),
                _ => (0..planned.len()).rev().collect(),
            };
            for i in order {
                let p = &planned[i];
                if !p.fits || p.prediction.is_none() {
                    continue;
                }
                eprintln!("inter 1/{ratio}: running {} (run {}) ...", p.name, run + 1);
                let r = grandis_parallel::train(
                    view,
                    &part,
                    config.clone(),
                    &opts,
                    &p.candidate.options(&base),
                    &mut |_| {},
                )
                .with_context(|| format!("running {}", p.name))?;
                runs[i].push(r.execution.time_split);
                epochs[i].push(r.train.epochs.iter().skip(1).map(|e| e.seconds).collect());
            }
        }
        let mut measured = Vec::new();
        for ((p, runs), epochs) in planned.iter().zip(&runs).zip(&epochs) {
            let (Some(pred), Some(m)) = (
                p.prediction.as_ref(),
                runs.iter().min_by(|a, b| a.epoch_s.total_cmp(&b.epoch_s)),
            ) else {
                measured.push(None);
                continue;
            };
            let t = m.epoch_s;
            println!(
                "inter 1/{ratio:<4} {:<20} predicted {:>8.3}s  measured {:>8.3}s  ratio {:>5.2}  \
                 (compute {:.3}/{:.3}, inter {:.3}/{:.3}, intra {:.3}/{:.3}, fetch {:.3}/{:.3}, \
                 all-reduce {:.3}/{:.3})",
                p.name,
                pred.epoch_s,
                t,
                pred.epoch_s / t,
                pred.compute_s,
                m.compute_s,
                pred.inter_s,
                m.inter_comm_s,
                pred.intra_s,
                m.intra_comm_s,
                pred.fetch_s,
                m.fetch_s,
                pred.all_reduce_s,
                m.all_reduce_s
            );
            measured.push(Some(t));
            let every: Vec<f64> = runs.iter().map(|r| r.epoch_s).collect();
            rows.push(serde_json::json!({
                "inter_ratio": ratio, "candidate": p.name, "predicted_s": pred.epoch_s,
                "measured_s": t, "prediction": pred, "measured": m, "runs_s": every,
                "epochs_s": epochs,
            }));
        }
        // The best measured plan by the planner's own rule (a sampled plan only when that
        // many times faster than the fastest exact one), and the fastest of all.
        let measured_rule = rule(&planned, args.exact_preference, |i| measured[i]);
        let fastest = rule(&planned, 1.0, |i| measured[i]);
        if let (Some((c, why)), Some(b), Some(f)) = (&chosen, measured_rule.chosen, fastest.chosen)
        {
            let (chosen_t, best_t) = (
                measured[*c].unwrap_or(f64::NAN),
                measured[b].unwrap_or(f64::NAN),
            );
            // How far apart a candidate's runs measured: two plans closer than that are a
            // tie the runs cannot order.
            let spread = |runs: &[grandis_wire::TimeSplit]| {
                let (lo, hi) = runs.iter().fold((f64::INFINITY, 0f64), |(lo, hi), r| {
                    (lo.min(r.epoch_s), hi.max(r.epoch_s))
                });
                format!("{lo:.3}-{hi:.3}s")
            };
            let cost = |i: usize, t: f64| {
                rule_cost(planned[i].candidate.is_exact(), t, args.exact_preference)
            };
            println!(
                "inter 1/{ratio}: chosen {} ({why}): measured {chosen_t:.3}s; by the same rule the \
                 best measured is {} {best_t:.3}s ({:.2}x its epoch, {:.2}x by the rule's cost); \
                 the fastest measured {} {:.3}s; their runs {} and {}",
                planned[*c].name,
                planned[b].name,
                chosen_t / best_t,
                cost(*c, chosen_t) / cost(b, best_t),
                planned[f].name,
                measured[f].unwrap_or(f64::NAN),
                spread(&runs[*c]),
                spread(&runs[b]),
            );
        }
    }
    if args.json {
        println!("{}", serde_json::json!({ "bench": "plan", "rows": rows }));
    }
    Ok(())
}
