//! The FB plan (every device owns its range, exchanges with every peer), the FLX plan with k
//! preloaded hops (each server replicates its k-hop in-neighbourhood, exchanges stay inside the
//! server, layers are masked), and the combined [`PreloadPlan`] that switches ("reshapes")
//! from FLX to FB after layer k - 1.

use std::sync::atomic::{AtomicU64, Ordering};

use rayon::prelude::*;

use crate::context::PlanContext;
use crate::error::{MaskingError, Result};
use crate::extract::{Edges, ExtractionSpec, RowSource, SampledEdges};
use crate::idmap::IdMap;
use crate::plan::{build_device, fill_sends, DevicePlan, DeviceSpec};

/// The FB plan (PipeGCN without pipeline): `devices[r]` is rank r's plan; halos come from any
/// peer, intra- and inter-server; no masks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FbPlan {
    pub devices: Vec<DevicePlan>,
}

/// What one server's head extracted for a masked (FLX or co-batch) plan.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct ServerExtraction {
    pub server: usize,
    /// `level_sizes[d]` vertices at level d (in-hop distance d from the targets over the kept
    /// edges, `d = 0..=k`).
    pub level_sizes: Vec<usize>,
    /// Targets (`level_sizes[0]`): the whole range for FLX, the co-batch for CoB.
    pub inner: usize,
    /// Extracted vertices owned by other servers in the layout (for FLX: levels 1..=k).
    pub replicated: usize,
    /// Extracted non-target vertices (levels 1..=k), this server's own included.
    pub dependencies: usize,
    /// Edges of the server's one-hop graphs (kept in-edges of complete rows).
    pub kept_edges: usize,
    /// Whether the spec was sampled (else exact).
    pub sampled: bool,
    /// Owned rows per device of this server after placement.
    pub owned_per_device: Vec<usize>,
}

/// The FLX plan with `k` preloaded hops: `devices[r]` is rank r's plan for layers `0..k`,
/// with `k` masks each; halos come only from devices of the same server.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FlxPlan {
    pub k: usize,
    pub servers: Vec<ServerExtraction>,
    pub devices: Vec<DevicePlan>,
}

impl FlxPlan {
    /// The vertices server `server` extracted (sorted): the union of its devices' owned rows.
    pub fn extracted(&self, server: usize) -> Vec<u32> {
        let mut all: Vec<u32> = self
            .devices
            .iter()
            .filter(|d| d.server == server)
            .flat_map(|d| d.global_ids[..d.n_owned].iter().copied())
            .collect();
        all.sort_unstable();
        all
    }
}

/// Flexible preloading for an `layers`-layer model: layers `0..k` run on `flx` (masked,
/// intra-server exchanges only), layers `k..layers` on `fb` (the reshaped, smaller graph).
/// `k = 0` is plain FB (`flx` is None); `k = layers` never uses `fb` for training, though it
/// is kept (it is cheap next to the FLX plan and the memory model counts it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PreloadPlan {
    pub k: usize,
    pub layers: usize,
    pub fb: FbPlan,
    pub flx: Option<FlxPlan>,
}

