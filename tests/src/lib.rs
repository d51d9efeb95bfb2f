//! Workspace-wide end-to-end tests of Metronome live in `tests/` beside this file;
//! they exercise several crates together (e.g. a layout from `metronome-masking`
//! through `metronome-model`). This library holds their shared helpers.
