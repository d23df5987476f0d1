//! Input features of a step's layer-0 plan, with replicated vertices fetched from their home
//! server (GraNNDIS §5.1, §5.3).
//!
//! A server holds only its own partition's features in host memory. FB plans own exactly the
//! rank's layout range (halo rows arrive by the per-layer exchange), but masked plans — FLX
//! preloading, FLX-EAS, cooperative batches, the per-GPU mini-batch baseline — also own
//! REPLICATED rows: vertices whose home rank, by the [`Layout`], is on another server. Their
//! features cross the inter-server link from the home rank, which is exactly the traffic that
//! preloading pays once and that cooperative batching with EAS cuts per iteration.
//!
//! Where a process holds the whole step (`plans[rank][layer]` of all ranks: one process, or
//! schedules built whole), no request round is needed: each rank derives what every other
//! rank needs from it and what it receives, and one `exchange_sized` under [`Tag::fetch`]
//! moves it. Where a process built only its server's part of a step (a daemon's batched
//! steps: `crate::steps::StepPart`), the other servers' plans are empty here, so each rank first
//! asks every rank of another server for the ids it needs from it (an empty list when none)
//! in one exchange under the same epoch in [`Phase::Other`], 4 bytes per fetched row against
//! a row's 4 x F, and the rows follow as before. Either way every rank loads the steps in the
//! same order (setup, each new training step, each evaluation build).

use std::collections::BTreeMap;
use std::sync::mpsc::{Receiver, SyncSender};
use std::sync::{Arc, Mutex};

use anyhow::{bail, Context};
use grandis_engine::HostBuffer;
use grandis_fabric::{Endpoint, Phase, Tag};
use grandis_masking::{DevicePlan, Layout};
use grandis_store::DatasetView;

/// Tag epoch of the plan built before the first training epoch (training epochs count from 1;
/// evaluation builds carry [`crate::EVAL_EPOCH_BIT`]).
pub(crate) const SETUP_EPOCH: u32 = 0;

/// Where a server's features come from: the dataset view (ORIGINAL ids), the map from new to
/// original ids, and the layout that says which rank is each new id's home.
#[derive(Clone, Copy)]
pub(crate) struct FeatureSource<'a> {
    pub view: DatasetView<'a>,
    pub new_to_old: &'a [u32],
    pub layout: &'a Layout,
}

