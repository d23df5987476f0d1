//! The checkpoint container, as both its writer and its checkers know it: a safetensors file
//! of `f32` tensors whose metadata holds the run's JSON under [`META_KEY`] and an xxh3-64
//! checksum over that JSON and every tensor (name, length, little-endian bytes, in name
//! order) under [`CHECKSUM_KEY`]. The trainer writes and restores it with the model
//! (`grandis_trainer`, which also checks the tensors against the model's parameters); the
//! coordinator opens it here, without any model code, to check an upload before it stores it
//! ([`check_upload`]): its checksum, the model it holds against the job's, and the epochs it
//! holds against the epoch the upload claims.

use std::collections::HashMap;

use safetensors::tensor::{Dtype, TensorView};
use safetensors::SafeTensors;
use serde::Deserialize;

use crate::{JobSpec, ModelKind};

/// Metadata key of the run's JSON.
pub const META_KEY: &str = "grandis";
/// Metadata key of the checksum (hex).
pub const CHECKSUM_KEY: &str = "grandis_xxh3";
/// The `format` of the run's JSON.
pub const FORMAT: &str = "grandis-checkpoint-v1";

/// What a checkpoint is not: a message naming the problem.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct CheckpointError(pub String);

fn err(message: impl Into<String>) -> CheckpointError {
    CheckpointError(message.into())
}

/// The fields of the run's JSON that hold for every checkpoint (the trainer reads the rest).
#[derive(Debug, Clone, Deserialize)]
pub struct Header {
    pub format: String,
    /// The model configuration (`grandis_models::ModelConfig` as JSON).
    pub model: serde_json::Value,
    pub epochs_done: u64,
    pub has_optimizer: bool,
}

/// A container whose checksum held: the run's JSON (as stored, and its common fields) and
/// the tensors.
pub struct Container<'a> {
    pub meta_json: String,
    pub header: Header,
    pub tensors: SafeTensors<'a>,
}

/// The checksum of a checkpoint's run JSON and its `(name, bytes)` tensors.
pub fn checksum<'a>(
    meta_json: &str,
    tensors: impl IntoIterator<Item = (&'a str, &'a [u8])>,
) -> String {
    let mut sorted: Vec<(&str, &[u8])> = tensors.into_iter().collect();
    sorted.sort_by_key(|(name, _)| *name);
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    h.update(meta_json.as_bytes());
    for (name, bytes) in sorted {
        h.update(name.as_bytes());
        h.update(&(bytes.len() as u64).to_le_bytes());
        h.update(bytes);
    }
    format!("{:016x}", h.digest())
}

/// The container of `meta_json` and `tensors` ((name, shape, little-endian `f32` bytes)),
/// its checksum included.
pub fn serialize(
    meta_json: String,
    tensors: &[(String, Vec<usize>, Vec<u8>)],
) -> Result<Vec<u8>, CheckpointError> {
    let sum = checksum(
        &meta_json,
        tensors.iter().map(|(n, _, b)| (n.as_str(), b.as_slice())),
    );
    let info = HashMap::from([
        (META_KEY.to_string(), meta_json),
        (CHECKSUM_KEY.to_string(), sum),
    ]);
    let views = tensors
        .iter()
        .map(|(name, shape, bytes)| {
            TensorView::new(Dtype::F32, shape.clone(), bytes).map(|v| (name.as_str(), v))
        })
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| err(format!("building the checkpoint's tensors: {e}")))?;
    safetensors::serialize(views, Some(info))
        .map_err(|e| err(format!("serialising the checkpoint: {e}")))
}

/// Opens a container: a safetensors file with the run's JSON of this [`FORMAT`] and a
/// checksum that holds over it and every tensor, all of them `f32`.
pub fn open(bytes: &[u8]) -> Result<Container<'_>, CheckpointError> {
    let (_, metadata) = SafeTensors::read_metadata(bytes)
        .map_err(|e| err(format!("not a safetensors file: {e}")))?;
    let entries = metadata.metadata().as_ref();
    let meta_json = entries
        .and_then(|m| m.get(META_KEY))
        .ok_or_else(|| err(format!("no '{META_KEY}' metadata entry")))?
        .clone();
    let stored_sum = entries
        .and_then(|m| m.get(CHECKSUM_KEY))
        .ok_or_else(|| err(format!("no '{CHECKSUM_KEY}' checksum entry")))?;
    let header: Header = serde_json::from_str(&meta_json)
        .map_err(|e| err(format!("invalid '{META_KEY}' metadata: {e}")))?;
    if header.format != FORMAT {
        return Err(err(format!(
            "unsupported checkpoint format '{}' (expected '{FORMAT}')",
            header.format
        )));
    }
    let tensors = SafeTensors::deserialize(bytes)
        .map_err(|e| err(format!("corrupt safetensors data: {e}")))?;
    let sum = checksum(&meta_json, tensors.iter().map(|(n, t)| (n, t.data())));
    if sum != *stored_sum {
        return Err(err(format!(
            "checksum mismatch (stored {stored_sum}, computed {sum}): the file is corrupt"
        )));
    }
    if let Some((name, t)) = tensors.iter().find(|(_, t)| t.dtype() != Dtype::F32) {
        return Err(err(format!(
            "tensor '{name}' has dtype {:?}, expected F32",
            t.dtype()
        )));
    }
    Ok(Container {
        meta_json,
        header,
        tensors,
    })
}

