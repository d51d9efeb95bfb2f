//! What the workspace's benchmarks share.

/// Re-runs this process with `name=value` in its environment, unless the environment
/// sets `name` already, and exits with the child's status; returns when it is set (or
/// the re-run cannot start). For settings a library reads once at start-up, such as
/// mimalloc's `MIMALLOC_PURGE_DELAY`, which a process cannot give itself without
/// `unsafe`.
pub fn rerun_with_env(name: &str, value: &str) {
    if std::env::var_os(name).is_some() {
        return;
    }
    let Ok(exe) = std::env::current_exe() else { return };
    let status = std::process::Command::new(exe).args(std::env::args_os().skip(1)).env(name, value).status();
    if let Ok(status) = status {
        std::process::exit(status.code().unwrap_or(1));
    }
}