impl FeatureSource<'_> {
    /// Rank `me`'s layer-0 feature matrix of `plans` (`rows x F`, `rows >= n_owned`) as far
    /// as this server's host memory holds it, with no peer involved: what a step's producer
    /// prepares for the rank. Its owned rows whose home is this rank or a sibling device of
    /// its server are read from the view (a server's host memory holds its whole partition,
    /// and its devices load from it over the host link, not the fabric); every other row is
    /// zero until [`LocalFeatures::complete`] fetches the replicated ones from their home
    /// rank. The rows this rank owes the other servers' ranks are read here too. `buf`
    /// becomes the matrix (its contents do not matter; it must hold `rows x F` elements).
    pub fn read_local(
        &self,
        plans: &[Vec<Arc<DevicePlan>>],
        me: usize,
        rows: usize,
        mut host: HostBuffer,
    ) -> anyhow::Result<LocalFeatures> {
        let reads = self.reads(plans, me)?;
        let f = self.view.feature_dim;
        let owned = reads.owned;
        if rows < owned {
            bail!("internal: {rows} feature rows for {owned} owned rows");
        }
        // Only the rows no read fills are cleared: a reused buffer is not zeroed whole.
        host.set_len(rows * f)?;
        let buf = host.as_mut_slice();
        buf[owned * f..].fill(0.0);
        for rows in reads.incoming.values() {
            for &i in rows {
                buf[i * f..(i + 1) * f].fill(0.0);
            }
        }
        let local_ids: Vec<u32> = reads.local.iter().map(|&(_, o)| o).collect();
        let owed = match reads.sends {
            Some(sends) => Owed::Rows(self.read_sends(&sends)?),
            None => Owed::Asked(reads.asks),
        };
        let in_order = reads.local.iter().enumerate().all(|(j, &(i, _))| i == j);
        if in_order {
            // The usual case (one server, or this server's rows first): straight into place.
            self.view
                .gather_features(&local_ids, &mut buf[..local_ids.len() * f])
                .context("reading the step's feature rows")?;
        } else {
            let mut read = vec![0f32; local_ids.len() * f];
            self.view
                .gather_features(&local_ids, &mut read)
                .context("reading the step's feature rows")?;
            for (&(i, _), src) in reads.local.iter().zip(read.chunks_exact(f.max(1))) {
                buf[i * f..(i + 1) * f].copy_from_slice(src);
            }
        }
        Ok(LocalFeatures {
            host,
            feature_dim: f,
            world: self.layout.num_ranks(),
            owed,
            incoming: reads.incoming,
        })
    }

    /// The whole feature rows of `sends` ((peer rank, original ids) in the peer's row order).
    fn read_sends(&self, sends: &[(usize, Vec<u32>)]) -> anyhow::Result<PeerRows> {
        let f = self.view.feature_dim;
        let sent: Vec<u32> = sends
            .iter()
            .flat_map(|(_, olds)| olds.iter().copied())
            .collect();
        let mut sent_rows = vec![0f32; sent.len() * f];
        self.view
            .gather_features(&sent, &mut sent_rows)
            .context("reading the feature rows other servers fetch")?;
        let mut rest = sent_rows.as_slice();
        let mut rows = Vec::with_capacity(sends.len());
        for (r, olds) in sends {
            let (data, tail) = rest.split_at(olds.len() * f);
            rows.push((*r, data.to_vec()));
            rest = tail;
        }
        Ok(rows)
    }

    /// The rows the ranks of other servers ask rank `ep.rank()` for in a step whose other
    /// servers' plans were not built here: those asked for ahead ([`AsksAhead`], read off this
    /// thread since the previous load) and those asked for now. Now, this rank sends every
    /// rank of another server the NEW ids it needs from it (an empty list to the others, as
    /// neither side knows the other's plans) unless it sent them ahead, and hears from every
    /// such rank that did not, under `tag`'s epoch in [`Phase::Other`]. Ids travel as the bit
    /// patterns of `f32` values (moved, never computed on).
    fn answer_asks(
        &self,
        ep: &mut Endpoint,
        asks: &BTreeMap<usize, Vec<u32>>,
        tag: Tag,
        ahead: Option<&mut Ahead<'_>>,
    ) -> anyhow::Result<PeerRows> {
        let peers = self.other_servers_ranks(ep.rank());
        // What was asked ahead for this step, by this rank and of it.
        let early = ahead.and_then(|a| a.state.take_for(a.index));
        let (sent_early, asked_early) = match &early {
            Some(e) => (e.sent, e.askers.as_slice()),
            None => (false, &[][..]),
        };
        let sends: PeerRows = if sent_early {
            Vec::new()
        } else {
            peers
                .iter()
                .map(|&r| (r, ask_message(asks.get(&r))))
                .collect()
        };
        let expect: Vec<usize> = peers
            .iter()
            .copied()
            .filter(|r| !asked_early.contains(r))
            .collect();
        let mut owed = Vec::new();
        if !sends.is_empty() || !expect.is_empty() {
            let asked = ep
                .exchange(sends, &expect, Tag::new(tag.epoch, 0, Phase::Other))
                .with_context(|| format!("asking for replicated feature rows {tag}"))?;
            for (peer, ids) in asked {
                let olds = self.asked_rows(ep.rank(), peer, &ids)?;
                if !olds.is_empty() {
                    owed.push((peer, olds));
                }
            }
        }
        let mut rows = self.read_sends(&owed)?;
        if let Some(early) = early {
            rows.extend(early.rows.wait()?);
        }
        Ok(rows)
    }

    /// After loading a step whose other servers' plans were not built here: every rank tells
    /// every rank of another server what it will ask it for in the next step, when that step
    /// is built already (an empty message when it is not: it asks at that step's load), and
    /// the rows asked of this rank are read on `ahead.answerer`'s thread while the ranks
    /// compute. One exchange at every such load, so every rank takes part in the same order.
    fn ask_ahead(&self, ep: &mut Endpoint, ahead: &mut Ahead<'_>, tag: Tag) -> anyhow::Result<()> {
        let me = ep.rank();
        let peers = self.other_servers_ranks(me);
        let mine = match ahead.next {
            Some(plans) => Some(self.asks(self.layer0(plans, me)?, me)),
            None => None,
        };
        let sends = peers
            .iter()
            .map(|&r| match &mine {
                Some(asks) => {
                    let mut m = vec![f32::from_bits(ASKED_AHEAD)];
                    m.extend(ask_message(asks.get(&r)));
                    (r, m)
                }
                None => (r, Vec::new()),
            })
            .collect();
        let got = ep
            .exchange(sends, &peers, Tag::new(tag.epoch, 1, Phase::Other))
            .with_context(|| format!("asking ahead for replicated feature rows {tag}"))?;
        let mut askers = Vec::new();
        let mut owed = Vec::new();
        for (peer, msg) in got {
            let Some((head, ids)) = msg.split_first() else {
                continue;
            };
            if head.to_bits() != ASKED_AHEAD {
                bail!("rank {peer} sent rank {me} a malformed ask {tag}");
            }
            askers.push(peer);
            let olds = self.asked_rows(me, peer, ids)?;
            if !olds.is_empty() {
                owed.push((peer, olds));
            }
        }
        let submitted = match ahead.answerer {
            Some(answerer) => answerer.submit(owed),
            None => Err(owed),
        };
        let rows = match submitted {
            Ok(pending) => Answer::Pending(pending),
            Err(owed) => Answer::Read(self.read_sends(&owed)?),
        };
        ahead.state.early = Some(Early {
            index: ahead.index + 1,
            sent: mine.is_some(),
            askers,
            rows,
        });
        Ok(())
    }

    /// The ranks of servers other than `me`'s, ascending.
    fn other_servers_ranks(&self, me: usize) -> Vec<usize> {
        (0..self.layout.num_ranks())
            .filter(|&r| !self.layout.same_server(r, me))
            .collect()
    }

    /// The original ids of the rows rank `peer` asked rank `me` for (`ids`: NEW ids as f32
    /// bit patterns). A vertex whose home is not `me` fails the step, naming both.
    fn asked_rows(&self, me: usize, peer: usize, ids: &[f32]) -> anyhow::Result<Vec<u32>> {
        let mine = self.layout.range(me);
        ids.iter()
            .map(|x| {
                let g = x.to_bits();
                if !mine.contains(&g) {
                    bail!(
                        "rank {peer} asked rank {me} for the features of vertex {g}, whose home \
                         is not rank {me}"
                    );
                }
                self.old(g)
            })
            .collect()
    }

    /// Starts reading the feature rows rank `me` will read for `plans` into the page cache
    /// (see [`DatasetView::prefetch_features`]), so the step's gather finds them there: what
    /// a rank asks for the next step while it computes this one. Advice only.
    pub fn prefetch(&self, plans: &[Vec<Arc<DevicePlan>>], me: usize) -> anyhow::Result<()> {
        let reads = self.reads(plans, me)?;
        let mut ids = reads.ids();
        ids.sort_unstable();
        ids.dedup();
        self.view.prefetch_features(&ids);
        Ok(())
    }

    /// What rank `me` reads from the view for a step's layer-0 plans (`plans[rank][layer]`
    /// for every rank) and what it receives. Rows whose home is this rank or a sibling device
    /// of its server are read from the view — a server's host memory holds its whole
    /// partition, and its devices load from it over the host link, not the fabric; the other
    /// servers' ranks are sent the rows of their layer-0 plans whose home is this rank.
    ///
    /// When this process did not build the other servers' plans (they are empty), what they
    /// need is unknown here: `sends` is None and `asks` holds the NEW ids this rank needs from
    /// each home rank, for [`LocalFeatures::complete`] to ask for.
    fn reads(&self, plans: &[Vec<Arc<DevicePlan>>], me: usize) -> anyhow::Result<Reads> {
        let layout = self.layout;
        let world = layout.num_ranks();
        if plans.len() != world {
            bail!(
                "internal: a step with plans for {} ranks and a layout of {world}",
                plans.len()
            );
        }
        let owned = self.layer0(plans, me)?;
        let my_server = layout.server_range(layout.server_of_rank(me));
        let mut local = Vec::new();
        let mut incoming: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
        for (i, &g) in owned.iter().enumerate() {
            if my_server.contains(&g) {
                local.push((i, self.old(g)?));
            } else {
                incoming.entry(layout.owner(g)).or_default().push(i);
            }
        }
        let others_built = (0..world)
            .filter(|&r| !layout.same_server(r, me))
            .all(|r| !plans[r].is_empty());
        if !others_built {
            return Ok(Reads {
                owned: owned.len(),
                local,
                sends: None,
                asks: self.asks(owned, me),
                incoming,
            });
        }
        // What the other servers' ranks need from this rank's range, in their row order.
        let mine = layout.range(me);
        let mut sends = Vec::new();
        for r in (0..world).filter(|&r| !layout.same_server(r, me)) {
            let olds = self
                .layer0(plans, r)?
                .iter()
                .filter(|g| mine.contains(g))
                .map(|&g| self.old(g))
                .collect::<anyhow::Result<Vec<u32>>>()?;
            // By rows, not values: the peer expects a message whenever it owns such a row.
            if !olds.is_empty() {
                sends.push((r, olds));
            }
        }
        Ok(Reads {
            owned: owned.len(),
            local,
            sends: Some(sends),
            asks: BTreeMap::new(),
            incoming,
        })
    }

    /// Rank `r`'s layer-0 owned rows (NEW ids) in `plans` (`[rank][layer]`), checked to lie
    /// in the layout.
    fn layer0<'p>(&self, plans: &'p [Vec<Arc<DevicePlan>>], r: usize) -> anyhow::Result<&'p [u32]> {
        let p = plans
            .get(r)
            .and_then(|p| p.first())
            .with_context(|| format!("internal: rank {r} has no layer-0 plan"))?;
        let owned = &p.global_ids[..p.n_owned];
        let n = self.layout.num_vertices();
        if let Some(&g) = owned.iter().find(|&&g| g >= n) {
            bail!("internal: rank {r}'s plan owns vertex {g}, past the layout's {n}");
        }
        Ok(owned)
    }

    /// Home rank -> the NEW ids of `owned` (rank `me`'s layer-0 owned rows) homed on another
    /// server, in row order: what rank `me` asks each home rank for when the other servers'
    /// plans were not built here.
    fn asks(&self, owned: &[u32], me: usize) -> BTreeMap<usize, Vec<u32>> {
        let my_server = self.layout.server_range(self.layout.server_of_rank(me));
        let mut asks: BTreeMap<usize, Vec<u32>> = BTreeMap::new();
        for &g in owned.iter().filter(|g| !my_server.contains(g)) {
            asks.entry(self.layout.owner(g)).or_default().push(g);
        }
        asks
    }

    /// The original id of NEW id `g`.
    fn old(&self, g: u32) -> anyhow::Result<u32> {
        self.new_to_old
            .get(g as usize)
            .copied()
            .with_context(|| format!("internal: vertex {g} has no original id"))
    }
}

