//! The performance model and the planner: what a candidate plan (mode, k, sampler, batch
//! size) costs per epoch, predicted from the plan's exact counts and measured rates, before
//! anything trains.
//!
//! **Counts** ([`EpochCounts`]) come from the same code that makes a run's steps (`decide`,
//! `steps::build_step`): per rank and conv layer the rows computed and the edges aggregated,
//! per layer the rows every rank receives from every other (forward halo exchange) and sends
//! back (backward), the replicated features fetched from their home server, the parameters
//! the all-reduce sums, and the memory model's bytes. Per-iteration plans (cob, mb) count the
//! first [`COUNTED_STEPS`] steps of the epoch and scale to its iterations.
//!
//! **Time** ([`predict`]): GraNNDIS Eqs. 1-4 generalised to the plan's own counts. A step is
//! every rank's sequence of layer computes and halo exchanges, run through
//! `timeline`: a rank sends its halo rows when its own layer ends and starts the next
//! layer when its rows are in, and each link (a server's NIC, shared by its devices, between
//! servers; a device's link inside one) carries its messages in the order they were sent. With
//! every rank ending together an exchange lasts as long as its busiest link (Eq. 3's max); a
//! bottleneck link starts on a layer's rows while slower ranks still compute. What the paper's
//! equations leave out and this model adds: the backward pass (twice the forward dense
//! products, the transposed aggregation, the same exchange reversed), the hierarchical
//! all-reduce of every iteration (reduce to the head and back over the intra links, a
//! reduce-scatter and all-gather among heads over the NICs), the fetch of replicated features
//! per step (and once at setup for static plans), and CPU contention when several ranks share
//! one machine's cores, with the host's step building (sampling, plans, the ranks' inputs)
//! when CPU ranks share its cores. Not modelled: evaluation, and overlap inside a rank (the
//! runtime does not compute while its own exchange is in flight).
//!
//! The module in layers, each knowing only those below it: `counts` (what a step of a plan
//! does: rows, edges and bytes per rank and layer), `price` (counts and measured rates to
//! seconds: [`predict`] and the timeline it runs), `calibrate` (the model trained on a sample of
//! the graph against `price`'s kernel seconds); this module makes the candidates, counts them
//! ([`plan`]) and chooses among them ([`rule`], [`choose`]).

mod calibrate;
mod counts;
mod price;

use grandis_masking::ModelDims;
use grandis_models::ModelConfig;
use grandis_wire::{PlanRates, Prediction};
use serde::Serialize;

use crate::fetch::FeatureSource;
use crate::link_task::{LinkSeeds, LinkTask};
use crate::prepare::{BufferPool, HostInput, Preparer};

pub use calibrate::{calibrate, Calibration, CALIBRATION_VERTICES};
pub(crate) use counts::{count_step, TypeLookup};
pub use counts::{layer_work, DecoderWork, EpochCounts, LayerWork, StepCounts, Traffic, TypeRows};
pub use price::{predict, KernelSeconds};

/// Steps of a per-iteration schedule counted for one epoch (the rest are assumed alike).
pub const COUNTED_STEPS: usize = 16;

/// Of the counted steps, those whose ranks' inputs the planner prepares and times.
const INPUT_STEPS: usize = 2;

/// One plan the planner considers: a mode with its knobs.
#[derive(Debug, Clone, PartialEq, Serialize, serde::Deserialize)]
pub struct Candidate {
    pub mode: grandis_wire::Mode,
    pub preload_hops: Option<usize>,
    pub sampling: grandis_wire::Sampling,
    pub batch_size: Option<usize>,
}

