//! Durable state in one redb file: jobs (as JSON, keyed by id), each job's latest checkpoint
//! (the bytes its leader uploaded), id counters and per-label election terms. Daemons are not stored: they re-register after a restart (their ids keep
//! increasing because the counter is stored).

use std::path::{Path, PathBuf};
use std::sync::Mutex;

use std::panic::AssertUnwindSafe;

use anyhow::{anyhow, Context};
use grandis_wire::{EpochProgress, JobId, JobRetry, JobSpec, JobState, RunSummary, ServerSlot};
use redb::{Database, DatabaseError, Durability, ReadableTable, StorageError, TableDefinition};
use serde::{Deserialize, Serialize};

const JOBS: TableDefinition<u64, &[u8]> = TableDefinition::new("jobs");
const META: TableDefinition<&str, u64> = TableDefinition::new("meta");
const TERMS: TableDefinition<&str, u64> = TableDefinition::new("terms");
/// The latest checkpoint file of a job, keyed by job id (its epoch is in the job record).
const CHECKPOINTS: TableDefinition<u64, &[u8]> = TableDefinition::new("checkpoints");

pub const NEXT_JOB_ID: &str = "next_job_id";
pub const NEXT_DAEMON_ID: &str = "next_daemon_id";

/// Everything the coordinator keeps about a job.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct JobRecord {
    pub id: JobId,
    pub spec: JobSpec,
    pub state: JobState,
    pub submitted_at_ms: u64,
    pub started_at_ms: Option<u64>,
    pub finished_at_ms: Option<u64>,
    /// Servers in server-index order (empty while queued).
    pub servers: Vec<ServerSlot>,
    /// Server indices that reported `finished`.
    pub finished_servers: Vec<u32>,
    pub history: Vec<EpochProgress>,
    pub summary: Option<RunSummary>,
    /// Each time the job went back to the queue (its length + 1 is the current attempt).
    #[serde(default)]
    pub retries: Vec<JobRetry>,
    /// Epoch of the checkpoint stored for the job (in the checkpoints table).
    #[serde(default)]
    pub checkpoint_epoch: Option<u32>,
}

impl JobRecord {
    /// A job just submitted: queued, nothing run or reported yet.
    pub fn queued(id: JobId, spec: JobSpec, submitted_at_ms: u64) -> JobRecord {
        JobRecord {
            id,
            spec,
            state: JobState::Queued,
            submitted_at_ms,
            started_at_ms: None,
            finished_at_ms: None,
            servers: Vec::new(),
            finished_servers: Vec::new(),
            history: Vec::new(),
            summary: None,
            retries: Vec::new(),
            checkpoint_epoch: None,
        }
    }

    /// Which run of the job this is: 1, plus one per retry.
    pub fn attempt(&self) -> u32 {
        self.retries.len() as u32 + 1
    }

    /// The checkpoint epoch the current run resumes after (`None`: from scratch).
    pub fn resume_epoch(&self) -> Option<u32> {
        self.retries.last().and_then(|r| r.resume_epoch)
    }

    /// The assigned run has started on a server. A retry runs (and reports) the epochs after
    /// its checkpoint again: they leave the history now (a run a coordinator restart ended
    /// kept them until here, as its own report may still have come).
    pub fn start(&mut self) {
        self.state = JobState::Running;
        self.started_at_ms.get_or_insert_with(crate::state::now_ms);
        if !self.retries.is_empty() {
            let resume_epoch = self.resume_epoch();
            self.history
                .retain(|p| resume_epoch.is_some_and(|e| p.epoch <= e));
        }
    }
}

pub struct Store {
    path: PathBuf,
    /// `None` once closed, so a restarted coordinator in the same process can reopen the file.
    db: Mutex<Option<Database>>,
}