/// Reads the feature rows of the steps the ranks will take next into the page cache while
/// they compute the current ones, on a thread of its own ([`FeatureSource::prefetch`] hands
/// the kernel a rank's whole next step at once), so a step's gather finds its rows cached
/// instead of waiting on the disk. Only while that works: when the memory left to the page
/// cache cannot hold the next step beside the current one, prefetched pages are evicted
/// before their gather comes and pages are read twice (on a 5M-vertex graph in 1.2 GB, the
/// epoch went from 11.8 s to 14-15 s with 25 % more read; with room for every page it changed
/// nothing, compute being a tenth of a CPU epoch). So the gathers sample what they
/// find cached ([`DatasetView::feature_pages_cached`]), and prefetching stops for the run
/// once the steps it prefetched were mostly not. Requests are advice: one that finds the
/// queue full is dropped.
pub(crate) struct Prefetcher {
    requests: Mutex<Option<SyncSender<Request>>>,
    /// Taken by [`Prefetcher::serve`].
    queue: Mutex<Option<Receiver<Request>>>,
}

/// A rank's next step's plans (`[rank][layer]`), and the rank.
type Request = (Vec<Vec<Arc<DevicePlan>>>, usize);

impl Prefetcher {
    /// Requests that may wait: one next step per local rank is plenty.
    const QUEUE: usize = 16;
    /// Requests between two looks at what the gathers found cached.
    const CHECK_EVERY: u64 = 8;
    /// Sampled pages a look needs to judge (a gather samples up to
    /// [`grandis_store::RESIDENCY_SAMPLE`]).
    const MIN_SAMPLED: u64 = 256;

