//! What fixes a model: its [`ModelConfig`] (built from a job spec by [`ModelConfig::for_job`])
//! and the graph normalisation its architecture aggregates with.

use serde::{Deserialize, Serialize};

use crate::stage::StageKind;
use crate::ModelKind;

/// The normalisation the graph blocks of `kind` must be built with.
pub fn aggregation(kind: ModelKind) -> grandis_engine::norm::Aggregation {
    match kind {
        ModelKind::Gcn => grandis_engine::norm::Aggregation::Gcn,
        _ => grandis_engine::norm::Aggregation::Mean,
    }
}

/// Everything that fixes a model's shape and initial weights.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelConfig {
    pub kind: ModelKind,
    /// Number of graph convolutions (linear layers for `Mlp`).
    pub layers: usize,
    pub in_dim: usize,
    pub hidden: usize,
    /// GAT: attention heads of each hidden layer (concatenated, `hidden / heads` columns
    /// each). Other models ignore it.
    #[serde(default = "one")]
    pub heads: usize,
    /// GAT: attention heads of the last layer (averaged). Other models ignore it.
    #[serde(default = "one")]
    pub output_heads: usize,
    pub classes: usize,
    pub dropout: f32,
    /// LayerNorm between layers (always before the activation).
    pub layer_norm: bool,
    pub seed: u64,
    /// Typed models (`rgcn`, `heterosage`, `rgat`): the dataset's relations in order, which name
    /// their parameters and pick the per-type terms. Empty for the others.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub relations: Vec<ModelRelation>,
    /// rgcn: each relation's weight a combination of this many shared bases; None = a full
    /// weight per relation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub num_bases: Option<usize>,
}

/// One relation of a typed model's dataset.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelRelation {
    /// PyG's key, `src__name__dst` (its parameters are `stage{s}.{key}.*`).
    pub key: String,
    /// The indices of its source and destination types among the dataset's vertex types.
    pub src_type: usize,
    pub dst_type: usize,
}

impl ModelRelation {
    /// The relations of a typed dataset, as a model names them.
    pub fn of(types: &grandis_store::Types) -> Vec<ModelRelation> {
        types
            .relation_keys()
            .into_iter()
            .enumerate()
            .map(|(r, key)| {
                let (src_type, dst_type) = types.ends(r);
                ModelRelation {
                    key,
                    src_type,
                    dst_type,
                }
            })
            .collect()
    }
}

/// What a partition-parallel runner needs to know of a model's stages, from its
/// configuration alone, so that it matches on no model kind: where the graph convolutions
/// sit among the stages, the width of the rows they exchange, and what backward keeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StageLayout {
    /// Stages before the first graph convolution: a row-local encoder (ResSAGE+), whose
    /// input gradient the first convolution must produce, and which reads only a vertex's
    /// own features.
    pub first_conv: usize,
    /// Whether a row-local head stage follows the last convolution.
    pub has_head: bool,
    /// Whether the model reads the graph at all (the MLP does not).
    pub reads_graph: bool,
    /// Width of the rows the first convolution reads (and exchanges).
    pub conv_in: usize,
    /// Width of the rows the last convolution writes.
    pub conv_out: usize,
    /// Whether every convolution's input is a transformed copy backward recomputes, with or
    /// without dropout (ResSAGE+'s norm and activation).
    pub recomputes_conv_inputs: bool,
    /// Output heads when the convolutions are attention layers (GAT).
    pub attention_output_heads: Option<usize>,
}

/// One stage's work per row ([`ModelConfig::stage_work`]).
#[derive(Debug, Clone, PartialEq)]
pub struct StageWork {
    pub d_in: usize,
    pub d_out: usize,
    /// Floating-point operations of its matrices per row, every row alike: all of an
    /// untyped stage's; of a typed stage only its own (R-GCN's root weight), its relations'
    /// being in `relations`.
    pub flops_per_row: f64,
    /// The part of `flops_per_row` a conv stage spends on each of its INPUT rows (`n_src`,
    /// halo and replicated rows too) rather than its output rows: the neighbour map of a
    /// stage that transforms before aggregating, and all of GAT's matrices (its shared map
    /// and attention vectors score every source row). A partition's rank reads far more
    /// rows than it writes, so pricing these per output row underprices it.
    pub input_flops_per_row: f64,
    /// A typed stage's relations, each priced on the rows of the types its matrices
    /// multiply (empty for other stages).
    pub relations: Vec<RelationWork>,
    /// The width of the rows it aggregates when it transforms before aggregating (None:
    /// it aggregates its input rows).
    pub aggregated_cols: Option<usize>,
    /// Whether its backward pass aggregates whether or not its input gets a gradient: a
    /// conv stage that maps before aggregating (GAT's included) gets its weights' gradients
    /// through the graph; one that aggregates first keeps its aggregate and reads the graph
    /// backward only for the input's gradient.
    pub backward_aggregates: bool,
}