impl Candidate {
    /// A short name: `fb`, `flx k=2`, `flx-eas h=1 f=15`, `cob 1024 sage(10,5)`, `mb 256 ...`.
    pub fn name(&self) -> String {
        use grandis_wire::{Mode, Sampling};
        let sampler = |s: &Sampling| match s {
            Sampling::None => "exact".to_string(),
            Sampling::Eas { hops, fanout, .. } => format!("eas h={hops} f={fanout}"),
            Sampling::Fanout { fanouts, .. } => format!(
                "sage({})",
                fanouts
                    .iter()
                    .map(|f| f.to_string())
                    .collect::<Vec<_>>()
                    .join(",")
            ),
            Sampling::Saint { walk_length } => format!("saint(walk {walk_length})"),
        };
        match (self.mode, &self.sampling) {
            (Mode::Flx, Sampling::None) => format!("flx k={}", self.preload_hops.unwrap_or(0)),
            (Mode::Flx, s) => format!("flx-{}", sampler(s)),
            (Mode::Cob | Mode::Mb, s) => format!(
                "{} {} {}",
                self.mode.name(),
                self.batch_size.unwrap_or(0),
                sampler(s)
            ),
            (m, _) => m.name().to_string(),
        }
    }

    /// Whether the candidate trains on the exact graph (no sampling).
    pub fn is_exact(&self) -> bool {
        self.sampling == grandis_wire::Sampling::None
    }

    /// `base` with this candidate's mode and knobs.
    pub fn options(&self, base: &crate::ParallelOptions) -> crate::ParallelOptions {
        let mut options = base.clone();
        options.job.mode = self.mode;
        options.job.preload_hops = self.preload_hops.map(|k| k as u32);
        options.job.sampling = self.sampling.clone();
        options.job.batch_size = self.batch_size.map(|b| b as u32);
        options
    }
}

/// The candidates for a model of `layers` layers: fb; exact flx with k = 1..=layers; flx-eas
/// with k = layers over hops {1, 2} x fanout {5, 15}; cob with the co-batch size `batch` and
/// its half and quarter, each with `sampling` (exact when none); mb with `batch` / devices per
/// device when `sampling` is a sampler mb runs (fanout or eas). `batch` 0: neither cob nor mb.
pub fn candidates(
    layers: usize,
    batch: usize,
    devices: usize,
    sampling: &grandis_wire::Sampling,
) -> Vec<Candidate> {
    use grandis_wire::{Mode, Priority, Sampling};
    let mut out = vec![Candidate {
        mode: Mode::Fb,
        preload_hops: None,
        sampling: Sampling::None,
        batch_size: None,
    }];
    for k in 1..=layers {
        out.push(Candidate {
            mode: Mode::Flx,
            preload_hops: Some(k),
            sampling: Sampling::None,
            batch_size: None,
        });
    }
    for hops in [1, 2] {
        for fanout in [5, 15] {
            out.push(Candidate {
                mode: Mode::Flx,
                preload_hops: Some(layers),
                sampling: Sampling::Eas {
                    hops,
                    fanout,
                    priority: Priority::Degree,
                },
                batch_size: None,
            });
        }
    }
    let cob_sampling = match sampling {
        Sampling::Saint { .. } => Sampling::None,
        s => s.clone(),
    };
    for b in [batch, batch / 2, batch / 4] {
        if b > 0 {
            out.push(Candidate {
                mode: Mode::Cob,
                preload_hops: None,
                sampling: cob_sampling.clone(),
                batch_size: Some(b),
            });
        }
    }
    if batch > 0 && matches!(sampling, Sampling::Fanout { .. } | Sampling::Eas { .. }) {
        out.push(Candidate {
            mode: Mode::Mb,
            preload_hops: None,
            sampling: sampling.clone(),
            batch_size: Some((batch / devices.max(1)).max(1)),
        });
    }
    out
}

/// A candidate with its counts and prediction, or why it cannot run or was not counted.
#[derive(Debug, Clone, Serialize)]
pub struct Planned {
    pub candidate: Candidate,
    pub name: String,
    pub prediction: Option<Prediction>,
    /// Whether the memory model's worst rank fits the budget.
    pub fits: bool,
    pub error: Option<String>,
    /// Why the candidate was not counted ([`Counting::Pruned`]): the floor that rules it out.
    pub pruned: Option<String>,
    /// Seconds spent counting it.
    pub count_seconds: f64,
}

