//! Period checkpoints: where a run resumes after a crash, for one process
//! (`metronome run`) and many (`metronome trainer`) alike.
//!
//! ```text
//! <run>/checkpoints/<store>/
//!   period-<n>/         the trainer's checkpoint and run_state.json: resume at period n
//!   latest              names the newest complete period-<n>
//!   .period-<n>.partial a checkpoint being written (or whose writer was killed)
//! ```
//!
//! A checkpoint is written into `.period-<n>.partial`, every file and folder in it is
//! synced to the disk, it is renamed to `period-<n>`, and only then does `latest`
//! (itself written to a temporary file, synced and renamed) point at it. A kill at any
//! moment leaves `latest` naming a complete checkpoint (or none), so a resumed run
//! continues from the last checkpoint that was whole. The checkpoint before the newest
//! is kept too; older ones are removed.
//!
//! Each checkpoint lists its files with their sizes and xxh3 hashes
//! (`manifest.json`). A checkpoint damaged afterwards (a disk error, a copy cut
//! short, a hand edit) is found before a run resumes from it
//! ([`Checkpoints::recover`]): it is set aside whole as `.period-<n>.unusable`,
//! never deleted, and `latest` moves to the newest older checkpoint that is whole, so
//! the run resumes from there, saying which checkpoint it left out and why.

use std::fs::{self, File};
use std::io;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use metronome_core::{Cursor, Trainer};
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// Where a run stands at a period boundary, beside the trainer's own state: enough
/// to repeat the run from there.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct RunState {
    /// The next period to run.
    pub(crate) next_period: u64,
    /// The data loader's position before that period's prompts are released.
    pub(crate) cursor: Cursor,
}

const STATE_FILE: &str = "run_state.json";
const LATEST_FILE: &str = "latest";
const MANIFEST_FILE: &str = "manifest.json";

/// A checkpoint's files, each with its size and xxh3 hash, relative to its folder.
#[derive(Debug, Default, Serialize, Deserialize)]
struct Manifest {
    files: std::collections::BTreeMap<String, FileEntry>,
}

#[derive(Debug, PartialEq, Eq, Serialize, Deserialize)]
struct FileEntry {
    bytes: u64,
    xxh3: String,
}

impl FileEntry {
    fn of(path: &Path) -> Result<Self> {
        let mut hasher = xxhash_rust::xxh3::Xxh3::new();
        let mut file = File::open(path).map_err(io(path))?;
        let bytes = io::copy(&mut file, &mut HashWriter(&mut hasher)).map_err(io(path))?;
        Ok(Self { bytes, xxh3: format!("{:016x}", hasher.digest()) })
    }
}

/// Feeds what is written to a hasher (so a file is hashed in buffered reads).
struct HashWriter<'a>(&'a mut xxhash_rust::xxh3::Xxh3);

impl io::Write for HashWriter<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.0.update(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl Manifest {
    /// Every file under `dir` (the manifest itself left out).
    fn of(dir: &Path) -> Result<Self> {
        let mut manifest = Self::default();
        let mut pending = vec![dir.to_owned()];
        while let Some(folder) = pending.pop() {
            for entry in fs::read_dir(&folder).map_err(io(&folder))? {
                let path = entry.map_err(io(&folder))?.path();
                if path.is_dir() {
                    pending.push(path);
                    continue;
                }
                let name = path.strip_prefix(dir).unwrap_or(&path).to_string_lossy().replace('\\', "/");
                if name != MANIFEST_FILE {
                    manifest.files.insert(name, FileEntry::of(&path)?);
                }
            }
        }
        Ok(manifest)
    }

    /// The first way `dir`'s files differ from the manifest's, if any.
    fn check(&self, dir: &Path) -> Option<String> {
        for (name, expected) in &self.files {
            let path = dir.join(name);
            match FileEntry::of(&path) {
                Err(_) => return Some(format!("{name} is missing or unreadable")),
                Ok(found) if found.bytes != expected.bytes => {
                    return Some(format!(
                        "{name} has {} bytes, {} were written",
                        found.bytes, expected.bytes
                    ));
                }
                Ok(found) if found != *expected => {
                    return Some(format!(
                        "{name} is not what was written (xxh3 {} != {})",
                        found.xxh3, expected.xxh3
                    ));
                }
                Ok(_) => {}
            }
        }
        None
    }
}

/// A checkpoint [`Checkpoints::recover`] set aside, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct SetAside {
    /// Where it is now (`.period-<n>.unusable`).
    pub(crate) moved_to: PathBuf,
    /// What is wrong with it.
    pub(crate) reason: String,
}