impl Store {
    /// Opens (or creates) the database. A damaged file is a [`Damaged`] error, whose message
    /// says how to start over; redb repairs what it can (an unclean shutdown) by itself.
    pub fn open(path: &Path) -> anyhow::Result<Store> {
        if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
            std::fs::create_dir_all(parent)
                .with_context(|| format!("creating the directory of {}", path.display()))?;
        }
        // redb makes a new database of an empty file without a word; an empty file where the
        // database should be was truncated or never written, and the jobs it held are gone.
        if std::fs::metadata(path).is_ok_and(|m| m.is_file() && m.len() == 0) {
            return Err(Damaged::new(path, "the file is empty (0 bytes)").into());
        }
        let store = Store {
            path: path.to_path_buf(),
            db: Mutex::new(Some(open_redb(path)?)),
        };
        // Create the tables up front so that readers never meet a missing table.
        store.with_db(|db| {
            let tx = db.begin_write()?;
            tx.open_table(JOBS)?;
            tx.open_table(META)?;
            tx.open_table(TERMS)?;
            tx.open_table(CHECKPOINTS)?;
            tx.commit()?;
            Ok(())
        })?;
        Ok(store)
    }

    /// Moves a damaged database at `path` aside (to `PATH.damaged-UNIXSECONDS`) so that a new
    /// one can be created there; returns where it went, or `None` when the file opens fine (or
    /// does not exist) and was left alone. What the old file held is lost to the new one.
    pub fn set_aside_if_damaged(path: &Path) -> anyhow::Result<Option<PathBuf>> {
        if !path.exists() {
            return Ok(None);
        }
        let damaged = match Store::open(path).and_then(|s| s.check_readable()) {
            Ok(()) => return Ok(None),
            Err(e) if e.downcast_ref::<Damaged>().is_some() => e,
            Err(e) => return Err(e),
        };
        let secs = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let mut aside = path.as_os_str().to_owned();
        aside.push(format!(".damaged-{secs}"));
        let aside = PathBuf::from(aside);
        std::fs::rename(path, &aside).with_context(|| {
            format!(
                "moving the damaged database {} to {}",
                path.display(),
                aside.display()
            )
        })?;
        tracing::warn!(
            "{damaged:#}: moved it to {} and starting a new database",
            aside.display()
        );
        Ok(Some(aside))
    }

    /// Reads every row once (what a coordinator does at start), so damage shows up here.
    fn check_readable(&self) -> anyhow::Result<()> {
        self.load_jobs()?;
        self.load_terms()?;
        self.meta(NEXT_JOB_ID)?;
        self.meta(NEXT_DAEMON_ID)?;
        Ok(())
    }

    fn with_db<T>(&self, f: impl FnOnce(&Database) -> anyhow::Result<T>) -> anyhow::Result<T> {
        let guard = self.db.lock().unwrap_or_else(|e| e.into_inner());
        let db = guard
            .as_ref()
            .ok_or_else(|| anyhow!("database {} is closed", self.path.display()))?;
        // redb asserts on some damaged pages instead of returning an error.
        match grandis_telemetry::panic::catch_quietly(AssertUnwindSafe(|| f(db))) {
            Ok(result) => result.map_err(|e| match storage_damage(&e) {
                Some(reason) => Damaged::new(&self.path, reason).into(),
                None => e.context(format!("coordinator database {}", self.path.display())),
            }),
            Err(panic) => Err(Damaged::new(&self.path, panic).into()),
        }
    }

    pub fn load_jobs(&self) -> anyhow::Result<Vec<JobRecord>> {
        let path = &self.path;
        self.with_db(|db| {
            let tx = db.begin_read()?;
            let table = tx.open_table(JOBS)?;
            let mut out = Vec::new();
            for row in table.iter()? {
                let (k, v) = row?;
                let rec: JobRecord = serde_json::from_slice(v.value()).map_err(|e| {
                    Damaged::new(path, format!("job {} does not parse: {e}", k.value()))
                })?;
                out.push(rec);
            }
            Ok(out)
        })
    }

    pub fn load_terms(&self) -> anyhow::Result<Vec<(String, u64)>> {
        self.with_db(|db| {
            let tx = db.begin_read()?;
            let table = tx.open_table(TERMS)?;
            let mut out = Vec::new();
            for row in table.iter()? {
                let (k, v) = row?;
                out.push((k.value().to_string(), v.value()));
            }
            Ok(out)
        })
    }

    pub fn meta(&self, key: &str) -> anyhow::Result<Option<u64>> {
        self.with_db(|db| {
            let tx = db.begin_read()?;
            let table = tx.open_table(META)?;
            Ok(table.get(key)?.map(|v| v.value()))
        })
    }

    /// Writes a job (and optionally a counter) in one transaction. `durable = false` is for
    /// progress updates: redb then skips the fsync, and the next durable commit persists them.
    pub fn put_job(
        &self,
        rec: &JobRecord,
        counter: Option<(&str, u64)>,
        durable: bool,
    ) -> anyhow::Result<()> {
        let bytes = serde_json::to_vec(rec)?;
        self.with_db(|db| {
            let mut tx = db.begin_write()?;
            if !durable {
                tx.set_durability(Durability::Eventual);
            }
            {
                let mut jobs = tx.open_table(JOBS)?;
                jobs.insert(rec.id, bytes.as_slice())?;
                if let Some((key, value)) = counter {
                    let mut meta = tx.open_table(META)?;
                    meta.insert(key, value)?;
                }
            }
            tx.commit()?;
            Ok(())
        })
        .with_context(|| format!("saving job {}", rec.id))
    }

    /// Stores a job's checkpoint and its record (which names the checkpoint's epoch) in one
    /// durable transaction, so the two never disagree.
    pub fn put_checkpoint(&self, rec: &JobRecord, checkpoint: &[u8]) -> anyhow::Result<()> {
        let bytes = serde_json::to_vec(rec)?;
        self.with_db(|db| {
            let tx = db.begin_write()?;
            {
                tx.open_table(JOBS)?.insert(rec.id, bytes.as_slice())?;
                tx.open_table(CHECKPOINTS)?.insert(rec.id, checkpoint)?;
            }
            tx.commit()?;
            Ok(())
        })
        .with_context(|| format!("saving the checkpoint of job {}", rec.id))
    }

    /// Deletes a job's checkpoint and stores its record (which no longer names one) in one
    /// transaction.
    pub fn drop_checkpoint(&self, rec: &JobRecord) -> anyhow::Result<()> {
        let bytes = serde_json::to_vec(rec)?;
        self.with_db(|db| {
            let tx = db.begin_write()?;
            {
                tx.open_table(JOBS)?.insert(rec.id, bytes.as_slice())?;
                tx.open_table(CHECKPOINTS)?.remove(rec.id)?;
            }
            tx.commit()?;
            Ok(())
        })
        .with_context(|| format!("deleting the checkpoint of job {}", rec.id))
    }

    /// The stored checkpoint of a job, if any.
    pub fn checkpoint(&self, id: JobId) -> anyhow::Result<Option<Vec<u8>>> {
        self.with_db(|db| {
            let tx = db.begin_read()?;
            let table = tx.open_table(CHECKPOINTS)?;
            Ok(table.get(id)?.map(|v| v.value().to_vec()))
        })
    }

    pub fn put_meta(&self, key: &str, value: u64) -> anyhow::Result<()> {
        self.with_db(|db| {
            let tx = db.begin_write()?;
            tx.open_table(META)?.insert(key, value)?;
            tx.commit()?;
            Ok(())
        })
    }

    pub fn put_term(&self, label: &str, term: u64) -> anyhow::Result<()> {
        self.with_db(|db| {
            let tx = db.begin_write()?;
            tx.open_table(TERMS)?.insert(label, term)?;
            tx.commit()?;
            Ok(())
        })
    }

    /// Closes the database file (later calls fail with "database ... is closed").
    pub fn close(&self) {
        self.db.lock().unwrap_or_else(|e| e.into_inner()).take();
    }
}

