//! What a QUIC peer sends: hellos and frames. Any bytes are a clean error or a message that
//! encodes back to the same bytes.
#![no_main]

use grandis_quic::frame::{check_frame_len, decode_frame_body, encode_frame, Hello};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(hello) = Hello::decode(data) {
        let again = hello.encode().expect("a decoded hello encodes");
        assert_eq!(Hello::decode(&again).expect("re-decodes"), hello);
    }
    if data.len() >= 4 {
        let _ = check_frame_len(data[..4].try_into().unwrap(), 1 << 20);
    }
    if let Ok(env) = decode_frame_body(data) {
        let frame = encode_frame(&env, usize::MAX).expect("a decoded frame encodes");
        assert_eq!(&frame[4..], data, "a frame body encodes back to itself");
    }
});