/// The period checkpoints of one run, under `root`.
#[derive(Clone, Debug)]
pub(crate) struct Checkpoints {
    root: PathBuf,
}

fn io(path: &Path) -> impl Fn(io::Error) -> Error + '_ {
    move |source| Error::Io { path: path.to_owned(), source }
}

impl Checkpoints {
    pub(crate) fn new(root: PathBuf) -> Self {
        Self { root }
    }

    /// The folder of the checkpoints.
    pub(crate) fn root(&self) -> &Path {
        &self.root
    }

    /// The newest complete checkpoint and its run state; `None` before the first.
    pub(crate) fn latest(&self) -> Result<Option<(PathBuf, RunState)>> {
        let pointer = self.root.join(LATEST_FILE);
        let name = match fs::read_to_string(&pointer) {
            Ok(name) => name,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(Error::Io { path: pointer, source: e }),
        };
        let dir = self.root.join(name.trim());
        let state_path = dir.join(STATE_FILE);
        let text = fs::read_to_string(&state_path).map_err(io(&state_path))?;
        let state = serde_json::from_str(&text)
            .map_err(|e| Error::Io { path: state_path.clone(), source: io::Error::other(e) })?;
        Ok(Some((dir, state)))
    }

    /// Makes `latest` name a checkpoint that is whole: while the one it names is not
    /// (its files differ from its manifest, or its run state does not read), that one
    /// is set aside as `.period-<n>.unusable` and `latest` moves to the newest older
    /// `period-<n>`. Returns what it set aside, for the caller to report; an error when
    /// no whole checkpoint is left (rather than a silent fresh start over a damaged
    /// run). Checkpoints written before manifests existed are taken as they are.
    pub(crate) fn recover(&self) -> Result<Vec<SetAside>> {
        let mut set_aside = Vec::new();
        loop {
            let pointer = self.root.join(LATEST_FILE);
            let name = match fs::read_to_string(&pointer) {
                Ok(name) => name.trim().to_owned(),
                Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(set_aside),
                Err(e) => return Err(Error::Io { path: pointer, source: e }),
            };
            let dir = self.root.join(&name);
            let Some(reason) = Self::damage(&dir) else { return Ok(set_aside) };
            let n = name.strip_prefix("period-").and_then(|n| n.parse::<u64>().ok());
            let moved_to = self.root.join(format!(".{name}.unusable"));
            if dir.exists() {
                if moved_to.exists() {
                    fs::remove_dir_all(&moved_to).map_err(io(&moved_to))?;
                }
                fs::rename(&dir, &moved_to).map_err(io(&moved_to))?;
            }
            tracing::warn!(checkpoint = %dir.display(), %reason, "checkpoint set aside as unusable");
            set_aside.push(SetAside { moved_to, reason: format!("{name}: {reason}") });
            // The newest older checkpoint, if any.
            let older = self.periods()?.into_iter().filter(|&k| n.is_none_or(|n| k < n)).max();
            let Some(older) = older else {
                let reasons: Vec<&str> = set_aside.iter().map(|s| s.reason.as_str()).collect();
                return Err(Error::Io {
                    path: self.root.clone(),
                    source: io::Error::other(format!(
                        "no whole checkpoint to resume from (set aside, kept for inspection: {})",
                        reasons.join("; ")
                    )),
                });
            };
            self.point_latest_at(&format!("period-{older}"))?;
        }
    }

