//! The PostgreSQL backend against a throwaway cluster: the conformance checks, and TLS to the
//! server. One test binary.

mod backend;
mod tls;
