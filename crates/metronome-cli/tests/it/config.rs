//! `metronome config`: the resolved configuration, as `run` would use it.

use std::process::Command;

fn resolved(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_metronome")).arg("config").args(args).output().unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into(),
        String::from_utf8_lossy(&out.stderr).into(),
    )
}

#[test]
fn schedule_shorthand_stale_brings_its_importance_sampling_cap() {
    // `cargo xtask e2e --schedule stale:2` must run on the embedded default.
    let (ok, toml, err) = resolved(&["--schedule", "stale:2"]);
    assert!(ok, "{err}");
    assert!(toml.contains("schedule = \"stale:2\""), "{toml}");
    assert!(toml.contains("tis_cap = 2.0"), "{toml}");
    // A cap the user chose is kept.
    let (ok, toml, err) = resolved(&["--schedule", "stale:1", "--set", "trainer.loss.tis_cap=5.0"]);
    assert!(ok, "{err}");
    assert!(toml.contains("tis_cap = 5.0"), "{toml}");
    // On-policy schedules get none, and `--set run.schedule` is taken as written.
    let (ok, toml, err) = resolved(&["--schedule", "sync"]);
    assert!(ok && !toml.contains("tis_cap"), "{err}{toml}");
    let (ok, _, err) = resolved(&["--set", "run.schedule=\"stale:2\""]);
    assert!(!ok && err.contains("trainer.loss.tis_cap"), "{err}");
}

/// `metronome config` with `env` set (and nothing else of this process's environment
/// named `METRONOME_NATS_PASSWORD`).
fn resolved_with(args: &[&str], env: &[(&str, &str)]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_metronome"))
        .arg("config")
        .args(args)
        .env_remove("METRONOME_NATS_PASSWORD")
        .envs(env.iter().copied())
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into(),
        String::from_utf8_lossy(&out.stderr).into(),
    )
}

fn deploy(file: &str) -> String {
    format!("{}/../../deploy/{file}", env!("CARGO_MANIFEST_DIR"))
}

#[test]
fn the_deploy_configs_authenticate_with_a_password_from_the_environment_and_never_print_it() {
    for file in ["single-host.toml", "cluster.toml"] {
        let path = deploy(file);
        let (ok, toml, err) = resolved_with(&["--config", &path], &[("METRONOME_NATS_PASSWORD", "pw-8d1e")]);
        assert!(ok, "{file}: {err}");
        assert!(toml.contains("kind = \"user_password\"") && toml.contains("<redacted>"), "{file}: {toml}");
        assert!(!toml.contains("pw-8d1e") && !err.contains("pw-8d1e"), "{file} printed the password");
        let (ok, _, err) = resolved_with(&["--config", &path], &[]);
        assert!(!ok, "{file} resolved without its password");
        assert!(
            err.contains("`transport.auth.password`") && err.contains("METRONOME_NATS_PASSWORD"),
            "{file}: {err}"
        );
    }
}

#[test]
fn the_deploy_nats_config_asks_for_the_password_and_keeps_monitoring_on_loopback() {
    let text = std::fs::read_to_string(deploy("nats-server.conf")).unwrap();
    assert!(text.contains("http: 127.0.0.1:8222"), "monitoring is not on loopback");
    // The server accepts the file (without the TLS block, whose certificates are the
    // operator's), with the password from its environment.
    let start = text.find("tls {").unwrap();
    let end = start + text[start..].find('}').unwrap() + 1;
    let dir = tempfile::tempdir().unwrap();
    let conf = dir.path().join("nats-server.conf");
    let mut local = format!("{}{}", &text[..start], &text[end..]);
    local = local.replace("/var/lib/nats/jetstream", &dir.path().join("js").display().to_string());
    std::fs::write(&conf, &local).unwrap();
    let bin = metronome_testkit::server::binary().expect("nats-server");
    let out = Command::new(bin)
        .args(["-t", "-c"])
        .arg(&conf)
        .env("METRONOME_NATS_PASSWORD", "pw")
        .output()
        .unwrap();
    let said = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{said}");
    assert!(local.contains("authorization {") && local.contains("$METRONOME_NATS_PASSWORD"), "{local}");
}

#[test]
fn config_files_layer_in_order_over_the_default() {
    let dir = tempfile::tempdir().unwrap();
    let (base, sweep) = (dir.path().join("base.toml"), dir.path().join("sweep.toml"));
    std::fs::write(&base, "[run]\nperiods = 7\n[trainer.schedule]\nlr = 1e-4\n").unwrap();
    std::fs::write(&sweep, "[trainer.schedule]\nlr = 5e-4\n").unwrap();
    let (ok, toml, err) = resolved(&[
        "--config",
        base.to_str().unwrap(),
        "--config",
        sweep.to_str().unwrap(),
        "--set",
        "run.seed=11",
    ]);
    assert!(ok, "{err}");
    let c: toml::Table = toml.parse().unwrap();
    assert_eq!(c["run"]["periods"].as_integer(), Some(7));
    assert_eq!(c["run"]["seed"].as_integer(), Some(11));
    assert_eq!(c["trainer"]["schedule"]["lr"].as_float(), Some(5e-4));
    // The embedded default fills what no file names.
    assert_eq!(c["data"]["release"]["batch_size"].as_integer(), Some(128));
}

#[test]
fn a_simd_level_the_kernels_do_not_know_is_refused_before_the_run_starts() {
    let out_dir = tempfile::tempdir().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_metronome"))
        .args(["run", "--out-dir"])
        .arg(out_dir.path())
        .env("METRONOME_SIMD", "avx1024")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("METRONOME_SIMD") && err.contains("avx1024"), "{err}");
    assert_eq!(std::fs::read_dir(out_dir.path()).unwrap().count(), 0, "a run directory was made: {err}");
}
