//! Pipeline tests with mock stages: the schedules' contracts, independent of any real
//! engine or trainer (those are tested end to end in the workspace `tests` package).

mod code;
mod config;
mod driver;
mod episodes;
mod errors;
mod events;
mod lora;
mod mocks;
mod rundir;
mod schedules;
