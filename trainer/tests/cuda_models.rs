//! Whole-model CPU/GPU parity: SAGE, GCN and ResSAGE+ (28 layers, LayerNorm) trained for 10
//! epochs on a synthetic power-law graph and (with `GRANDIS_CORA`) on Cora, once on the CPU
//! backend and once on `cuda:0`, must give per-epoch losses within 1e-3 relative and final
//! logits within 1e-3 (relative to the largest logit). cuBLAS runs in plain FP32 (no TF32).
//!
//! Needs `--features cuda` and a GPU. Without a driver or device each test says it skipped;
//! `GRANDIS_REQUIRE_GPU=1` (set by `scripts/gpu-check.sh`) turns those skips into failures.
#![cfg(feature = "cuda")]

use grandis_engine::cuda::CudaBackend;
use grandis_engine::Kernels;
use grandis_models::{ModelConfig, ModelKind};
use grandis_store::DatasetView;
use grandis_synth::SynthConfig;
use grandis_trainer::{CheckpointOptions, TrainOptions, TrainReport};

const REL: f64 = 1e-3;

fn gpu() -> Option<CudaBackend> {
    grandis_engine::cuda::device_for_tests()
}

fn opts() -> TrainOptions {
    TrainOptions {
        objective: Default::default(),
        epochs: 10,
        lr: 0.01,
        weight_decay: 5e-4,
        adamw: false,
        grad_clip: Some(5.0),
        seed: 3,
        eval: Default::default(),
        embedding_dim: 0,
    }
}

/// The models on `view`: SAGE (3 layers), GCN (2 layers), ResSAGE+ (28 layers with LayerNorm)
/// and GAT (2 layers, 4 heads).
fn models(view: &DatasetView<'_>) -> Vec<(&'static str, ModelConfig)> {
    let base = |kind, layers, layer_norm| ModelConfig {
        heads: 2,
        layer_norm,
        seed: 5,
        ..ModelConfig::new(kind, layers, view.feature_dim, 32, view.num_classes)
    };
    vec![
        ("sage-3", base(ModelKind::Sage, 3, false)),
        ("gcn-2", base(ModelKind::Gcn, 2, false)),
        ("ressage+-28", base(ModelKind::ResSage, 28, true)),
        (
            "gat-2",
            ModelConfig {
                heads: 4,
                ..base(ModelKind::Gat, 2, false)
            },
        ),
    ]
}

fn run_cpu(view: DatasetView<'_>, cfg: &ModelConfig) -> TrainReport {
    let ck = CheckpointOptions::default();
    grandis_trainer::train(view, cfg.clone(), &opts(), &ck, None, |_| {}).unwrap()
}

/// Trains every model on both backends and compares losses epoch by epoch and the final
/// logits (through a checkpoint, so the comparison covers the weights too).
fn compare_models(name: &str, view: DatasetView<'_>) {
    let Some(first) = gpu() else { return };
    eprintln!("{name}: {} on {}", first.name(), first.device_name());
    drop(first);
    for (label, cfg) in models(&view) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("gpu.safetensors");
        let cpu = run_cpu(view, &cfg);
        let gpu = gpu().unwrap();
        let ck = CheckpointOptions {
            path: Some(path.clone()),
            resume: false,
            ..Default::default()
        };
        let cuda = grandis_trainer::train_on(gpu, view, cfg.clone(), &opts(), &ck, |_| {}).unwrap();
        assert_eq!(cpu.epochs.len(), cuda.epochs.len());
        let mut worst = 0.0f64;
        for (c, g) in cpu.epochs.iter().zip(&cuda.epochs) {
            let rel = (c.loss - g.loss).abs() / c.loss.abs().max(1e-12);
            worst = worst.max(rel);
            assert!(
                rel <= REL,
                "{name} {label} epoch {}: cpu loss {} vs cuda loss {} (relative {rel:.2e})",
                c.epoch,
                c.loss,
                g.loss
            );
        }
        let on_cpu = grandis_trainer::predict_logits(view, &path, None).unwrap();
        let on_gpu = grandis_trainer::predict_logits_on(gpu_again(), view, &path).unwrap();
        let scale = on_cpu.iter().fold(1e-6f32, |m, x| m.max(x.abs()));
        let logit_rel = on_cpu
            .iter()
            .zip(&on_gpu)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max)
            / scale;
        assert!(
            logit_rel as f64 <= REL,
            "{name} {label}: logits differ by {logit_rel:.2e} of the largest"
        );
        eprintln!(
            "{name} {label}: 10 epochs, worst loss difference {worst:.2e} relative, logits \
             {logit_rel:.2e}; losses cpu {:.6} -> {:.6}, cuda {:.6} -> {:.6}; median epoch \
             cpu {:.4}s, cuda {:.4}s",
            cpu.epochs[0].loss,
            cpu.final_loss,
            cuda.epochs[0].loss,
            cuda.final_loss,
            cpu.median_epoch_s,
            cuda.median_epoch_s
        );
    }
}

fn gpu_again() -> CudaBackend {
    CudaBackend::new(0).unwrap()
}

#[test]
fn models_match_cpu_on_a_synthetic_graph() {
    let ds = grandis_synth::generate_in_memory(&SynthConfig {
        nodes: 3_000,
        avg_degree: 12.0,
        features: 24,
        classes: 6,
        seed: 9,
        ..SynthConfig::default()
    })
    .unwrap();
    compare_models("synthetic", ds.view());
}

#[test]
fn models_match_cpu_on_cora() {
    let Ok(dir) = std::env::var("GRANDIS_CORA") else {
        eprintln!("skipped: GRANDIS_CORA is not set (scripts/fetch-cora.sh)");
        return;
    };
    let ds = grandis_store::Dataset::open_verified(&dir).unwrap();
    compare_models("cora", ds.view());
}
