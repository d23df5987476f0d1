//! Reading a job document: the JSON or TOML text is parsed into a generic value first and then
//! read field by field ([`Reader`]), so that every problem is reported at once and each message
//! names its field.

use super::bytes::parse_bytes;
use super::kinds::{InterTransport, Mode, ModelKind, PartitionMethod, Priority};
use super::kinds::{LinkDecoder, Task};
use super::{FieldError, JobSpec, LinkSpec, PredictSpec, Sampling, SpecError, Staleness, FIELDS};
use serde_json::{Map, Value};
use std::collections::BTreeMap;

impl JobSpec {
    /// Parses and validates a JSON job document.
    pub fn from_json_str(text: &str) -> Result<JobSpec, SpecError> {
        let value: Value = serde_json::from_str(text).map_err(|e| SpecError::Syntax {
            format: "JSON",
            message: e.to_string(),
        })?;
        JobSpec::from_value(&value)
    }

    /// Parses and validates a TOML job document (same fields as JSON; `sampling` may be a
    /// string or a table).
    pub fn from_toml_str(text: &str) -> Result<JobSpec, SpecError> {
        let value: Value = toml::from_str(text).map_err(|e| SpecError::Syntax {
            format: "TOML",
            message: e.to_string().trim_end().to_string(),
        })?;
        JobSpec::from_value(&value)
    }

