//! The workspace's fourth change to candle (`vendor/candle-core/PATCH.md`): a shape's
//! dimensions and a layout's strides are held inline up to three dimensions, so a view
//! (narrow, transpose, a reshape of a contiguous tensor, a detached copy) allocates
//! only the tensor itself, and a new tensor its storage and the tensor; and the views
//! and shapes read as before, at three dimensions and past them.

use candle_core::{DType, Device, Shape, Tensor};

#[test]
fn views_of_up_to_three_dimensions_allocate_only_the_tensor() {
    let t = Tensor::arange(0f32, 24.0, &Device::Cpu).unwrap().reshape((2, 3, 4)).unwrap();
    let count = |f: &dyn Fn() -> Tensor| allocation_counter::measure(|| drop(f())).count_total;
    // A view: the `Arc` of the new tensor; before, also its shape and strides (3).
    assert_eq!(count(&|| t.narrow(1, 1, 2).unwrap()), 1);
    assert_eq!(count(&|| t.t().unwrap()), 1);
    assert_eq!(count(&|| t.reshape((6, 4)).unwrap()), 1);
    let var = candle_core::Var::from_tensor(&t).unwrap();
    assert_eq!(count(&|| var.as_tensor().detach()), 1);
    // A new tensor: its elements, the storage's lock and the tensor.
    assert_eq!(count(&|| Tensor::zeros((2, 3, 4), DType::F32, &Device::Cpu).unwrap()), 3);
}

#[test]
fn shapes_and_views_read_as_before_within_and_past_the_inline_dimensions() {
    let t = Tensor::arange(0f32, 720.0, &Device::Cpu).unwrap();
    let six = t.reshape((1, 2, 3, 4, 5, 6)).unwrap();
    assert_eq!(six.dims(), &[1, 2, 3, 4, 5, 6]);
    assert_eq!(six.stride(), &[720, 360, 120, 30, 6, 1]);
    let moved = six.permute((5, 4, 3, 2, 1, 0)).unwrap();
    assert_eq!(moved.dims(), &[6, 5, 4, 3, 2, 1]);
    assert_eq!(moved.stride(), &[1, 6, 30, 120, 360, 720]);
    let back = moved.contiguous().unwrap().permute((5, 4, 3, 2, 1, 0)).unwrap().contiguous().unwrap();
    assert_eq!(back.flatten_all().unwrap().to_vec1::<f32>().unwrap(), t.to_vec1::<f32>().unwrap());
    let narrow = six.narrow(4, 1, 3).unwrap().transpose(0, 5).unwrap();
    assert_eq!(narrow.dims(), &[6, 2, 3, 4, 3, 1]);
    assert_eq!(narrow.stride(), &[1, 360, 120, 30, 6, 720]);
    assert_eq!(Shape::from(vec![2, 3]).into_dims(), vec![2, 3]);
    assert_eq!(Shape::from((2, 3, 4, 5, 6)).extend(&[7, 8]).dims(), &[2, 3, 4, 5, 6, 7, 8]);
    let b = Tensor::ones((3, 1), DType::F32, &Device::Cpu).unwrap().broadcast_as((2, 2, 3, 4)).unwrap();
    assert_eq!(b.stride(), &[0, 0, 1, 0]);
    assert_eq!(b.sum_all().unwrap().to_scalar::<f32>().unwrap(), 48.0);
}