/// Checks an upload of the checkpoint of `spec`'s run after `epoch` epochs before it is
/// stored: a container whose checksum holds ([`open`]), of the job's model ([`check_model`]),
/// holding exactly `epoch` epochs and the optimizer state a resumed run needs.
pub fn check_upload(bytes: &[u8], spec: &JobSpec, epoch: u64) -> Result<(), CheckpointError> {
    let container = open(bytes)?;
    let h = &container.header;
    if h.epochs_done != epoch {
        return Err(err(format!(
            "the checkpoint holds {} epochs but was uploaded as epoch {epoch}",
            h.epochs_done
        )));
    }
    if !h.has_optimizer {
        return Err(err(
            "the checkpoint has no optimizer state: a retry could not resume from it",
        ));
    }
    check_model(spec, &h.model)
}

/// The fields of a checkpoint's model configuration that a job spec states (the input width
/// and the classes come from the dataset), as `grandis_models::ModelConfig::for_job` maps them.
#[derive(Deserialize)]
struct SpecModel {
    kind: ModelKind,
    layers: u64,
    hidden: u64,
    heads: u64,
    output_heads: u64,
    dropout: f32,
    layer_norm: bool,
    seed: u64,
    #[serde(default)]
    num_bases: Option<u64>,
}

/// Checks that `model` (a checkpoint's model configuration as JSON) is `spec`'s model,
/// naming the first field that differs.
pub fn check_model(spec: &JobSpec, model: &serde_json::Value) -> Result<(), CheckpointError> {
    let m = SpecModel::deserialize(model).map_err(|e| {
        err(format!(
            "the checkpoint's model configuration is invalid: {e}"
        ))
    })?;
    let differs = |field: &str, theirs: String, ours: String| {
        err(format!(
            "the checkpoint is of another model: its {field} is {theirs}, the job's {ours}"
        ))
    };
    if m.kind != spec.model {
        return Err(differs(
            "model",
            m.kind.name().into(),
            spec.model.name().into(),
        ));
    }
    let numbers = [
        ("layers", m.layers, u64::from(spec.layers)),
        ("hidden", m.hidden, u64::from(spec.hidden)),
        ("heads", m.heads, u64::from(spec.heads)),
        ("output_heads", m.output_heads, u64::from(spec.output_heads)),
        ("seed", m.seed, spec.seed),
        (
            "num_bases",
            m.num_bases.unwrap_or(0),
            spec.num_bases.map_or(0, u64::from),
        ),
    ];
    for (field, theirs, ours) in numbers {
        if theirs != ours {
            return Err(differs(field, theirs.to_string(), ours.to_string()));
        }
    }
    if m.dropout.to_bits() != (spec.dropout as f32).to_bits() {
        return Err(differs(
            "dropout",
            m.dropout.to_string(),
            spec.dropout.to_string(),
        ));
    }
    if m.layer_norm != spec.layer_norm {
        return Err(differs(
            "layer_norm",
            m.layer_norm.to_string(),
            spec.layer_norm.to_string(),
        ));
    }
    Ok(())
}

/// Well-formed checkpoints of a job's model, for tests of what checks them.
#[cfg(any(test, feature = "testing"))]
pub mod testing {
    use super::*;

    /// A container of `spec`'s model after `epochs` epochs (with the optimizer state when
    /// `optimizer`), as the trainer writes one: one small tensor, a valid checksum.
    pub fn container(spec: &JobSpec, epochs: u64, optimizer: bool) -> Vec<u8> {
        let meta = serde_json::json!({
            "format": FORMAT,
            "model": {
                "kind": spec.model, "layers": spec.layers, "in_dim": 8,
                "hidden": spec.hidden, "heads": spec.heads, "output_heads": spec.output_heads,
                "classes": 3, "dropout": spec.dropout as f32, "layer_norm": spec.layer_norm,
                "seed": spec.seed,
            },
            "train": null,
            "epochs_done": epochs,
            "has_optimizer": optimizer,
        });
        let w: Vec<u8> = [1.5f32, -2.0, 0.25]
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect();
        serialize(meta.to_string(), &[("w".into(), vec![3], w)])
            .expect("a small f32 tensor serialises")
    }
}

#[cfg(test)]
mod tests {
    use super::testing::container;
    use super::*;

    fn spec() -> JobSpec {
        JobSpec::from_json_str(r#"{"dataset": "/d", "epochs": 10, "layers": 2, "hidden": 16}"#)
            .unwrap()
    }

    #[test]
    fn an_upload_is_checked_before_it_is_stored() {
        let spec = spec();
        let good = container(&spec, 4, true);
        check_upload(&good, &spec, 4).unwrap();
        let opened = open(&good).unwrap();
        assert_eq!(opened.header.epochs_done, 4);
        assert_eq!(opened.tensors.tensor("w").unwrap().shape(), &[3]);

        let refused = |bytes: &[u8], epoch: u64, want: &str| {
            let e = check_upload(bytes, &spec, epoch).unwrap_err().0;
            assert!(e.contains(want), "{e} (wanted '{want}')");
        };
        refused(b"not a checkpoint", 4, "not a safetensors file");
        let mut flipped = good.clone();
        let last = flipped.len() - 1;
        flipped[last] ^= 0x40;
        refused(&flipped, 4, "checksum mismatch");
        // Another run's file: more epochs than the upload claims.
        refused(&good, 2, "holds 4 epochs but was uploaded as epoch 2");
        refused(&container(&spec, 4, false), 4, "no optimizer state");
        let other = JobSpec {
            layers: 3,
            ..spec.clone()
        };
        refused(
            &container(&other, 4, true),
            4,
            "its layers is 3, the job's 2",
        );
        let other = JobSpec {
            model: ModelKind::Gcn,
            ..spec.clone()
        };
        refused(
            &container(&other, 4, true),
            4,
            "its model is gcn, the job's sage",
        );
    }
}
