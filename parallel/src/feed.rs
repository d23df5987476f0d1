//! The producer side of a run: threads that build steps ahead of the ranks
//! ([`produce`]) and the bounded [`Feed`] that hands each step to every
//! rank. A step is a pure function of its index, so producers build steps in parallel, out of
//! order, and the run stays deterministic: the feed releases them in order and the counts are
//! added in step order.
//!
//! A batched step passes through named stages, one [`Step`] value handed along: the producers
//! sample it, plan it and stage its ranks' inputs (graphs, loss rows: [`Fetch::stage`]); the
//! fetch stage, one thread taking steps in order, reads their feature rows once the ranks are
//! near ([`Fetch::read`]) and offers them to the ranks, who upload them. Reading is what
//! bounds host memory (a products-like step reads 223 MB), so only a few steps read ahead;
//! planning is small, so producers plan the whole window ahead and never wait for reads.

use std::collections::BTreeMap;
use std::sync::{Arc, Condvar, Mutex};

use anyhow::Context;

use crate::steps::{build_step, Built, RunStats, Schedule, Step, StepInputs, StepStats};

/// What each step built here computes and the host seconds it took, by step index. A step's
/// counts are recorded before it is handed to the ranks, so once a rank has taken every step
/// of the run, all their counts are here.
#[derive(Default)]
pub(crate) struct StepCounts(Mutex<BTreeMap<u64, (StepStats, BuildSeconds)>>);

/// Host seconds spent on one step: all of them (sampling, plans and staging on its producer,
/// then reading its feature rows on the fetch stage), and the reading.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct BuildSeconds {
    pub total: f64,
    pub inputs: f64,
}

impl StepCounts {
    pub fn insert(&self, index: u64, stats: StepStats, seconds: BuildSeconds) {
        if let Ok(mut m) = self.0.lock() {
            m.insert(index, (stats, seconds));
        }
    }

    /// Adds `seconds` of preparing step `index`'s inputs to its count (recorded by then).
    pub fn add_inputs(&self, index: u64, seconds: f64) {
        if let Ok(mut m) = self.0.lock() {
            if let Some((_, s)) = m.get_mut(&index) {
                s.total += seconds;
                s.inputs += seconds;
            }
        }
    }

    /// The run's sums, added in step order so that floating-point sums (β) do not depend on
    /// which producer finished first.
    pub fn sums(&self) -> RunStats {
        let mut sums = RunStats::default();
        let m = self.0.lock().unwrap_or_else(|e| e.into_inner());
        for (stats, seconds) in m.values() {
            sums.add(stats);
            sums.build_seconds += seconds.total;
            sums.inputs_seconds += seconds.inputs;
        }
        sums
    }
}

/// Steps handed from the producers to the ranks: each step is kept until every rank took it,
/// and only the `depth` steps from the oldest one not yet taken by every rank may wait (so
/// producers finishing out of order never fill the window with later steps).
pub(crate) struct Feed {
    state: Mutex<FeedState>,
    cv: Condvar,
    ranks: usize,
    depth: usize,
    /// Steps before this one are not trained here (see [`Feed::new`]).
    first: u64,
}

#[derive(Default)]
struct FeedState {
    /// step index -> (step, ranks that have not taken it yet)
    ready: BTreeMap<u64, (Arc<Step>, usize)>,
    /// Steps planned but not offered yet (their inputs being prepared): their plans are
    /// final, which is all a rank asking ahead for replicated rows needs.
    planned: BTreeMap<u64, Arc<Step>>,
    /// The step every rank needs next (all before it were taken by every rank).
    oldest: u64,
    /// The earliest step that failed to build, and why.
    failed: Option<(u64, String)>,
    closed: bool,
}

impl Feed {
    /// A feed of steps `first..` (a resumed run starts past the steps it already trained;
    /// steps are pure functions of their index, so the earlier ones are never built).
    pub fn new(ranks: usize, depth: usize, first: u64) -> Feed {
        Feed {
            state: Mutex::new(FeedState {
                oldest: first,
                ..FeedState::default()
            }),
            cv: Condvar::new(),
            ranks,
            depth: depth.max(1),
            first,
        }
    }

