//! Configuration merging (defaults < TOML file < GRANDIS_COORDINATOR_* environment). One test
//! in its own binary, because it changes the process environment.

use grandis_coordinator::{print_config, CoordinatorConfig};

#[test]
fn file_then_environment_with_redacted_print() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("coordinator.toml");
    std::fs::write(
        &path,
        "listen = \"0.0.0.0:9000\"\ntoken = \"file-token\"\nlease_ms = 5000\ndb_path = \"/var/lib/grandis/c.redb\"\n",
    )
    .unwrap();
    std::env::set_var("GRANDIS_COORDINATOR_LISTEN", "127.0.0.1:7777");
    // Digits only: arrives as a number from the environment and must still be a token.
    std::env::set_var("GRANDIS_COORDINATOR_DAEMON_TOKEN", "123456");
    std::env::set_var("GRANDIS_COORDINATOR_SOMETHING_ELSE", "ignored");

    let c = CoordinatorConfig::load(Some(&path)).unwrap();
    assert_eq!(c.listen, "127.0.0.1:7777", "environment beats the file");
    assert_eq!(c.token.as_deref(), Some("file-token"));
    assert_eq!(c.daemon_token.as_deref(), Some("123456"));
    assert_eq!(c.lease_ms, 5000);
    assert_eq!(c.heartbeat_interval_ms, 1000, "default");

    let printed = print_config(Some(&path)).unwrap();
    assert!(
        !printed.contains("file-token") && !printed.contains("123456"),
        "{printed}"
    );
    let line = |key: &str| {
        printed
            .lines()
            .find(|l| l.starts_with(&format!("{key} = ")))
            .unwrap_or_else(|| panic!("no {key} in\n{printed}"))
            .to_string()
    };
    assert!(line("listen").contains("\"127.0.0.1:7777\""));
    assert!(line("listen").contains("GRANDIS_COORDINATOR_"), "{printed}");
    assert!(line("lease_ms").contains("coordinator.toml"), "{printed}");
    assert!(
        line("heartbeat_interval_ms").ends_with("# from default"),
        "{printed}"
    );
    assert!(line("token").contains("<redacted>"));

    // Problems name the key and the source.
    std::fs::write(&path, "token = \"t\"\nlease_ms = \"soon\"\n").unwrap();
    let err = CoordinatorConfig::load(Some(&path))
        .unwrap_err()
        .to_string();
    assert!(err.contains("lease_ms"), "{err}");
    std::fs::write(&path, "token = \"t\"\nlaese_ms = 5\n").unwrap();
    let err = CoordinatorConfig::load(Some(&path))
        .unwrap_err()
        .to_string();
    assert!(err.contains("laese_ms"), "{err}");
    std::fs::write(&path, "token = \"t\"\nlease_ms = 500\n").unwrap();
    let err = CoordinatorConfig::load(Some(&path))
        .unwrap_err()
        .to_string();
    assert_eq!(
        err,
        "lease_ms: must be greater than heartbeat_interval_ms (1000), got 500"
    );
    std::fs::write(&path, "listen = \"127.0.0.1:1\"\n").unwrap();
    let err = CoordinatorConfig::load(Some(&path))
        .unwrap_err()
        .to_string();
    assert!(err.starts_with("token: not set"), "{err}");
    let err = CoordinatorConfig::load(Some(&dir.path().join("missing.toml")))
        .unwrap_err()
        .to_string();
    assert!(err.contains("missing.toml: not found"), "{err}");
}