/// Which candidates [`plan`] counts. The static ones (FB and FLX: one plan over the whole
/// graph) are the expensive ones to count, as long as a run's setup; the per-iteration ones
/// (cob, mb) count a few steps.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Counting {
    /// Every candidate.
    Every,
    /// The per-iteration candidates first, then a static one only when its floors (what its
    /// owned rows alone cost, [`StaticFloor`]) leave it able to fit the budget and to be
    /// chosen by [`choose`] with this `exact_preference` over what was counted before it.
    Pruned { exact_preference: f64 },
}

/// Lower bounds on every static plan of a job, from the partition alone: each FB or FLX plan
/// (exact or EAS-sampled) computes at least every rank's own rows at every layer, aggregating
/// at least their in-edges from the rank's server (EAS samples only the inter-server ones;
/// exact plans keep them all), and holds at least those rows in memory.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct StaticFloor {
    /// Predicted seconds of an exact static plan's epoch on the owned rows and all their
    /// in-edges, with nothing exchanged or fetched.
    pub exact_s: f64,
    /// The same with only the in-edges from the rank's own server.
    pub sampled_s: f64,
    /// [`grandis_masking::owned_rows_floor`] of the largest rank.
    pub bytes: u64,
}

/// The [`StaticFloor`] of `ctx`'s partition for a model of `work`, `dims` and `parameters`.
pub fn static_floor(
    ctx: &grandis_masking::PlanContext<'_>,
    dims: &ModelDims,
    work: &[LayerWork],
    parameters: usize,
    rates: &PlanRates,
) -> StaticFloor {
    let layout = ctx.layout();
    let ranks = layout.num_ranks();
    let (mut owned, mut all, mut inner) = (vec![0u64; ranks], vec![0u64; ranks], vec![0u64; ranks]);
    for r in 0..ranks {
        let server = layout.server_range(layout.server_of_rank(r));
        for v in layout.range(r) {
            let sources = ctx.in_neighbors(v);
            owned[r] += 1;
            all[r] += sources.len() as u64;
            inner[r] += sources.iter().filter(|u| server.contains(u)).count() as u64;
        }
    }
    let layers = work.len();
    let epoch_s = |edges: &[u64]| {
        let per_layer = |x: &[u64]| x.iter().map(|&n| vec![n; layers]).collect::<Vec<_>>();
        let counts = EpochCounts {
            iterations: 1,
            steps: vec![StepCounts {
                rows: per_layer(&owned),
                edges: per_layer(edges),
                inputs: per_layer(&owned),
                forward: vec![Traffic::default(); layers],
                backward: vec![Traffic::default(); layers],
                ..StepCounts::default()
            }],
            scale: 1.0,
            parameters,
            ..EpochCounts::default()
        };
        predict(&counts, work, layout, rates).epoch_s
    };
    StaticFloor {
        exact_s: epoch_s(&all),
        sampled_s: epoch_s(&inner),
        bytes: owned
            .iter()
            .map(|&n| grandis_masking::owned_rows_floor(dims, n))
            .max()
            .unwrap_or(0),
    }
}

/// The parameters of `config` (what every iteration's all-reduce sums).
pub fn parameters(config: &ModelConfig) -> anyhow::Result<usize> {
    Ok(config
        .parameter_shapes()
        .map_err(|e| anyhow::anyhow!("invalid model configuration: {e}"))?
        .iter()
        .map(|(_, shape)| shape.iter().product::<usize>())
        .sum())
}