impl PreloadPlan {
    /// All devices' plans used at `layer`, indexed by rank.
    pub fn layer_plans(&self, layer: usize) -> &[DevicePlan] {
        match &self.flx {
            Some(f) if layer < self.k => &f.devices,
            _ => &self.fb.devices,
        }
    }
    /// Rank `rank`'s plan used at `layer`.
    pub fn device_plan(&self, layer: usize, rank: usize) -> &DevicePlan {
        &self.layer_plans(layer)[rank]
    }
    /// The first layer that runs on the FB plan after the FLX layers, if there is a switch.
    pub fn reshape_layer(&self) -> Option<usize> {
        (self.k > 0 && self.k < self.layers).then_some(self.k)
    }
    /// For rank `rank`: the FB-plan owned row of each of its FLX-plan inner rows (`0..n_inner`).
    /// By construction this is the identity; the trainer can rely on it (see
    /// [`PreloadPlan::reshape_is_identity_prefix`]). Empty when there is no FLX plan.
    pub fn reshape_map(&self, rank: usize) -> Vec<u32> {
        let Some(flx) = &self.flx else {
            return Vec::new();
        };
        let src = &flx.devices[rank];
        let dst = &self.fb.devices[rank];
        src.global_ids[..src.n_inner]
            .iter()
            .map(|&g| dst.local_of(g).unwrap_or(u32::MAX))
            .collect()
    }
    /// Whether every rank's reshape map is `0..n_inner` and covers the FB owned block exactly.
    pub fn reshape_is_identity_prefix(&self) -> bool {
        let Some(flx) = &self.flx else {
            return true;
        };
        (0..self.fb.devices.len()).all(|r| {
            let map = self.reshape_map(r);
            map.len() == self.fb.devices[r].n_owned
                && flx.devices[r].n_inner == self.fb.devices[r].n_owned
                && map.iter().enumerate().all(|(i, &m)| m == i as u32)
        })
    }
}

/// The vertices one server's extraction reached (by key, see `RowSource`), numbered in
/// discovery order: a vertex's level and, once placed, its device within the server.
struct Reached {
    /// Key -> discovery index; None while every key so far was discovered in key order
    /// (key i is the i-th: a sample numbered level by level, as the layer-wise sampler
    /// numbers it), where the map would be the identity and is not built.
    index: Option<IdMap>,
    /// The map's size and key span, for when it is built.
    expected: usize,
    span: usize,
    level: Vec<u8>,
    device: Vec<u16>,
}

impl Reached {
    /// For an extraction of about `expected` vertices, keys below `n`.
    fn new(expected: usize, n: usize) -> Reached {
        Reached {
            index: None,
            expected,
            span: n,
            level: Vec::with_capacity(expected.min(n)),
            device: Vec::with_capacity(expected.min(n)),
        }
    }
    fn len(&self) -> usize {
        self.level.len()
    }
    /// Records `v` at `level` unless already reached; whether it was new.
    fn insert_new(&mut self, v: u32, level: u8) -> bool {
        let next = self.level.len() as u32;
        let new = match &mut self.index {
            None if v == next => true,
            None if v < next => false,
            None => {
                // The first key out of order: the identity ends here.
                let mut index = IdMap::for_size(self.expected, self.span);
                for k in 0..next {
                    index.insert_new(k, k);
                }
                index.insert_new(v, next);
                self.index = Some(index);
                true
            }
            Some(index) => index.insert_new(v, next),
        };
        if new {
            self.level.push(level);
            self.device.push(u16::MAX);
        }
        new
    }
    fn index(&self, v: u32) -> Option<usize> {
        match &self.index {
            None => ((v as usize) < self.level.len()).then_some(v as usize),
            Some(index) => index.get(v).map(|i| i as usize),
        }
    }
    fn set_device(&mut self, v: u32, device: u16) {
        let i = self.index(v).expect("placing a reached vertex");
        self.device[i] = device;
    }
    /// Device of a reached vertex (`u16::MAX` before placement, or for a vertex not reached).
    fn device(&self, v: u32) -> u16 {
        self.index(v).map_or(u16::MAX, |i| self.device[i])
    }
}

const ABSENT: u8 = u8::MAX;

/// Level `d` of a sample that declares its levels ([`SampledEdges::with_levels`]): its keys,
/// checked to fit a `k`-hop extraction whose targets have the keys `targets` (they must lead
/// the sample, in order, as level 0; levels `0..=k`).
fn declared_level(starts: &[usize], d: usize, k: usize, targets: &[u32]) -> Result<Vec<u32>> {
    let leading = targets.iter().enumerate().all(|(i, &t)| t == i as u32);
    if starts.len() != k + 2 || starts[1] != targets.len() || !leading {
        return Err(MaskingError::Spec(format!(
            "sample levels {starts:?} do not fit {} targets over {k} hops (the targets must \
             lead the sample, in order)",
            targets.len()
        )));
    }
    Ok((starts[d] as u32..starts[d + 1] as u32).collect())
}

