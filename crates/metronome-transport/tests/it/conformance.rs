//! The conformance suite, run by both transports.

use std::sync::Arc;

use async_trait::async_trait;
use metronome_core::{ControlReceiver, ControlSender};
use metronome_core::{GroupReceiver, GroupSender, WeightPublisher, WeightSubscriber};
use metronome_testkit::conformance::transport::{self as conformance, Transport};
#[cfg(feature = "local")]
use metronome_transport::local;

/// Generates one test per named conformance check for a transport factory expression.
macro_rules! conformance_tests {
    ($make:expr) => {
        conformance_tests!(
            $make;
            groups_round_trip,
            duplicate_keys_count_once,
            acknowledged_key_is_not_delivered_again,
            concurrent_senders_lose_nothing,
            weights_newest_wins,
            control_in_order
        );
    };
    ($make:expr; $($check:ident),*) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $check() {
                conformance::$check(&$make).await;
            }
        )*
    };
}

/// The in-process transport: each call makes new channels.
#[cfg(feature = "local")]
struct Local;

#[cfg(feature = "local")]
#[async_trait]
impl Transport for Local {
    async fn groups(&self) -> (Arc<dyn GroupSender>, Box<dyn GroupReceiver>) {
        let (s, r) = local::group_channel(8);
        (Arc::new(s), Box::new(r))
    }

    async fn weights(
        &self,
    ) -> (Box<dyn WeightPublisher>, Box<dyn WeightSubscriber>, Box<dyn WeightSubscriber>) {
        let (p, s) = local::weight_channel();
        let second = p.subscribe();
        (Box::new(p), Box::new(s), Box::new(second))
    }

    async fn control(&self) -> (Box<dyn ControlSender>, Box<dyn ControlReceiver>) {
        let (s, r) = local::control_channel(16);
        (Box::new(s), Box::new(r))
    }
}

#[cfg(feature = "local")]
mod in_process {
    use super::*;

    conformance_tests!(Local);
}

#[cfg(feature = "nats")]
mod over_nats {
    use std::sync::atomic::{AtomicU64, Ordering};

    use metronome_transport::nats::{NatsConfig, NatsTransport};

    use super::*;
    use metronome_testkit::server::NatsServer;

    /// One server per test; every call makes endpoints under a new name prefix.
    pub(crate) struct Nats {
        server: NatsServer,
        next: AtomicU64,
    }

    impl Nats {
        pub(crate) fn start() -> Self {
            Self { server: NatsServer::start(&[]).expect("start nats-server"), next: AtomicU64::new(0) }
        }

        async fn transport(&self) -> NatsTransport {
            let n = self.next.fetch_add(1, Ordering::Relaxed);
            NatsTransport::connect(NatsConfig::with_prefix(vec![self.server.url()], &format!("conf{n}")))
                .await
                .expect("connect to the test nats-server")
        }
    }

    #[async_trait]
    impl Transport for Nats {
        async fn groups(&self) -> (Arc<dyn GroupSender>, Box<dyn GroupReceiver>) {
            let t = self.transport().await;
            let receiver = t.group_receiver().await.expect("group receiver");
            let sender = t.group_sender().await.expect("group sender");
            (Arc::new(sender), Box::new(receiver))
        }

        async fn weights(
            &self,
        ) -> (Box<dyn WeightPublisher>, Box<dyn WeightSubscriber>, Box<dyn WeightSubscriber>) {
            let t = self.transport().await;
            let p = t.weight_publisher().await.expect("weight publisher");
            let a = t.weight_subscriber().await.expect("weight subscriber");
            let b = t.weight_subscriber().await.expect("weight subscriber");
            (Box::new(p), Box::new(a), Box::new(b))
        }

        async fn control(&self) -> (Box<dyn ControlSender>, Box<dyn ControlReceiver>) {
            let t = self.transport().await;
            let r = t.control_receiver().await.expect("control receiver");
            let s = t.control_sender().await.expect("control sender");
            (Box::new(s), Box::new(r))
        }
    }

    conformance_tests!(Nats::start());
}