    pub fn new() -> Prefetcher {
        let (tx, rx) = std::sync::mpsc::sync_channel(Self::QUEUE);
        Prefetcher {
            requests: Mutex::new(Some(tx)),
            queue: Mutex::new(Some(rx)),
        }
    }

    /// Serves the requests from `source` until [`Prefetcher::close`] (on a thread of its
    /// own; a second call returns at once).
    pub fn serve(&self, source: FeatureSource<'_>) {
        let Some(queue) = self.queue.lock().ok().and_then(|mut q| q.take()) else {
            return;
        };
        let cached = || source.view.feature_pages_cached();
        let (mut since, mut served, mut on) = (None, 0u64, true);
        for (plans, rank) in queue {
            if !on {
                continue;
            }
            // The gathers since the last look were of prefetched steps: were they cached?
            if served % Self::CHECK_EVERY == 0 {
                let now = cached();
                if let (Some((c0, s0)), Some((c1, s1))) = (since, now) {
                    let (hit, sampled) = (c1 - c0, s1 - s0);
                    tracing::debug!("feature prefetch: {hit} of {sampled} sampled pages cached");
                    if sampled >= Self::MIN_SAMPLED && hit * 8 < sampled * 7 {
                        tracing::info!(
                            "feature prefetch off: the steps it read ahead were evicted before \
                             their gathers ({hit} of {sampled} sampled pages cached); the \
                             page cache holds less than two steps"
                        );
                        on = false;
                        continue;
                    }
                }
                since = now;
            }
            served += 1;
            if let Err(e) = source.prefetch(&plans, rank) {
                // The rank's own gather of this step reports the same problem.
                tracing::debug!("prefetching rank {rank}'s features: {e:#}");
            }
        }
    }