/// The keys first reached in hop `d` of a `k`-hop extraction over a sample's kept rows, in
/// key order: the frontier's rows scanned on the thread pool, every source not reached yet
/// marked in a bitmap over the sample's keys (no list of the hop's sources to sort).
fn scan_sampled_hop(
    sample: &SampledEdges,
    reached: &Reached,
    levels: &[Vec<u32>],
    d: usize,
    k: usize,
) -> Vec<u32> {
    let per_layer = sample.is_per_layer();
    let layer = k - d;
    let frontier: Vec<u32> = if per_layer {
        levels.iter().flatten().copied().collect()
    } else {
        levels[d - 1].clone()
    };
    let marks: Vec<AtomicU64> = (0..sample.vertices().len().div_ceil(64))
        .map(|_| AtomicU64::new(0))
        .collect();
    frontier.par_chunks(4096).for_each(|chunk| {
        for &v in chunk {
            let (base, srcs) = sample.row_at(v);
            for (j, &u) in srcs.iter().enumerate() {
                if (!per_layer || sample.used_at(base + j, layer)) && reached.index(u).is_none() {
                    marks[u as usize / 64].fetch_or(1 << (u % 64), Ordering::Relaxed);
                }
            }
        }
    });
    let mut next = Vec::new();
    for (w, word) in marks.into_iter().enumerate() {
        let mut bits = word.into_inner();
        while bits != 0 {
            next.push((w * 64) as u32 + bits.trailing_zeros());
            bits &= bits - 1;
        }
    }
    next
}

/// Where an extraction puts its targets.
#[derive(Debug, Clone, Copy)]
enum Placement {
    /// Over the server's devices: its own vertices on their layout devices, and with
    /// `foreign` another server's on the least loaded device.
    Server { foreign: bool },
    /// Everything on device `d` (a standalone device plan).
    Device(usize),
}

impl<'a> PlanContext<'a> {
    /// Builds the FB plan.
    pub fn fb_plan(&self) -> Result<FbPlan> {
        let layout = self.layout();
        let mut devices = (0..layout.num_ranks())
            .into_par_iter()
            .map(|rank| {
                let range = layout.range(rank);
                let owned: Vec<u32> = range.collect();
                let n = owned.len();
                build_device(
                    self,
                    &RowSource::Exact(self.graph()),
                    DeviceSpec {
                        rank,
                        server: layout.server_of_rank(rank),
                        device: layout.device_of_rank(rank),
                        n_inner: n,
                        owned,
                        owned_level: vec![0; n],
                        complete_below: 1,
                        masked_layers: 0,
                        sole: false,
                    },
                    |u| Some(layout.owner(u)),
                    |_| 0,
                )
            })
            .collect::<Result<Vec<_>>>()?;
        fill_sends(&mut devices)?;
        tracing::debug!(
            ranks = devices.len(),
            halo_rows = devices.iter().map(|d| d.n_halo()).sum::<usize>(),
            "built FB plan"
        );
        Ok(FbPlan { devices })
    }