    /// What is wrong with the checkpoint in `dir`, if anything.
    fn damage(dir: &Path) -> Option<String> {
        if !dir.is_dir() {
            return Some("is missing".into());
        }
        let state = fs::read_to_string(dir.join(STATE_FILE)).ok();
        if state.and_then(|t| serde_json::from_str::<RunState>(&t).ok()).is_none() {
            return Some(format!("{STATE_FILE} is missing or does not read"));
        }
        let manifest = match fs::read_to_string(dir.join(MANIFEST_FILE)) {
            Ok(text) => text,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return None,
            Err(e) => return Some(format!("{MANIFEST_FILE} cannot be read: {e}")),
        };
        match serde_json::from_str::<Manifest>(&manifest) {
            Ok(m) => m.check(dir),
            Err(e) => Some(format!("{MANIFEST_FILE} does not read: {e}")),
        }
    }

    /// The `n` of every `period-<n>` folder.
    fn periods(&self) -> Result<Vec<u64>> {
        let entries = fs::read_dir(&self.root).map_err(io(&self.root))?;
        Ok(entries
            .flatten()
            .filter_map(|e| e.file_name().to_str()?.strip_prefix("period-")?.parse().ok())
            .collect())
    }

    /// Points `latest` at `name`, durably (a temporary file, synced and renamed).
    fn point_latest_at(&self, name: &str) -> Result<()> {
        let tmp = self.root.join(format!("{LATEST_FILE}.tmp"));
        fs::write(&tmp, name).map_err(io(&tmp))?;
        File::open(&tmp).and_then(|f| f.sync_all()).map_err(io(&tmp))?;
        let pointer = self.root.join(LATEST_FILE);
        fs::rename(&tmp, &pointer).map_err(io(&pointer))?;
        sync_dir(&self.root)
    }

    /// Writes the trainer's checkpoint and `state` as `period-<next_period>` and makes
    /// it the latest, durably (see the module docs); returns its folder.
    pub(crate) async fn save(&self, trainer: &mut dyn Trainer, state: RunState) -> Result<PathBuf> {
        let name = format!("period-{}", state.next_period);
        let partial = self.root.join(format!(".{name}.partial"));
        if partial.exists() {
            fs::remove_dir_all(&partial).map_err(io(&partial))?;
        }
        fs::create_dir_all(&self.root).map_err(io(&self.root))?;
        trainer.save_checkpoint(&partial).await?;
        let state_path = partial.join(STATE_FILE);
        let text = serde_json::to_string_pretty(&state)
            .map_err(|e| Error::Io { path: state_path.clone(), source: io::Error::other(e) })?;
        fs::write(&state_path, text).map_err(io(&state_path))?;
        let manifest_path = partial.join(MANIFEST_FILE);
        let manifest = serde_json::to_string_pretty(&Manifest::of(&partial)?)
            .map_err(|e| Error::Io { path: manifest_path.clone(), source: io::Error::other(e) })?;
        fs::write(&manifest_path, manifest).map_err(io(&manifest_path))?;
        sync_tree(&partial)?;
        let dir = self.root.join(&name);
        if dir.exists() {
            // Written by a run killed before it pointed `latest` here; replaced whole.
            fs::remove_dir_all(&dir).map_err(io(&dir))?;
        }
        fs::rename(&partial, &dir).map_err(io(&dir))?;
        sync_dir(&self.root)?;
        self.point_latest_at(&name)?;
        self.prune(state.next_period);
        Ok(dir)
    }

    /// Removes the checkpoints older than the one before `newest`; a failure only
    /// costs space.
    fn prune(&self, newest: u64) {
        let Ok(entries) = fs::read_dir(&self.root) else { return };
        for entry in entries.flatten() {
            let name = entry.file_name();
            let Some(n) = name.to_str().and_then(|n| n.strip_prefix("period-")).and_then(|n| n.parse().ok())
            else {
                continue;
            };
            let n: u64 = n;
            if n + 1 < newest
                && let Err(e) = fs::remove_dir_all(entry.path())
            {
                tracing::warn!("cannot remove old checkpoint {}: {e}", entry.path().display());
            }
        }
    }
}

