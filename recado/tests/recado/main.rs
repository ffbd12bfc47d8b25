//! recado run as a process against a real broker: one test binary, one module per concern.

mod support;

mod cli;
mod transports;