    /// Builds the FLX plan with `k >= 1` preloaded hops (one server per rayon task, as the
    /// paper's head group does it per server): [`PlanContext::extract_plan`] with every
    /// server's spec = its whole range, exact k-hop closure ([`ExtractionSpec::flx`]).
    ///
    /// Placement rule for replicated vertices (inner vertices stay on their layout device):
    /// levels are placed in order 1, 2, ..., k, vertices of a level in ascending global id.
    /// Before level d, every device's capacity is `ceil(|levels 0..=d| / G)`; a device whose
    /// load has reached it is skipped. Among the others, vertex u goes to the device owning the
    /// most of u's out-neighbours at level d - 1 (exactly the rows that read u when they are
    /// computed), ties broken by smaller load, then smaller device index. Such a device always
    /// exists (pigeonhole). Since level d's placement depends only on levels < d, the plan for
    /// k is the restriction of the plan for k + 1: the rows plans hold grow monotonically in k.
    pub fn flx_plan(&self, k: usize) -> Result<FlxPlan> {
        if k == 0 || k >= ABSENT as usize {
            return Err(MaskingError::InvalidK {
                k,
                reason: format!(
                    "the FLX plan needs 1 <= k <= {} (k = 0 is the FB plan)",
                    ABSENT - 1
                ),
            });
        }
        let layout = self.layout();
        let specs: Vec<ExtractionSpec> = (0..layout.servers())
            .map(|s| ExtractionSpec::flx(layout, s, k))
            .collect();
        self.extract_plan(&specs)
    }

    /// Builds a masked plan from one extraction spec per server (`specs[s].server == s`, all
    /// with the same `hops`, which becomes the plan's `k`): each server's targets stay on
    /// their layout devices as inner rows, its dependencies (levels 1..=hops over the kept
    /// edges) are placed over its devices by the FLX placement rule (counting only readers
    /// that keep the edge), and exchanges stay inside the server. See [`crate::extract`] for
    /// levels and masks on sampled graphs.
    pub fn extract_plan(&self, specs: &[ExtractionSpec]) -> Result<FlxPlan> {
        self.extract_servers(specs, false)
    }

    /// [`Self::extract_plan`] for co-batches seeded by edges (link prediction): a server's
    /// targets are the ends of its supervision pairs, which other servers may own; such a
    /// target is placed on the least loaded of the server's devices (replicated there, a
    /// level-0 row like the server's own, which stay on their layout devices).
    pub fn extract_pairs_plan(&self, specs: &[ExtractionSpec]) -> Result<FlxPlan> {
        self.extract_servers(specs, true)
    }

    fn extract_servers(&self, specs: &[ExtractionSpec], foreign: bool) -> Result<FlxPlan> {
        let layout = self.layout();
        if specs.len() != layout.servers() {
            return Err(MaskingError::Spec(format!(
                "{} extraction specs given for {} servers",
                specs.len(),
                layout.servers()
            )));
        }
        let k = specs[0].hops;
        for (s, spec) in specs.iter().enumerate() {
            if spec.server != s {
                return Err(MaskingError::Spec(format!(
                    "spec {s} is for server {}; specs must be in server order",
                    spec.server
                )));
            }
            if spec.hops != k {
                return Err(MaskingError::Spec(format!(
                    "server {s} extracts {} hops but server 0 extracts {k}; one plan has one k",
                    spec.hops
                )));
            }
        }
        let per_server = specs
            .par_iter()
            .map(|spec| self.extract_server(spec, Placement::Server { foreign }))
            .collect::<Result<Vec<_>>>()?;
        let mut servers = Vec::with_capacity(per_server.len());
        let mut devices = Vec::with_capacity(layout.num_ranks());
        for (extraction, plans) in per_server {
            servers.push(extraction);
            devices.extend(plans);
        }
        fill_sends(&mut devices)?;
        tracing::debug!(
            k,
            replicated = servers.iter().map(|s| s.replicated).sum::<usize>(),
            halo_rows = devices.iter().map(|d| d.n_halo()).sum::<usize>(),
            "built masked plan"
        );
        Ok(FlxPlan {
            k,
            servers,
            devices,
        })
    }

    /// One device's standalone plan for `spec` (a per-GPU mini-batch, no intra-server
    /// sharing): every extracted vertex is owned by device `device` of `spec.server`, so the
    /// plan has no halo rows and no exchanges. Its rank is that device's rank.
    pub fn extract_device_plan(&self, spec: &ExtractionSpec, device: usize) -> Result<DevicePlan> {
        if device >= self.layout().devices() {
            return Err(MaskingError::Spec(format!(
                "device {device} does not exist (the layout has {} devices per server)",
                self.layout().devices()
            )));
        }
        let (_, mut plans) = self.extract_server(spec, Placement::Device(device))?;
        plans
            .pop()
            .ok_or_else(|| MaskingError::Internal("single-device extraction built no plan".into()))
    }

