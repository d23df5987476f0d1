//! Writes small Parquet tables as Neo4j GDS exports them (nodes with ids, a label and a
//! feature list; relationships as id pairs), for the importers' tests.
#![allow(dead_code)]

use std::path::Path;
use std::sync::Arc;

use parquet::data_type::{DoubleType, Int64Type};
use parquet::file::properties::WriterProperties;
use parquet::file::writer::SerializedFileWriter;
use parquet::schema::parser::parse_message_type;

/// `(nodeId, subject, features)`; `None` is null.
pub type NodeRow = (i64, Option<i64>, Option<Vec<f64>>);

/// Writes a GDS-style nodes table (label column `subject`, features column `features`).
pub fn nodes(path: &Path, rows: &[NodeRow]) {
    nodes_with(path, rows, "subject", "features")
}

/// Writes a nodes table whose label and feature columns are named `label` and `features`.
pub fn nodes_with(path: &Path, rows: &[NodeRow], label: &str, features: &str) {
    let schema = Arc::new(
        parse_message_type(&format!(
            "message schema {{
                required int64 nodeId;
                optional int64 {label};
                optional group {features} (LIST) {{
                    repeated group list {{ optional double element; }}
                }}
            }}"
        ))
        .unwrap(),
    );
    let props = Arc::new(
        WriterProperties::builder()
            .set_compression(parquet::basic::Compression::GZIP(Default::default()))
            .build(),
    );
    let file = std::fs::File::create(path).unwrap();
    let mut writer = SerializedFileWriter::new(file, schema, props).unwrap();
    let mut group = writer.next_row_group().unwrap();
    // nodeId
    let mut col = group.next_column().unwrap().unwrap();
    let ids: Vec<i64> = rows.iter().map(|r| r.0).collect();
    col.typed::<Int64Type>()
        .write_batch(&ids, None, None)
        .unwrap();
    col.close().unwrap();
    // the label (nullable: definition level 1 = present)
    let mut col = group.next_column().unwrap().unwrap();
    let values: Vec<i64> = rows.iter().filter_map(|r| r.1).collect();
    let defs: Vec<i16> = rows.iter().map(|r| r.1.is_some() as i16).collect();
    col.typed::<Int64Type>()
        .write_batch(&values, Some(&defs), None)
        .unwrap();
    col.close().unwrap();
    // the features: definition 0 = null list, 1 = empty list, 3 = element present.
    let mut col = group.next_column().unwrap().unwrap();
    let (mut values, mut defs, mut reps) = (vec![], vec![], vec![]);
    for r in rows {
        match &r.2 {
            None => {
                defs.push(0);
                reps.push(0);
            }
            Some(list) if list.is_empty() => {
                defs.push(1);
                reps.push(0);
            }
            Some(list) => {
                for (i, &v) in list.iter().enumerate() {
                    values.push(v);
                    defs.push(3);
                    reps.push((i > 0) as i16);
                }
            }
        }
    }
    col.typed::<DoubleType>()
        .write_batch(&values, Some(&defs), Some(&reps))
        .unwrap();
    col.close().unwrap();
    group.close().unwrap();
    writer.close().unwrap();
}

pub fn rels(path: &Path, rows: &[(i64, i64)]) {
    let schema = Arc::new(
        parse_message_type(
            "message schema { required int64 sourceNodeId; required int64 targetNodeId; }",
        )
        .unwrap(),
    );
    let file = std::fs::File::create(path).unwrap();
    let mut writer =
        SerializedFileWriter::new(file, schema, Arc::new(WriterProperties::default())).unwrap();
    let mut group = writer.next_row_group().unwrap();
    for pick in [0, 1] {
        let mut col = group.next_column().unwrap().unwrap();
        let values: Vec<i64> = rows
            .iter()
            .map(|r| if pick == 0 { r.0 } else { r.1 })
            .collect();
        col.typed::<Int64Type>()
            .write_batch(&values, None, None)
            .unwrap();
        col.close().unwrap();
    }
    group.close().unwrap();
    writer.close().unwrap();
}