    /// Whether step `index` is trained (and so counted) in this run.
    pub fn wants(&self, index: u64) -> bool {
        index >= self.first
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, FeedState> {
        // A panicking rank poisons nothing we rely on: the state stays consistent per call.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Waits until step `index` may be built: while it is `depth` or more steps ahead of the
    /// oldest one the ranks still need, so a producer never holds a step the window has no
    /// room for. False once closed.
    pub fn may_build(&self, index: u64) -> bool {
        let st = self.lock();
        self.wait_for_room(st, index).is_some()
    }

    /// Waits until step `index` is fewer than `ahead` steps ahead of the oldest one the ranks
    /// still need, so its features may be read: the plans of a window of steps are small,
    /// their feature rows are not (a products-like mini-batch reads 223 MB). False once
    /// closed.
    pub fn may_fetch(&self, index: u64, ahead: u64) -> bool {
        let mut st = self.lock();
        while index >= st.oldest + ahead.max(1) && !st.closed {
            st = self.cv.wait(st).unwrap_or_else(|e| e.into_inner());
        }
        !st.closed
    }

    fn wait_for_room<'g>(
        &self,
        mut st: std::sync::MutexGuard<'g, FeedState>,
        index: u64,
    ) -> Option<std::sync::MutexGuard<'g, FeedState>> {
        while index >= st.oldest + self.depth as u64 && !st.closed {
            st = self.cv.wait(st).unwrap_or_else(|e| e.into_inner());
        }
        (!st.closed).then_some(st)
    }

    /// Shows step `index`'s plans before its inputs are prepared ([`Feed::peek_plans`]) and
    /// hands it to the fetch stage ([`Feed::next_planned`]).
    pub fn planned(&self, index: u64, step: Arc<Step>) {
        if self.wants(index) {
            self.lock().planned.insert(index, step);
            self.cv.notify_all();
        }
    }

