//! Training layouts (work in progress).
