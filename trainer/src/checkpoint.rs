//! Checkpoints: parameters as safetensors tensors (named like the model's parameters), the
//! model configuration, training options and epoch count as JSON in the safetensors metadata,
//! and optionally the Adam moments (`adam_m.<name>`, `adam_v.<name>`) for `--resume`.

use crate::TrainOptions;
use anyhow::{bail, Context};
use grandis_engine::Backend;
use grandis_models::{Model, ModelConfig};
use safetensors::tensor::{Dtype, TensorView};
use safetensors::SafeTensors;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::path::Path;

const META_KEY: &str = "grandis";
const FORMAT: &str = "grandis-checkpoint-v1";

#[derive(Serialize, Deserialize)]
struct Meta {
    format: String,
    model: ModelConfig,
    train: Option<TrainOptions>,
    epochs_done: usize,
    has_optimizer: bool,
}

/// A loaded checkpoint (host copies of every tensor).
pub struct Checkpoint {
    pub model: ModelConfig,
    pub train: Option<TrainOptions>,
    pub epochs_done: usize,
    tensors: HashMap<String, (Vec<usize>, Vec<f32>)>,
    has_optimizer: bool,
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
    let mut owned: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
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
    };
    let mut info = HashMap::new();
    info.insert(META_KEY.to_string(), serde_json::to_string(&meta)?);
    let views = owned
        .iter()
        .map(|(name, shape, bytes)| {
            Ok((
                name.as_str(),
                TensorView::new(Dtype::F32, shape.clone(), bytes)?,
            ))
        })
        .collect::<Result<Vec<_>, safetensors::SafeTensorError>>()
        .context("building checkpoint tensors")?;
    let bytes = safetensors::serialize(views, Some(info)).context("serialising checkpoint")?;
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
    let (_, metadata) = SafeTensors::read_metadata(&bytes)
        .with_context(|| format!("{}: not a safetensors file", path.display()))?;
    let meta_json = metadata
        .metadata()
        .as_ref()
        .and_then(|m| m.get(META_KEY))
        .with_context(|| format!("{}: no '{META_KEY}' metadata entry", path.display()))?;
    let meta: Meta = serde_json::from_str(meta_json)
        .with_context(|| format!("{}: invalid '{META_KEY}' metadata", path.display()))?;
    if meta.format != FORMAT {
        bail!(
            "{}: unsupported checkpoint format '{}' (expected '{FORMAT}')",
            path.display(),
            meta.format
        );
    }
    let st = SafeTensors::deserialize(&bytes)
        .with_context(|| format!("{}: corrupt safetensors data", path.display()))?;
    let mut tensors = HashMap::new();
    for name in st.names() {
        let t = st.tensor(name)?;
        if t.dtype() != Dtype::F32 {
            bail!(
                "{}: tensor '{name}' has dtype {:?}, expected F32",
                path.display(),
                t.dtype()
            );
        }
        let data: Vec<f32> = t
            .data()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        tensors.insert(name.to_string(), (t.shape().to_vec(), data));
    }
    Ok(Checkpoint {
        model: meta.model,
        train: meta.train,
        epochs_done: meta.epochs_done,
        tensors,
        has_optimizer: meta.has_optimizer,
    })
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
        if optimizer && !self.has_optimizer {
            bail!("checkpoint has no optimizer state, so training cannot resume from it");
        }
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