    /// Builds the plans for a `layers`-layer model with `k` preloaded hops (`0 <= k <= layers`).
    pub fn preload_plan(&self, k: usize, layers: usize) -> Result<PreloadPlan> {
        if layers == 0 || k > layers {
            return Err(MaskingError::InvalidK {
                k,
                reason: format!("k must lie in 0..={layers} for a {layers}-layer model"),
            });
        }
        let fb = self.fb_plan()?;
        let flx = if k == 0 {
            None
        } else {
            Some(self.flx_plan(k)?)
        };
        Ok(PreloadPlan { k, layers, fb, flx })
    }

    /// `placed`: the targets stay on their layout devices (a server's masked plan), so each
    /// must be `spec.server`'s; otherwise (a standalone device plan, which owns whatever it
    /// reads, or co-batches seeded by edges) they may be any vertices.
    fn validate_spec(&self, spec: &ExtractionSpec, placed: bool) -> Result<()> {
        let layout = self.layout();
        let s = spec.server;
        if s >= layout.servers() {
            return Err(MaskingError::Spec(format!(
                "server {s} does not exist (the layout has {})",
                layout.servers()
            )));
        }
        if spec.hops == 0 || spec.hops >= ABSENT as usize {
            return Err(MaskingError::InvalidK {
                k: spec.hops,
                reason: format!("an extraction needs 1 <= hops <= {}", ABSENT - 1),
            });
        }
        let range = layout.server_range(s);
        if let Some(w) = spec.targets.windows(2).find(|w| w[0] >= w[1]) {
            return Err(MaskingError::Spec(format!(
                "server {s}: targets must be sorted and distinct ({} then {})",
                w[0], w[1]
            )));
        }
        let n = self.num_vertices();
        if placed {
            if let Some(&t) = spec.targets.iter().find(|t| !range.contains(t)) {
                return Err(MaskingError::Spec(format!(
                    "server {s}: target {t} is not one of its vertices ({}..{})",
                    range.start, range.end
                )));
            }
        } else if let Some(&t) = spec.targets.iter().find(|&&t| t as usize >= n) {
            return Err(MaskingError::Spec(format!(
                "server {s}: target {t} is not a vertex (the graph has {n})"
            )));
        }
        if let Edges::Sampled(e) = &spec.edges {
            let n = self.num_vertices() as u32;
            if e.is_per_layer() && e.num_layers() != spec.hops {
                return Err(MaskingError::Spec(format!(
                    "server {s}: {} per-layer edge sets for {} hops",
                    e.num_layers(),
                    spec.hops
                )));
            }
            // Ids are checked always (a bad one would index out of range), in one pass over
            // the sample's vertices; that every kept edge is an edge of the graph only in
            // debug builds and tests: samplers draw from the graph's rows by construction, and
            // the check reads every full row again, which costs a step more than the rest of
            // its extraction.
            let out_of_range = e.vertices().iter().any(|&v| v >= n);
            if !out_of_range && !cfg!(debug_assertions) {
                return Ok(());
            }
            let vertices = e.vertices();
            for (v, _, kept) in e.iter_rows() {
                if v >= n {
                    return Err(MaskingError::Spec(format!(
                        "server {s}: sampled row of vertex {v}, the graph has {n} vertices"
                    )));
                }
                let mut kept = kept.iter().map(|&i| vertices[i as usize]);
                if let Some(u) = kept.clone().find(|&u| u >= n) {
                    return Err(MaskingError::Spec(format!(
                        "server {s}: sampled edge {u} -> {v}, the graph has {n} vertices"
                    )));
                }
                let full = self.in_neighbors(v);
                if let Some(u) = kept.find(|u| full.binary_search(u).is_err()) {
                    return Err(MaskingError::Spec(format!(
                        "server {s}: sampled edge {u} -> {v} is not an edge of the graph"
                    )));
                }
            }
            if let Some(&v) = vertices.iter().find(|&&v| v >= n) {
                return Err(MaskingError::Spec(format!(
                    "server {s}: sampled vertex {v}, the graph has {n} vertices"
                )));
            }
        }
        Ok(())
    }

