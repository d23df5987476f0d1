//! Durable state in one redb file: jobs (as JSON, keyed by id), id counters and per-label
//! election terms. Daemons are not stored: they re-register after a restart (their ids keep
//! increasing because the counter is stored).

use std::path::{Path, PathBuf};
use std::sync::Mutex;

use anyhow::{anyhow, Context};
use grandis_wire::{EpochProgress, JobId, JobSpec, JobState, RunSummary, ServerSlot};
use redb::{Database, Durability, ReadableTable, TableDefinition};
use serde::{Deserialize, Serialize};

const JOBS: TableDefinition<u64, &[u8]> = TableDefinition::new("jobs");
const META: TableDefinition<&str, u64> = TableDefinition::new("meta");
const TERMS: TableDefinition<&str, u64> = TableDefinition::new("terms");

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
}

pub struct Store {
    path: PathBuf,
    /// `None` once closed, so a restarted coordinator in the same process can reopen the file.
    db: Mutex<Option<Database>>,
}

impl Store {
    pub fn open(path: &Path) -> anyhow::Result<Store> {
        if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
            std::fs::create_dir_all(parent)
                .with_context(|| format!("creating the directory of {}", path.display()))?;
        }
        let db = Database::create(path)
            .with_context(|| format!("opening coordinator database {}", path.display()))?;
        // Create the tables up front so that readers never meet a missing table.
        let tx = db.begin_write()?;
        tx.open_table(JOBS)?;
        tx.open_table(META)?;
        tx.open_table(TERMS)?;
        tx.commit()?;
        Ok(Store {
            path: path.to_path_buf(),
            db: Mutex::new(Some(db)),
        })
    }

    fn with_db<T>(&self, f: impl FnOnce(&Database) -> anyhow::Result<T>) -> anyhow::Result<T> {
        let guard = self.db.lock().unwrap_or_else(|e| e.into_inner());
        let db = guard
            .as_ref()
            .ok_or_else(|| anyhow!("database {} is closed", self.path.display()))?;
        f(db).with_context(|| format!("coordinator database {}", self.path.display()))
    }

    pub fn load_jobs(&self) -> anyhow::Result<Vec<JobRecord>> {
        self.with_db(|db| {
            let tx = db.begin_read()?;
            let table = tx.open_table(JOBS)?;
            let mut out = Vec::new();
            for row in table.iter()? {
                let (k, v) = row?;
                let rec: JobRecord = serde_json::from_slice(v.value())
                    .with_context(|| format!("job {} is corrupt", k.value()))?;
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jobs_counters_and_terms_survive_reopening() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sub/c.redb");
        let rec = JobRecord {
            id: 4,
            spec: JobSpec {
                dataset: "d".into(),
                ..JobSpec::default()
            },
            state: JobState::Queued,
            submitted_at_ms: 9,
            started_at_ms: None,
            finished_at_ms: None,
            servers: vec![],
            finished_servers: vec![],
            history: vec![],
            summary: None,
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
        assert_eq!(s.load_jobs().unwrap(), vec![rec]);
        assert_eq!(s.meta(NEXT_JOB_ID).unwrap(), Some(5));
        assert_eq!(s.meta(NEXT_DAEMON_ID).unwrap(), None);
        assert_eq!(s.load_terms().unwrap(), vec![("a".to_string(), 3)]);
    }
}