/// The database file is damaged (truncated, overwritten, or written by something else): the
/// coordinator cannot read its jobs. The message says how to start over.
#[derive(Debug)]
pub struct Damaged {
    pub path: PathBuf,
    pub reason: String,
}

impl Damaged {
    fn new(path: &Path, reason: impl Into<String>) -> Damaged {
        Damaged {
            path: path.to_path_buf(),
            reason: reason.into(),
        }
    }
}

impl std::fmt::Display for Damaged {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "coordinator database {} is damaged ({}). To start over with a new database, \
             keeping the damaged file beside it, run the coordinator once with \
             --reset-damaged-db (queued and running jobs in the old file are not carried \
             over; daemons register again by themselves). See docs/guide.md, \"Troubleshooting\".",
            self.path.display(),
            self.reason
        )
    }
}

impl std::error::Error for Damaged {}

/// Opens or creates the redb file. redb 2 panics (an assertion in its page manager) on a file
/// shorter than its header says, which is what any truncation leaves: that, and the errors
/// redb itself calls corruption, are [`Damaged`].
fn open_redb(path: &Path) -> anyhow::Result<Database> {
    match grandis_telemetry::panic::catch_quietly(|| Database::create(path)) {
        Ok(Ok(db)) => Ok(db),
        Ok(Err(DatabaseError::Storage(StorageError::Corrupted(reason)))) => {
            Err(Damaged::new(path, reason).into())
        }
        // What redb says of a file that is not one of its databases (bad magic, too short).
        Ok(Err(DatabaseError::Storage(StorageError::Io(e))))
            if matches!(
                e.kind(),
                std::io::ErrorKind::InvalidData | std::io::ErrorKind::UnexpectedEof
            ) =>
        {
            Err(Damaged::new(path, format!("not a readable redb file: {e}")).into())
        }
        Ok(Err(DatabaseError::RepairAborted)) => {
            Err(Damaged::new(path, "redb could not repair it").into())
        }
        Ok(Err(e)) => Err(anyhow::Error::new(e)
            .context(format!("opening coordinator database {}", path.display()))),
        Err(panic) => Err(Damaged::new(path, format!("redb: {panic}")).into()),
    }
}

