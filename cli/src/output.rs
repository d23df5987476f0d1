//! What the training commands print: the per-epoch line (local runs and runs followed from a
//! coordinator alike) and the run's summary (a line, or the line and the JSON).

use grandis_wire::RunSummary;

/// The per-epoch line of every mode, local (`train`) or followed from a coordinator
/// (`submit --follow`, `cluster up`).
pub(crate) fn epoch_line(epoch: usize, loss: f64, train: f64, val: f64, seconds: f64) -> String {
    use grandis_wire::summary::accuracy;
    format!(
        "epoch {epoch:>4}  loss {loss:.4}  train {}  val {}  {seconds:.3}s",
        accuracy(train),
        accuracy(val)
    )
}

/// [`epoch_line`] of a local epoch (link prediction's evaluated epochs: the validation AUC
/// instead of the accuracies).
pub(crate) fn stats_line(s: &grandis_trainer::EpochStats) -> String {
    if s.val_auc.is_nan() {
        epoch_line(s.epoch, s.loss, s.train_acc, s.val_acc, s.seconds)
    } else {
        format!(
            "epoch {:>4}  loss {:.4}  val auc {:.4}  {:.3}s",
            s.epoch, s.loss, s.val_auc, s.seconds
        )
    }
}

/// Prints the summary: one line, or (`json`) the line on stderr and the JSON on stdout.
pub(crate) fn print_summary(summary: &RunSummary, json: bool) -> anyhow::Result<()> {
    if json {
        eprintln!("{}", summary.line());
        println!("{}", serde_json::to_string(summary)?);
    } else {
        println!("{}", summary.line());
    }
    Ok(())
}