/// One relation's matrices in a typed conv stage, by the rows they multiply
/// (`crate::relation`): each weight runs only on the rows of its type, so a rank whose
/// input rows are mostly of one type does that type's relations' work, not every
/// relation's on every row.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct RelationWork {
    pub src_type: usize,
    pub dst_type: usize,
    /// Flops per input row of the source type: the neighbour map when the stage transforms
    /// before aggregating; R-GAT's map and attention scores of its source rows.
    pub per_source_input_row: f64,
    /// Flops per output row of the destination type: the neighbour map when the stage
    /// aggregates first, R-GAT's map of the destination rows (when their type differs from
    /// the sources'), the relation's self weight (hetero-SAGE).
    pub per_destination_output_row: f64,
}

/// What configurations written before GAT existed mean by `heads` and `output_heads`.
fn one() -> usize {
    1
}

impl ModelConfig {
    /// The work of every stage of this model per row, from its configuration alone (no
    /// backend, no weights): what a planner prices.
    pub fn stage_work(&self) -> std::result::Result<Vec<StageWork>, String> {
        self.validate()?;
        let mut layout = crate::param::ParamLayout::new(self.layer_norm);
        let stages = crate::arch::stages(&mut layout, self);
        Ok(stages
            .iter()
            .enumerate()
            .map(|(s, st)| {
                // Every matrix of the stage (its weights, GAT's attention vectors) is one
                // multiply-add per entry and row; biases and norms are not counted.
                let prefix = format!("stage{s}.");
                let flops_per_row = layout
                    .specs
                    .iter()
                    .filter(|p| p.name.starts_with(&prefix) && p.shape.len() == 2)
                    .map(|p| 2.0 * (p.shape[0] * p.shape[1]) as f64)
                    .sum();
                let matrix = |i: Option<usize>| {
                    i.map(|i| &layout.specs[i].shape)
                        .filter(|shape| shape.len() == 2)
                        .map_or(0.0, |shape| 2.0 * (shape[0] * shape[1]) as f64)
                };
                let relations: Vec<RelationWork> = st
                    .relations
                    .iter()
                    .map(|rw| {
                        // The neighbour map (its own weight, or one the bases make, as wide).
                        let cols = rw.attention.map_or(st.d_out, |a| a.heads * a.head_dim);
                        let map = 2.0 * (st.d_in * cols) as f64;
                        let (source, destination) = match rw.attention {
                            // Both ends' rows are mapped, each once; the scores are two
                            // `heads`-wide products per source row.
                            Some(a) => (
                                map + 2.0 * (cols * 2 * a.heads) as f64,
                                if rw.src_type == rw.dst_type { 0.0 } else { map },
                            ),
                            None if st.transforms_first() => (map, 0.0),
                            None => (0.0, map),
                        };
                        RelationWork {
                            src_type: rw.src_type,
                            dst_type: rw.dst_type,
                            per_source_input_row: source,
                            per_destination_output_row: destination + matrix(rw.w_self),
                        }
                    })
                    .collect();
                let (flops_per_row, input_flops_per_row) = match st.kind {
                    StageKind::Conv { .. } if !relations.is_empty() => {
                        (matrix(st.w_self) + matrix(st.w_neigh), 0.0)
                    }
                    StageKind::Conv { .. } if st.attention.is_some() => {
                        (flops_per_row, flops_per_row - matrix(st.w_self))
                    }
                    StageKind::Conv { .. } if st.transforms_first() => {
                        (flops_per_row, matrix(st.w_neigh))
                    }
                    _ => (flops_per_row, 0.0),
                };
                StageWork {
                    d_in: st.d_in,
                    d_out: st.d_out,
                    flops_per_row,
                    input_flops_per_row,
                    relations,
                    aggregated_cols: st.neighbour_width(),
                    backward_aggregates: matches!(st.kind, StageKind::Conv { .. })
                        && (st.attention.is_some() || st.transforms_first()),
                }
            })
            .collect())
    }

    /// How this model's stages are laid out ([`StageLayout`]).
    pub fn stage_layout(&self) -> StageLayout {
        crate::arch::stage_layout(self)
    }

