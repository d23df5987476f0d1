//! Checkpoint files: any bytes are a clean error (bad header, checksum, shapes) or a
//! checkpoint whose tensors match its metadata.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let path = grandis_fuzz::file("checkpoint.safetensors", data);
    let _ = grandis_trainer::load_checkpoint(&path);
});
