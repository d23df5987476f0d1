//! Layered configuration shared by the grandis services (coordinator, daemon): built-in
//! defaults, then a TOML file, then `GRANDIS_<SERVICE>_*` environment variables, later sources
//! winning, merged with figment. Only the service's known keys are read from the environment,
//! so unrelated variables with the same prefix cannot break start-up, while a typo in the file
//! is still an error (the config structs use `deny_unknown_fields`). [`Layers::render`] prints
//! the merged result with the source of every key and secrets redacted (`--print-config`).

use std::path::Path;

use anyhow::{bail, Context};
use figment::providers::{Env, Format, Serialized, Toml};
use figment::Figment;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Deserializer, Serialize};

/// How one service's configuration is layered.
#[derive(Debug, Clone, Copy)]
pub struct Layers {
    /// Service name for messages ("coordinator", "daemon").
    pub service: &'static str,
    /// Environment prefix, e.g. `GRANDIS_DAEMON_` (the variable is the prefix + key in upper case).
    pub env_prefix: &'static str,
    /// Every key, in the order `render` shows them.
    pub keys: &'static [&'static str],
    /// Keys whose values are never printed.
    pub secrets: &'static [&'static str],
}

impl Layers {
    /// The merged sources: defaults < `path` (if given; it must exist) < environment.
    pub fn figment<T: Serialize + Default>(&self, path: Option<&Path>) -> anyhow::Result<Figment> {
        let mut fig = Figment::from(Serialized::defaults(T::default()));
        if let Some(path) = path {
            if !path.is_file() {
                bail!("config file {}: not found", path.display());
            }
            fig = fig.merge(Toml::file_exact(path));
        }
        Ok(fig.merge(Env::prefixed(self.env_prefix).only(self.keys)))
    }

    /// Merges and deserializes; the error names the service, the file and the key.
    pub fn extract<T: Serialize + Default + DeserializeOwned>(
        &self,
        path: Option<&Path>,
    ) -> anyhow::Result<T> {
        self.figment::<T>(path)?.extract().map_err(|e| {
            anyhow::anyhow!(
                "invalid {} configuration{}: {e}",
                self.service,
                path.map(|p| format!(" ({})", p.display()))
                    .unwrap_or_default()
            )
        })
    }

    /// Renders `config` (already loaded and validated from `path`) as TOML, one key per line,
    /// each annotated with the source it came from; secrets are redacted.
    pub fn render<T: Serialize + Default>(
        &self,
        path: Option<&Path>,
        config: &T,
    ) -> anyhow::Result<String> {
        let fig = self.figment::<T>(path)?;
        let table = toml::Table::try_from(config).context("rendering the configuration")?;
        let mut out = format!(
            "# grandis {} configuration: defaults < config file < {}* environment\n",
            self.service, self.env_prefix
        );
        for key in self.keys {
            let value = match table.get(*key) {
                Some(_) if self.secrets.contains(key) => "\"<redacted>\"".to_string(),
                Some(v) => v.to_string(),
                None => "# (not set)".to_string(),
            };
            let source = match fig.find_metadata(key) {
                Some(m) if m.name.contains("environment") => {
                    format!(
                        "environment {}{}",
                        self.env_prefix,
                        key.to_ascii_uppercase()
                    )
                }
                Some(m) => match &m.source {
                    Some(figment::Source::File(file)) => format!("config file {}", file.display()),
                    _ => "default".to_string(),
                },
                None => "default".to_string(),
            };
            let line = if value.starts_with('#') {
                format!("# {key} {value}")
            } else {
                format!("{key} = {value}")
            };
            out.push_str(&format!("{line:<48} # from {source}\n"));
        }
        Ok(out)
    }
}

/// For `#[serde(deserialize_with = ...)]` on optional secrets: a token made only of digits
/// arrives from the environment as a number; accept it as text.
pub fn opt_string_lenient<'de, D: Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Lenient {
        S(String),
        U(u64),
        I(i64),
        F(f64),
    }
    Ok(Option::<Lenient>::deserialize(d)?.map(|v| match v {
        Lenient::S(s) => s,
        Lenient::U(n) => n.to_string(),
        Lenient::I(n) => n.to_string(),
        Lenient::F(n) => n.to_string(),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
    #[serde(default, deny_unknown_fields)]
    struct Demo {
        listen: String,
        #[serde(deserialize_with = "opt_string_lenient")]
        token: Option<String>,
    }
    impl Default for Demo {
        fn default() -> Self {
            Demo {
                listen: "127.0.0.1:1".into(),
                token: None,
            }
        }
    }
    const LAYERS: Layers = Layers {
        service: "demo",
        env_prefix: "GRANDIS_CONFIG_TEST_DEMO_",
        keys: &["listen", "token"],
        secrets: &["token"],
    };

    #[test]
    fn file_overrides_defaults_and_secrets_are_redacted() {
        let dir = std::env::temp_dir().join(format!("grandis-config-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("demo.toml");
        std::fs::write(&path, "token = 1234\n").unwrap();
        let demo: Demo = LAYERS.extract(Some(&path)).unwrap();
        assert_eq!(demo.token.as_deref(), Some("1234"));
        assert_eq!(demo.listen, "127.0.0.1:1");
        let printed = LAYERS.render(Some(&path), &demo).unwrap();
        assert!(
            printed.contains("<redacted>") && !printed.contains("1234"),
            "{printed}"
        );
        assert!(printed.contains("# from config file"), "{printed}");
        std::fs::write(&path, "tokn = \"x\"\n").unwrap();
        let err = LAYERS.extract::<Demo>(Some(&path)).unwrap_err().to_string();
        assert!(err.contains("tokn") && err.contains("demo.toml"), "{err}");
        let err = LAYERS
            .extract::<Demo>(Some(&dir.join("missing.toml")))
            .unwrap_err()
            .to_string();
        assert!(err.contains("not found"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
