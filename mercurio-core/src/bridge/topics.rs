//! A bridge's topic rules: which local messages go out and under which remote topic, which
//! remote filters the bridge subscribes to, and which local topic a message from the remote
//! takes. `local_prefix + T` on this broker is `remote_prefix + T` on the remote.

use crate::codec::QoS;
use crate::config::BridgeTopic;
use crate::topic;

/// One `[[bridges.topics]]` entry, ready to use.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct TopicRule {
    /// `local_prefix + pattern`: what is matched on this broker.
    pub local_filter: String,
    /// `remote_prefix + pattern`: what is matched on the remote.
    pub remote_filter: String,
    pub local_prefix: String,
    pub remote_prefix: String,
    pub qos: QoS,
    pub out: bool,
    pub inbound: bool,
}

/// Every rule of one bridge, in configuration order.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct TopicMap {
    pub rules: Vec<TopicRule>,
}

impl TopicMap {
    pub(crate) fn new(topics: &[BridgeTopic]) -> TopicMap {
        TopicMap {
            rules: topics
                .iter()
                .map(|t| TopicRule {
                    local_filter: format!("{}{}", t.local_prefix, t.pattern),
                    remote_filter: format!("{}{}", t.remote_prefix, t.pattern),
                    local_prefix: t.local_prefix.clone(),
                    remote_prefix: t.remote_prefix.clone(),
                    qos: QoS::from_u8(t.qos).unwrap_or(QoS::AtMostOnce),
                    out: t.direction.is_out(),
                    inbound: t.direction.is_in(),
                })
                .collect(),
        }
    }

    /// Local filters the bridge's session subscribes to, with the highest QoS asked for each
    /// (two rules may share a filter).
    pub(crate) fn local_subscriptions(&self) -> Vec<(String, QoS)> {
        let mut out: Vec<(String, QoS)> = Vec::new();
        for r in self.rules.iter().filter(|r| r.out) {
            match out.iter_mut().find(|(f, _)| *f == r.local_filter) {
                Some((_, q)) => *q = (*q).max(r.qos),
                None => out.push((r.local_filter.clone(), r.qos)),
            }
        }
        out
    }

    /// Remote filters the bridge subscribes to on the remote, with their QoS.
    pub(crate) fn remote_subscriptions(&self) -> Vec<(String, QoS)> {
        let mut out: Vec<(String, QoS)> = Vec::new();
        for r in self.rules.iter().filter(|r| r.inbound) {
            match out.iter_mut().find(|(f, _)| *f == r.remote_filter) {
                Some((_, q)) => *q = (*q).max(r.qos),
                None => out.push((r.remote_filter.clone(), r.qos)),
            }
        }
        out
    }

    /// The remote topic and QoS ceiling for a local topic going out: the first `out` rule
    /// whose local filter matches it. `None` when no rule does (the rules changed since the
    /// message was queued).
    pub(crate) fn outgoing(&self, local_topic: &str) -> Option<(String, QoS)> {
        let r = self
            .rules
            .iter()
            .find(|r| r.out && topic::matches(&r.local_filter, local_topic))?;
        let rest = local_topic.strip_prefix(r.local_prefix.as_str())?;
        Some((format!("{}{rest}", r.remote_prefix), r.qos))
    }

    /// The local topic for a topic coming from the remote: the first `in` rule whose remote
    /// filter matches it.
    pub(crate) fn incoming(&self, remote_topic: &str) -> Option<(String, QoS)> {
        let r = self
            .rules
            .iter()
            .find(|r| r.inbound && topic::matches(&r.remote_filter, remote_topic))?;
        let rest = remote_topic.strip_prefix(r.remote_prefix.as_str())?;
        let local = format!("{}{rest}", r.local_prefix);
        topic::validate_topic_name(&local).ok()?;
        Some((local, r.qos))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::BridgeDirection;

    fn rule(pattern: &str, direction: BridgeDirection, local: &str, remote: &str) -> BridgeTopic {
        BridgeTopic {
            pattern: pattern.into(),
            direction,
            qos: 1,
            local_prefix: local.into(),
            remote_prefix: remote.into(),
        }
    }

    #[test]
    fn prefixes_both_ways() {
        let m = TopicMap::new(&[
            rule("sensors/#", BridgeDirection::Out, "", "site1/"),
            rule("cmd/#", BridgeDirection::In, "from-cloud/", "site1/"),
        ]);
        assert_eq!(
            m.outgoing("sensors/t1"),
            Some(("site1/sensors/t1".into(), QoS::AtLeastOnce))
        );
        assert_eq!(m.outgoing("cmd/x"), None);
        assert_eq!(
            m.incoming("site1/cmd/reboot"),
            Some(("from-cloud/cmd/reboot".into(), QoS::AtLeastOnce))
        );
        assert_eq!(m.incoming("site1/sensors/t1"), None);
        assert_eq!(
            m.local_subscriptions(),
            vec![("sensors/#".into(), QoS::AtLeastOnce)]
        );
        assert_eq!(
            m.remote_subscriptions(),
            vec![("site1/cmd/#".into(), QoS::AtLeastOnce)]
        );
    }

    #[test]
    fn both_directions_and_shared_filters() {
        let mut a = rule("a/#", BridgeDirection::Both, "", "");
        a.qos = 0;
        let b = rule("a/#", BridgeDirection::Out, "", "");
        let m = TopicMap::new(&[a, b]);
        // The first matching rule maps; the subscription takes the highest QoS.
        assert_eq!(m.outgoing("a/b"), Some(("a/b".into(), QoS::AtMostOnce)));
        assert_eq!(
            m.local_subscriptions(),
            vec![("a/#".into(), QoS::AtLeastOnce)]
        );
        assert_eq!(
            m.remote_subscriptions(),
            vec![("a/#".into(), QoS::AtMostOnce)]
        );
    }
}