    /// One server's extraction: levels over the kept edges, placement, device plans (without
    /// send lists). `single = Some(g)`: everything on device g (one plan, no halo).
    fn extract_server(
        &self,
        spec: &ExtractionSpec,
        placement: Placement,
    ) -> Result<(ServerExtraction, Vec<DevicePlan>)> {
        let (single, foreign) = match placement {
            Placement::Server { foreign } => (None, foreign),
            Placement::Device(d) => (Some(d), true),
        };
        self.validate_spec(spec, !foreign)?;
        let layout = self.layout();
        let server = spec.server;
        let own = layout.server_range(server);
        let k = spec.hops;
        let rows = match &spec.edges {
            Edges::Exact => RowSource::Exact(self.graph()),
            Edges::Sampled(e) => RowSource::Sampled(e),
        };
        let exact = spec.is_exact();
        let g_count = if single.is_some() {
            1
        } else {
            layout.devices()
        };
        let rank_of = |g: usize| layout.rank(server, single.unwrap_or(g));
        // Vertices are named by their keys (global ids, or a sample's own indices: see
        // `RowSource`), recorded in order of discovery: a step's work is proportional to what
        // it reaches, never to |V| (no vertex-sized array allocated or cleared per step).
        // Sampled batches reach at most their targets and one vertex per kept edge; exact
        // closures and whole-range extractions most of the graph. `IdMap` picks its
        // representation from that size (an array over a sample's keys).
        let expected = match &rows {
            // A server another process builds gets no targets: nothing to size for.
            _ if spec.targets.is_empty() => 0,
            RowSource::Exact(_) => self.num_vertices(),
            // At most the targets and one vertex per kept edge.
            RowSource::Sampled(e) => spec.targets.len().saturating_add(e.num_edges()),
        };
        let mut reached = Reached::new(expected, rows.key_span());
        let mut loads = vec![0usize; g_count];
        let targets = rows.target_keys(&spec.targets)?;
        for (&v, &t) in targets.iter().zip(&spec.targets) {
            let g = if single.is_some() {
                0
            } else if own.contains(&t) {
                layout.device_of(t)
            } else {
                // Another server's vertex (an end of a pair): the least loaded device.
                (0..g_count).min_by_key(|&g| (loads[g], g)).unwrap_or(0)
            };
            reached.insert_new(v, 0);
            reached.set_device(v, g as u16);
            loads[g] += 1;
        }
        // levels[d]: keys of the vertices at level d, by ascending global id.
        let declared = matches!(&rows, RowSource::Sampled(s) if s.level_starts().is_some());
        let mut levels: Vec<Vec<u32>> = vec![targets];
        let mut total = levels[0].len();
        for d in 1..=k {
            let lvl = d as u8;
            let first_new = reached.len();
            let mut next = Vec::new();
            if let RowSource::Sampled(sample) = &rows {
                // Hop d feeds layer k - d, whose valid rows are, with per-layer flags, all
                // levels <= d - 1, else level d - 1. A sample that declares its levels (the
                // layer-wise sampler) names them outright: nothing to scan.
                next = match sample.level_starts() {
                    Some(starts) => {
                        let declared = declared_level(starts, d, k, &levels[0])?;
                        debug_assert_eq!(
                            declared,
                            scan_sampled_hop(sample, &reached, &levels, d, k),
                            "server {server}: declared level {d} differs from the scanned one"
                        );
                        declared
                    }
                    None => scan_sampled_hop(sample, &reached, &levels, d, k),
                };
                for &u in &next {
                    reached.insert_new(u, lvl);
                }
            } else {
                // The whole graph's rows (exact closures): streamed, as the sources of a
                // partition's frontier can be most of the graph's edges.
                for &v in &levels[d - 1] {
                    for &u in rows.row(v).1 {
                        if reached.insert_new(u, lvl) {
                            next.push(u);
                        }
                    }
                }
            }
            // By global id (a sample that declares its levels has them in that order, checked
            // when declared).
            if !declared {
                next.sort_unstable_by_key(|&u| rows.global(u));
            }
            total += next.len();
            if g_count == 1 {
                for &u in &next {
                    reached.set_device(u, 0);
                }
            } else {
                // How many of u's readers at level d - 1 (rows that keep the edge u -> w) each
                // device owns, counted from those readers' kept rows: the new vertices are
                // the reached indices from `first_new` on.
                let mut counts = vec![0u32; (reached.len() - first_new) * g_count];
                for &w in &levels[d - 1] {
                    let gw = reached.device(w) as usize;
                    for &u in rows.row(w).1 {
                        if let Some(i) = reached.index(u).filter(|&i| i >= first_new) {
                            counts[(i - first_new) * g_count + gw] += 1;
                        }
                    }
                }
                let cap = total.div_ceil(g_count);
                for &u in &next {
                    let i = reached.index(u).expect("inserted above") - first_new;
                    let c = &counts[i * g_count..(i + 1) * g_count];
                    let best = (0..g_count)
                        .filter(|&g| loads[g] < cap)
                        .max_by_key(|&g| (c[g], std::cmp::Reverse(loads[g]), std::cmp::Reverse(g)))
                        .ok_or_else(|| {
                            MaskingError::Internal(format!(
                                "server {server}: no device below capacity {cap} at level {d}"
                            ))
                        })?;
                    loads[best] += 1;
                    reached.set_device(u, best as u16);
                }
            }
            levels.push(next);
        }

        let reached = &reached;
        let levels = &levels;
        let rows = &rows;
        let plans = (0..g_count)
            .into_par_iter()
            .map(|g| {
                let rank = rank_of(g);
                let mut owned: Vec<u32> = levels[0]
                    .iter()
                    .copied()
                    .filter(|&t| reached.device(t) as usize == g)
                    .collect();
                let n_inner = owned.len();
                let mut owned_level = vec![0u8; n_inner];
                for (d, lvl) in levels.iter().enumerate().skip(1) {
                    for &u in lvl {
                        if reached.device(u) as usize == g {
                            owned.push(u);
                            owned_level.push(d as u8);
                        }
                    }
                }
                build_device(
                    self,
                    rows,
                    DeviceSpec {
                        rank,
                        server,
                        device: single.unwrap_or(g),
                        n_inner,
                        owned,
                        owned_level,
                        complete_below: k as u8,
                        masked_layers: k,
                        // One device: every vertex it reads is its own (no halo).
                        sole: g_count == 1,
                    },
                    |u| {
                        reached
                            .index(u)
                            .map(|i| rank_of(reached.device[i] as usize))
                    },
                    |u| reached.index(u).map_or(ABSENT, |i| reached.level[i]),
                )
            })
            .collect::<Result<Vec<_>>>()?;
        let level_sizes: Vec<usize> = levels.iter().map(Vec::len).collect();
        let server_range = layout.server_range(server);
        let extraction = ServerExtraction {
            server,
            inner: level_sizes[0],
            replicated: levels
                .iter()
                .flatten()
                .filter(|&&v| !server_range.contains(&rows.global(v)))
                .count(),
            dependencies: level_sizes[1..].iter().sum(),
            level_sizes,
            kept_edges: plans.iter().map(DevicePlan::num_edges).sum(),
            sampled: !exact,
            owned_per_device: plans.iter().map(|p| p.n_owned).collect(),
        };
        Ok((extraction, plans))
    }
}
