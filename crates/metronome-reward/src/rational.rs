//! Exact rational arithmetic on `i128`, with every operation checked.
//!
//! Countdown and exact math comparison need `1/3 * 3 == 1` without rounding. Numbers
//! in completions are bounded by the parsers, and an operation that would overflow
//! returns `None` instead of wrapping, so adversarial input cannot produce a wrong
//! "correct".

use std::cmp::Ordering;
use std::fmt;

/// A reduced fraction `num / den` with `den > 0`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Rational {
    num: i128,
    den: i128,
}

fn gcd(mut a: u128, mut b: u128) -> u128 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

impl Rational {
    /// Zero.
    pub const ZERO: Self = Self { num: 0, den: 1 };

    /// `num / den` reduced; `None` when `den` is zero or the value does not fit.
    #[must_use]
    pub fn new(num: i128, den: i128) -> Option<Self> {
        if den == 0 {
            return None;
        }
        let g = gcd(num.unsigned_abs(), den.unsigned_abs());
        // g >= 1 because den != 0; the quotients fit in i128 unless an operand is i128::MIN
        // and g == 1, which the checked negation below rejects.
        let g = i128::try_from(g).ok()?;
        let (mut num, mut den) = (num.checked_div(g)?, den.checked_div(g)?);
        if den < 0 {
            num = num.checked_neg()?;
            den = den.checked_neg()?;
        }
        Some(Self { num, den })
    }

    /// The integer `n`.
    #[must_use]
    pub const fn integer(n: i128) -> Self {
        Self { num: n, den: 1 }
    }

    /// The numerator (sign carrier).
    #[must_use]
    pub const fn numer(self) -> i128 {
        self.num
    }

    /// The denominator, always positive.
    #[must_use]
    pub const fn denom(self) -> i128 {
        self.den
    }

    /// True when the denominator is one.
    #[must_use]
    pub const fn is_integer(self) -> bool {
        self.den == 1
    }

    /// True when the value is zero.
    #[must_use]
    pub const fn is_zero(self) -> bool {
        self.num == 0
    }

    /// `self + rhs`, or `None` on overflow.
    #[must_use]
    pub fn checked_add(self, rhs: Self) -> Option<Self> {
        let g = i128::try_from(gcd(self.den.unsigned_abs(), rhs.den.unsigned_abs())).ok()?;
        let l = self.den.checked_div(g)?;
        let r = rhs.den.checked_div(g)?;
        let num = self.num.checked_mul(r)?.checked_add(rhs.num.checked_mul(l)?)?;
        Self::new(num, self.den.checked_mul(r)?)
    }

    /// `self - rhs`, or `None` on overflow.
    #[must_use]
    pub fn checked_sub(self, rhs: Self) -> Option<Self> {
        self.checked_add(rhs.checked_neg()?)
    }

    /// `-self`, or `None` on overflow.
    #[must_use]
    pub fn checked_neg(self) -> Option<Self> {
        Some(Self { num: self.num.checked_neg()?, den: self.den })
    }

    /// `|self|`, or `None` on overflow.
    #[must_use]
    pub fn checked_abs(self) -> Option<Self> {
        Some(Self { num: self.num.checked_abs()?, den: self.den })
    }

    /// `self * rhs`, or `None` on overflow.
    #[must_use]
    pub fn checked_mul(self, rhs: Self) -> Option<Self> {
        // Cross-reduce first so products of reduced fractions overflow only when the
        // result itself does not fit.
        let g1 = i128::try_from(gcd(self.num.unsigned_abs(), rhs.den.unsigned_abs())).ok()?.max(1);
        let g2 = i128::try_from(gcd(rhs.num.unsigned_abs(), self.den.unsigned_abs())).ok()?.max(1);
        let num = (self.num / g1).checked_mul(rhs.num / g2)?;
        let den = (self.den / g2).checked_mul(rhs.den / g1)?;
        Self::new(num, den)
    }

    /// `self / rhs`, or `None` when `rhs` is zero or on overflow.
    #[must_use]
    pub fn checked_div(self, rhs: Self) -> Option<Self> {
        if rhs.num == 0 {
            return None;
        }
        let inv = Self::new(rhs.den, rhs.num)?;
        self.checked_mul(inv)
    }

    /// The nearest `f64`.
    #[must_use]
    pub fn to_f64(self) -> f64 {
        self.num as f64 / self.den as f64
    }
}

impl PartialOrd for Rational {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Rational {
    fn cmp(&self, other: &Self) -> Ordering {
        // Denominators are positive, so cross multiplication keeps the order; fall back
        // to floats only if the products overflow (values far beyond any parsed input).
        match (self.num.checked_mul(other.den), other.num.checked_mul(self.den)) {
            (Some(a), Some(b)) => a.cmp(&b),
            _ => self.to_f64().total_cmp(&other.to_f64()),
        }
    }
}

impl fmt::Display for Rational {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.den == 1 { write!(f, "{}", self.num) } else { write!(f, "{}/{}", self.num, self.den) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn r(n: i128, d: i128) -> Rational {
        Rational::new(n, d).unwrap()
    }

    #[test]
    fn reduces_and_normalises_sign() {
        assert_eq!(r(2, 4), r(1, 2));
        assert_eq!(r(1, -2), r(-1, 2));
        assert_eq!(r(-3, -6), r(1, 2));
        assert_eq!(r(0, -5), Rational::ZERO);
        assert_eq!(Rational::new(1, 0), None);
    }

    #[test]
    fn arithmetic_is_exact() {
        let third = r(1, 3);
        assert_eq!(third.checked_mul(Rational::integer(3)), Some(Rational::integer(1)));
        assert_eq!(third.checked_add(r(1, 6)), Some(r(1, 2)));
        assert_eq!(r(3, 4).checked_sub(r(1, 4)), Some(r(1, 2)));
        assert_eq!(r(-3, 4).checked_abs(), Some(r(3, 4)));
        assert_eq!(Rational::integer(6).checked_div(r(1, 4)), Some(Rational::integer(24)));
        assert_eq!(Rational::integer(1).checked_div(Rational::ZERO), None);
    }

    #[test]
    fn overflow_is_none_not_wrong() {
        let big = Rational::integer(i128::MAX / 2 + 1);
        assert_eq!(big.checked_mul(Rational::integer(2)), None);
        assert_eq!(big.checked_add(big), None);
        assert_eq!(Rational::integer(i128::MIN).checked_neg(), None);
        assert_eq!(Rational::integer(i128::MIN).checked_abs(), None);
        assert_eq!(Rational::new(i128::MIN, 1).and_then(|x| x.checked_mul(Rational::integer(-1))), None);
    }

    #[test]
    fn orders_by_value() {
        assert!(r(1, 3) < r(1, 2));
        assert!(r(-1, 2) < Rational::ZERO);
        assert_eq!(r(2, 6).cmp(&r(1, 3)), Ordering::Equal);
    }
}
