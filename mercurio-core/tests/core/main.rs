//! The core's pure logic (codec, topic rules, router) tested through its public API: one
//! test binary, one module per concern. `tests/router_memory.rs` stays apart: it installs its
//! own counting allocator.

mod codec_corpus;
mod codec_differential;
mod codec_hostile;
mod codec_malformed;
mod codec_roundtrip;
mod codec_support;
mod router_index;
mod router_proptest;
mod router_retained;
mod topic_rules;
