//! The workspace's patch of candle's backward pass (`vendor/candle-core/PATCH.md`): the
//! first gradient reaching a node is stored, not added into zeros. What the patch must
//! keep: fan-in sums every contribution, in both orders and with subtraction first; a
//! gradient stored for one input of an add and shared with the other is not changed by
//! later contributions to either; and a gradient rule that returns the wrong shape is
//! still an error, as the add into zeros made it.

use candle_core::{CpuStorage, CustomOp1, DType, Device, Layout, Shape, Tensor, Var};

fn var(values: &[f32]) -> Var {
    Var::from_slice(values, values.len(), &Device::Cpu).unwrap()
}

fn grad(grads: &candle_core::backprop::GradStore, v: &Var) -> Vec<f32> {
    grads.get(v.as_tensor()).expect("a gradient").to_vec1().unwrap()
}

#[test]
fn fan_in_sums_every_contribution() {
    let (x, a, b) = (var(&[1.0, 2.0]), var(&[3.0, -1.0]), var(&[0.5, 4.0]));
    let (xt, at, bt) = (x.as_tensor(), a.as_tensor(), b.as_tensor());
    // y = x a + x b + x - (x + x): dy/dx = a + b - 1, dy/da = x, dy/db = x.
    let y =
        ((((xt * at).unwrap() + (xt * bt).unwrap()).unwrap() + xt).unwrap() - (xt + xt).unwrap()).unwrap();
    let grads = y.sum_all().unwrap().backward().unwrap();
    assert_eq!(grad(&grads, &x), [2.5, 2.0]);
    assert_eq!(grad(&grads, &a), [1.0, 2.0]);
    assert_eq!(grad(&grads, &b), [1.0, 2.0]);
    // Subtraction as the first contribution: d(c - x)/dx = -1, then + 3 from 3 x.
    let c = Tensor::new(&[5f32, 6.0], &Device::Cpu).unwrap();
    let z = ((&c - xt).unwrap() + (xt * 3.0).unwrap()).unwrap();
    assert_eq!(grad(&z.sum_all().unwrap().backward().unwrap(), &x), [2.0, 2.0]);
}

#[test]
fn a_shared_first_gradient_is_not_changed_by_later_ones() {
    // s = a + b hands both inputs the same gradient; a then receives another, from
    // a * 2: a's sum must be a new tensor, b's gradient the shared one unchanged.
    let (a, b) = (var(&[1.0, 1.0]), var(&[1.0, 1.0]));
    let s = (a.as_tensor() + b.as_tensor()).unwrap();
    let y = (s + (a.as_tensor() * 2.0).unwrap()).unwrap();
    let grads = y.sum_all().unwrap().backward().unwrap();
    assert_eq!(grad(&grads, &a), [3.0, 3.0]);
    assert_eq!(grad(&grads, &b), [1.0, 1.0]);
}

/// The identity, whose backward returns a gradient of the wrong shape.
struct WrongShape;

impl CustomOp1 for WrongShape {
    fn name(&self) -> &'static str {
        "wrong-shape"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        Ok((s.clone(), l.shape().clone()))
    }

    fn bwd(&self, arg: &Tensor, _res: &Tensor, _g: &Tensor) -> candle_core::Result<Option<Tensor>> {
        Ok(Some(Tensor::zeros(arg.elem_count() + 1, DType::F32, arg.device())?))
    }
}

#[test]
fn a_gradient_of_the_wrong_shape_is_an_error() {
    let x = var(&[1.0, 2.0, 3.0]);
    let y = x.as_tensor().apply_op1(WrongShape).unwrap();
    let e = y.sum_all().unwrap().backward().unwrap_err().to_string();
    assert!(e.contains("shape mismatch") && e.contains("backward"), "{e}");
}