    /// Reads a job from a generic value (a JSON object), reporting every bad field, then
    /// [`validate`](Self::validate)s it.
    pub fn from_value(value: &Value) -> Result<JobSpec, SpecError> {
        let Some(obj) = value.as_object() else {
            return Err(SpecError::Invalid(vec![FieldError {
                field: "(document)".into(),
                message: format!(
                    "expected an object with the job's fields, got {}",
                    describe(value)
                ),
            }]));
        };
        let mut r = Reader {
            obj,
            prefix: "",
            errors: Vec::new(),
        };
        r.unknown_fields(FIELDS);
        let d = JobSpec::default();
        let mut spec = JobSpec {
            name: r.string("name"),
            dataset: match r.string("dataset") {
                Some(s) => s,
                None if !obj.contains_key("dataset") => {
                    r.error(
                        "dataset",
                        "required (the dataset directory, as a path on every server)",
                    );
                    String::new()
                }
                None => String::new(),
            },
            model: r
                .choice("model", "model", ModelKind::parse, ModelKind::EXPECTED)
                .unwrap_or(d.model),
            layers: r.uint("layers", 1, 1024).unwrap_or(d.layers),
            hidden: r.uint("hidden", 1, 1 << 16).unwrap_or(d.hidden),
            heads: r.uint("heads", 1, 256).unwrap_or(d.heads),
            output_heads: r.uint("output_heads", 1, 256).unwrap_or(d.output_heads),
            dropout: r.float("dropout").unwrap_or(d.dropout),
            lr: r.float("lr").unwrap_or(d.lr),
            weight_decay: r.float("weight_decay").unwrap_or(d.weight_decay),
            adamw: r.bool("adamw").unwrap_or(d.adamw),
            grad_clip: r.float("grad_clip"),
            layer_norm: r.bool("layer_norm").unwrap_or(d.layer_norm),
            mode: r
                .choice("mode", "mode", Mode::parse, Mode::EXPECTED)
                .unwrap_or(d.mode),
            preload_hops: r.uint("preload_hops", 0, 1024),
            batch_size: r.uint("batch_size", 1, u32::MAX as i64),
            sampling: d.sampling.clone(),
            resample_every: r.u64("resample_every"),
            exact_preference: r.float("exact_preference"),
            checkpoint_every: r.uint("checkpoint_every", 1, u32::MAX as i64),
            max_retries: r.uint("max_retries", 0, 100).unwrap_or(d.max_retries),
            elastic: r.bool("elastic").unwrap_or(d.elastic),
            epochs: r.uint("epochs", 1, 10_000_000).unwrap_or(d.epochs),
            eval_every: r
                .uint("eval_every", 0, u32::MAX as i64)
                .unwrap_or(d.eval_every),
            evaluate: r.bool("evaluate").unwrap_or(d.evaluate),
            seed: r.u64("seed").unwrap_or(d.seed),
            servers: r.uint("servers", 1, 4096).unwrap_or(d.servers),
            devices: r.uint("devices", 1, 256).unwrap_or(d.devices),
            partition: r
                .choice(
                    "partition",
                    "partition method",
                    PartitionMethod::parse,
                    PartitionMethod::EXPECTED,
                )
                .unwrap_or(d.partition),
            inter_transport: r
                .choice(
                    "inter_transport",
                    "inter-server transport",
                    InterTransport::parse,
                    InterTransport::EXPECTED,
                )
                .unwrap_or(d.inter_transport),
            partition_seed: r.u64("partition_seed").unwrap_or(d.partition_seed),
            partition_dir: r.string("partition_dir"),
            device_memory: r.bytes("device_memory"),
            predict: r.predict(),
            staleness: r.staleness(),
            remote_features: r.float("remote_features"),
            task: r
                .choice("task", "task", Task::parse, Task::EXPECTED)
                .unwrap_or_default(),
            link: r.link(),
            embedding_dim: r.uint("embedding_dim", 0, 4096).unwrap_or(0),
            num_bases: r.uint("num_bases", 1, 4096),
        };
        // The default is what a serialized spec of a run without evaluation carries.
        if !spec.evaluate && obj.contains_key("eval_every") && spec.eval_every != d.eval_every {
            r.error(
                "eval_every",
                "has no effect with evaluate = false (the run does not evaluate); drop one",
            );
        }
        if let Some((s, roots)) = r.sampling() {
            spec.sampling = s;
            // `roots` is another way to give GraphSAINT's budget (roots × (walk_length + 1)).
            if let (Some(roots), Sampling::Saint { walk_length }) = (roots, &spec.sampling) {
                let budget = roots.saturating_mul(walk_length + 1);
                match spec.batch_size {
                    None => spec.batch_size = Some(budget),
                    Some(b) if (b / (walk_length + 1)).max(1) == roots => {}
                    Some(b) => r.error(
                        "sampling.roots",
                        format!(
                            "{roots} disagrees with batch_size {b}: GraphSAINT draws batch_size / \
                             (walk_length + 1) = {} roots per server; drop one of them",
                            (b / (walk_length + 1)).max(1)
                        ),
                    ),
                }
            }
        }
        let mut errors = r.errors;
        // Range and cross-field checks run even when reading failed, so one round trip shows
        // every problem; fields that failed to read hold defaults, which pass these checks.
        if let Err(SpecError::Invalid(more)) = spec.validate() {
            for e in more {
                if !errors.iter().any(|x| x.field == e.field) {
                    errors.push(e);
                }
            }
        }
        if errors.is_empty() {
            Ok(spec)
        } else {
            Err(SpecError::Invalid(errors))
        }
    }
}

/// Reads typed fields out of a JSON object, collecting errors instead of stopping.
struct Reader<'a> {
    obj: &'a Map<String, Value>,
    prefix: &'static str,
    errors: Vec<FieldError>,
}

