//! The ranges and combinations a read job must satisfy ([`JobSpec::validate`]), and the extra
//! ones of a cluster job.

use super::kinds::{InterTransport, Mode, ModelKind, Task};
use super::{
    task_conflict, FieldError, JobSpec, Sampling, SpecError, NAME_MAX_BYTES, PATH_MAX_BYTES,
};

impl JobSpec {
    /// Checks ranges and combinations; every message names its field.
    pub fn validate(&self) -> Result<(), SpecError> {
        let mut errors = Vec::new();
        let mut err = |field: &str, message: String| {
            errors.push(FieldError {
                field: field.into(),
                message,
            })
        };
        if self.dataset.trim().is_empty() {
            err(
                "dataset",
                "must not be empty (the dataset directory, as a path on every server)".into(),
            );
        }
        // Paths end up in log lines and job names: none a server can open is longer than
        // PATH_MAX, and a longer one would only make 100 KB log lines.
        if self.dataset.len() > PATH_MAX_BYTES {
            err(
                "dataset",
                format!(
                    "must be at most {PATH_MAX_BYTES} bytes (the longest path a server opens), \
                     got {}",
                    self.dataset.len()
                ),
            );
        }
        // Names and paths end up in log lines and terminals: a newline or an escape code in
        // them could forge log lines or repaint a user's screen.
        if self.dataset.chars().any(char::is_control) {
            err(
                "dataset",
                "must not contain control characters (newlines, tabs, escape codes)".into(),
            );
        }
        if let Some(dir) = &self.partition_dir {
            if dir.trim().is_empty() || dir.chars().any(char::is_control) {
                err(
                    "partition_dir",
                    "must be a directory path (not empty, no control characters)".into(),
                );
            }
        }
        if let Some(p) = &self.predict {
            if p.dir.trim().is_empty() || p.dir.chars().any(char::is_control) {
                err(
                    "predict.dir",
                    "must be a directory path (not empty, no control characters)".into(),
                );
            }
            if p.block_memory == Some(0) {
                err("predict.block_memory", "must be > 0 bytes".into());
            }
            if self.mode == Mode::Single {
                err(
                    "predict",
                    "runs on the ranks of a distributed mode; with mode single, run `grandis \
                     predict` on the checkpoint"
                        .into(),
                );
            }
        }
        if let Some(name) = &self.name {
            if name.chars().any(char::is_control) {
                err(
                    "name",
                    "must not contain control characters (newlines, tabs, escape codes)".into(),
                );
            } else if name.trim().is_empty() {
                err("name", "must not be empty when given".into());
            } else if name.len() > NAME_MAX_BYTES {
                err(
                    "name",
                    format!("must be at most {NAME_MAX_BYTES} bytes, got {}", name.len()),
                );
            }
        }
        if self.layers < 1 {
            err("layers", format!("must be ≥ 1, got {}", self.layers));
        }
        if self.hidden < 1 {
            err("hidden", format!("must be ≥ 1, got {}", self.hidden));
        }
        if self.num_bases.is_some() && self.model != ModelKind::Rgcn {
            err(
                "num_bases",
                format!(
                    "decomposes rgcn's relation weights; model {} has none",
                    self.model
                ),
            );
        }
        if self.heads < 1 || self.output_heads < 1 {
            let (field, v) = if self.heads < 1 {
                ("heads", self.heads)
            } else {
                ("output_heads", self.output_heads)
            };
            err(field, format!("must be ≥ 1, got {v}"));
        } else if self.model.uses_attention()
            && self.layers > 1
            && !self.hidden.is_multiple_of(self.heads)
        {
            err(
                "heads",
                format!(
                    "must divide hidden ({}) for {}: the heads split the hidden width, got {}",
                    self.hidden, self.model, self.heads
                ),
            );
        }
        if self.epochs < 1 {
            err("epochs", format!("must be ≥ 1, got {}", self.epochs));
        }
        if self.servers < 1 {
            err("servers", format!("must be ≥ 1, got {}", self.servers));
        }
        if self.devices < 1 {
            err("devices", format!("must be ≥ 1, got {}", self.devices));
        }
        if !(self.dropout.is_finite() && (0.0..1.0).contains(&self.dropout)) {
            err(
                "dropout",
                format!("must be in [0, 1), got {}", self.dropout),
            );
        }
        if !(self.lr.is_finite() && self.lr > 0.0) {
            err(
                "lr",
                format!("must be a finite number > 0, got {}", self.lr),
            );
        }
        if !(self.weight_decay.is_finite() && self.weight_decay >= 0.0) {
            err(
                "weight_decay",
                format!("must be a finite number ≥ 0, got {}", self.weight_decay),
            );
        }
        if self.mode == Mode::Single && (self.servers != 1 || self.devices != 1) {
            err(
                if self.servers != 1 {
                    "servers"
                } else {
                    "devices"
                },
                format!(
                    "mode 'single' runs on one device of one server; got servers = {}, devices = {}",
                    self.servers, self.devices
                ),
            );
        }
        if let Some(c) = self.grad_clip {
            if !(c.is_finite() && c > 0.0) {
                err("grad_clip", format!("must be a finite number > 0, got {c}"));
            }
        }
        if self.model == ModelKind::Mlp && self.mode.is_distributed() {
            err(
                "model",
                format!(
                    "mlp (features only) has no graph to distribute: use mode 'single' (mode is '{}')",
                    self.mode
                ),
            );
        }
        if let Some(k) = self.preload_hops {
            if !matches!(self.mode, Mode::Flx | Mode::Cob | Mode::Auto) {
                err(
                    "preload_hops",
                    format!(
                        "only used by modes flx, cob and auto (mode is '{}')",
                        self.mode
                    ),
                );
            } else if k > self.layers {
                err(
                    "preload_hops",
                    format!("must be ≤ layers ({}), got {k}", self.layers),
                );
            }
        }
        if let Some(b) = self.batch_size {
            if !(self.mode.is_mini_batch() || self.mode == Mode::Auto) {
                err(
                    "batch_size",
                    format!(
                        "only used by the mini-batch modes mb, cob and auto (mode is '{}')",
                        self.mode
                    ),
                );
            } else if b < 1 {
                err("batch_size", format!("must be ≥ 1, got {b}"));
            }
        }
        if let Some(n) = self.resample_every {
            if n < 1 {
                err("resample_every", format!("must be ≥ 1, got {n}"));
            } else if self.sampling == Sampling::None {
                err(
                    "resample_every",
                    "only used with sampling (sampling is 'none')".into(),
                );
            }
        }
        if self.inter_transport == InterTransport::Nccl && !self.mode.is_distributed() {
            err(
                "inter_transport",
                "nccl carries traffic between ranks; mode 'single' has none".into(),
            );
        }
        if let Some(x) = self.exact_preference {
            if self.mode != Mode::Auto {
                err(
                    "exact_preference",
                    format!("only used by mode auto (mode is '{}')", self.mode),
                );
            } else if !(x.is_finite() && x >= 1.0) {
                err(
                    "exact_preference",
                    format!("must be a number ≥ 1 (1 = no preference), got {x}"),
                );
            }
        }
        if let Some(st) = self.staleness {
            if !matches!(self.mode, Mode::Fb | Mode::Flx) {
                err(
                    "staleness",
                    format!(
                        "bounds the full-batch halo exchange of modes fb and flx (mode is '{}')",
                        self.mode
                    ),
                );
            } else if self.inter_transport == InterTransport::Nccl {
                err(
                    "staleness",
                    "skipped sends need the quic transport between servers (NCCL receives \
                     need their sizes in advance)"
                        .into(),
                );
            }
            if let Err(e) = st.check() {
                err("staleness", e);
            }
        }
        if let Some(f) = self.remote_features {
            if !self.mode.is_mini_batch() {
                err(
                    "remote_features",
                    format!(
                        "samples the features fetched from other servers in modes cob, mb and \
                         cluster (mode is '{}')",
                        self.mode
                    ),
                );
            } else if !(f.is_finite() && f > 0.0 && f <= 1.0) {
                err(
                    "remote_features",
                    format!("must be a fraction in (0, 1], got {f}"),
                );
            }
        }
        match (self.task, &self.link) {
            (Task::Node, Some(_)) => err(
                "link",
                "are link prediction's options: give them with task = \"link\"".into(),
            ),
            (Task::Link, link) => {
                if let Some(why) = task_conflict(Task::Link, self.mode, &self.sampling) {
                    err("task", why);
                }
                let link = link.unwrap_or_default();
                if !(1..=1000).contains(&link.negatives) {
                    err(
                        "link.negatives",
                        format!("must be 1..=1000, got {}", link.negatives),
                    );
                }
                if link.out_dim == Some(0) {
                    err("link.out_dim", "must be ≥ 1".into());
                }
            }
            (Task::Node, None) => {}
        }
        if self.embedding_dim > 0 {
            if let Some(why) = self.embedding_conflict() {
                err("embedding_dim", why);
            }
        }
        if self.device_memory == Some(0) {
            err("device_memory", "must be > 0 bytes".into());
        }
        if self.max_retries > 100 {
            err(
                "max_retries",
                format!("must be ≤ 100, got {}", self.max_retries),
            );
        }
        if self.mode == Mode::Auto && self.device_memory.is_none() {
            // Every server must reach the same FLX/CoB decision, so the budget comes from the
            // job, not from each daemon's own memory.
            err(
                "device_memory",
                "required with mode 'auto' (the per-device budget every server decides with)"
                    .into(),
            );
        }
        if let Some(why) = self.sampling.conflict_with(self.mode) {
            err("sampling", why);
        }
        match &self.sampling {
            Sampling::None => {}
            Sampling::Eas { hops, fanout, .. } => {
                if *hops < 1 {
                    err("sampling.hops", format!("must be ≥ 1, got {hops}"));
                }
                if *fanout < 1 {
                    err("sampling.fanout", format!("must be ≥ 1, got {fanout}"));
                }
            }
            Sampling::Fanout {
                fanouts,
                relation_fanouts,
            } => {
                let lists = std::iter::once(("sampling.fanouts".to_string(), fanouts)).chain(
                    relation_fanouts
                        .iter()
                        .map(|(name, list)| (format!("sampling.relation_fanouts.{name}"), list)),
                );
                for (field, list) in lists {
                    if list.len() != 1 && list.len() != self.layers as usize {
                        err(
                            &field,
                            format!(
                                "expected 1 value or {} (= layers), got {}",
                                self.layers,
                                list.len()
                            ),
                        );
                    }
                    if let Some(i) = list.iter().position(|&f| f < 1) {
                        err(
                            &field,
                            format!("every fanout must be ≥ 1, got 0 at index {i}"),
                        );
                    }
                }
                if relation_fanouts.keys().any(|k| k.trim().is_empty()) {
                    err(
                        "sampling.relation_fanouts",
                        "a relation's name must not be empty".to_string(),
                    );
                }
            }
            Sampling::Saint { walk_length } => {
                if *walk_length > 1024 {
                    err(
                        "sampling.walk_length",
                        format!("must be ≤ 1024, got {walk_length}"),
                    );
                }
            }
        }
        if errors.is_empty() {
            Ok(())
        } else {
            Err(SpecError::Invalid(errors))
        }
    }