/// Counts and predicts the candidates for `config` on `part` (whose plan context is `ctx`)
/// with `rates` (all of them, or as `counting` prunes); `base` carries the budget
/// (`device_memory`, else what the ranks' devices have) and everything a candidate does not
/// set. The result is in `candidates`' order.
#[allow(clippy::too_many_arguments)]
pub fn plan(
    view: grandis_store::DatasetView<'_>,
    part: &crate::PartitionedGraph,
    ctx: &grandis_masking::PlanContext<'_>,
    config: &ModelConfig,
    seed: u64,
    base: &crate::ParallelOptions,
    candidates: &[Candidate],
    rates: &PlanRates,
    counting: Counting,
) -> anyhow::Result<Vec<Planned>> {
    let link = base.job.task == grandis_wire::Task::Link;
    let objective = grandis_trainer::Objective::for_job(&base.job);
    let embedding_dim = base.job.embedding_dim as usize;
    crate::setup::check_job_inputs(&view, part, config, objective, embedding_dim)?;
    let (flags, totals) = crate::setup::labelled(&view, part)?;
    if totals[0] == 0 && !link {
        anyhow::bail!("the dataset's train split has no labelled vertices");
    }
    let work = layer_work(config, &crate::model_dims(config))?;
    let (budget, _) = crate::budget::budget(base, &part.layout)?;
    let labelled_train = |g: u32| crate::setup::in_train_split(&flags, g);
    let link_task = match (objective, view.links) {
        (grandis_trainer::Objective::Link { negatives, decoder }, Some(split)) => Some((
            LinkTask { split, negatives },
            decoder == grandis_wire::LinkDecoder::Mlp,
        )),
        _ => None,
    };
    // What a run's producers prepare after building a batched step, as a run sets it up.
    let scales = grandis_engine::norm::global_scales(
        part.graph.view(),
        grandis_models::aggregation(config.kind),
    );
    let buffers = BufferPool::default();
    let preparer = Preparer::for_model(
        FeatureSource {
            view,
            new_to_old: &part.new_to_old,
            layout: &part.layout,
        },
        config,
        &scales,
        &flags,
        &buffers,
    );
    let count = |c: &Candidate| -> Planned {
        let mut popts = c.options(base);
        popts.job.device_memory = Some(budget);
        let started = std::time::Instant::now();
        let counted = (|| -> anyhow::Result<EpochCounts> {
            let sampler = crate::setup::dependency_sampler(
                &view,
                part,
                &popts.job.sampling,
                config.layers,
                seed,
            )?;
            // The candidate's own dims: a link job's gathered embeddings depend on the mode.
            let dims = crate::budget::job_dims(config, &popts.job, view.num_vertices());
            // A link job's batches (cob, mb) are seeded by its supervision edges, as a run's.
            let seeds = match (&link_task, c.mode) {
                (Some((task, _)), grandis_wire::Mode::Cob | grandis_wire::Mode::Mb) => {
                    Some(LinkSeeds::new(*task, part, seed, false))
                }
                _ => None,
            };
            let inputs = crate::steps::StepInputs {
                ctx,
                dims: &dims,
                step_part: crate::steps::StepPart::All,
                labelled_train: &labelled_train,
                link: seeds.as_ref(),
            };
            let decision =
                crate::decide::decide(&inputs, config, &popts, sampler.as_deref(), seed)?;
            let (counts, step_pairs) = count_epoch(
                &inputs,
                &decision,
                &work,
                (view.feature_dim, embedding_dim),
                &preparer,
            )?;
            // Link prediction all-reduces the embeddings it gathers and their gradients each
            // step besides the parameters (`link_task`).
            let parameters = parameters(config)? + 2 * dims.link_embedding_values as usize;
            // The decoder: every rank scores its share of a batched step's pairs, or of every
            // supervision edge and its negatives in the exact modes (`link_task`).
            let ranks = part.layout.num_ranks() as f64;
            let decoder = match &link_task {
                Some((task, mlp)) => {
                    let (pairs, rows) = if step_pairs > 0.0 {
                        (
                            step_pairs,
                            (2.0 * step_pairs).min(view.num_vertices() as f64),
                        )
                    } else {
                        let edges = (task.split.train.len() / 2) as f64;
                        (
                            edges * (1 + task.negatives) as f64,
                            view.num_vertices() as f64,
                        )
                    };
                    DecoderWork {
                        pairs_per_rank: pairs / ranks,
                        cols: config.classes,
                        rows,
                        mlp: *mlp,
                    }
                }
                None => DecoderWork::default(),
            };
            Ok(EpochCounts {
                parameters,
                decoder,
                ..counts
            })
        })();
        let count_seconds = started.elapsed().as_secs_f64();
        tracing::info!(candidate = %c.name(), seconds = count_seconds, "counted");
        let (prediction, error) = match counted {
            Ok(counts) => (Some(predict(&counts, &work, &part.layout, rates)), None),
            Err(e) => (None, Some(format!("{e:#}"))),
        };
        Planned {
            candidate: c.clone(),
            name: c.name(),
            fits: prediction.as_ref().is_some_and(|p| p.peak_bytes <= budget),
            prediction,
            error,
            pruned: None,
            count_seconds,
        }
    };
    let is_static =
        |c: &Candidate| matches!(c.mode, grandis_wire::Mode::Fb | grandis_wire::Mode::Flx);
    let exact_preference = match counting {
        Counting::Every => return Ok(candidates.iter().map(count).collect()),
        Counting::Pruned { exact_preference } => exact_preference,
    };
    let floor = candidates
        .iter()
        .any(is_static)
        .then(|| -> anyhow::Result<StaticFloor> {
            // What the static candidates (fb, flx) hold: an exact mode's dims and parameters.
            let exact = grandis_wire::JobSpec {
                mode: grandis_wire::Mode::Fb,
                ..base.job.clone()
            };
            let dims = crate::budget::job_dims(config, &exact, view.num_vertices());
            let parameters = parameters(config)? + 2 * dims.link_embedding_values as usize;
            Ok(static_floor(ctx, &dims, &work, parameters, rates))
        })
        .transpose()?;
    let mut out: Vec<Option<Planned>> = vec![None; candidates.len()];
    let per_iteration_first = (0..candidates.len())
        .filter(|&i| !is_static(&candidates[i]))
        .chain((0..candidates.len()).filter(|&i| is_static(&candidates[i])));
    for i in per_iteration_first {
        let c = &candidates[i];
        let pruned = floor.and_then(|floor| {
            let counted: Vec<&Planned> = out.iter().flatten().collect();
            is_static(c)
                .then(|| ruled_out(c, &floor, budget, &counted, exact_preference))
                .flatten()
        });
        out[i] = Some(match pruned {
            Some(why) => {
                tracing::info!(candidate = %c.name(), %why, "not counted");
                Planned {
                    candidate: c.clone(),
                    name: c.name(),
                    prediction: None,
                    fits: false,
                    error: None,
                    pruned: Some(why),
                    count_seconds: 0.0,
                }
            }
            None => count(c),
        });
    }
    Ok(out.into_iter().flatten().collect())
}