impl Reader<'_> {
    fn field(&self, key: &str) -> String {
        format!("{}{key}", self.prefix)
    }

    fn error(&mut self, key: &str, message: impl Into<String>) {
        let field = self.field(key);
        self.errors.push(FieldError {
            field,
            message: message.into(),
        });
    }

    fn unknown_fields(&mut self, known: &[&str]) {
        let unknown: Vec<String> = self
            .obj
            .keys()
            .filter(|k| !known.contains(&k.as_str()))
            .cloned()
            .collect();
        for k in unknown {
            self.error(
                &k,
                format!("unknown field (expected one of: {})", known.join(", ")),
            );
        }
    }

    fn get(&self, key: &str) -> Option<&Value> {
        // JSON null means "absent" (so programs can send optional fields explicitly).
        self.obj.get(key).filter(|v| !v.is_null())
    }

    fn string(&mut self, key: &str) -> Option<String> {
        match self.get(key)? {
            Value::String(s) => Some(s.clone()),
            other => {
                let msg = format!("expected a string, got {}", describe(other));
                self.error(key, msg);
                None
            }
        }
    }

    fn choice<T>(
        &mut self,
        key: &str,
        what: &str,
        parse: fn(&str) -> Option<T>,
        expected: &str,
    ) -> Option<T> {
        let s = self.string(key)?;
        match parse(&s) {
            Some(t) => Some(t),
            None => {
                self.error(key, format!("unknown {what} '{s}' (expected {expected})"));
                None
            }
        }
    }

    fn int(&mut self, key: &str) -> Option<i128> {
        let v = self.get(key)?.clone();
        self.int_of(key, &v)
    }

    /// [`Self::int`] of a value found under `key` (a field, or an entry of an object).
    fn int_of(&mut self, key: &str, v: &Value) -> Option<i128> {
        let n = match v {
            Value::Number(n) => n
                .as_i64()
                .map(i128::from)
                .or_else(|| n.as_u64().map(i128::from)),
            _ => None,
        };
        if n.is_none() {
            let msg = format!("expected an integer, got {}", describe(v));
            self.error(key, msg);
        }
        n
    }

    fn uint(&mut self, key: &str, min: i64, max: i64) -> Option<u32> {
        let v = self.get(key)?.clone();
        self.uint_of(key, &v, min, max)
    }

    /// [`Self::uint`] of a value found under `key`.
    fn uint_of(&mut self, key: &str, v: &Value, min: i64, max: i64) -> Option<u32> {
        let n = self.int_of(key, v)?;
        if n < min as i128 {
            self.error(key, format!("must be ≥ {min}, got {n}"));
            None
        } else if n > max as i128 {
            self.error(key, format!("must be ≤ {max}, got {n}"));
            None
        } else {
            Some(n as u32)
        }
    }

    fn u64(&mut self, key: &str) -> Option<u64> {
        let n = self.int(key)?;
        match u64::try_from(n) {
            Ok(v) => Some(v),
            Err(_) => {
                self.error(key, format!("must be ≥ 0, got {n}"));
                None
            }
        }
    }

    fn bool(&mut self, key: &str) -> Option<bool> {
        let v = self.get(key)?;
        match v.as_bool() {
            Some(b) => Some(b),
            None => {
                let msg = format!("expected true or false, got {}", describe(v));
                self.error(key, msg);
                None
            }
        }
    }

    fn float(&mut self, key: &str) -> Option<f64> {
        let v = self.get(key)?;
        match v.as_f64() {
            Some(f) => Some(f),
            None => {
                let msg = format!("expected a number, got {}", describe(v));
                self.error(key, msg);
                None
            }
        }
    }

    /// A byte count: an integer, or a string with a unit ("16GiB", "512 MB", "1.5 GiB").
    fn bytes(&mut self, key: &str) -> Option<u64> {
        let v = self.get(key)?;
        let parsed = match v {
            Value::Number(_) => {
                let n = self.int(key)?;
                u64::try_from(n).map_err(|_| format!("must be ≥ 0, got {n}"))
            }
            Value::String(s) => parse_bytes(s),
            other => Err(format!(
                "expected a byte count (integer or a string such as \"16GiB\"), got {}",
                describe(other)
            )),
        };
        match parsed {
            Ok(b) => Some(b),
            Err(msg) => {
                self.error(key, msg);
                None
            }
        }
    }

    /// The `predict` table.
    fn predict(&mut self) -> Option<PredictSpec> {
        let v = self.get("predict")?.clone();
        let Value::Object(obj) = &v else {
            let msg = format!(
                "expected a table with 'dir' (and optionally logits, embeddings, block_memory), \
                 got {}",
                describe(&v)
            );
            self.error("predict", msg);
            return None;
        };
        let mut sub = Reader {
            obj,
            prefix: "predict.",
            errors: Vec::new(),
        };
        sub.unknown_fields(&["dir", "logits", "embeddings", "block_memory"]);
        let dir = sub.string("dir");
        if dir.is_none() && sub.get("dir").is_none() {
            sub.error(
                "dir",
                "required (the output directory, as a path on every server)",
            );
        }
        let spec = PredictSpec {
            dir: dir.unwrap_or_default(),
            logits: sub.bool("logits").unwrap_or(false),
            embeddings: sub.bool("embeddings").unwrap_or(false),
            block_memory: sub.bytes("block_memory"),
        };
        self.errors.append(&mut sub.errors);
        Some(spec)
    }

    /// The `link` table (`negatives`, `out_dim`, `decoder`).
    fn link(&mut self) -> Option<LinkSpec> {
        let v = self.get("link")?.clone();
        let Value::Object(obj) = &v else {
            let msg = format!(
                "expected a table with 'negatives', 'out_dim' and/or 'decoder', got {}",
                describe(&v)
            );
            self.error("link", msg);
            return None;
        };
        let mut sub = Reader {
            obj,
            prefix: "link.",
            errors: Vec::new(),
        };
        sub.unknown_fields(&["negatives", "out_dim", "decoder"]);
        let d = LinkSpec::default();
        let spec = LinkSpec {
            negatives: sub.uint("negatives", 1, 1000).unwrap_or(d.negatives),
            out_dim: sub.uint("out_dim", 1, 1 << 16),
            decoder: sub
                .choice(
                    "decoder",
                    "link decoder",
                    LinkDecoder::parse,
                    LinkDecoder::EXPECTED,
                )
                .unwrap_or(d.decoder),
        };
        self.errors.append(&mut sub.errors);
        Some(spec)
    }

    /// The `staleness` table (`bound`, `max_skips`).
    fn staleness(&mut self) -> Option<Staleness> {
        let v = self.get("staleness")?.clone();
        let Value::Object(obj) = &v else {
            let msg = format!(
                "expected a table with 'bound' and 'max_skips', got {}",
                describe(&v)
            );
            self.error("staleness", msg);
            return None;
        };
        let mut sub = Reader {
            obj,
            prefix: "staleness.",
            errors: Vec::new(),
        };
        sub.unknown_fields(&["bound", "max_skips"]);
        let bound = sub.float("bound");
        let max_skips = sub.uint("max_skips", 1, u32::MAX as i64);
        for (key, given) in [
            ("bound", bound.is_some()),
            ("max_skips", max_skips.is_some()),
        ] {
            if !given && sub.get(key).is_none() {
                sub.error(key, "required");
            }
        }
        self.errors.append(&mut sub.errors);
        Some(Staleness {
            bound: bound?,
            max_skips: max_skips?,
        })
    }

    /// The `sampling` field, and GraphSAINT's `roots` when given (a budget in disguise,
    /// turned into `batch_size` by the caller).
    fn sampling(&mut self) -> Option<(Sampling, Option<u32>)> {
        let v = self.get("sampling")?.clone();
        let unknown = |m: &str| {
            format!(
                "unknown sampling method '{m}' (expected {})",
                Sampling::EXPECTED
            )
        };
        match &v {
            Value::String(s) => match Sampling::with_defaults(s) {
                Some(s) => Some((s, None)),
                None => {
                    self.error("sampling", unknown(s));
                    None
                }
            },
            Value::Object(obj) => {
                let mut sub = Reader {
                    obj,
                    prefix: "sampling.",
                    errors: Vec::new(),
                };
                let method = match sub.get("method") {
                    None => {
                        sub.error("method", format!("required ({})", Sampling::EXPECTED));
                        None
                    }
                    Some(_) => sub.string("method"),
                };
                let result = method.and_then(|m| {
                    let Some(default) = Sampling::with_defaults(&m) else {
                        sub.error("method", unknown(&m));
                        return None;
                    };
                    Some(match default {
                        Sampling::None => {
                            sub.unknown_fields(&["method"]);
                            (Sampling::None, None)
                        }
                        Sampling::Eas {
                            hops,
                            fanout,
                            priority,
                        } => {
                            sub.unknown_fields(&["method", "hops", "fanout", "priority"]);
                            let s = Sampling::Eas {
                                hops: sub.uint("hops", 1, 1024).unwrap_or(hops),
                                fanout: sub.uint("fanout", 1, u32::MAX as i64).unwrap_or(fanout),
                                priority: sub
                                    .choice(
                                        "priority",
                                        "EAS priority",
                                        Priority::parse,
                                        Priority::EXPECTED,
                                    )
                                    .unwrap_or(priority),
                            };
                            (s, None)
                        }
                        Sampling::Fanout {
                            fanouts,
                            relation_fanouts,
                        } => {
                            sub.unknown_fields(&["method", "fanouts", "relation_fanouts"]);
                            let s = Sampling::Fanout {
                                fanouts: sub.fanouts().unwrap_or(fanouts),
                                relation_fanouts: sub
                                    .relation_fanouts()
                                    .unwrap_or(relation_fanouts),
                            };
                            (s, None)
                        }
                        Sampling::Saint { walk_length } => {
                            sub.unknown_fields(&["method", "roots", "walk_length"]);
                            let roots = sub.uint("roots", 1, u32::MAX as i64);
                            let s = Sampling::Saint {
                                walk_length: sub
                                    .uint("walk_length", 0, 1024)
                                    .unwrap_or(walk_length),
                            };
                            (s, roots)
                        }
                    })
                });
                self.errors.append(&mut sub.errors);
                result
            }
            other => {
                let msg = format!(
                    "expected a method name or a table with 'method', got {}",
                    describe(other)
                );
                self.error("sampling", msg);
                None
            }
        }
    }

    fn fanouts(&mut self) -> Option<Vec<u32>> {
        let v = self.get("fanouts")?.clone();
        self.fanout_list("fanouts", &v)
    }

    /// `relation_fanouts`: an object from relation names to fanout lists.
    fn relation_fanouts(&mut self) -> Option<BTreeMap<String, Vec<u32>>> {
        let v = self.get("relation_fanouts")?.clone();
        let Value::Object(map) = &v else {
            let msg = format!(
                "expected an object from relation names to fanout lists, got {}",
                describe(&v)
            );
            self.error("relation_fanouts", msg);
            return None;
        };
        let mut out = BTreeMap::new();
        for (name, list) in map {
            let list = self.fanout_list(&format!("relation_fanouts.{name}"), list)?;
            out.insert(name.clone(), list);
        }
        Some(out)
    }

    /// A fanout list at `key` (one integer stands for a list of one).
    fn fanout_list(&mut self, key: &str, v: &Value) -> Option<Vec<u32>> {
        match v {
            Value::Number(_) => self.uint_of(key, v, 1, u32::MAX as i64).map(|f| vec![f]),
            Value::Array(items) => {
                let mut out = Vec::with_capacity(items.len());
                for (i, item) in items.iter().enumerate() {
                    match item.as_i64() {
                        Some(f) if f >= 1 && f <= u32::MAX as i64 => out.push(f as u32),
                        _ => {
                            self.error(
                                key,
                                format!(
                                    "every fanout must be an integer ≥ 1, got {} at index {i}",
                                    describe(item)
                                ),
                            );
                            return None;
                        }
                    }
                }
                if out.is_empty() {
                    self.error(key, "must list at least one fanout");
                    return None;
                }
                Some(out)
            }
            other => {
                let msg = format!("expected a list of integers, got {}", describe(other));
                self.error(key, msg);
                None
            }
        }
    }
}

/// "a string \"x\"", "the number 1.5": used in "expected ..., got ..." messages.
fn describe(v: &Value) -> String {
    match v {
        Value::Null => "null".into(),
        Value::Bool(b) => format!("the boolean {b}"),
        Value::Number(n) => format!("the number {n}"),
        Value::String(s) => format!("the string {s:?}"),
        Value::Array(_) => "a list".into(),
        Value::Object(_) => "a table/object".into(),
    }
}
