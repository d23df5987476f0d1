//! Checkpoints: parameters as safetensors tensors (named like the model's parameters), the
//! model configuration, training options and epoch count as JSON in the safetensors metadata,
//! and optionally the Adam moments (`adam_m.<name>`, `adam_v.<name>`) for `--resume`; a model
//! with learnable node embeddings also holds their table (`node_embedding`, vertices x dim)
//! and, for `--resume`, its sparse Adam state ([`crate::NodeEmbeddings::tensors`]); a link
//! decoder with parameters (the MLP) holds them as `decoder.*` ([`crate::Decoder::tensors`]).
//!
//! Nothing in a checkpoint is trusted: the container (`grandis_wire::checkpoint`, which the
//! coordinator also checks uploads with) carries an xxh3 checksum over the metadata and every
//! tensor, so flipped bytes anywhere are an error, and the tensors must be exactly the
//! parameters the stored model configuration has (names and shapes, computed without building
//! the model), so metadata that claims a huge model is refused before anything is allocated.

use crate::{Decoder, NodeEmbeddings, Objective, TrainOptions};
use anyhow::{bail, Context};
use grandis_engine::Backend;
use grandis_models::{Model, ModelConfig};
use grandis_wire::checkpoint::{self as container, FORMAT};
use safetensors::tensor::TensorView;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::path::Path;

#[derive(Serialize, Deserialize)]
struct Meta {
    format: String,
    model: ModelConfig,
    train: Option<TrainOptions>,
    epochs_done: usize,
    has_optimizer: bool,
    /// `[vertices, dim]` of the learnable node embeddings' table, when the model has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    embeddings: Option<[usize; 2]>,
}

/// A loaded checkpoint (host copies of every tensor).
pub struct Checkpoint {
    pub model: ModelConfig,
    pub train: Option<TrainOptions>,
    pub epochs_done: usize,
    tensors: HashMap<String, (Vec<usize>, Vec<f32>)>,
    has_optimizer: bool,
    embeddings: Option<[usize; 2]>,
}

impl Checkpoint {
    /// Refuses a checkpoint without optimizer state when `optimizer` (resuming) needs it.
    fn need_optimizer(&self, optimizer: bool) -> anyhow::Result<()> {
        if optimizer && !self.has_optimizer {
            bail!("checkpoint has no optimizer state, so training cannot resume from it");
        }
        Ok(())
    }

    /// The learnable node embeddings the model was trained with (with `optimizer`, their
    /// sparse Adam state for resuming), checked against the dataset's `vertices`; None when
    /// the model has none.
    pub fn node_embeddings(
        &self,
        vertices: usize,
        optimizer: bool,
    ) -> anyhow::Result<Option<NodeEmbeddings>> {
        let Some([rows, _]) = self.embeddings else {
            return Ok(None);
        };
        if rows != vertices {
            bail!(
                "the checkpoint's node embeddings have {rows} rows, the dataset {vertices} \
                 vertices: it was trained on another graph"
            );
        }
        self.need_optimizer(optimizer)?;
        NodeEmbeddings::from_tensors(|name| self.tensors.get(name), optimizer).map(Some)
    }

    /// The link decoder the model was trained with (with `optimizer`, its Adam state for
    /// resuming); None for node classification.
    pub fn link_decoder(&self, optimizer: bool) -> anyhow::Result<Option<Decoder>> {
        let Objective::Link { decoder, .. } = self.objective() else {
            return Ok(None);
        };
        self.need_optimizer(optimizer)?;
        Decoder::from_tensors(
            decoder,
            self.model.classes,
            |name| self.tensors.get(name),
            optimizer,
        )
        .map(Some)
    }

    /// What the model was trained for (node classification for checkpoints without training
    /// options, or from before link prediction).
    pub fn objective(&self) -> crate::Objective {
        self.train
            .as_ref()
            .map_or_else(Default::default, |t| t.objective)
    }