/// Why static candidate `c` cannot be what [`choose`] picks, whatever its counts, given its
/// `floor` and the candidates `counted` so far; None when it might be.
fn ruled_out(
    c: &Candidate,
    floor: &StaticFloor,
    budget: u64,
    counted: &[&Planned],
    exact_preference: f64,
) -> Option<String> {
    if floor.bytes > budget {
        return Some(format!(
            "its ranks' own rows alone need {} bytes, over the {budget}-byte budget",
            floor.bytes
        ));
    }
    let fastest = |exact: bool| {
        counted
            .iter()
            .filter(|p| p.fits && p.candidate.is_exact() == exact)
            .filter_map(|p| p.prediction.as_ref().map(|x| (x.epoch_s, p.name.as_str())))
            .min_by(|a, b| a.0.total_cmp(&b.0))
    };
    let (exact, sampled) = (fastest(true), fastest(false));
    if c.is_exact() {
        let at_least = floor.exact_s;
        if let Some((t, name)) = exact.filter(|&(t, _)| at_least > t) {
            return Some(format!(
                "at least {at_least:.3} s per epoch (its own rows' compute), slower than {name} \
                 ({t:.3} s)"
            ));
        }
        if let Some((t, name)) = sampled.filter(|&(t, _)| at_least > t * exact_preference) {
            return Some(format!(
                "at least {at_least:.3} s per epoch (its own rows' compute), more than \
                 {exact_preference:.2}x the {t:.3} s of {name}"
            ));
        }
    } else {
        let at_least = floor.sampled_s;
        if let Some((t, name)) = sampled.filter(|&(t, _)| at_least > t) {
            return Some(format!(
                "at least {at_least:.3} s per epoch (its own rows' compute), slower than {name} \
                 ({t:.3} s)"
            ));
        }
        if let Some((t, name)) = exact.filter(|&(t, _)| at_least * exact_preference >= t) {
            return Some(format!(
                "at least {at_least:.3} s per epoch (its own rows' compute): not \
                 {exact_preference:.2}x faster than the exact {name} ({t:.3} s)"
            ));
        }
    }
    None
}