    /// The model of a job for a dataset: [`Self::for_shape`] of its feature columns and
    /// classes, with its relations when it is typed.
    pub fn for_job(
        spec: &grandis_wire::JobSpec,
        data: &grandis_store::DatasetView<'_>,
    ) -> ModelConfig {
        ModelConfig {
            relations: data.types.map(ModelRelation::of).unwrap_or_default(),
            ..Self::for_shape(spec, data.feature_dim, data.num_classes)
        }
    }

    /// A `kind` model of `layers` layers from `in_dim` to `classes` columns through `hidden`,
    /// everything else a job's default (`grandis_wire::JobSpec::default()`: 8 heads, dropout
    /// 0.5, seed 0, no layer norm, no types); callers change what they need with
    /// `ModelConfig { seed: 3, ..ModelConfig::new(..) }`.
    pub fn new(
        kind: ModelKind,
        layers: usize,
        in_dim: usize,
        hidden: usize,
        classes: usize,
    ) -> ModelConfig {
        let spec = grandis_wire::JobSpec {
            model: kind,
            layers: layers as u32,
            hidden: hidden as u32,
            ..grandis_wire::JobSpec::default()
        };
        ModelConfig::for_shape(&spec, in_dim, classes)
    }

    /// The model of a job for a dataset of `features` feature columns and `classes` classes
    /// and no types. Its input is the features and then the job's `embedding_dim` learnable
    /// columns. For link prediction the last layer outputs the embedding instead:
    /// `link.out_dim` columns (default `hidden`), whatever the dataset's classes.
    pub fn for_shape(spec: &grandis_wire::JobSpec, features: usize, classes: usize) -> ModelConfig {
        let classes = match spec.task {
            grandis_wire::Task::Node => classes,
            grandis_wire::Task::Link => {
                spec.link.and_then(|l| l.out_dim).unwrap_or(spec.hidden) as usize
            }
        };
        ModelConfig {
            kind: spec.model,
            layers: spec.layers as usize,
            in_dim: features + spec.embedding_dim as usize,
            hidden: spec.hidden as usize,
            heads: spec.heads as usize,
            output_heads: spec.output_heads as usize,
            classes,
            dropout: spec.dropout as f32,
            layer_norm: spec.layer_norm,
            seed: spec.seed,
            num_bases: spec.num_bases.map(|b| b as usize),
            relations: Vec::new(),
        }
    }

    /// The name and shape of every parameter of this model, in creation order, computed
    /// without building it (a checkpoint's tensors are checked against it before anything is
    /// allocated).
    pub fn parameter_shapes(&self) -> std::result::Result<Vec<(String, Vec<usize>)>, String> {
        self.validate()?;
        let mut layout = crate::param::ParamLayout::new(self.layer_norm);
        crate::arch::stages(&mut layout, self);
        Ok(layout
            .specs
            .into_iter()
            .map(|p| (p.name, p.shape))
            .collect())
    }

