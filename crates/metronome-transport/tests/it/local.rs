//! Behaviour specific to the in-process transport.

use std::sync::Arc;

use futures::FutureExt;
use metronome_core::{GroupReceiver, GroupSender, WeightPublisher};
use metronome_testkit::data::{scored_group, snapshot};
use metronome_transport::local;

#[tokio::test]
async fn a_full_channel_makes_the_sender_wait() {
    let (sender, mut receiver) = local::group_channel(2);
    sender.send(scored_group(0, 0, 1, 1)).await.unwrap();
    sender.send(scored_group(0, 1, 1, 1)).await.unwrap();
    // The third send cannot complete while the trainer has not taken a group.
    let mut third = Box::pin(sender.send(scored_group(0, 2, 1, 1)));
    assert!((&mut third).now_or_never().is_none(), "a send into a full channel completed");
    let d = receiver.recv().await.unwrap().unwrap();
    d.acker.ack().await.unwrap();
    third.await.unwrap();
    assert_eq!(receiver.stats().messages_received, 1);
}

#[tokio::test]
async fn the_stream_ends_when_every_sender_is_gone() {
    let (sender, mut receiver) = local::group_channel(4);
    let second = sender.clone();
    sender.send(scored_group(0, 0, 1, 1)).await.unwrap();
    drop(sender);
    drop(second);
    assert!(receiver.recv().await.unwrap().is_some());
    assert!(receiver.recv().await.unwrap().is_none());
}

#[tokio::test]
async fn a_delivery_dropped_unacknowledged_frees_its_key() {
    let (sender, mut receiver) = local::group_channel(4);
    sender.send(scored_group(0, 0, 1, 1)).await.unwrap();
    drop(receiver.recv().await.unwrap().unwrap());
    sender.send(scored_group(0, 0, 1, 1)).await.unwrap();
    let d = receiver.recv().await.unwrap().unwrap();
    assert_eq!(d.group.key(), scored_group(0, 0, 1, 1).key());
    assert_eq!(receiver.stats().duplicates, 0);
}

#[tokio::test]
async fn publishing_shares_the_snapshot_without_copying() {
    let (publisher, mut subscriber) = local::weight_channel();
    let s = Arc::new(snapshot(1, 8));
    publisher.publish(Arc::clone(&s)).await.unwrap();
    let got = metronome_core::WeightSubscriber::latest(&mut subscriber).await.unwrap().unwrap();
    assert!(Arc::ptr_eq(&got, &s));
}