/// Counts one epoch of `decision`'s schedule (epoch 0; per-iteration schedules: its first
/// [`COUNTED_STEPS`] steps, scaled), with the mean pairs a link job's batched step scores (0
/// for every other schedule).
fn count_epoch(
    inputs: &crate::steps::StepInputs<'_>,
    decision: &crate::decide::Decision<'_>,
    work: &[LayerWork],
    widths: (usize, usize),
    preparer: &Preparer<'_>,
) -> anyhow::Result<(EpochCounts, f64)> {
    let ctx = inputs.ctx;
    use crate::steps::Schedule;
    let iterations = decision.schedule.iterations();
    let counted = iterations.clamp(1, COUNTED_STEPS);
    let mut counts = EpochCounts {
        iterations,
        scale: iterations as f64 / counted as f64,
        ..EpochCounts::default()
    };
    let mut prev = None;
    let mut pairs = 0;
    for it in 0..counted {
        let t = std::time::Instant::now();
        let built = crate::steps::build_step(inputs, &decision.schedule, 0, it, prev.as_ref())?;
        if matches!(
            decision.schedule,
            Schedule::Cob { .. } | Schedule::Mb { .. } | Schedule::Cluster { .. }
        ) {
            counts.build_seconds += t.elapsed().as_secs_f64() * counts.scale;
            // A run's producers then prepare every rank's input of the step (its graphs and
            // its feature rows, `crate::feed::Fetch`): host work too, timed on the first
            // steps (reading every counted step's rows would make planning slow).
            if it < INPUT_STEPS {
                let t = std::time::Instant::now();
                for rank in 0..ctx.layout().num_ranks() {
                    HostInput::prepare(preparer, &built.1.plans, rank)?;
                }
                counts.build_seconds +=
                    t.elapsed().as_secs_f64() * iterations as f64 / counted.min(INPUT_STEPS) as f64;
            }
        }
        let types = preparer.features.view.types.map(|types| TypeLookup {
            types,
            new_to_old: preparer.features.new_to_old,
        });
        let mut step = count_step(&built.1, ctx.layout(), work, widths, types);
        crate::steps::raise_peaks(&mut counts.model_bytes, &built.2.model_bytes);
        let fetch = std::mem::take(&mut step.fetch);
        step.fetch = match &decision.schedule {
            // One plan for the whole run: its features are fetched once, before training.
            Schedule::Static { .. } => {
                counts.setup_fetch = fetch;
                Traffic::default()
            }
            // Sampled FLX fetches when it draws a sample: once, or every `every` epochs.
            Schedule::FlxSampled { every, .. } => match every {
                Some(n) if *n > 0 => fetch.scaled(1.0 / *n as f64),
                _ => {
                    counts.setup_fetch = fetch;
                    Traffic::default()
                }
            },
            Schedule::Cob { .. } | Schedule::Mb { .. } | Schedule::Cluster { .. } => fetch,
        };
        counts.steps.push(step);
        pairs += built.1.link.pairs();
        prev = Some(built);
    }
    Ok((counts, pairs as f64 / counted as f64))
}

