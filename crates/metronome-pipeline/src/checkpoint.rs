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

use std::fs::{self, File};
use std::io;
use std::path::{Path, PathBuf};

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
        sync_tree(&partial)?;
        let dir = self.root.join(&name);
        if dir.exists() {
            // Written by a run killed before it pointed `latest` here; replaced whole.
            fs::remove_dir_all(&dir).map_err(io(&dir))?;
        }
        fs::rename(&partial, &dir).map_err(io(&dir))?;
        sync_dir(&self.root)?;
        let tmp = self.root.join(format!("{LATEST_FILE}.tmp"));
        fs::write(&tmp, &name).map_err(io(&tmp))?;
        File::open(&tmp).and_then(|f| f.sync_all()).map_err(io(&tmp))?;
        let pointer = self.root.join(LATEST_FILE);
        fs::rename(&tmp, &pointer).map_err(io(&pointer))?;
        sync_dir(&self.root)?;
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
}
