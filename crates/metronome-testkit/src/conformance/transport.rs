//! The contract every transport must keep: [`GroupSender`]/[`GroupReceiver`],
//! [`WeightPublisher`]/[`WeightSubscriber`] and [`ControlSender`]/[`ControlReceiver`].
//!
//! Implement [`Transport`] for a factory of fresh endpoints and call each check (or
//! [`run_all`]) from your tests. `metronome-transport` runs the suite against both of
//! its transports (`tests/it/conformance.rs`), and a future transport is held to the
//! same contract.
//!
//! The promises: groups arrive intact and in send order from one sender; a
//! (period, prompt) key is delivered once however often it is sent; concurrent senders
//! lose nothing; subscribers see the newest published weights bit-identically, wait
//! for a version, and a version older than the newest is refused; control messages
//! arrive in order.

use std::collections::BTreeSet;
use std::future::Future;
use std::sync::Arc;

use async_trait::async_trait;
use metronome_core::{
    ControlMessage, ControlReceiver, ControlSender, Delivery, GroupReceiver, GroupSender, PeriodId,
    PolicyVersion, PromptId, WeightPublisher, WeightSubscriber,
};

use crate::data::{scored_group, snapshot};

/// A factory of fresh, independent transport endpoints.
#[async_trait]
pub trait Transport: Send + Sync {
    /// A sender and a receiver of a new, empty group stream.
    async fn groups(&self) -> (Arc<dyn GroupSender>, Box<dyn GroupReceiver>);
    /// A publisher and two subscribers of a new, empty weight store.
    async fn weights(
        &self,
    ) -> (Box<dyn WeightPublisher>, Box<dyn WeightSubscriber>, Box<dyn WeightSubscriber>);
    /// A sender and a receiver of a new control channel.
    async fn control(&self) -> (Box<dyn ControlSender>, Box<dyn ControlReceiver>);
}

async fn patiently<T>(what: &str, f: impl Future<Output = T>) -> T {
    super::patiently("transport", what, f).await
}

async fn next(receiver: &mut dyn GroupReceiver) -> Delivery {
    match patiently("receiving a group", receiver.recv()).await {
        Ok(Some(d)) => d,
        Ok(None) => panic!("transport conformance: the group stream ended early"),
        Err(e) => {
            panic!("transport conformance: receiving a group failed: {}", metronome_core::ErrorChain(&e))
        }
    }
}

async fn ack(delivery: Delivery) {
    if let Err(e) = delivery.acker.ack().await {
        let key = delivery.group.key();
        panic!("transport conformance: acknowledging group {key} failed: {}", metronome_core::ErrorChain(&e));
    }
}

/// Runs every check.
pub async fn run_all(t: &dyn Transport) {
    groups_round_trip(t).await;
    duplicate_keys_count_once(t).await;
    acknowledged_key_is_not_delivered_again(t).await;
    concurrent_senders_lose_nothing(t).await;
    weights_newest_wins(t).await;
    control_in_order(t).await;
}

/// Groups of varied shapes arrive equal to what was sent, in send order.
pub async fn groups_round_trip(t: &dyn Transport) {
    let (sender, mut receiver) = t.groups().await;
    let sent: Vec<_> = (0..5).map(|i| scored_group(1, i, 1 + i as u32, 3 * i as usize)).collect();
    for g in &sent {
        sender.send(g.clone()).await.expect("transport conformance: send failed");
    }
    for expected in &sent {
        let d = next(&mut *receiver).await;
        assert_eq!(
            &d.group,
            expected,
            "transport conformance: group {} changed in transit or out of order",
            expected.key()
        );
        ack(d).await;
    }
}

/// A key sent twice is delivered once (the second copy is dropped while the first is
/// in flight).
pub async fn duplicate_keys_count_once(t: &dyn Transport) {
    let (sender, mut receiver) = t.groups().await;
    let a = scored_group(2, 1, 2, 4);
    let mut a_again = scored_group(2, 1, 2, 4);
    a_again.group.timing.finished_s += 1.0;
    let b = scored_group(2, 2, 2, 4);
    for g in [&a, &a_again, &b] {
        sender.send(g.clone()).await.expect("transport conformance: send failed");
    }
    let first = next(&mut *receiver).await;
    assert_eq!(first.group, a);
    let second = next(&mut *receiver).await;
    assert_eq!(second.group.key(), b.key(), "transport conformance: a duplicate key was delivered twice");
    ack(first).await;
    ack(second).await;
}