    /// Waits until step `index` is planned ([`Feed::planned`]) and returns it; None once it
    /// (or an earlier step) failed, or the feed closed.
    pub fn next_planned(&self, index: u64) -> Option<Arc<Step>> {
        let mut st = self.lock();
        loop {
            if let Some(step) = st.planned.get(&index) {
                return Some(step.clone());
            }
            if st.closed || st.failed.as_ref().is_some_and(|(f, _)| *f <= index) {
                return None;
            }
            st = self.cv.wait(st).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// Offers step `index`; waits as [`Feed::may_build`] does. False once closed.
    pub fn push(&self, index: u64, step: Arc<Step>) -> bool {
        if !self.wants(index) {
            return true;
        }
        let Some(mut st) = self.wait_for_room(self.lock(), index) else {
            return false;
        };
        st.planned.remove(&index);
        st.ready.insert(index, (step, self.ranks));
        self.cv.notify_all();
        true
    }

    /// Records that step `index` could not be built; a rank asking for it (or a later step)
    /// returns this error. The earliest failed step wins, as if steps were built in order.
    pub fn fail(&self, index: u64, message: String) {
        let mut st = self.lock();
        if st.failed.as_ref().is_none_or(|(f, _)| index < *f) {
            st.failed = Some((index, message));
        }
        self.cv.notify_all();
    }

    /// Stops the producer (after the ranks are done, or gave up).
    pub fn close(&self) {
        let mut st = self.lock();
        st.closed = true;
        self.cv.notify_all();
    }

    /// Step `index` if it is built and some rank here has not taken it yet, without taking
    /// it: what a rank looks at to prefetch its next step's data.
    pub fn peek(&self, index: u64) -> Option<Arc<Step>> {
        self.lock().ready.get(&index).map(|(step, _)| step.clone())
    }

    /// Step `index` once its plans are built, whether or not its inputs are prepared yet,
    /// without taking it: what a rank asks ahead from (the plans are all it reads).
    pub fn peek_plans(&self, index: u64) -> Option<Arc<Step>> {
        let st = self.lock();
        st.ready
            .get(&index)
            .map(|(step, _)| step.clone())
            .or_else(|| st.planned.get(&index).cloned())
    }

    /// Step `index` for one rank (each rank takes every step exactly once, in order).
    pub fn take(&self, index: u64) -> anyhow::Result<Arc<Step>> {
        let mut st = self.lock();
        loop {
            if let Some(entry) = st.ready.get_mut(&index) {
                let step = entry.0.clone();
                entry.1 -= 1;
                if entry.1 == 0 {
                    st.ready.remove(&index);
                    // Ranks take steps in order, so the slowest one retires them in order.
                    st.oldest = index + 1;
                    self.cv.notify_all();
                }
                return Ok(step);
            }
            if let Some((_, m)) = st.failed.as_ref().filter(|(f, _)| *f <= index) {
                anyhow::bail!("building the plan of step {index}: {m}");
            }
            if st.closed {
                anyhow::bail!("the plan producer stopped before step {index}");
            }
            st = self.cv.wait(st).unwrap_or_else(|e| e.into_inner());
        }
    }
}

/// What is done with a step after sampling and planning it, so that a rank's load is its
/// uploads (`crate::prepare`): `stage` on the producer that planned it, as soon as its plans
/// exist (what is small beside the feature rows), then `read` on the fetch stage, in step
/// order, once the step is fewer than `ahead` steps ahead of the ranks. Both keep what they
/// make in the step ([`Step::set_staged`], [`Step::set_prepared`]).
#[derive(Clone, Copy)]
pub(crate) struct Fetch<'f> {
    pub stage: &'f (dyn Fn(&Step) -> anyhow::Result<()> + Sync),
    pub read: &'f (dyn Fn(&Step) -> anyhow::Result<()> + Sync),
    /// Steps ahead of the ranks whose inputs may be read: what bounds the host memory of
    /// prepared steps (one step's rows per rank and step), whatever the number of producers.
    pub ahead: u64,
}

/// Builds `inputs.step_part` of every step of `epochs` epochs that `feed` wants into it, on
/// `threads` producer threads (step `i` on thread `i % threads`), and records what each
/// computes in `counts`. A step whose memory-model estimate exceeds `budget` (an explicit
/// `--device-memory`) fails the run as out of memory, as the device would when that step's
/// buffers were allocated. Each new step then goes through `fetch`, when given.
#[allow(clippy::too_many_arguments)]
pub(crate) fn produce(
    inputs: &StepInputs<'_>,
    schedule: &Schedule<'_>,
    epochs: usize,
    budget: Option<u64>,
    feed: &Feed,
    counts: &StepCounts,
    threads: usize,
    fetch: Option<Fetch<'_>>,
) {
    let n = schedule.iterations() as u64;
    // FLX-EAS reuses the previous step while its sampling round lasts: one thread, in order.
    let threads = match schedule {
        Schedule::FlxSampled { .. } => 1,
        _ => threads,
    };
    let build = |index: u64, prev: Option<&Built>| {
        let (epoch, it) = (index / n, (index % n) as usize);
        build_step(inputs, schedule, epoch, it, prev)
            .and_then(|b| {
                crate::budget::check_budget(budget, &b.2.model_bytes, "this step's plan")?;
                Ok(b)
            })
            .with_context(|| format!("epoch {} iteration {it}", epoch + 1))
    };
    produce_steps(epochs as u64 * n, threads, feed, counts, &build, fetch);
}

/// Runs `build` for steps `feed.first..total` on `threads` threads (step `i` on thread `i %
/// threads`, each handing its previous step back to `build`) and records what each computes
/// in `counts`. A step that is not its predecessor again is staged and goes through the fetch
/// stage ([`fetch_steps`]) when `fetch` is given; otherwise it is pushed into `feed` as built.
/// The first failure is recorded in the feed for the rank that asks for that step.
fn produce_steps(
    total: u64,
    threads: usize,
    feed: &Feed,
    counts: &StepCounts,
    build: &(dyn Fn(u64, Option<&Built>) -> anyhow::Result<Built> + Sync),
    fetch: Option<Fetch<'_>>,
) {
    let threads = threads.max(1) as u64;
    let producer = |first: u64| {
        let mut prev: Option<Built> = None;
        for index in (first..total).step_by(threads as usize) {
            if !feed.may_build(index) {
                return;
            }
            // Busy seconds only: waiting for the feed is not building.
            let building = std::time::Instant::now();
            let built_step = build(index, prev.as_ref()).and_then(|b| {
                let again = prev.as_ref().is_some_and(|p| Arc::ptr_eq(&p.1, &b.1));
                if let (Some(fetch), false) = (fetch, again) {
                    (fetch.stage)(&b.1).context("preparing the step's inputs")?;
                }
                Ok((b, again))
            });
            let (b, again) = match built_step {
                Ok(b) => b,
                Err(e) => {
                    feed.fail(index, format!("{e:#}"));
                    return;
                }
            };
            let seconds = BuildSeconds {
                total: building.elapsed().as_secs_f64(),
                inputs: 0.0,
            };
            if feed.wants(index) {
                counts.insert(index, b.2.clone(), seconds);
            }
            let step = b.1.clone();
            prev = Some(b);
            let offered = match (fetch, again) {
                // The fetch stage reads its rows and offers it.
                (Some(_), false) => {
                    feed.planned(index, step);
                    true
                }
                _ => feed.push(index, step),
            };
            if !offered {
                return;
            }
        }
    };
    let cores = rayon::current_num_threads();
    std::thread::scope(|scope| {
        if let Some(fetch) = fetch {
            let spawned = std::thread::Builder::new()
                .name("grandis-fetch".into())
                .spawn_scoped(scope, move || fetch_steps(total, feed, counts, fetch));
            if let Err(e) = spawned {
                feed.fail(feed.first, format!("starting the fetch thread: {e}"));
                return;
            }
        }
        for t in 0..threads {
            let producer = &producer;
            let spawned = std::thread::Builder::new()
                .name(format!("grandis-plans-{t}"))
                .spawn_scoped(scope, move || {
                    match producer_pool(threads as usize, cores, t as usize) {
                        Ok(Some(pool)) => pool.install(|| producer(feed.first + t)),
                        Ok(None) => producer(feed.first + t),
                        Err(e) => feed.fail(feed.first + t, format!("{e:#}")),
                    }
                });
            if let Err(e) = spawned {
                feed.fail(
                    feed.first + t,
                    format!("starting a plan producer thread: {e}"),
                );
            }
        }
    });
}

/// The fetch stage: takes the planned steps `feed.first..total` in order, reads each one's
/// inputs once it is fewer than `fetch.ahead` steps ahead of the ranks, adds the seconds to
/// its counts and offers it to the ranks. Stops at the first step that failed (to build here
/// or to read) and when the feed closes.
fn fetch_steps(total: u64, feed: &Feed, counts: &StepCounts, fetch: Fetch<'_>) {
    for index in feed.first..total {
        let Some(step) = feed.next_planned(index) else {
            return;
        };
        if !feed.may_fetch(index, fetch.ahead) {
            return;
        }
        let reading = std::time::Instant::now();
        if let Err(e) = (fetch.read)(&step).context("preparing the step's inputs") {
            feed.fail(index, format!("{e:#}"));
            return;
        }
        counts.add_inputs(index, reading.elapsed().as_secs_f64());
        if !feed.push(index, step) {
            return;
        }
    }
}

/// The rayon pool producer `index` of `producers` builds its steps on when they are several:
/// `cores` shared out among them. On one shared pool a producer's parallel stages wait on work
/// the others stole and take their parallel paths (row runs built apart, then joined by a copy)
/// where one thread's straight path is cheaper: two producers built steps at 1.2-1.4x the rate
/// of one that way and at 1.5-2.0x each on its own thread (docs/benchmarks.md, "Mini-batch
/// steps against DGL's CPU sampler"). None for a single producer: it keeps every core of the
/// pool it runs on.
pub(crate) fn producer_pool(
    producers: usize,
    cores: usize,
    index: usize,
) -> anyhow::Result<Option<rayon::ThreadPool>> {
    if producers <= 1 {
        return Ok(None);
    }
    rayon::ThreadPoolBuilder::new()
        .num_threads((cores / producers).max(1))
        .thread_name(move |i| format!("grandis-plans-{index}-{i}"))
        .build()
        .map(Some)
        .context("starting a plan producer's thread pool")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn step() -> Arc<Step> {
        Arc::new(Step::new(Vec::new(), 0))
    }

    /// Peeking at a step neither takes it nor waits: the step stays for every rank, and a
    /// step not built yet (or taken by every rank) is None.
    #[test]
    fn peeking_takes_nothing() {
        let feed = Feed::new(2, 4, 0);
        assert!(feed.peek(0).is_none());
        feed.push(0, step());
        assert!(feed.peek(0).is_some());
        feed.take(0).unwrap();
        assert!(feed.peek(0).is_some(), "one rank has not taken it");
        feed.take(0).unwrap();
        assert!(feed.peek(0).is_none());
    }

    /// Steps built by `threads` producers and read by the fetch stage `ahead` steps ahead:
    /// returns how many steps were planned and how many read once the ranks (one, taking steps
    /// in order) have taken step 0 and nothing else, and, after they took every step, the
    /// order in which the fetch stage read them.
    fn run_stages(total: u64, threads: usize, depth: usize, ahead: u64) -> (u64, u64, Vec<u64>) {
        use std::sync::atomic::{AtomicU64, Ordering};
        let feed = Feed::new(1, depth, 0);
        let counts = StepCounts::default();
        let (planned, read) = (AtomicU64::new(0), Mutex::new(Vec::new()));
        // Each step carries its index (as its target count) for the fetch stage to record.
        let build = |index: u64, _: Option<&Built>| -> anyhow::Result<Built> {
            let step = Arc::new(Step::new(Vec::new(), index as usize));
            Ok((index, step, StepStats::default()))
        };
        let stage = |_: &Step| -> anyhow::Result<()> {
            planned.fetch_add(1, Ordering::SeqCst);
            Ok(())
        };
        let read_step = |s: &Step| -> anyhow::Result<()> {
            read.lock().unwrap().push(s.targets as u64);
            Ok(())
        };
        let fetch = Fetch {
            stage: &stage,
            read: &read_step,
            ahead,
        };
        let mut seen = (0, 0);
        std::thread::scope(|scope| {
            scope.spawn(|| produce_steps(total, threads, &feed, &counts, &build, Some(fetch)));
            let first = feed.take(0).unwrap();
            drop(first);
            // The stages settle: producers fill the window, the fetch stage its `ahead`.
            let t = std::time::Instant::now();
            while planned.load(Ordering::SeqCst) < depth.min(total as usize) as u64
                && t.elapsed().as_secs() < 10
            {
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
            seen = (
                planned.load(Ordering::SeqCst),
                read.lock().unwrap().len() as u64,
            );
            for i in 1..total {
                feed.take(i).unwrap();
            }
        });
        let sums = counts.sums();
        assert_eq!(sums.steps, total);
        assert!(sums.inputs_seconds > 0.0 && sums.inputs_seconds <= sums.build_seconds);
        (seen.0, seen.1, read.into_inner().unwrap())
    }

    /// Producers plan the whole window ahead of the ranks while the fetch stage reads only
    /// `ahead` steps of it: reading, not planning, is what waits for the ranks.
    #[test]
    fn producers_plan_past_the_read_window() {
        for threads in [1, 3] {
            let (planned, read, order) = run_stages(12, threads, 6, 2);
            // The ranks took step 0, so steps 1..7 may be built (6 from the oldest not taken)
            // and steps 1 and 2 read (2 ahead), besides step 0.
            assert_eq!(planned, 7, "{threads} producers");
            assert_eq!(read, 3, "{threads} producers");
            assert_eq!(order, (0..12).collect::<Vec<_>>());
        }
    }

    /// A step whose inputs cannot be read fails for the rank that asks for it, with the
    /// reason; earlier steps are trained as usual.
    #[test]
    fn a_failed_read_reaches_the_rank() {
        let feed = Feed::new(1, 4, 0);
        let counts = StepCounts::default();
        let build = |index: u64, _: Option<&Built>| -> anyhow::Result<Built> {
            Ok((index, step(), StepStats::default()))
        };
        let stage = |_: &Step| -> anyhow::Result<()> { Ok(()) };
        let reads = std::sync::atomic::AtomicU64::new(0);
        let read = |_: &Step| -> anyhow::Result<()> {
            if reads.fetch_add(1, std::sync::atomic::Ordering::SeqCst) == 2 {
                anyhow::bail!("feature file truncated");
            }
            Ok(())
        };
        let fetch = Fetch {
            stage: &stage,
            read: &read,
            ahead: 1,
        };
        std::thread::scope(|scope| {
            scope.spawn(|| produce_steps(6, 2, &feed, &counts, &build, Some(fetch)));
            feed.take(0).unwrap();
            feed.take(1).unwrap();
            let e = feed.take(2).err().expect("step 2 failed");
            assert!(format!("{e:#}").contains("feature file truncated"), "{e:#}");
            feed.close();
        });
    }

    /// A producer fills the window of `depth` steps at once and waits there until the ranks
    /// take the oldest.
    #[test]
    fn the_window_fills_and_waits() {
        use std::sync::atomic::{AtomicU64, Ordering};
        let feed = Feed::new(1, 4, 0);
        let pushed = AtomicU64::new(0);
        std::thread::scope(|scope| {
            scope.spawn(|| {
                for i in 0..6 {
                    if !feed.push(i, step()) {
                        return;
                    }
                    pushed.fetch_add(1, Ordering::SeqCst);
                }
            });
            // Reaching a count is polled (slow machines); staying below one is checked after a
            // pause (a wrong build would have happened by then).
            let reaches = |n: u64| {
                let t = std::time::Instant::now();
                while pushed.load(Ordering::SeqCst) < n && t.elapsed().as_secs() < 10 {
                    std::thread::sleep(std::time::Duration::from_millis(1));
                }
                std::thread::sleep(std::time::Duration::from_millis(50));
                pushed.load(Ordering::SeqCst)
            };
            assert_eq!(reaches(4), 4, "the window fills");
            for i in 0..6 {
                feed.take(i).unwrap();
            }
            feed.close();
        });
        assert_eq!(pushed.load(Ordering::SeqCst), 6);
    }
}
