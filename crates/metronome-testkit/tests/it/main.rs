//! The kit's mock stages pass the conformance suites, and the suites catch the
//! contract breaks the mocks can be set to make.

mod mocks;