    /// Refuses to resume a run of `epochs` epochs from this checkpoint when it holds that many
    /// or more already: there would be nothing to train (and no epoch to summarise).
    pub fn check_epochs_left(&self, epochs: usize) -> anyhow::Result<()> {
        if self.epochs_done >= epochs {
            bail!(
                "the checkpoint already holds {} epochs and the run asks for {epochs}: raise \
                 --epochs to train further",
                self.epochs_done
            );
        }
        Ok(())
    }
}

fn to_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// Writes `model` (and, with `with_optimizer`, its Adam moments) to `path` atomically.
pub fn save_checkpoint<B: Backend>(
    path: &Path,
    b: &B,
    model: &Model<B>,
    train: Option<&TrainOptions>,
    epochs_done: usize,
    with_optimizer: bool,
) -> anyhow::Result<()> {
    save_checkpoint_with(
        path,
        b,
        model,
        Learnt::default(),
        train,
        epochs_done,
        with_optimizer,
    )
}

/// What a model trains beside its parameters, saved with them.
#[derive(Debug, Clone, Copy, Default)]
pub struct Learnt<'a> {
    /// Learnable node embeddings ([`TrainOptions::embedding_dim`]).
    pub embeddings: Option<&'a NodeEmbeddings>,
    /// Link prediction's decoder (its parameters, if it has any).
    pub decoder: Option<&'a Decoder>,
}

/// [`save_checkpoint`] of a model with what it `learnt` beside its parameters.
pub fn save_checkpoint_with<B: Backend>(
    path: &Path,
    b: &B,
    model: &Model<B>,
    learnt: Learnt<'_>,
    train: Option<&TrainOptions>,
    epochs_done: usize,
    with_optimizer: bool,
) -> anyhow::Result<()> {
    let embeddings = learnt.embeddings;
    let mut owned: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    let extra = embeddings
        .map(|e| e.tensors(with_optimizer))
        .into_iter()
        .chain(learnt.decoder.map(|d| d.tensors(with_optimizer)))
        .flatten();
    for (name, shape, values) in extra {
        owned.push((name, shape, to_bytes(values)));
    }
    for p in &model.params {
        let mut host = vec![0.0f32; p.len()];
        b.download(&p.value, 0, &mut host)?;
        owned.push((p.name.clone(), p.shape.clone(), to_bytes(&host)));
        if with_optimizer {
            b.download(&p.m, 0, &mut host)?;
            owned.push((
                format!("adam_m.{}", p.name),
                p.shape.clone(),
                to_bytes(&host),
            ));
            b.download(&p.v, 0, &mut host)?;
            owned.push((
                format!("adam_v.{}", p.name),
                p.shape.clone(),
                to_bytes(&host),
            ));
        }
    }
    let meta = Meta {
        format: FORMAT.into(),
        model: model.config.clone(),
        train: train.cloned(),
        epochs_done,
        has_optimizer: with_optimizer,
        embeddings: embeddings.map(|e| [e.vertices(), e.dim()]),
    };
    let meta_json = serde_json::to_string(&meta)?;
    let bytes = container::serialize(meta_json, &owned)?;
    grandis_store::write_file_atomic(path, &bytes)
        .with_context(|| format!("writing checkpoint {}", path.display()))?;
    tracing::info!(
        "saved checkpoint {} ({} bytes, epoch {epochs_done})",
        path.display(),
        bytes.len()
    );
    Ok(())
}

