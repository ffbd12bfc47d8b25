//! The shortest path through the broker: one subscriber, one publisher, each version.
use crate::common;

use common::*;
use mercurio::codec::{ProtocolVersion, QoS, ReasonCode};

#[tokio::test]
async fn publish_reaches_subscriber_in_every_version() {
    let (broker, addr) = start().await;
    for version in [
        ProtocolVersion::V31,
        ProtocolVersion::V311,
        ProtocolVersion::V5,
    ] {
        let mut sub = Client::connect(addr, version, "smoke-sub").await;
        assert_eq!(
            sub.subscribe("smoke/+", QoS::ExactlyOnce).await,
            ReasonCode::GRANTED_QOS_2
        );
        let mut publisher = Client::connect(addr, version, "smoke-pub").await;
        for qos in [QoS::AtMostOnce, QoS::AtLeastOnce, QoS::ExactlyOnce] {
            publisher
                .publish("smoke/t", format!("{qos:?}").as_bytes(), qos, false)
                .await;
            let p = sub.expect_publish().await;
            assert_eq!(p.topic, "smoke/t");
            assert_eq!(p.qos, qos);
            assert_eq!(&p.payload[..], format!("{qos:?}").as_bytes());
            sub.ack(&p).await;
        }
        publisher.disconnect().await;
        sub.disconnect().await;
    }
    broker.shutdown().await;
}