    /// [`validate`](Self::validate), plus what a job submitted to a cluster must also be:
    /// partition-parallel (`single` is the one-process trainer of `grandis train`).
    pub fn check_cluster_job(&self) -> Result<(), SpecError> {
        let mut errors = match self.validate() {
            Ok(()) => Vec::new(),
            Err(SpecError::Invalid(errors)) => errors,
            Err(e) => return Err(e),
        };
        if !self.mode.is_distributed() {
            errors.push(FieldError {
                field: "mode".into(),
                message: format!(
                    "'{}' is the single-process trainer (`grandis train --mode single`); a \
                     cluster job runs in mode fb, flx, cob, mb, cluster or auto",
                    self.mode
                ),
            });
        }
        if errors.is_empty() {
            Ok(())
        } else {
            Err(SpecError::Invalid(errors))
        }
    }
    /// Why this job's learnable node embeddings (`embedding_dim` > 0) cannot train as asked,
    /// if they cannot: every mode trains them, but outside mode single (where each rank keeps
    /// its own vertices' rows and the model's first stage must read them as its input's
    /// gradient reaches them) not ResSAGE+, whose encoder comes first.
    pub fn embedding_conflict(&self) -> Option<String> {
        (self.mode != Mode::Single && self.model == ModelKind::ResSage).then(|| {
            format!(
                "learnable node embeddings train outside mode single with models sage, gcn \
                 and gat so far, not {} (mode '{}'); it takes them in mode single",
                self.model, self.mode
            )
        })
    }
}
