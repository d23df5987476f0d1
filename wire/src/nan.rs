//! Serde for measures that may be absent, held as `f64::NAN`: an accuracy over an empty
//! split or a run that did not evaluate, the loss of a run that trained no epoch.
//!
//! JSON has no NaN: `serde_json` writes it as `null` and then refuses to read `null` back as a
//! number, so a summary with an absent accuracy could be written but not read. Fields use
//! `#[serde(with = "crate::nan")]`: NaN goes out as an absent value (`null` in JSON) and
//! comes back as NaN, in any format (it is an `Option<f64>` on the wire).

use serde::{Deserialize, Deserializer, Serialize, Serializer};

pub fn serialize<S: Serializer>(value: &f64, s: S) -> Result<S::Ok, S::Error> {
    (!value.is_nan()).then_some(*value).serialize(s)
}

pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
    Ok(Option::<f64>::deserialize(d)?.unwrap_or(f64::NAN))
}

#[cfg(test)]
mod tests {
    use serde::{Deserialize, Serialize};

    #[derive(Serialize, Deserialize)]
    struct Acc {
        #[serde(with = "crate::nan")]
        acc: f64,
    }

    #[test]
    fn nan_round_trips_through_json_as_null() {
        let text = serde_json::to_string(&Acc { acc: f64::NAN }).unwrap();
        assert_eq!(text, r#"{"acc":null}"#);
        assert!(serde_json::from_str::<Acc>(&text).unwrap().acc.is_nan());
        let text = serde_json::to_string(&Acc { acc: 0.25 }).unwrap();
        assert_eq!(serde_json::from_str::<Acc>(&text).unwrap().acc, 0.25);
    }
}