/// Reads and validates a checkpoint written by [`save_checkpoint`].
pub fn load_checkpoint(path: &Path) -> anyhow::Result<Checkpoint> {
    let bytes =
        std::fs::read(path).with_context(|| format!("reading checkpoint {}", path.display()))?;
    let opened = container::open(&bytes).with_context(|| path.display().to_string())?;
    let meta: Meta = serde_json::from_str(&opened.meta_json).with_context(|| {
        format!(
            "{}: invalid '{}' metadata",
            path.display(),
            container::META_KEY
        )
    })?;
    let views = opened.tensors.tensors();
    check_tensors(&meta, &views).with_context(|| {
        format!(
            "{}: the tensors do not match the stored model configuration",
            path.display()
        )
    })?;
    let mut tensors = HashMap::new();
    // Every tensor is f32 (the container checked it).
    for (name, t) in views {
        let data: Vec<f32> = t
            .data()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        tensors.insert(name, (t.shape().to_vec(), data));
    }
    Ok(Checkpoint {
        model: meta.model,
        train: meta.train,
        epochs_done: meta.epochs_done,
        tensors,
        has_optimizer: meta.has_optimizer,
        embeddings: meta.embeddings,
    })
}

/// Checks that `views` are exactly the parameters (and, with optimizer state, the Adam
/// moments) of `meta.model`, with their shapes.
fn check_tensors(meta: &Meta, views: &[(String, TensorView<'_>)]) -> anyhow::Result<()> {
    // A plain stack has 2 to 5 tensors per layer: more layers than tensors cannot match, and
    // laying out 2^40 layers would take forever.
    if meta.model.layers > views.len() {
        bail!(
            "the configuration has {} layers but the file only {} tensors",
            meta.model.layers,
            views.len()
        );
    }
    let shapes = meta
        .model
        .parameter_shapes()
        .map_err(|e| anyhow::anyhow!("invalid model configuration: {e}"))?;
    let mut expected: HashMap<String, Vec<usize>> = HashMap::new();
    for (name, shape) in shapes {
        if meta.has_optimizer {
            expected.insert(format!("adam_m.{name}"), shape.clone());
            expected.insert(format!("adam_v.{name}"), shape.clone());
        }
        expected.insert(name, shape);
    }
    if let Some([vertices, dim]) = meta.embeddings {
        expected.extend(NodeEmbeddings::tensor_shapes(
            vertices,
            dim,
            meta.has_optimizer,
        ));
    }
    if let Some(Objective::Link { decoder, .. }) = meta.train.as_ref().map(|t| t.objective) {
        expected.extend(Decoder::tensor_shapes(
            decoder,
            meta.model.classes,
            meta.has_optimizer,
        ));
    }
    for (name, view) in views {
        match expected.remove(name) {
            None => bail!("unexpected tensor '{name}'"),
            Some(shape) if shape != view.shape() => bail!(
                "tensor '{name}' has shape {:?}, the configuration says {shape:?}",
                view.shape()
            ),
            Some(_) => {}
        }
    }
    if let Some(name) = expected.keys().min() {
        bail!("tensor '{name}' is missing");
    }
    Ok(())
}

impl Checkpoint {
    /// Copies the stored tensors into `model` (built from `self.model`); with `optimizer`,
    /// also the Adam moments.
    pub fn restore<B: Backend>(
        &self,
        b: &B,
        model: &mut Model<B>,
        optimizer: bool,
    ) -> anyhow::Result<()> {
        self.need_optimizer(optimizer)?;
        for p in &mut model.params {
            let get = |name: &str| -> anyhow::Result<&Vec<f32>> {
                let (shape, data) = self
                    .tensors
                    .get(name)
                    .with_context(|| format!("checkpoint lacks tensor '{name}'"))?;
                if *shape != p.shape {
                    bail!(
                        "checkpoint tensor '{name}' has shape {shape:?}, model expects {:?}",
                        p.shape
                    );
                }
                Ok(data)
            };
            b.upload_into(&mut p.value, 0, get(&p.name)?)?;
            if optimizer {
                b.upload_into(&mut p.m, 0, get(&format!("adam_m.{}", p.name))?)?;
                b.upload_into(&mut p.v, 0, get(&format!("adam_v.{}", p.name))?)?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use grandis_engine::CpuBackend;
    use grandis_models::ModelKind;

    fn saved(dir: &Path) -> std::path::PathBuf {
        let b = CpuBackend::new(Some(1)).unwrap();
        let config = ModelConfig {
            heads: 2,
            dropout: 0.0,
            layer_norm: true,
            seed: 1,
            ..ModelConfig::new(ModelKind::Sage, 2, 5, 4, 3)
        };
        let model = Model::new(&b, config).unwrap();
        let path = dir.join("m.safetensors");
        save_checkpoint(&path, &b, &model, None, 3, true).unwrap();
        path
    }

    /// Rewrites the checkpoint at `path` with its metadata changed by `edit` and a VALID
    /// checksum, so only the other checks can catch the forgery.
    fn forge(path: &Path, edit: impl Fn(&mut serde_json::Value)) {
        let bytes = std::fs::read(path).unwrap();
        let opened = container::open(&bytes).unwrap();
        let mut meta: serde_json::Value = serde_json::from_str(&opened.meta_json).unwrap();
        edit(&mut meta);
        let tensors: Vec<(String, Vec<usize>, Vec<u8>)> = opened
            .tensors
            .tensors()
            .into_iter()
            .map(|(n, t)| (n, t.shape().to_vec(), t.data().to_vec()))
            .collect();
        let out = container::serialize(meta.to_string(), &tensors).unwrap();
        std::fs::write(path, out).unwrap();
    }

    fn load_error(path: &Path) -> String {
        match load_checkpoint(path) {
            Ok(_) => panic!("{} loaded", path.display()),
            Err(e) => format!("{e:#}"),
        }
    }

    #[test]
    fn intact_checkpoint_loads() {
        let dir = tempfile::tempdir().unwrap();
        let ck = load_checkpoint(&saved(dir.path())).unwrap();
        assert_eq!(ck.epochs_done, 3);
        assert_eq!(ck.model.hidden, 4);
    }

    #[test]
    fn flipped_tensor_byte_is_a_checksum_error() {
        let dir = tempfile::tempdir().unwrap();
        let path = saved(dir.path());
        let mut bytes = std::fs::read(&path).unwrap();
        let last = bytes.len() - 3;
        bytes[last] ^= 0x40;
        std::fs::write(&path, bytes).unwrap();
        let err = load_error(&path);
        assert!(err.contains("checksum mismatch"), "{err}");
    }

    #[test]
    fn edited_metadata_is_a_checksum_error() {
        let dir = tempfile::tempdir().unwrap();
        let path = saved(dir.path());
        let text = std::fs::read(&path).unwrap();
        // "epochs_done":3 -> "epochs_done":9 in the header, same length.
        let needle = b"\\\"epochs_done\\\":3";
        let at = text
            .windows(needle.len())
            .position(|w| w == needle)
            .expect("epochs_done in the header");
        let mut bytes = text.clone();
        bytes[at + needle.len() - 1] = b'9';
        std::fs::write(&path, bytes).unwrap();
        let err = load_error(&path);
        assert!(err.contains("checksum mismatch"), "{err}");
    }

    #[test]
    fn metadata_claiming_a_huge_model_is_refused_before_allocating() {
        let dir = tempfile::tempdir().unwrap();
        let path = saved(dir.path());
        forge(&path, |m| {
            m["model"]["hidden"] = serde_json::json!(1u64 << 40)
        });
        let err = load_error(&path);
        assert!(
            err.contains("do not match") && err.contains("shape"),
            "{err}"
        );

        let path = saved(dir.path());
        forge(&path, |m| {
            m["model"]["layers"] = serde_json::json!(1u64 << 40)
        });
        let err = load_error(&path);
        assert!(err.contains("layers"), "{err}");

        let path = saved(dir.path());
        forge(&path, |m| m["has_optimizer"] = serde_json::json!(false));
        let err = load_error(&path);
        assert!(err.contains("unexpected tensor 'adam_"), "{err}");
    }
}