/// The planner's rule over any epoch times of `planned` (`time(i)`, None for a candidate
/// without one): the fastest exact candidate, the fastest sampled one, and which of the two
/// the rule takes — the sampled one only when `exact_preference` times faster (sampling
/// changes what is learned; exact plans reproduce full-batch training). [`choose`] applies it
/// to the predictions; `grandis bench plan` to the measured epochs, to check the choice.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ruled {
    pub exact: Option<usize>,
    pub sampled: Option<usize>,
    pub chosen: Option<usize>,
}

pub fn rule(
    planned: &[Planned],
    exact_preference: f64,
    time: impl Fn(usize) -> Option<f64>,
) -> Ruled {
    let fastest = |exact: bool| {
        (0..planned.len())
            .filter(|&i| planned[i].candidate.is_exact() == exact)
            .filter_map(|i| time(i).map(|t| (i, t)))
            .min_by(|a, b| a.1.total_cmp(&b.1))
    };
    let (exact, sampled) = (fastest(true), fastest(false));
    // The candidate of the least [`rule_cost`] (the exact one on a tie).
    let chosen = match (exact, sampled) {
        (Some((_, e)), Some((s, st)))
            if rule_cost(false, st, exact_preference) < rule_cost(true, e, exact_preference) =>
        {
            Some(s)
        }
        (Some((e, _)), _) => Some(e),
        (None, s) => s.map(|(s, _)| s),
    };
    Ruled {
        exact: exact.map(|(i, _)| i),
        sampled: sampled.map(|(i, _)| i),
        chosen,
    }
}

/// What [`rule`] minimises: an exact plan's epoch, a sampled plan's epoch `exact_preference`
/// times over. The measure of a choice: a chosen plan 1.01x the best one's cost lost 1 % by
/// the rule's own account, where comparing epochs would call an exact choice 1.21x slower
/// than a sampled plan 1.21x faster (by 1.2x wanted) and 1.00x at 1.19x.
pub fn rule_cost(exact: bool, epoch_s: f64, exact_preference: f64) -> f64 {
    if exact {
        epoch_s
    } else {
        epoch_s * exact_preference
    }
}

/// The plan to run: [`rule`] over the predictions of the candidates that fit their budget.
/// Returns its index in `planned` and why; None when nothing fits.
pub fn choose(planned: &[Planned], exact_preference: f64) -> Option<(usize, String)> {
    let predicted = |i: usize| {
        let p: &Planned = &planned[i];
        p.prediction.as_ref().filter(|_| p.fits).map(|x| x.epoch_s)
    };
    let time = |i: usize| predicted(i).unwrap_or(f64::INFINITY);
    let ruled = rule(planned, exact_preference, predicted);
    let chosen = ruled.chosen?;
    let why = match (ruled.exact, ruled.sampled) {
        (Some(e), Some(s)) if chosen == s => format!(
            "{} is predicted {:.2}x faster than the fastest exact plan ({}), more than the \
             {exact_preference:.2}x a sampled plan must win by",
            planned[s].name,
            time(e) / time(s),
            planned[e].name
        ),
        (Some(_), Some(s)) => format!(
            "the fastest exact plan; the fastest sampled one ({}) is not {exact_preference:.2}x faster",
            planned[s].name
        ),
        (Some(_), None) => "the fastest plan that fits".into(),
        (None, _) => {
            if planned
                .iter()
                .any(|p| p.candidate.is_exact() && p.pruned.is_some())
            {
                format!(
                    "the fastest plan that fits; the exact plans are ruled out by their floors \
                     (more than {exact_preference:.2}x slower than this one, or over the budget)"
                )
            } else {
                "no exact plan fits the budget".into()
            }
        }
    };
    Some((chosen, why))
}