    /// Asks for rank `rank`'s rows of the step of `plans` (the step it takes next).
    pub fn request(&self, plans: Vec<Vec<Arc<DevicePlan>>>, rank: usize) {
        if let Ok(tx) = self.requests.lock() {
            if let Some(tx) = tx.as_ref() {
                let _ = tx.try_send((plans, rank));
            }
        }
    }

    /// Ends [`Prefetcher::serve`] once the requests already queued are served.
    pub fn close(&self) {
        if let Ok(mut tx) = self.requests.lock() {
            tx.take();
        }
    }
}

/// (peer rank, whole feature rows in the peer's row order): what a rank sends one peer.
type PeerRows = Vec<(usize, Vec<f32>)>;

/// First value of an ask sent ahead (its bit pattern), so an empty message means "not
/// built yet" and an ask of nothing is still an ask.
const ASKED_AHEAD: u32 = 1;

/// An ask's message: the NEW ids as `f32` bit patterns.
fn ask_message(ids: Option<&Vec<u32>>) -> Vec<f32> {
    ids.map_or_else(Vec::new, |ids| {
        ids.iter().map(|&g| f32::from_bits(g)).collect()
    })
}

/// A rank's asks sent ahead, between the load that sent them and the load of the step they
/// are for ([`FeatureSource::ask_ahead`]). Starts empty: the first step's rows are asked for
/// at its load.
#[derive(Default)]
pub(crate) struct AsksAhead {
    early: Option<Early>,
}

impl AsksAhead {
    /// What was asked ahead for step `index`, taken (None when nothing was, or for another
    /// step: then everything is asked for at the load, on every rank alike).
    fn take_for(&mut self, index: u64) -> Option<Early> {
        self.early.take().filter(|e| e.index == index)
    }
}

/// What was asked ahead for one step.
struct Early {
    index: u64,
    /// Whether this rank sent its asks ahead (its step was built in time).
    sent: bool,
    /// The ranks that asked this rank ahead.
    askers: Vec<usize>,
    /// Their rows, being read.
    rows: Answer,
}

/// Rows read for ranks that asked ahead.
enum Answer {
    Read(PeerRows),
    Pending(Receiver<anyhow::Result<PeerRows>>),
}

impl Answer {
    fn wait(self) -> anyhow::Result<PeerRows> {
        match self {
            Answer::Read(rows) => Ok(rows),
            Answer::Pending(rx) => rx
                .recv()
                .map_err(|_| anyhow::anyhow!("the feature reader thread stopped"))?,
        }
    }
}

/// What a training load needs to ask ahead: the rank's asks state, the index of the step it
/// loads, the next step's plans when built (`[rank][layer]`), and the thread that reads rows
/// asked for ahead.
pub(crate) struct Ahead<'s> {
    pub state: &'s mut AsksAhead,
    pub index: u64,
    pub next: Option<&'s [Vec<Arc<DevicePlan>>]>,
    pub answerer: Option<&'s Answerer>,
}

/// Reads the feature rows other servers' ranks asked for ahead, on a thread of its own, so a
/// rank's load finds them read ([`FeatureSource::ask_ahead`]): reading them at the load put
/// 7-9 s of a products-like cob epoch's 35-44 s on the ranks' path under `cluster up`.
pub(crate) struct Answerer {
    jobs: Mutex<Option<SyncSender<AnswerJob>>>,
    /// Taken by [`Answerer::serve`].
    queue: Mutex<Option<Receiver<AnswerJob>>>,
    serving: std::sync::atomic::AtomicBool,
}

/// (peer rank, original ids) to read, and where the rows go.
type AnswerJob = (Owes, SyncSender<anyhow::Result<PeerRows>>);

/// (peer rank, original ids) of the rows a rank owes its peers.
type Owes = Vec<(usize, Vec<u32>)>;

impl Answerer {
    /// Jobs that may wait: one per local rank and step asked ahead.
    const QUEUE: usize = 64;

    pub fn new() -> Answerer {
        let (tx, rx) = std::sync::mpsc::sync_channel(Self::QUEUE);
        Answerer {
            jobs: Mutex::new(Some(tx)),
            queue: Mutex::new(Some(rx)),
            serving: Default::default(),
        }
    }

    /// Serves the jobs from `source` until [`Answerer::close`] (on a thread of its own; a
    /// second call returns at once).
    pub fn serve(&self, source: FeatureSource<'_>) {
        let Some(queue) = self.queue.lock().ok().and_then(|mut q| q.take()) else {
            return;
        };
        self.serving
            .store(true, std::sync::atomic::Ordering::SeqCst);
        for (owed, done) in queue {
            // A rank that gave up no longer waits: nothing to tell it.
            let _ = done.send(source.read_sends(&owed));
        }
    }

