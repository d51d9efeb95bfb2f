//! A work counter that parsers charge for every step, so that tests can check that
//! the work done on adversarial text stays linear in the (already bounded) input.

/// Counts parser steps and stops the parser past a budget.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Meter {
    steps: u64,
}

impl Meter {
    /// A meter at zero.
    #[must_use]
    pub const fn new() -> Self {
        Self { steps: 0 }
    }

    /// Charges `n` steps.
    pub(crate) fn charge(&mut self, n: usize) {
        self.steps = self.steps.saturating_add(n as u64);
    }

    /// Steps charged so far.
    #[must_use]
    pub const fn steps(&self) -> u64 {
        self.steps
    }
}
