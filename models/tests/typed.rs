//! Typed models compute what PyG's do: one layer of R-GCN (`RGCNConv`, mean per relation),
//! of hetero-SAGE (`to_hetero(SAGEConv)`, summed over the relations into a vertex's type)
//! and of R-GAT (`to_hetero(GATConv(add_self_loops=False))`, summed likewise) against the
//! formulas evaluated naively from the model's own parameters, on a graph where one type has
//! no relation into it.

use grandis_engine::norm::full_block;
use grandis_engine::{Backend, CpuBackend};
use grandis_models::{Model, ModelConfig, ModelKind, ModelRelation, RelationGraphs, StageCtx};
use grandis_store::{EdgeOptions, Relation, SelfLoops, TypeSchema, Types, VertexType};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

const N: usize = 12;
const D_IN: usize = 3;

/// Types a = 0..5, b = 5..9, c = 9..12; relations a -> a, a -> b, c -> b (nothing enters a
/// c, and a has only its own type's sources).
fn typed_graph() -> (grandis_store::CsrGraph, Types) {
    let vt = |name: &str, count| VertexType::new(name, count, D_IN as u64);
    let rel = |src: &str, dst: &str| Relation::new(src, "r", dst);
    let schema = TypeSchema {
        vertex_types: vec![vt("a", 5), vt("b", 4), vt("c", 3)],
        relations: vec![rel("a", "a"), rel("a", "b"), rel("c", "b")],
        target: "a".into(),
    };
    let types = Types::new(schema, N as u64, D_IN as u64).unwrap();
    let mut rng = ChaCha8Rng::seed_from_u64(2);
    let mut edges = Vec::new();
    for _ in 0..40 {
        let (u, v) = (rng.gen_range(0..N as u32), rng.gen_range(0..N as u32));
        if types.relation(types.type_of(u), types.type_of(v)).is_some() {
            edges.push((u, v));
        }
    }
    let opts = EdgeOptions {
        symmetrize: false,
        self_loops: SelfLoops::Remove,
    };
    (
        grandis_store::graph_from_edges(N as u64, edges, opts).unwrap(),
        types,
    )
}

/// `x W` for one row (`W` is `D_IN x d_out`, row-major).
fn times(x: &[f32], w: &[f32], d_out: usize) -> Vec<f64> {
    (0..d_out)
        .map(|j| {
            (0..D_IN)
                .map(|i| x[i] as f64 * w[i * d_out + j] as f64)
                .sum()
        })
        .collect()
}

/// The model's logits and the formula's with `d_out` output columns (fewer than the input's
/// transform before aggregating, more aggregate first).
fn logits(
    kind: ModelKind,
    d_out: usize,
    num_bases: Option<usize>,
    output_heads: usize,
) -> (Vec<f32>, Vec<f64>) {
    let (g, types) = typed_graph();
    let b = CpuBackend::new(Some(1)).unwrap();
    let config = ModelConfig {
        heads: 1,
        output_heads,
        dropout: 0.0,
        seed: 3,
        relations: ModelRelation::of(&types),
        num_bases,
        ..ModelConfig::new(kind, 1, D_IN, 4, d_out)
    };
    let model = Model::new(&b, config).unwrap();
    let mut rng = ChaCha8Rng::seed_from_u64(9);
    let x: Vec<f32> = (0..N * D_IN).map(|_| rng.gen_range(-1.0..1.0)).collect();
    let block = full_block(g.view(), grandis_models::aggregation(kind));
    let ids: Vec<u32> = (0..N as u32).collect();
    let split = grandis_models::split_block(model.config.kind, &block, Some(&types), &ids).unwrap();
    let relations = RelationGraphs::upload(&b, split.as_ref()).unwrap();
    let graph = b.upload_graph(&block).unwrap();
    let ctx = StageCtx::<CpuBackend> {
        graph: &graph,
        typed: relations.as_ref(),
        n_dst: N,
        n_src: N,
        global_ids: &ids,
        train: None,
    };
    let (out, _) = model.forward(&b, &ctx, &x, false).unwrap();

    let param = |name: &str| -> &Vec<f32> {
        &model
            .params
            .iter()
            .find(|p| p.name == name)
            .unwrap_or_else(|| panic!("no parameter {name}"))
            .value
    };
    let row = |v: u32| &x[v as usize * D_IN..(v as usize + 1) * D_IN];
    let keys = types.relation_keys();
    let mut expected = vec![0f64; N * d_out];
    for v in 0..N as u32 {
        let mut acc = vec![0f64; d_out];
        let mut add = |t: Vec<f64>| acc.iter_mut().zip(t).for_each(|(a, t)| *a += t);
        let tv = types.type_of(v);
        if kind == ModelKind::Rgcn {
            add(times(row(v), param("stage0.root"), d_out));
            add(param("stage0.bias").iter().map(|&b| b as f64).collect());
        }
        for (r, key) in keys.iter().enumerate() {
            let (src, dst) = types.ends(r);
            if dst != tv {
                continue;
            }
            let nbrs: Vec<u32> = g
                .view()
                .neighbors(v)
                .iter()
                .copied()
                .filter(|&u| types.type_of(u) == src)
                .collect();
            if kind == ModelKind::Rgat {
                add(rgat_term(&nbrs, v, key, output_heads, d_out, &row, &param));
                continue;
            }
            let neigh = match (kind, num_bases) {
                // W_r = sum_b comp[r, b] basis[b].
                (ModelKind::Rgcn, Some(bases)) => {
                    let (comp, basis) = (param("stage0.comp"), param("stage0.basis"));
                    let k = D_IN * d_out;
                    (0..k)
                        .map(|i| {
                            (0..bases)
                                .map(|b| comp[r * bases + b] * basis[b * k + i])
                                .sum()
                        })
                        .collect()
                }
                (ModelKind::Rgcn, None) => param(&format!("stage0.{key}.weight")).clone(),
                _ => param(&format!("stage0.{key}.w_neigh")).clone(),
            };
            for &u in &nbrs {
                let t = times(row(u), &neigh, d_out);
                add(t.into_iter().map(|t| t / nbrs.len() as f64).collect());
            }
            if kind == ModelKind::HeteroSage {
                add(times(row(v), param(&format!("stage0.{key}.w_self")), d_out));
                let bias = param(&format!("stage0.{key}.bias"));
                add(bias.iter().map(|&b| b as f64).collect());
            }
        }
        expected[v as usize * d_out..(v as usize + 1) * d_out].copy_from_slice(&acc);
    }
    (out, expected)
}