    /// Reads `owed` on the serving thread; `owed` back when no thread serves (the caller
    /// reads).
    fn submit(&self, owed: Owes) -> Result<Receiver<anyhow::Result<PeerRows>>, Owes> {
        if !self.serving.load(std::sync::atomic::Ordering::SeqCst) {
            return Err(owed);
        }
        let Ok(jobs) = self.jobs.lock() else {
            return Err(owed);
        };
        let Some(jobs) = jobs.as_ref() else {
            return Err(owed);
        };
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        jobs.send((owed, tx)).map_err(|e| e.0 .0)?;
        Ok(rx)
    }

    /// Ends [`Answerer::serve`] once the jobs already queued are served.
    pub fn close(&self) {
        if let Ok(mut tx) = self.jobs.lock() {
            tx.take();
        }
    }
}

/// One rank's share of a step's layer-0 features (see [`FeatureSource::reads`]).
struct Reads {
    /// Rows of the rank's layer-0 plan.
    owned: usize,
    /// (plan row, original id) of the rows read from this server's features.
    local: Vec<(usize, u32)>,
    /// (peer rank, original ids) of the rows this rank sends, in the peer's row order; None
    /// when the peers' plans were not built here (they ask).
    sends: Option<Vec<(usize, Vec<u32>)>>,
    /// Without `sends`: home rank -> NEW ids this rank asks it for, in plan row order.
    asks: BTreeMap<usize, Vec<u32>>,
    /// Home rank -> plan rows that arrive from it.
    incoming: BTreeMap<usize, Vec<usize>>,
}

impl Reads {
    /// The original ids the rank reads: its own server's rows, then each peer's, in order
    /// (as far as they are known here).
    fn ids(&self) -> Vec<u32> {
        let local = self.local.iter().map(|&(_, o)| o);
        let sent = self
            .sends
            .iter()
            .flatten()
            .flat_map(|(_, olds)| olds.iter().copied());
        local.chain(sent).collect()
    }
}

/// The rows a rank owes the ranks of other servers for a step.
enum Owed {
    /// Read beside its own rows: (peer rank, whole feature rows in the peer's row order).
    Rows(PeerRows),
    /// Unknown until asked (the peers' plans were built elsewhere): home rank -> the NEW ids
    /// this rank asks it for.
    Asked(BTreeMap<usize, Vec<u32>>),
}

/// A rank's layer-0 feature matrix as its own server holds it ([`FeatureSource::read_local`]),
/// and the rows it owes other servers; [`LocalFeatures::complete`] adds the replicated rows.
pub(crate) struct LocalFeatures {
    /// `rows x F`: local rows read, replicated rows and rows past the owned ones zero.
    host: HostBuffer,
    feature_dim: usize,
    /// Ranks of the layout the rows were read for.
    world: usize,
    /// What this rank sends other servers' ranks (or asks them for first).
    owed: Owed,
    /// Home rank -> rows of `host` that arrive from it.
    incoming: BTreeMap<usize, Vec<usize>>,
}

