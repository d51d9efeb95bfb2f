//! What a LoRA adapter's gradient must hold, for the model's and the trainer's tests.

/// Asserts what the gradient `values` of the adapter matrix `name` hold: every value is
/// finite; an `A` matrix's are exactly zero while every `B` is still zero (`∂L/∂A =
/// s·Bᵀ·∂L/∂y·x`); any other matrix's are not all zero.
///
/// # Panics
/// When the gradient breaks one of these, naming the matrix.
pub fn check_adapter_gradient(name: &str, values: &[f32], b_is_zero: bool) {
    assert!(values.iter().all(|x| x.is_finite()), "{name}: non-finite gradient");
    if b_is_zero && name.contains("lora_A") {
        assert!(values.iter().all(|&x| x == 0.0), "{name}: non-zero gradient while B = 0");
    } else {
        assert!(values.iter().any(|&x| x != 0.0), "{name}: all-zero gradient");
    }
}