/// The reason, when an error from inside a transaction is redb reporting corruption.
fn storage_damage(e: &anyhow::Error) -> Option<String> {
    e.chain().find_map(|cause| {
        let storage = cause
            .downcast_ref::<StorageError>()
            .or_else(|| match cause.downcast_ref::<redb::TransactionError>() {
                Some(redb::TransactionError::Storage(s)) => Some(s),
                _ => None,
            })
            .or_else(|| match cause.downcast_ref::<redb::TableError>() {
                Some(redb::TableError::Storage(s)) => Some(s),
                _ => None,
            })
            .or_else(|| match cause.downcast_ref::<redb::CommitError>() {
                Some(redb::CommitError::Storage(s)) => Some(s),
                _ => None,
            });
        match storage {
            Some(StorageError::Corrupted(reason)) => Some(reason.clone()),
            _ => None,
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jobs_counters_and_terms_survive_reopening() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sub/c.redb");
        let spec = JobSpec {
            dataset: "d".into(),
            ..JobSpec::default()
        };
        let rec = JobRecord {
            checkpoint_epoch: Some(2),
            ..JobRecord::queued(4, spec, 9)
        };
        {
            let s = Store::open(&path).unwrap();
            s.put_job(&rec, Some((NEXT_JOB_ID, 5)), true).unwrap();
            s.put_term("a", 3).unwrap();
            s.close();
            assert!(s
                .meta(NEXT_JOB_ID)
                .unwrap_err()
                .to_string()
                .contains("closed"));
        }
        let s = Store::open(&path).unwrap();
        assert_eq!(s.load_jobs().unwrap(), vec![rec.clone()]);
        assert_eq!(s.checkpoint(4).unwrap(), None);
        s.put_checkpoint(&rec, b"weights").unwrap();
        s.close();
        let s = Store::open(&path).unwrap();
        assert_eq!(s.checkpoint(4).unwrap().as_deref(), Some(&b"weights"[..]));
        assert_eq!(s.meta(NEXT_JOB_ID).unwrap(), Some(5));
        assert_eq!(s.meta(NEXT_DAEMON_ID).unwrap(), None);
        assert_eq!(s.load_terms().unwrap(), vec![("a".to_string(), 3)]);
    }
}

#[cfg(test)]
mod damage_tests {
    use super::*;

    fn job(id: u64) -> JobRecord {
        let spec = JobSpec {
            dataset: format!("dataset-{id}-{}", "x".repeat(2000)),
            ..JobSpec::default()
        };
        JobRecord::queued(id, spec, id)
    }

    fn filled_database(dir: &Path) -> (PathBuf, Vec<u8>) {
        let path = dir.join("c.redb");
        let s = Store::open(&path).unwrap();
        for id in 0..400 {
            s.put_job(&job(id), Some((NEXT_JOB_ID, id + 1)), id % 50 == 0)
                .unwrap();
        }
        s.put_term("node-a", 3).unwrap();
        s.close();
        let bytes = std::fs::read(&path).unwrap();
        (path, bytes)
    }

    /// Opens like a starting coordinator does; `Ok(jobs)` or the error's text.
    fn open_and_read(path: &Path) -> Result<usize, anyhow::Error> {
        let s = Store::open(path)?;
        s.check_readable()?;
        Ok(s.load_jobs()?.len())
    }

    #[test]
    fn every_truncation_is_a_damaged_error_naming_the_way_back() {
        let dir = tempfile::tempdir().unwrap();
        let (_, full) = filled_database(dir.path());
        assert!(full.len() > 1 << 20, "{} bytes", full.len());
        let cuts = (1..full.len())
            .step_by(full.len() / 23)
            .chain([4096, full.len() - 1]);
        for cut in cuts {
            let p = dir.path().join(format!("t{cut}.redb"));
            std::fs::write(&p, &full[..cut]).unwrap();
            let err = open_and_read(&p).expect_err("a truncated file opened");
            let damaged = err
                .downcast_ref::<Damaged>()
                .unwrap_or_else(|| panic!("cut {cut}: not Damaged: {err:#}"));
            assert_eq!(damaged.path, p);
            let text = err.to_string();
            assert!(
                text.contains("is damaged") && text.contains("--reset-damaged-db"),
                "{text}"
            );
        }
    }

    /// An empty file is damage too (redb would silently start a new database in it), and the
    /// reset sets it aside like any other.
    #[test]
    fn an_empty_database_file_is_damaged_not_new() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("empty.redb");
        std::fs::write(&path, b"").unwrap();
        let err = open_and_read(&path).expect_err("an empty file opened as a new database");
        assert!(err.downcast_ref::<Damaged>().is_some(), "{err:#}");
        let text = err.to_string();
        assert!(
            text.contains("empty.redb") && text.contains("empty (0 bytes)"),
            "{text}"
        );
        let aside = Store::set_aside_if_damaged(&path).unwrap().expect("moved");
        assert_eq!(std::fs::read(&aside).unwrap(), b"");
        assert_eq!(open_and_read(&path).unwrap(), 0);
    }

    #[test]
    fn flipped_bytes_never_panic() {
        let dir = tempfile::tempdir().unwrap();
        let (_, full) = filled_database(dir.path());
        let mut rng = 0x9e3779b97f4a7c15u64;
        for trial in 0..40 {
            let mut bytes = full.clone();
            for _ in 0..8 {
                rng ^= rng << 13;
                rng ^= rng >> 7;
                rng ^= rng << 17;
                let at = (rng % bytes.len() as u64) as usize;
                bytes[at] ^= 0x5a;
            }
            let p = dir.path().join(format!("f{trial}.redb"));
            std::fs::write(&p, &bytes).unwrap();
            // Either it still reads (redb repaired it, or the flips hit free space) or it is
            // an error; a panic fails the test.
            if let Err(e) = open_and_read(&p) {
                assert!(!format!("{e:#}").is_empty());
            }
        }
    }

    #[test]
    fn reset_sets_a_damaged_file_aside_and_leaves_a_healthy_one() {
        let dir = tempfile::tempdir().unwrap();
        let (path, full) = filled_database(dir.path());
        assert_eq!(Store::set_aside_if_damaged(&path).unwrap(), None);
        assert_eq!(open_and_read(&path).unwrap(), 400);
        assert_eq!(
            Store::set_aside_if_damaged(&dir.path().join("absent.redb")).unwrap(),
            None
        );

        std::fs::write(&path, &full[..full.len() / 2]).unwrap();
        let aside = Store::set_aside_if_damaged(&path).unwrap().expect("moved");
        assert!(aside.to_string_lossy().contains("c.redb.damaged-"));
        assert_eq!(std::fs::read(&aside).unwrap(), &full[..full.len() / 2]);
        assert_eq!(open_and_read(&path).unwrap(), 0);
    }
}