    pub fn validate(&self) -> std::result::Result<(), String> {
        if self.layers == 0 {
            return Err("layers must be at least 1".into());
        }
        if self.kind == ModelKind::ResSage && self.layers < 1 {
            return Err("ressage needs at least 1 layer".into());
        }
        if self.in_dim == 0 || self.classes == 0 {
            return Err(format!(
                "input dimension ({}) and classes ({}) must be positive",
                self.in_dim, self.classes
            ));
        }
        if self.hidden == 0 && (self.layers > 1 || self.kind == ModelKind::ResSage) {
            return Err("hidden must be positive".into());
        }
        if self.kind.uses_attention() {
            if self.heads == 0 || self.output_heads == 0 {
                return Err(format!("{} needs at least one head per layer", self.kind));
            }
            if self.layers > 1 && !self.hidden.is_multiple_of(self.heads) {
                return Err(format!(
                    "{}: heads ({}) must divide hidden ({})",
                    self.kind, self.heads, self.hidden
                ));
            }
        }
        if self.num_bases.is_some() && self.kind != ModelKind::Rgcn {
            return Err(format!(
                "num_bases decomposes rgcn's weights, not {}'s",
                self.kind
            ));
        }
        if self.num_bases == Some(0) {
            return Err("num_bases must be at least 1".into());
        }
        if self.kind.is_typed() && self.relations.is_empty() {
            return Err(format!(
                "{} reads a typed dataset's relations, and this dataset has no types (see \
                 `grandis data synth --hetero` and `grandis data import --format npy`)",
                self.kind
            ));
        }
        if !(0.0..1.0).contains(&self.dropout) {
            return Err(format!("dropout must be in [0, 1), got {}", self.dropout));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The coordinator checks an uploaded checkpoint's model against the job's without this
    /// crate (`grandis_wire::checkpoint::check_model`): it must read the configuration that
    /// `for_job` makes as the job's, and another job's as another model.
    #[test]
    fn the_coordinator_reads_a_jobs_model_as_for_job_makes_it() {
        let spec = grandis_wire::JobSpec::from_json_str(
            r#"{"dataset": "/d", "model": "gat", "layers": 3, "hidden": 32, "heads": 4,
                "dropout": 0.3, "layer_norm": true, "seed": 9}"#,
        )
        .unwrap();
        let json = serde_json::to_value(ModelConfig::for_shape(&spec, 17, 5)).unwrap();
        grandis_wire::checkpoint::check_model(&spec, &json).unwrap();
        let other = grandis_wire::JobSpec {
            hidden: 64,
            ..spec.clone()
        };
        let e = grandis_wire::checkpoint::check_model(&other, &json).unwrap_err();
        assert!(e.0.contains("hidden is 32, the job's 64"), "{e}");
    }

    /// The layout a configuration describes is the one its model builds, for every kind.
    #[test]
    fn the_stage_layout_is_the_built_models() {
        let b = grandis_engine::CpuBackend::new(Some(1)).unwrap();
        for kind in [
            ModelKind::Sage,
            ModelKind::Gcn,
            ModelKind::Gat,
            ModelKind::Mlp,
            ModelKind::ResSage,
        ] {
            let config = ModelConfig {
                kind,
                layers: 3,
                in_dim: 7,
                hidden: 8,
                heads: 2,
                output_heads: 3,
                classes: 5,
                dropout: 0.0,
                layer_norm: false,
                seed: 1,
                relations: Vec::new(),
                num_bases: None,
            };
            let layout = config.stage_layout();
            let model = crate::Model::new(&b, config.clone()).unwrap();
            let reads: Vec<usize> = (0..model.num_stages())
                .filter(|&s| model.stage_reads_neighbors(s))
                .collect();
            assert_eq!(layout.reads_graph, !reads.is_empty(), "{kind:?}");
            let last_conv = layout.first_conv + config.layers - 1;
            if layout.reads_graph {
                let convs: Vec<usize> = (layout.first_conv..=last_conv).collect();
                assert_eq!(reads, convs, "{kind:?}");
            }
            assert_eq!(
                model.num_stages(),
                last_conv + 1 + usize::from(layout.has_head)
            );
            assert_eq!(
                model.stage_dims(layout.first_conv).0,
                layout.conv_in,
                "{kind:?}"
            );
            assert_eq!(model.stage_dims(last_conv).1, layout.conv_out, "{kind:?}");
            assert_eq!(
                layout.attention_output_heads.is_some(),
                kind == ModelKind::Gat,
                "{kind:?}"
            );
            // The work of every stage, from the configuration alone, is the built model's.
            let work = config.stage_work().unwrap();
            assert_eq!(work.len(), model.num_stages(), "{kind:?}");
            for (s, w) in work.iter().enumerate() {
                assert_eq!((w.d_in, w.d_out), model.stage_dims(s), "{kind:?} stage {s}");
                assert_eq!(
                    w.aggregated_cols,
                    model.stage_neighbour_width(s),
                    "{kind:?} {s}"
                );
                let matrices: f64 = model
                    .params
                    .iter()
                    .filter(|p| p.name.starts_with(&format!("stage{s}.")) && p.shape.len() == 2)
                    .map(|p| 2.0 * (p.shape[0] * p.shape[1]) as f64)
                    .sum();
                assert_eq!(w.flops_per_row, matrices, "{kind:?} stage {s}");
                assert!(w.flops_per_row > 0.0, "{kind:?} stage {s}");
                // GAT maps and scores every input row; plain convolutions map their inputs
                // only when that narrows them (ResSAGE+'s hidden-width convolutions always;
                // its encoder and head are row-local).
                let conv = (layout.first_conv..=last_conv).contains(&s);
                let input = match kind {
                    ModelKind::Gat => w.flops_per_row,
                    ModelKind::Sage if w.d_out <= w.d_in => w.flops_per_row / 2.0,
                    ModelKind::Gcn if w.d_out <= w.d_in => w.flops_per_row,
                    ModelKind::ResSage if conv => w.flops_per_row / 2.0,
                    ModelKind::Sage | ModelKind::Gcn | ModelKind::Mlp | ModelKind::ResSage => 0.0,
                    // Typed stages price every product per output row.
                    ModelKind::Rgcn | ModelKind::HeteroSage | ModelKind::Rgat => 0.0,
                };
                assert_eq!(w.input_flops_per_row, input, "{kind:?} stage {s}");
            }
        }
    }
}