/// After a key is acknowledged, a later copy of it is dropped.
pub async fn acknowledged_key_is_not_delivered_again(t: &dyn Transport) {
    let (sender, mut receiver) = t.groups().await;
    let a = scored_group(3, 1, 2, 2);
    sender.send(a.clone()).await.expect("transport conformance: send failed");
    ack(next(&mut *receiver).await).await;
    sender.send(a.clone()).await.expect("transport conformance: send failed");
    let b = scored_group(3, 2, 2, 2);
    sender.send(b.clone()).await.expect("transport conformance: send failed");
    let d = next(&mut *receiver).await;
    assert_eq!(d.group.key(), b.key(), "transport conformance: an acknowledged key was delivered again");
    ack(d).await;
}

/// Four senders sending at once: every group arrives exactly once.
pub async fn concurrent_senders_lose_nothing(t: &dyn Transport) {
    let (sender, mut receiver) = t.groups().await;
    let tasks: Vec<_> = (0..4u64)
        .map(|s| {
            let sender = Arc::clone(&sender);
            tokio::spawn(async move {
                for i in 0..25u64 {
                    sender
                        .send(scored_group(4, s * 100 + i, 2, 3))
                        .await
                        .expect("transport conformance: send failed");
                }
            })
        })
        .collect();
    let mut keys = BTreeSet::new();
    for _ in 0..100 {
        let d = next(&mut *receiver).await;
        assert!(keys.insert(d.group.key()), "transport conformance: group {} delivered twice", d.group.key());
        ack(d).await;
    }
    for task in tasks {
        task.await.expect("transport conformance: a sender task panicked");
    }
    let expected: BTreeSet<_> =
        (0..4u64).flat_map(|s| (0..25).map(move |i| s * 100 + i)).map(PromptId).collect();
    let got: BTreeSet<_> = keys.iter().map(|k| k.prompt).collect();
    assert_eq!(got, expected);
}

/// Subscribers see nothing before the first publication, then the newest snapshot
/// bit-identically; `wait_for` waits for a future version; an older version is refused.
pub async fn weights_newest_wins(t: &dyn Transport) {
    let (publisher, mut first, mut second) = t.weights().await;
    assert!(
        patiently("latest()", first.latest()).await.expect("transport conformance: latest failed").is_none(),
        "transport conformance: a snapshot appeared before any was published"
    );
    let v1 = Arc::new(snapshot(1, 64));
    let v2 = Arc::new(snapshot(2, 64));
    publisher.publish(Arc::clone(&v1)).await.expect("transport conformance: publish v1 failed");
    publisher.publish(Arc::clone(&v2)).await.expect("transport conformance: publish v2 failed");
    let got = patiently("latest()", first.latest()).await.expect("transport conformance: latest failed");
    assert_eq!(got.as_deref(), Some(&*v2), "transport conformance: latest() is not the newest snapshot");
    let got = patiently("wait_for(1)", second.wait_for(PolicyVersion(1))).await.expect("wait_for failed");
    assert_eq!(&*got, &*v2, "transport conformance: wait_for(1) did not return the newest snapshot");
    assert!(
        publisher.publish(Arc::clone(&v1)).await.is_err(),
        "transport conformance: publishing an older version than the newest was accepted"
    );
    let waiter = tokio::spawn(async move { second.wait_for(PolicyVersion(3)).await });
    let v3 = Arc::new(snapshot(3, 64));
    publisher.publish(Arc::clone(&v3)).await.expect("transport conformance: publish v3 failed");
    let got = patiently("wait_for(3)", waiter).await.expect("waiter panicked").expect("wait_for(3) failed");
    assert_eq!(&*got, &*v3, "transport conformance: wait_for(3) did not return version 3");
}

/// Control messages arrive in send order.
pub async fn control_in_order(t: &dyn Transport) {
    let (sender, mut receiver) = t.control().await;
    let messages = [
        ControlMessage::PeriodStart {
            period: PeriodId(7),
            version: PolicyVersion(7),
            prompts: vec![PromptId(3), PromptId(1)],
        },
        ControlMessage::PeriodEnd { period: PeriodId(7) },
        ControlMessage::Shutdown,
    ];
    for m in &messages {
        sender.send(m.clone()).await.expect("transport conformance: control send failed");
    }
    for expected in &messages {
        let got = patiently("receiving a control message", receiver.recv()).await;
        assert_eq!(
            got.expect("control recv failed").as_ref(),
            Some(expected),
            "transport conformance: control message lost or reordered"
        );
    }
}
