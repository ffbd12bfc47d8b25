pub use mercurio_core::*;
