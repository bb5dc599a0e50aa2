//! Shared set-up of the host tests: an ext4 file system on a loop device.
pub use nearstore_testkit::Fs;