/// When a run writes checkpoints (the runner after periods, the warm start after
/// steps): the points it resumes from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Checkpointing {
    /// The folder of the checkpoints (see `checkpoint.rs`: `period-<n>/`, `latest`).
    pub dir: PathBuf,
    /// After every this many periods; 0: not by count.
    pub every: u64,
    /// After the first period that ends this long after the last checkpoint; zero:
    /// not by time.
    pub interval: Duration,
}

/// A run's checkpoints and when the next one is due: every `every` periods (or
/// warm-start steps), the first boundary `interval` after the last one, and after the
/// last. The runner keeps one for its periods, the warm start one for its steps.
pub(crate) struct Checkpointer {
    pub(crate) store: Checkpoints,
    policy: Checkpointing,
    last: Instant,
}

impl Checkpointer {
    pub(crate) fn new(policy: Checkpointing) -> Self {
        Self { store: Checkpoints::new(policy.dir.clone()), policy, last: Instant::now() }
    }

    /// Writes the checkpoint from which a run resumes at `next` when one is due (by
    /// count, by time, or after the `last` period or step); whether it did.
    pub(crate) async fn save_if_due(
        &mut self,
        trainer: &mut dyn Trainer,
        next: u64,
        last: bool,
        cursor: Cursor,
    ) -> Result<bool> {
        let by_count = self.policy.every > 0 && next.is_multiple_of(self.policy.every);
        let by_time = !self.policy.interval.is_zero() && self.last.elapsed() >= self.policy.interval;
        if !(by_count || by_time || last) {
            return Ok(false);
        }
        self.store.save(trainer, RunState { next_period: next, cursor }).await?;
        self.last = Instant::now();
        Ok(true)
    }
}

/// Syncs every file under `dir`, and the folders themselves, to the disk.
fn sync_tree(dir: &Path) -> Result<()> {
    for entry in fs::read_dir(dir).map_err(io(dir))? {
        let path = entry.map_err(io(dir))?.path();
        if path.is_dir() {
            sync_tree(&path)?;
        } else {
            File::open(&path).and_then(|f| f.sync_all()).map_err(io(&path))?;
        }
    }
    sync_dir(dir)
}

/// Syncs a folder's entries (a rename or a new file in it) to the disk.
fn sync_dir(dir: &Path) -> Result<()> {
    File::open(dir).and_then(|f| f.sync_all()).map_err(io(dir))
}

#[cfg(test)]
mod tests {
    use metronome_model::{Device, Model, ModelConfig};
    use metronome_trainer::GrpoTrainer;

    use super::*;

    fn trainer() -> GrpoTrainer {
        let model = Model::new(ModelConfig::tiny(), &Device::Cpu, 3).unwrap();
        GrpoTrainer::new(metronome_trainer::TrainerConfig::default(), model).unwrap()
    }

    fn state(next_period: u64) -> RunState {
        RunState {
            next_period,
            cursor: Cursor { period: metronome_core::PeriodId(next_period), ..Cursor::default() },
        }
    }