impl LocalFeatures {
    /// The whole matrix: the replicated rows fetched from their home rank under `tag` while
    /// this rank sends the other servers' ranks the rows whose home it is, in one
    /// `exchange_sized` (no message at all when nothing moves, so FB plans add none). Raw
    /// values travel, so the result is bit-identical to reading every row locally.
    ///
    /// With `columns` (ascending feature columns; DGS's feature-level sampling), rows fetched
    /// from other servers carry only those columns and the others are zero: every rank of the
    /// step must pass the same columns.
    ///
    /// `source` answers the other servers' asks when this rank's rows were read without their
    /// plans (see [`FeatureSource::reads`]).
    ///
    /// `ahead` (training loads): rows asked for ahead are used, and this load asks ahead for
    /// the next step ([`FeatureSource::ask_ahead`]).
    pub fn complete(
        self,
        source: &FeatureSource<'_>,
        ep: &mut Endpoint,
        tag: Tag,
        columns: Option<&[u32]>,
        mut ahead: Option<Ahead<'_>>,
    ) -> anyhow::Result<HostBuffer> {
        let LocalFeatures {
            mut host,
            feature_dim: f,
            world,
            owed,
            incoming,
        } = self;
        if ep.world() != world {
            bail!(
                "internal: a fabric of {} ranks and a layout of {world}",
                ep.world()
            );
        }
        let asked = matches!(owed, Owed::Asked(_));
        let sends = match owed {
            Owed::Rows(rows) => rows,
            Owed::Asked(asks) => source.answer_asks(ep, &asks, tag, ahead.as_mut())?,
        };
        if let Some(&c) = columns.and_then(|c| c.iter().find(|&&c| c as usize >= f)) {
            bail!("internal: feature column {c} of {f}");
        }
        // What one fetched row carries.
        let sent_width = columns.map_or(f, <[u32]>::len);
        let sends: PeerRows = match columns {
            None => sends,
            Some(cols) => sends
                .into_iter()
                .map(|(r, data)| {
                    let picked = data
                        .chunks_exact(f.max(1))
                        .flat_map(|row| cols.iter().map(|&c| row[c as usize]))
                        .collect();
                    (r, picked)
                })
                .collect(),
        };
        let expect: Vec<(usize, usize)> = incoming
            .iter()
            .map(|(&home, rows)| (home, rows.len() * sent_width))
            .collect();
        // Point-to-point only: a rank with nothing to move skips the call (its peers, deriving
        // the same lists, expect nothing from it).
        if !sends.is_empty() || !expect.is_empty() {
            let got = ep
                .exchange_sized(sends, &expect, tag)
                .with_context(|| format!("fetching replicated features {tag}"))?;
            for ((home, data), (&want, rows)) in got.into_iter().zip(&incoming) {
                if home != want {
                    bail!("internal: features from rank {home} where rank {want}'s were due");
                }
                let host = host.as_mut_slice();
                for (&i, src) in rows.iter().zip(data.chunks_exact(sent_width.max(1))) {
                    let row = &mut host[i * f..(i + 1) * f];
                    match columns {
                        None => row.copy_from_slice(src),
                        Some(cols) => {
                            for (&c, &x) in cols.iter().zip(src) {
                                row[c as usize] = x;
                            }
                        }
                    }
                }
            }
        }
        if let (true, Some(ahead)) = (asked, ahead.as_mut()) {
            source.ask_ahead(ep, ahead, tag)?;
        }
        Ok(host)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_support::{random_2x2, synth};
    use crate::{plan_context, steps, PartitionedGraph};
    use grandis_fabric::{Counters, Direction, Fabric, FabricConfig, LinkClass, Phase};
    use grandis_masking::FlxPlan;
    use grandis_sampling::{CoBatcher, Exact};

    const LAYERS: usize = 2;

    fn per_rank(plan: FlxPlan) -> Vec<Vec<Arc<DevicePlan>>> {
        plan.devices
            .into_iter()
            .map(|d| steps::every_layer(d, LAYERS))
            .collect()
    }

    /// (rank, owned row) pairs of the layer-0 plans whose home is on another server.
    fn remote_rows(layout: &Layout, plans: &[Vec<Arc<DevicePlan>>]) -> u64 {
        plans
            .iter()
            .enumerate()
            .map(|(r, p)| {
                let s = layout.server_of_rank(r);
                p[0].global_ids[..p[0].n_owned]
                    .iter()
                    .filter(|&&g| layout.server_of(g) != s)
                    .count() as u64
            })
            .sum()
    }

    /// Every rank runs `layer0_features` on `plans` over an in-process 2 x 2 fabric, reading
    /// ONLY its own server's features: rows of other servers are NaN in its view, as they are
    /// absent from a real server's host memory. With `per_server`, a rank sees only its own
    /// server's plans, as under a daemon that built only its part of the step (it asks).
    /// Returns each rank's matrix and the counters.
    fn run(
        view: DatasetView<'_>,
        part: &PartitionedGraph,
        plans: &[Vec<Arc<DevicePlan>>],
        columns: Option<&[u32]>,
        per_server: bool,
    ) -> (Vec<Vec<f32>>, Counters) {
        let layout = &part.layout;
        let f = view.feature_dim;
        // Per server, the dataset's features with every other server's rows poisoned.
        let local: Vec<Vec<f32>> = (0..layout.servers())
            .map(|s| {
                let mut x = view.features.to_vec();
                for (new, &old) in part.new_to_old.iter().enumerate() {
                    if layout.server_of(new as u32) != s {
                        let o = old as usize;
                        x[o * f..(o + 1) * f].fill(f32::NAN);
                    }
                }
                x
            })
            .collect();
        let out = Fabric::new(FabricConfig::new(layout.servers(), layout.devices()))
            .unwrap()
            .run(|mut ep| {
                let rank = ep.rank();
                let src = FeatureSource {
                    view: DatasetView {
                        features: &local[layout.server_of_rank(rank)],
                        ..view
                    },
                    new_to_old: &part.new_to_old,
                    layout,
                };
                let p0 = &plans[rank][0];
                let seen: Vec<Vec<Arc<DevicePlan>>> = plans
                    .iter()
                    .enumerate()
                    .map(|(r, p)| match per_server && !layout.same_server(r, rank) {
                        true => Vec::new(),
                        false => p.clone(),
                    })
                    .collect();
                let host = src
                    .read_local(&seen, rank, p0.n_local(), HostBuffer::default())?
                    .complete(&src, &mut ep, Tag::fetch(1), columns, None)?;
                anyhow::Ok((host.into_vec().unwrap(), ep.counters()))
            })
            .unwrap();
        let counters = Counters::sum(out.iter().map(|(_, c)| c));
        (out.into_iter().map(|(h, _)| h).collect(), counters)
    }

    /// Fetched bytes are exactly 4 x F per (rank, owned row) pair whose home is on another
    /// server, all inter-server; every row (fetched or local) holds the dataset's own values;
    /// FB plans fetch nothing and send no message at all.
    #[test]
    fn replicated_rows_are_fetched_from_their_home_and_counted() {
        let ds = synth(400, 4);
        let view = ds.view();
        let f = view.feature_dim;
        let part = random_2x2(&view, 1);
        let ctx = plan_context(&view, &part).unwrap();
        let batcher = CoBatcher::new(&ctx, 40, 2).unwrap();
        let batch = batcher.batch(0, 0).unwrap();
        let cob = per_rank(grandis_sampling::cob_plan(&ctx, &batch, LAYERS, &Exact, 0).unwrap());
        let remote = remote_rows(&part.layout, &cob);
        assert!(
            remote > 0,
            "a 2-layer co-batch must reach into the other server"
        );

        for per_server in [false, true] {
            let (hosts, counters) = run(view, &part, &cob, None, per_server);
            let fetched = |class, dir| -> u64 {
                counters
                    .epochs
                    .iter()
                    .map(|e| e.bytes_where(dir, |r| r.phase == Phase::Fetch && r.class == class))
                    .sum()
            };
            for dir in [Direction::Sent, Direction::Received] {
                assert_eq!(fetched(LinkClass::InterServer, dir), 4 * f as u64 * remote);
                assert_eq!(fetched(LinkClass::IntraServer, dir), 0);
            }
            assert!(counters.epochs.iter().all(|e| e.epoch == 1));
            // Asking costs 4 bytes per fetched row (an empty ask to the other ranks).
            let asked: u64 = counters
                .epochs
                .iter()
                .map(|e| {
                    e.bytes_where(Direction::Sent, |r| {
                        r.phase == Phase::Other && r.class == LinkClass::InterServer
                    })
                })
                .sum();
            assert_eq!(asked, if per_server { 4 * remote } else { 0 });
            for (rank, host) in hosts.iter().enumerate() {
                let p = &cob[rank][0];
                assert_eq!(host.len(), p.n_local() * f);
                for (i, &g) in p.global_ids[..p.n_owned].iter().enumerate() {
                    let want = view.feature_row(part.new_to_old[g as usize]).to_vec();
                    let got = &host[i * f..(i + 1) * f];
                    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(got), bits(&want), "rank {rank} row {i} (vertex {g})");
                }
                assert!(host[p.n_owned * f..].iter().all(|&v| v == 0.0));
            }
        }

        // DGS: only columns 1 and 3 travel; the others of fetched rows are zero, local rows
        // are whole, and the bytes are exactly 4 x 2 per fetched row.
        let columns = [1u32, 3];
        let (hosts, counters) = run(view, &part, &cob, Some(&columns), true);
        let fetched: u64 = counters
            .epochs
            .iter()
            .map(|e| {
                e.bytes_where(Direction::Sent, |r| {
                    r.phase == Phase::Fetch && r.class == LinkClass::InterServer
                })
            })
            .sum();
        assert_eq!(fetched, 4 * columns.len() as u64 * remote);
        for (rank, host) in hosts.iter().enumerate() {
            let p = &cob[rank][0];
            let home = part.layout.server_of_rank(rank);
            for (i, &g) in p.global_ids[..p.n_owned].iter().enumerate() {
                let want = view.feature_row(part.new_to_old[g as usize]);
                let got = &host[i * f..(i + 1) * f];
                for c in 0..f {
                    let kept = part.layout.server_of(g) == home || columns.contains(&(c as u32));
                    let expected = if kept { want[c] } else { 0.0 };
                    assert_eq!(
                        got[c].to_bits(),
                        expected.to_bits(),
                        "rank {rank} row {i} col {c}"
                    );
                }
            }
        }

        let fb: Vec<Vec<Arc<DevicePlan>>> = ctx
            .fb_plan()
            .unwrap()
            .devices
            .into_iter()
            .map(|d| steps::every_layer(d, LAYERS))
            .collect();
        assert_eq!(remote_rows(&part.layout, &fb), 0);
        let (hosts, counters) = run(view, &part, &fb, None, false);
        assert!(counters.epochs.is_empty(), "{counters:?}");
        assert!(hosts.iter().flatten().all(|v| v.is_finite()));
    }
}
