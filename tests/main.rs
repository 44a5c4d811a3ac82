//! Cross-crate tests, one binary: sharded runs against single-device references.
mod suite;