    #[tokio::test]
    async fn a_checkpoint_killed_mid_write_leaves_the_previous_one_latest() {
        let root = tempfile::tempdir().unwrap();
        let store = Checkpoints::new(root.path().join("periods"));
        assert_eq!(store.latest().unwrap(), None);
        let mut t = trainer();
        store.save(&mut t, state(1)).await.unwrap();
        store.save(&mut t, state(2)).await.unwrap();
        // A writer killed while writing period 3: half a trainer checkpoint.
        let partial = root.path().join("periods/.period-3.partial");
        fs::create_dir_all(partial.join("policy")).unwrap();
        fs::write(partial.join("policy/model.safetensors"), b"half").unwrap();
        let (dir, st) = store.latest().unwrap().unwrap();
        assert_eq!(st, state(2));
        assert!(dir.ends_with("period-2"));
        GrpoTrainer::resume(metronome_trainer::TrainerConfig::default(), &dir, &Device::Cpu).unwrap();
        // Killed after the rename but before `latest` moved: still period 2, and
        // saving period 3 again replaces the orphan whole.
        fs::rename(&partial, root.path().join("periods/period-3")).unwrap();
        assert_eq!(store.latest().unwrap().unwrap().1, state(2));
        store.save(&mut t, state(3)).await.unwrap();
        let (dir, st) = store.latest().unwrap().unwrap();
        assert_eq!(st, state(3));
        GrpoTrainer::resume(metronome_trainer::TrainerConfig::default(), &dir, &Device::Cpu).unwrap();
        // Only the newest and the one before are kept.
        store.save(&mut t, state(4)).await.unwrap();
        let mut names: Vec<String> = fs::read_dir(root.path().join("periods"))
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        names.sort();
        assert_eq!(names, ["latest", "period-3", "period-4"]);
    }

    /// A latest checkpoint whose files were damaged after it was written is set aside
    /// whole (kept), `latest` moves to the one before, and each damage is named; with
    /// no whole checkpoint left, an error names them all. A checkpoint without a
    /// manifest (written before manifests) is taken as it is.
    #[tokio::test]
    async fn a_damaged_latest_checkpoint_is_set_aside_for_the_one_before() {
        let root = tempfile::tempdir().unwrap();
        let store = Checkpoints::new(root.path().join("periods"));
        assert_eq!(store.recover().unwrap(), []);
        let mut t = trainer();
        for n in 1..=3 {
            store.save(&mut t, state(n)).await.unwrap();
        }
        assert_eq!(store.recover().unwrap(), [], "whole checkpoints are left alone");
        let weights = |n: u64| root.path().join(format!("periods/period-{n}/policy/model.safetensors"));
        // One bit flipped in period 3's weights.
        let mut bytes = fs::read(weights(3)).unwrap();
        let mid = bytes.len() / 2;
        bytes[mid] ^= 0x10;
        fs::write(weights(3), &bytes).unwrap();
        let set_aside = store.recover().unwrap();
        assert_eq!(set_aside.len(), 1);
        assert!(
            set_aside[0].reason.starts_with("period-3: policy/model.safetensors is not what was written")
        );
        assert!(set_aside[0].moved_to.ends_with(".period-3.unusable") && set_aside[0].moved_to.is_dir());
        let (dir, st) = store.latest().unwrap().unwrap();
        assert_eq!(st, state(2));
        GrpoTrainer::resume(metronome_trainer::TrainerConfig::default(), &dir, &Device::Cpu).unwrap();

        // Period 2 cut short, and period 1 already pruned: nothing whole is left.
        let cut = fs::read(weights(2)).unwrap();
        fs::write(weights(2), &cut[..cut.len() - 7]).unwrap();
        let e = metronome_core::ErrorChain(&store.recover().unwrap_err()).to_string();
        assert!(e.contains("no whole checkpoint to resume from"), "{e}");
        assert!(
            e.contains(&format!(
                "period-2: policy/model.safetensors has {} bytes, {} were written",
                cut.len() - 7,
                cut.len()
            )),
            "{e}"
        );

        // Without a manifest (an older checkpoint), only the run state is checked.
        let old = Checkpoints::new(root.path().join("old"));
        old.save(&mut t, state(5)).await.unwrap();
        fs::remove_file(root.path().join("old/period-5").join(MANIFEST_FILE)).unwrap();
        assert_eq!(old.recover().unwrap(), []);
        fs::write(root.path().join("old/period-5").join(STATE_FILE), "{").unwrap();
        let e = metronome_core::ErrorChain(&old.recover().unwrap_err()).to_string();
        assert!(e.contains("period-5: run_state.json is missing or does not read"), "{e}");
    }
}