#[test]
fn rgcn_and_heterosage_compute_pygs_formulas() {
    for kind in [ModelKind::Rgcn, ModelKind::HeteroSage] {
        let bases: &[Option<usize>] = match kind {
            ModelKind::Rgcn => &[None, Some(2)],
            _ => &[None],
        };
        for (d_out, &num_bases) in [2, 5]
            .iter()
            .flat_map(|&d| bases.iter().map(move |b| (d, b)))
        {
            let (out, expected) = logits(kind, d_out, num_bases, 1);
            for (i, (&o, &e)) in out.iter().zip(&expected).enumerate() {
                let row = i / d_out;
                assert!(
                    (o as f64 - e).abs() < 1e-5,
                    "{kind} {d_out} row {row}: {o} vs {e}"
                );
            }
            if kind == ModelKind::HeteroSage {
                // No relation enters a c: its rows are zero (PyG drops the type).
                assert!(out[9 * d_out..].iter().all(|&o| o == 0.0));
            }
        }
    }
}

/// One R-GAT relation's term for destination `v` (its `nbrs` of the relation's source type):
/// per head, a softmax over the neighbours of `LeakyReLU(t_u · att_src + t_v · att_dst)`, no
/// self-loop; the heads averaged; plus the relation's bias (alone when `v` has none).
fn rgat_term<'a>(
    nbrs: &[u32],
    v: u32,
    key: &str,
    heads: usize,
    f: usize,
    row: &dyn Fn(u32) -> &'a [f32],
    param: &dyn Fn(&str) -> &'a Vec<f32>,
) -> Vec<f64> {
    let w = param(&format!("stage0.{key}.weight"));
    let (att_src, att_dst) = (
        param(&format!("stage0.{key}.att_src")),
        param(&format!("stage0.{key}.att_dst")),
    );
    let c = heads * f;
    let t = |u: u32| times(row(u), w, c);
    let score = |tu: &[f64], att: &[f32], h: usize| -> f64 {
        (0..f).map(|j| tu[h * f + j] * att[h * f + j] as f64).sum()
    };
    let tv = t(v);
    let mut out: Vec<f64> = param(&format!("stage0.{key}.bias"))
        .iter()
        .map(|&b| b as f64)
        .collect();
    for h in 0..heads {
        let ts: Vec<Vec<f64>> = nbrs.iter().map(|&u| t(u)).collect();
        let e: Vec<f64> = ts
            .iter()
            .map(|tu| {
                let pre = score(tu, att_src, h) + score(&tv, att_dst, h);
                if pre > 0.0 {
                    pre
                } else {
                    0.2 * pre
                }
            })
            .collect();
        let max = e.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let z: f64 = e.iter().map(|e| (e - max).exp()).sum();
        for (tu, e) in ts.iter().zip(&e) {
            let a = (e - max).exp() / z / heads as f64;
            for j in 0..f {
                out[j] += a * tu[h * f + j];
            }
        }
    }
    out
}

#[test]
fn rgat_computes_pygs_formula() {
    for (d_out, heads) in [(2, 1), (5, 2), (3, 3)] {
        let (out, expected) = logits(ModelKind::Rgat, d_out, None, heads);
        for (i, (&o, &e)) in out.iter().zip(&expected).enumerate() {
            let row = i / d_out;
            assert!(
                (o as f64 - e).abs() < 1e-5,
                "rgat {d_out} x {heads} heads row {row}: {o} vs {e}"
            );
        }
        // No relation enters a c: its rows are zero (PyG drops the type).
        assert!(out[9 * d_out..].iter().all(|&o| o == 0.0));
    }
}
